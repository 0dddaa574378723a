"""What the runtimes' detection reports (part of the host's facts) and the names every runtime shares.
What a configure asks for and changes is driverd.runtime.changes: detect never makes those classes."""
from __future__ import annotations

import re

from driverd.datatypes import dataclass

RESTART_MODES = ("systemd", "signal", "none")
DEFAULT_CDI_SPEC = "/var/run/cdi/nvidia.yaml"
DEFAULT_BINARY = "/usr/bin/nvidia-container-runtime"
# A handler name every runtime accepts as a table key / runtime name (config's runtime.handler too).
HANDLER_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
# The CDI specification's default spec directories (tags.cncf.io/container-device-interface,
# pkg/cdi/spec-dirs.go: /etc/cdi static, /var/run/cdi generated), which containerd, CRI-O and Docker
# read unless their configuration names others; the kind of NVIDIA's GPU devices.
CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
CDI_KIND = "nvidia.com/gpu"


@dataclass(frozen=True)
class CdiFacts:
    """Whether a runtime can hand out GPUs through CDI on this host (driverd.runtime.needs)."""
    supported: bool | None                  # this version injects CDI devices (None: version unknown)
    enabled: bool | None                    # on in its effective configuration (None: unknown)
    evidence: str                           # why, in words: the version rule, the key and its file
    spec_dirs: tuple[str, ...] = CDI_SPEC_DIRS   # where it reads specs (its configuration, else the defaults)
    specs: tuple[str, ...] = ()             # spec files of kind nvidia.com/gpu in spec_dirs under the root

    @property
    def usable(self) -> bool:
        return bool(self.supported and self.enabled and self.specs)

    @classmethod
    def by_version(cls, product: str, version: tuple[int, ...] | None, key: str, value: bool | None,
                   where: str | None, dirs: tuple[str, ...], *, since: tuple[int, int], since_word: str,
                   default_on: tuple[int, int], unknown: str, off_word: str) -> "CdiFacts":
        """The rule containerd and Docker share: no CDI before `since`, the configured `key` when it is set,
        else on by default from `default_on`, off before it (`off_word` says what the product needs)."""
        said = f"{key} = {str(value).lower()} in {where}" if value is not None else None
        if version is None:
            return cls(None, value, f"{unknown}; {said}" if said else unknown, dirs)
        v = f"{version[0]}.{version[1]}"
        if version < since:
            return cls(False, False, f"{product} {v} has no CDI support; it came with {product} {since_word}", dirs)
        if said:
            return cls(True, value, said, dirs)
        if version >= default_on:
            return cls(True, True, f"{key} is not set: on by default since {product} {default_on[0]}.{default_on[1]}",
                       dirs)
        return cls(True, False, f"{key} is not set: {product} {v} {off_word}", dirs)


@dataclass(frozen=True)
class HandlerNeeds:
    """What the runtime handler (runtime.handler) needs on this host and whether it has it: the binary
    it runs and CDI as the alternative. Part of RuntimeFacts; the plan warns from it."""
    runtime: str                            # the registry name
    handler: str
    configured: bool                        # the runtime's effective configuration defines the handler
    default: bool                           # ... and makes it the default runtime (every container runs it)
    binary: str                             # what the handler runs (as its configuration names it), else runtime.binary
    binary_from: str                        # "config" | "runtime.binary"
    binary_path: str | None                 # the host path it resolves to (a bare name: on the host's PATH)
    binary_state: str                       # present | missing | not-executable
    cdi: CdiFacts
    status: str                             # ok | not-configured | binary-missing
    verdict: str                            # one line in operators' words
    cdi_line: str                           # CDI's state in one line
    fixes: tuple[str, ...] = ()
    waits_for_binary: bool = False          # the runtime refuses the handler until its binary exists (CRI-O)


@dataclass(frozen=True)
class RuntimeFacts:
    """What `detect` found of one runtime (part of the host's Facts)."""
    name: str                               # a registry name: containerd | crio | docker
    binary: str | None
    version: str | None
    config_path: str | None
    config_exists: bool
    socket: str | None
    socket_exists: bool
    handlers: tuple[str, ...] = ()
    nvidia_handler: bool = False
    note: str | None = None
    needs: HandlerNeeds | None = None       # what the handler needs here (driverd.runtime.needs)
