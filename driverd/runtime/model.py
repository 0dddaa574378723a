"""Data shared by the runtime handlers: what the operator asked for, what one edit of one file is,
and what a configure/revert run did."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class Options:
    """How to configure a runtime's handler: its name, binary, CDI, restart and where driverd records it."""
    handler: str = "nvidia"
    binary: str = DEFAULT_BINARY
    set_as_default: bool = False
    cdi: bool = False
    restart: str = "systemd"                 # systemd | signal | none
    dry_run: bool = False
    config_path: str | None = None           # a custom runtime config file (host path)
    cdi_spec_path: str = DEFAULT_CDI_SPEC
    wait_timeout_s: float = 30.0             # bounded wait for the runtime's socket after a restart
    adopt_foreign: bool = False              # take over a same-named handler that runs something else
    binary_explicit: bool = False            # the binary was asked for (flag or runtime.binary), not defaulted
    state_dir: str = "/var/lib/driverd"      # state.dir: driverd's record of what it changed lives under it
    # write the CDI spec even of a user-space whose version is not the loaded driver's (runtime configure --allow-mismatch)
    force_cdi: bool = False

    @property
    def binary_chosen(self) -> bool:
        """True when the operator named the binary: an adopted handler then runs it; otherwise an
        adopted handler keeps the NVIDIA runtime it already runs."""
        return self.binary_explicit or self.binary != DEFAULT_BINARY

    @classmethod
    def from_config(cls, cfg, **overrides: Any) -> "Options":
        """Options from driverd's configuration (runtime.* keys); CLI flags override (None = keep)."""
        base = dict(handler=cfg["runtime.handler"], binary=cfg["runtime.binary"],
                    set_as_default=cfg["runtime.set_as_default"], cdi=cfg["runtime.cdi"],
                    restart=cfg["runtime.restart"], adopt_foreign=cfg["runtime.adopt_foreign"],
                    state_dir=cfg["state.dir"])
        explicit = overrides.get("binary") is not None or "runtime.binary" in (getattr(cfg, "sources", None) or {})
        base.update({k: v for k, v in overrides.items() if v is not None})
        base["binary_explicit"] = bool(base.get("binary_explicit")) or explicit
        return cls(**base)


@dataclass
class Change:
    """One reversible change inside a structured file (TOML/JSON).

    op "set": `key` was set; `had_old`/`old` is what was there before (revert puts it back or
    deletes the key). op "append": `value` was appended to the list at `key` (revert removes it).
    op "delete": `key` (whose value was `old`) was removed (revert puts it back).
    """
    op: str
    key: list[str]
    had_old: bool = False
    old: Any = None
    value: Any = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Change":
        return cls(d["op"], list(d["key"]), d.get("had_old", False), d.get("old"), d.get("value"))


@dataclass
class FileEdit:
    """The new content of one host file and the changes that produced it (for surgical revert)."""
    path: str                                # host path
    new: bytes                               # the complete new content
    old: bytes | None                        # the content before (None: the file did not exist)
    fmt: str                                 # toml | json | block (marker-delimited text) | owned (whole file is ours)
    changes: list[Change] = field(default_factory=list)
    marker: str | None = None                # for fmt == block: the block's marker name

    @property
    def noop(self) -> bool:
        return self.old == self.new


@dataclass
class ChangeReport:
    """What configuring or reverting one runtime changed: its files and their backups."""
    runtime: str
    handler: str
    action: str = "configure"                # configure | revert
    config_path: str | None = None
    files_changed: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    restarted: bool = False
    restart_detail: str | None = None
    socket_ready_s: float | None = None
    skipped: str | None = None               # why nothing was done
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False
    diffs: dict[str, str] = field(default_factory=dict)
    # handlers another tool wrote that this run took over: {handler, file, before, binary, how, foreign}
    adopted: list[dict] = field(default_factory=list)
    binary: str | None = None                # the binary the handler runs once this run is done

    @property
    def changed(self) -> bool:
        return bool(self.files_changed)

    def to_json(self) -> dict:
        return asdict(self)
