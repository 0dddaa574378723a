"""Container runtimes present on the host — binary, version, config, socket, the runtime handlers
their configuration already defines, and what the handler needs there (its binary, CDI). Each runtime
of driverd.runtime's registry detects itself."""
from __future__ import annotations

from driverd.root import Root
from driverd.runtime.model import DEFAULT_BINARY, RuntimeFacts
from driverd.runtime.registry import Versions, detect_all, start_versions


def start(root: Root) -> Versions:
    """The runtime binaries' `--version` runs, started before the other reads of a collect."""
    return start_versions(root)


def read_runtimes(root: Root, handler: str = "nvidia", binary: str = DEFAULT_BINARY,
                  versions: Versions | None = None) -> list[RuntimeFacts]:
    return detect_all(root, handler, binary, versions)
