"""The seams where driverd picks an implementation of a boundary: the kernel (modules), the manager
of the GPU daemons and MIG. The real implementations are the defaults; `driverd.sim.install_backends`
adds the simulated ones (tests, the demo, benchmarks), and only the composition root (the CLI) or a
test calls it. Production code never imports driverd.sim; it asks here."""
from __future__ import annotations

from typing import Any, Callable

# name -> factory. Kernels: (root, runner) -> Kernel. Services: (kernel) -> Services. MIG: (kernel) -> backend.
KERNELS: dict[str, Callable[..., Any]] = {}
SERVICES: dict[str, Callable[..., Any]] = {}
MIG: dict[str, Callable[..., Any]] = {}


def register(kind: dict[str, Callable[..., Any]], name: str, factory: Callable[..., Any]) -> None:
    kind[name] = factory
