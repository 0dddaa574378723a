"""The container runtimes driverd knows: one explicit table, in detection order.

Nothing registers itself on import. Adding a runtime is one module in this package (a subclass of
`driverd.runtime.base.Runtime`) plus its line here; detect, plan, `driverd runtime`, the
configuration's and the CLI's choices, restarts and revert read this table.
"""
from __future__ import annotations

from driverd.root import Root
from driverd.runtime.base import Runtime, Versions
from driverd.runtime.containerd import Containerd
from driverd.runtime.crio import Crio
from driverd.runtime.docker import Docker
from driverd.runtime.model import DEFAULT_BINARY, RuntimeFacts

REGISTRY: dict[str, Runtime] = {r.name: r for r in (Containerd(), Crio(), Docker())}


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> Runtime:
    """The runtime registered as `name` (KeyError for another name: callers check names() first)."""
    return REGISTRY[name]


def runtimes() -> tuple[Runtime, ...]:
    return tuple(REGISTRY.values())


def start_versions(root: Root) -> Versions:
    """Every present runtime binary's `--version`, started now to be collected by detect_all."""
    return Versions.start(root, [b for b in (r.find_binary(root) for r in runtimes()) if b])


def detect_all(root: Root, handler: str = "nvidia", binary: str = DEFAULT_BINARY,
               versions: Versions | None = None) -> list[RuntimeFacts]:
    """The facts of every registered runtime present on the host, in the table's order, each with what
    `handler` (running `binary`, runtime.binary, where driverd adds it) needs there. `versions`: from
    start_versions, when the caller had other reading to do meanwhile."""
    versions = versions or start_versions(root)
    return [f for f in (r.detect(root, handler, binary, versions) for r in runtimes()) if f is not None]
