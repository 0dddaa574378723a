"""What configuring or reverting a runtime asks for and changes: the options, one reversible change in
a structured file, one edit of one file, and the report of a run. Apart from driverd.runtime.model (the
detection's facts) so that `detect`, which configures nothing, does not make these classes (issue 47)."""
from __future__ import annotations

from dataclasses import asdict, field
from typing import Any

from driverd.datatypes import dataclass
from driverd.runtime.model import DEFAULT_BINARY, DEFAULT_CDI_SPEC


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
