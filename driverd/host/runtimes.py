"""Container runtimes present on the host — binary, version, config, socket, and the runtime handlers
their configuration already defines. Each runtime of driverd.runtime's registry detects itself."""
from __future__ import annotations

from driverd.root import Root
from driverd.runtime.model import RuntimeFacts
from driverd.runtime.registry import detect_all


def read_runtimes(root: Root, handler: str = "nvidia") -> list[RuntimeFacts]:
    return detect_all(root, handler)
