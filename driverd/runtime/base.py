"""What every container runtime driverd configures provides: the `Runtime` base class, and the
helpers its detection shares.

One runtime is one module of this package with one subclass of `Runtime`, listed in
`driverd/runtime/registry.py`. Everything else — facts (`driverd detect`), the plan's
configure-runtime steps, `driverd runtime configure|revert`, the CLI's and the configuration's
choices, restarts, the executor's file preimages — asks the registry, never a runtime by name.

A runtime answers five questions:
- detect: is it on this host (binary, config, socket), which version, which handlers are defined, and
  what the handler needs here (`needs.py`: the binary it runs — `handler_binary` —, whether it is
  the default runtime — `default_runtime` —, CDI — `cdi`);
- effective config: the handlers its configuration *in effect* defines (the config file plus what it
  imports or the drop-ins it reads);
- configure: the file edits (`FileEdit`) that add the handler, computed, not written — `handler.py`
  writes them through driverd's runtime record (backups, revert) and restarts;
- revert: undo what driverd recorded for it (the record is the same for every runtime);
- restart: its systemd unit, its default socket, the processes a signal restart signals and whether
  a signal reloads its configuration at all (`restart.py` does the restarting).
Reading never changes anything and never raises for a missing or odd file: absence is a fact.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from abc import ABC, abstractmethod

from driverd.root import Root
from driverd.runtime.model import DEFAULT_BINARY, CdiFacts, RuntimeFacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import ClassVar, Iterable

    from driverd.runtime.changes import ChangeReport, FileEdit, Options

# `driverd debug capture-host` records each runtime binary's `--version` here: a captured tree is not
# live, so its binaries cannot be run.
CAPTURED_VERSIONS = "/var/lib/driverd/capture/versions.json"


class Runtime(ABC):
    name: ClassVar[str]                         # the registry key: config's runtime.runtimes, --runtime
    title: ClassVar[str]                        # how people spell it (help texts)
    detail: ClassVar[str] = ""                  # what of it is covered, for help texts ("1.x/2.x, ...")
    binaries: ClassVar[tuple[str, ...]]         # where its binary lives, in order of preference
    configs: ClassVar[tuple[str, ...]]          # its config files, in order of preference; the first is the default
    sockets: ClassVar[tuple[str, ...]]          # its API sockets, in order of preference; the first is the default
    process_names: ClassVar[tuple[str, ...]]    # /proc/<pid>/comm of the processes a signal restart signals
    reloads_on_signal: ClassVar[bool]           # SIGHUP makes it read its configuration again
    checks_binary: ClassVar[bool] = False       # configure refuses a missing handler binary itself
    # What breaks while the handler's binary is missing, in operators' words ({handler}: its name).
    handler_failure: ClassVar[str] = "containers that ask for runtime handler '{handler}' will fail to start"

    @property
    def default_config(self) -> str:
        return self.configs[0]

    @property
    def default_socket(self) -> str:
        return self.sockets[0]

    # -- detect -------------------------------------------------------------------------------------
    def find_binary(self, root: Root) -> str | None:
        return first(root, self.binaries)

    def detect(self, root: Root, handler: str, handler_bin: str = DEFAULT_BINARY,
               versions: Versions | None = None) -> RuntimeFacts | None:
        """This runtime's facts, None when nothing of it (binary, config, socket) is on the host.
        `handler_bin` is runtime.binary: what a handler driverd adds would run; `versions`: the
        `--version` runs started earlier (`Versions.start`), else this one runs now."""
        binary = self.find_binary(root)
        config = first(root, self.configs)
        socket = first(root, self.sockets, want_file=False)
        if binary is None and config is None and socket is None:
            return None
        handlers, note = self.effective_handlers(root, config)
        facts = RuntimeFacts(
            name=self.name, binary=binary, version=(versions or Versions(root)).get(binary) if binary else None,
            config_path=config or self.default_config, config_exists=config is not None,
            socket=socket or self.default_socket, socket_exists=socket is not None, handlers=tuple(handlers),
            nvidia_handler=handler in handlers, note=note)
        from driverd.runtime import needs
        return dataclasses.replace(facts, needs=needs.assess(root, self, facts, handler, handler_bin))

    def handler_binary(self, root: Root, facts: RuntimeFacts, handler: str) -> str | None:
        """The binary the handler defined in the effective configuration runs, as the configuration
        names it (a bare name is looked up on the host's PATH); None when the handler is not defined
        or names none (then runtime.binary is what it needs)."""
        return None

    def default_runtime(self, root: Root, facts: RuntimeFacts) -> str | None:
        """The handler that runs containers which ask for none, per the configuration in effect (None:
        unknown). When it is the NVIDIA handler, a missing binary breaks every container."""
        return None

    def cdi(self, root: Root, facts: RuntimeFacts) -> CdiFacts:
        """Whether this runtime, at its version and with its configuration in effect, injects CDI
        devices, and the spec directories it reads (`needs.py` looks for NVIDIA's spec in them)."""
        return CdiFacts(None, None, f"driverd does not know how {self.title} enables CDI")

    @abstractmethod
    def effective_handlers(self, root: Root, config_path: str | None) -> tuple[list[str], str | None]:
        """The runtime handlers the configuration in effect defines (config_path: the config detect
        found, None when there is none), and a note when it cannot be read."""

    # -- configure / revert ---------------------------------------------------------------------------
    @abstractmethod
    def configure(self, root: Root, config_path: str, options: Options, report: ChangeReport,
                  facts: RuntimeFacts | None, record: dict | None) -> list[FileEdit]:
        """The edits that add options.handler (and CDI, the default) to the configuration at
        config_path; notes go into report. `record` is what driverd recorded for this runtime
        before (its own earlier edits). Writes nothing; raises RuntimeConfigError to refuse."""

    def revert(self, root: Root, report: ChangeReport, dry_run: bool, state_dir: str = "/var/lib/driverd") -> None:
        """Undo what driverd recorded for this runtime (surgically: later edits by others stay)."""
        from driverd.runtime import state
        state.revert(root, self.name, report, dry_run, state_dir)

    # -- restart -------------------------------------------------------------------------------------
    def unit(self, root: Root, config_path: str) -> str:
        """The systemd unit that runs it with this configuration."""
        return self.name


def first(root: Root, paths: tuple[str, ...], want_file: bool = True) -> str | None:
    for p in paths:
        if (root.is_file(p) if want_file else root.exists(p)):
            return p
    return None


def read_toml(root: Root, path: str) -> dict:
    """A TOML config as read-only data, {} when missing or invalid (detection never raises)."""
    text = root.read_text(path)
    if not text:
        return {}
    if path.endswith(".tmpl"):
        # Go-template lines ({{ ... }}) are not TOML; the static part still names the runtimes.
        text = "\n".join(ln for ln in text.splitlines() if "{{" not in ln)
    import tomllib  # not at the top: most hosts parse no TOML, and its import was ~4 ms of detect
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):   # deeply nested junk overflows the parser
        return {}


def dig(doc: object, *keys: str) -> dict:
    """doc[k1][k2]...; {} as soon as a level is missing or not a table (a hostile file may put a
    string or an array where a table belongs)."""
    for k in keys:
        if not isinstance(doc, dict):
            return {}
        doc = doc.get(k, {})
    return doc if isinstance(doc, dict) else {}


def version_tuple(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '1.6.20~ds1' or 'v28.2.2'; None when there is none."""
    m = re.match(r"v?(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


class Versions:
    """Each runtime binary's `--version`, run while everything else is read (issue 47: containerd's took
    20-50 ms, and going through `sh` another 45 ms of imports, in a `detect` that should cost what
    `nvidia-smi -q` does). `start` launches them, `get` collects one; a run never collected is killed
    with this object. On a captured tree the versions come from the capture."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self._runs: dict[str, subprocess.Popen | None] = {}

    @classmethod
    def start(cls, root: Root, binaries: Iterable[str]) -> Versions:
        v = cls(root)
        if root.is_live():
            for b in binaries:
                v._runs[b] = v._spawn(b)
        return v

    def _spawn(self, binary: str) -> subprocess.Popen | None:
        try:
            return subprocess.Popen([self.root.real_on_disk(binary), "--version"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    errors="replace", cwd="/")
        except OSError:
            return None

    def get(self, binary: str) -> str | None:
        if not self.root.is_live():
            try:
                v = json.loads(self.root.read_text(CAPTURED_VERSIONS) or "{}").get(binary)
            except (ValueError, AttributeError, RecursionError):
                return None
            return v if isinstance(v, str) else None
        p = self._runs.pop(binary) if binary in self._runs else self._spawn(binary)
        if p is None:
            return None
        try:
            out, _ = p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return None
        m = re.search(r"\bv?(\d+\.\d+\.\d+[\w.+~-]*)", out or "")
        return m.group(1) if m else None

    def __del__(self) -> None:
        for p in self._runs.values():
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
