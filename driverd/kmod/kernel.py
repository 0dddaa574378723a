"""The kernel boundary: load, unload and inspect modules, and index a module tree (depmod) and resolve
a module's dependencies in it (modprobe --show-depends). One interface, two implementations:

- RealKernel: kmod tools through the Runner (`modprobe [-d ROOT] NAME k=v...`, `rmmod NAME`,
  `depmod -b ROOT RELEASE`, `modprobe -d ROOT -S RELEASE --show-depends NAME`, the kernel log from
  /dev/kmsg (driverd.kmod.kmsg; `dmesg` where it cannot be read)), honouring
  --root the way the driver container needs (root=/host).
- SimKernel (driverd/sim/kernel.py): keeps /proc/modules, /sys/module/*/{refcnt,holders},
  /proc/driver/nvidia/* and /proc/devices inside a root tree and fails the way the real kernel fails;
  it writes modules.dep itself (no kmod needed), in depmod's format.

What a module file declares (modinfo) is read from the file itself by both (driverd.modinfo).

Everything above this line (load/unload/reload/validate) is written once against `Kernel` and runs
identically on a host, in the driver container, in tests and in the demo. `select_kernel` is the one
place that chooses.
"""
from __future__ import annotations

import os
import re
import signal as _signal
import stat
import time
from abc import ABC, abstractmethod
from dataclasses import field
from typing import Iterable

from driverd.datatypes import dataclass
from driverd.errors import ConfigError, ModuleError
from driverd.host.modules import INSTALL_DIR, loaded_modules, read_module
from driverd.kmod import kmsg
from driverd.modinfo import ModInfo, module_name, read_modinfo
from driverd.root import Root

NVRM_RE = re.compile(r"NVRM|nvidia", re.IGNORECASE)


@dataclass(frozen=True)
class LoadedModule:
    """A module loaded in the kernel, as sysfs shows it."""
    name: str
    refcount: int | None
    holders: tuple[str, ...]
    version: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)


def kernel_error(verb: str, name: str, reason: str, log: list[str], fix: str, **details) -> ModuleError:
    """A failed insert/remove, carrying the kernel's own words (the NVRM / module lines of its log)."""
    # The lines since the attempt started; on a busy real host keep the ones about the driver.
    words = ([ln for ln in log if NVRM_RE.search(ln) or name in ln or "module" in ln] if len(log) > 8 else log)[-8:]
    # the kernel's lines stay lines (details["kernel_log"]: printed under the error, a list in JSON),
    # not " | "-joined into one error line hundreds of characters long
    cause = f"{reason}; the kernel log's lines about it follow" if words else reason
    return ModuleError(f"could not {verb} {name}: {reason}", cause=cause, fix=fix,
                       details={"module": name, "reason": reason, "kernel_log": words, **details})


class Kernel(ABC):
    """Module operations on one host (its running kernel, seen through `root`)."""

    name = "abstract"

    def __init__(self, root: Root, runner) -> None:
        self.root = root
        self.runner = runner
        from driverd.host.kernel import running_release
        self.release = running_release(root) or ""

    # -- inspection (shared: both kernels expose the same procfs/sysfs files) --------------------
    def modules(self, names: Iterable[str] | None = None) -> dict[str, LoadedModule]:
        """The loaded modules with their refcount, holders, version and parameters (sysfs) - all of them,
        or those of `names` that are loaded. Naming them matters: a GPU host runs a hundred modules or
        more, each several files to read, and a reload asks a dozen times."""
        rows = loaded_modules(self.root)
        if names is not None:
            rows = {n: rows[n] for n in dict.fromkeys(names) if n in rows}
        out = {}
        for name, row in rows.items():
            mf = read_module(self.root, name, row)
            params = {p: (self.root.read_first_line(f"/sys/module/{name}/parameters/{p}") or "")
                      for p in self.root.listdir(f"/sys/module/{name}/parameters")}
            out[name] = LoadedModule(name, mf.refcount, mf.holders, mf.version, params)
        return out

    def loaded_names(self) -> set[str]:
        """The names of the loaded modules (/proc/modules alone: the same set modules() has)."""
        return set(loaded_modules(self.root))

    def is_loaded(self, name: str) -> bool:
        return name in self.loaded_names()

    def modules_dir(self) -> str:
        return f"/lib/modules/{self.release}"

    def module_file(self, name: str) -> str | None:
        """Host path of the file modprobe would load for `name`, from depmod's modules.dep."""
        dep = parse_modules_dep(self.root.read_text(f"{self.modules_dir()}/modules.dep") or "")
        rel = dep.get(name.replace("-", "_"))
        return f"{self.modules_dir()}/{rel[0]}" if rel else None

    def module_deps(self, name: str) -> list[str]:
        dep = parse_modules_dep(self.root.read_text(f"{self.modules_dir()}/modules.dep") or "")
        rel = dep.get(name.replace("-", "_"))
        return [module_name(p) for p in rel[1]] if rel else []

    def modinfo(self, name: str) -> ModInfo:
        path = self.module_file(name)
        if path is None:
            raise ModuleError(f"module {name} is not installed for kernel {self.release}",
                              cause=f"{self.modules_dir()}/modules.dep has no entry for {name}",
                              fix="install the driver package (driverd install) or run depmod")
        real = str(self.root.real(path))
        try:
            return read_modinfo(real)
        except (OSError, ValueError) as e:
            raise ModuleError(f"cannot read module {name} ({path}): {e}", cause="the installed .ko file is damaged",
                              fix="reinstall the driver package (driverd install)") from None

    # -- the module tree: depmod and modprobe's resolution ----------------------------------------
    @abstractmethod
    def depmod(self, release: str, check: bool = True) -> str:
        """Write `release`'s modules.dep (and what else the implementation indexes) for the module
        files under /lib/modules/<release> in the root. Returns the command as it ran (for reports).
        Raises ModuleError when `check` and it failed."""

    @abstractmethod
    def show_depends(self, release: str, name: str) -> list[str]:
        """The module files (real paths) `modprobe` would insert for `name` under `release`,
        dependencies first, `name` last. Raises ModuleError when it does not resolve."""

    # -- the kernel's log ------------------------------------------------------------------------
    @abstractmethod
    def log_mark(self) -> int: ...

    @abstractmethod
    def log_since(self, mark: int) -> list[str]: ...

    # -- changes ---------------------------------------------------------------------------------
    @abstractmethod
    def load(self, name: str, params: dict[str, str] | None = None) -> None:
        """Insert `name` (modprobe semantics: a loaded module is left alone). Raises ModuleError."""

    @abstractmethod
    def unload(self, name: str) -> None:
        """Remove exactly `name` (rmmod semantics). Raises ModuleError (e.g. in use)."""

    @abstractmethod
    def mknod(self, hostpath: str, major: int, minor: int) -> None: ...

    @abstractmethod
    def set_firmware_path(self, hostdir: str) -> None:
        """Point the kernel's firmware loader at an extra directory (firmware_class.path)."""

    def firmware_path(self) -> str:
        return (self.root.read_first_line("/sys/module/firmware_class/parameters/path") or "").strip()

    # -- processes (holders are terminated through the kernel boundary) ---------------------------
    @abstractmethod
    def signal(self, pid: int, sig: int) -> None: ...

    @abstractmethod
    def alive(self, pid: int) -> bool: ...

    def wait_gone(self, pids: list[int], timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        left = [p for p in pids if self.alive(p)]
        while left and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            left = [p for p in left if self.alive(p)]
        return left


def parse_modules_dep(text: str) -> dict[str, tuple[str, list[str]]]:
    """modules.dep: 'path/mod.ko: dep1.ko dep2.ko' -> {name: (path, [deps in load-last-first order])}."""
    out: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        path, sep, deps = line.partition(":")
        if not sep:
            continue
        name = module_name(path.strip())
        out.setdefault(name, (path.strip(), deps.split()))
    return out


_ERRNO_FIX = {
    "Exec format error": "the module was built for another kernel (vermagic); install the package built for "
                         "the running kernel",
    "Key was rejected by service": "the kernel enforces module signatures: sign the modules with a key "
                                   "enrolled in the MOK/platform keyring ([signing] key/cert)",
    "Required key not available": "the kernel enforces module signatures: sign the modules with an enrolled key",
    "Invalid argument": "a module parameter has a value the module rejects; check [modules.parameters]",
    "Numerical result out of range": "a module parameter's value is outside its type's range; check "
                                     "[modules.parameters]",
    "No such device": "no GPU could be initialised: check the kernel log lines above (firmware, nouveau bound, "
                      "unsupported GPU for this flavour)",
    "Unknown symbol in module": "a dependency is missing or was built against another driver version",
    "File exists": "the module is already loaded",
}


class RealKernel(Kernel):
    """kmod tools through the Runner. A root that is not the live host (a captured tree) can be read
    and dry-run, but never changed: modprobe would load this machine's kernel with another
    machine's files, and its PIDs are not this machine's."""

    name = "real"

    def __init__(self, root: Root, runner) -> None:
        super().__init__(root, runner)
        self.live = root.is_live()

    def _changes_allowed(self) -> bool:
        """False in dry-run (record only); raises for a real change to a tree that is not this host."""
        if self.runner.dry_run:
            return False
        self.check_changeable()
        return True

    def check_changeable(self) -> None:
        if not self.live:
            raise ConfigError(f"root {self.root.base} is not the live host; the real kernel cannot change it",
                              cause="its /proc is not this machine's /proc",
                              fix="use --kernel-backend sim for a simulated tree, --dry-run to see the steps, or run on "
                                  "the host (root / or /host)")

    def _tool(self, name: str) -> str:
        """The tool's path on PATH, looked up once per process once found (a reload runs eight)."""
        got = _TOOLS.get(name)
        if got is None:
            from driverd.runner import which
            got = which(name)
            if got is None:
                return name
            _TOOLS[name] = got
        return got

    def log_mark(self) -> int:
        """Where the kernel log is now: the timestamp (µs) of its last line. Not a count of lines: once
        the ring buffer is full (a long-running host, a verbose boot) old lines drop out as new ones
        arrive, and a count would hide exactly the lines of the attempt (seen on Debian's 6.1 in the VM
        tests)."""
        stamped = self._log()
        return stamped[-1][0] if stamped else 0

    def log_since(self, mark: int) -> list[str]:
        return [ln for t, ln in self._log() if t > mark]

    def _log(self) -> list[tuple[int, str]]:
        if not self.live:      # this machine's kernel log says nothing about a captured tree
            return []
        got = kmsg.records()
        return got if got is not None else _stamped(self._dmesg())

    def _dmesg(self) -> list[str]:
        res = self.runner.run([self._tool("dmesg")], timeout=15, check=False, mutates=False)
        return res.stdout.splitlines() if res.ok else []

    def _attempt(self, verb: str, name: str, argv: list[str], timeout: float, fix) -> None:
        """Run modprobe/rmmod; a failure carries the kernel's lines logged meanwhile (read from the log's
        tail only then; a mark by the whole log where /dev/kmsg cannot be read). `fix`: reason -> fix."""
        with kmsg.Tail() as tail:
            mark = None if tail.ok else self.log_mark()
            res = self.runner.run(argv, timeout=timeout, check=False)
            if res.ok:
                return
            reason = _reason(res.stderr or res.stdout)
            log = tail.lines() if mark is None else self.log_since(mark)
        raise kernel_error(verb, name, reason, log or [], fix(reason))

    def depmod(self, release: str, check: bool = True) -> str:
        # Indexing a module tree is not a change to the running kernel: allowed for a captured tree.
        from driverd.runner import which
        exe = which("depmod")
        if exe is None:
            raise ModuleError("depmod is not installed", cause="kmod is missing", fix="install kmod")
        res = self.runner.run([exe, "-b", self.root.base, release], timeout=300, check=False)
        if check and not res.ok:
            raise ModuleError(f"depmod failed for {release}: {res.first_error_line()}",
                              cause=f"depmod -b {self.root.base} {release} exited {res.returncode}",
                              fix="see the depmod message")
        return " ".join(res.argv)

    def show_depends(self, release: str, name: str) -> list[str]:
        from driverd.runner import which
        exe = which("modprobe")
        if exe is None:
            raise ModuleError("modprobe is not installed", cause="kmod is missing", fix="install kmod")
        res = self.runner.run([exe, "-d", self.root.base, "-S", release, "--show-depends", name], timeout=60,
                              check=False, mutates=False)
        if res.dry_run:
            return []
        if not res.ok:
            raise ModuleError(f"installed modules do not resolve: {res.first_error_line()}",
                              cause=f"modprobe --show-depends {name} failed after depmod",
                              fix="check the package's modules and run depmod")
        # 'insmod /path/mod.ko [options from modprobe.d]': the path is the second word
        return [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("insmod ") and len(ln.split()) > 1]

    def load_argv(self, name: str, params: dict[str, str] | None = None) -> list[str]:
        argv = [self._tool("modprobe")]
        if not self.root.is_slash:
            argv += ["-d", self.root.base]        # modules.dep and the .ko files of the host tree
        return argv + [name] + [f"{k}={v}" for k, v in sorted((params or {}).items())]

    def unload_argv(self, name: str) -> list[str]:
        return [self._tool("rmmod"), name]

    def load(self, name: str, params: dict[str, str] | None = None) -> None:
        if not self._changes_allowed():
            self.runner.run(self.load_argv(name, params))      # recorded by the dry-run runner
            return
        self._attempt("load", name, self.load_argv(name, params), 300,
                      lambda reason: _ERRNO_FIX.get(reason, "see the kernel log (dmesg) for the NVRM lines"))

    def unload(self, name: str) -> None:
        if not self._changes_allowed():
            self.runner.run(self.unload_argv(name))
            return
        self._attempt("unload", name, self.unload_argv(name), 120,
                      lambda reason: "stop the processes and modules holding it (driverd unload lists them)")

    def mknod(self, hostpath: str, major: int, minor: int) -> None:
        if not self._changes_allowed():
            return
        self.root.mknod(hostpath, 0o666 | stat.S_IFCHR, os.makedev(major, minor))

    def set_firmware_path(self, hostdir: str) -> None:
        if not self._changes_allowed():
            return
        self.root.write_existing("/sys/module/firmware_class/parameters/path", hostdir)

    def signal(self, pid: int, sig: int) -> None:
        if not self._changes_allowed():
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def alive(self, pid: int) -> bool:
        """A zombie is not alive: it has closed its files and dropped its module references; only its
        parent's wait() is missing (seen in the VM tests: a terminated holder whose parent had not
        reaped it yet was reported as 'survived SIGKILL, stuck in D state')."""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        stat = self.root.read_text(f"/proc/{pid}/stat") or ""
        state = stat.rpartition(")")[2].split()[:1]
        return state not in (["Z"], ["X"])


_TOOLS: dict[str, str] = {}
_STAMP = re.compile(r"^\[\s*(\d+)\.(\d{6})\]")


def _stamped(lines: list[str]) -> list[tuple[int, str]]:
    """(µs since boot, line) for dmesg's lines; a line without a stamp (a record's continuation) takes
    the one before it."""
    out, t = [], 0
    for ln in lines:
        m = _STAMP.match(ln)
        if m:
            t = int(m.group(1)) * 1_000_000 + int(m.group(2))
        out.append((t, ln))
    return out


def _reason(text: str) -> str:
    """'modprobe: ERROR: could not insert 'nvidia': Exec format error' -> 'Exec format error'."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "failed"
    last = lines[-1]
    m = re.search(r"could not (?:insert|remove) '[^']+': (.+)$", last) or re.search(r"ERROR: (.+)$", last)
    return (m.group(1) if m else last).strip()


KERNELS = ("auto", "real", "sim")


def select_kernel(root: Root, runner, choice: str | None = None) -> Kernel:
    """The one place the kernel implementation is chosen.

    Order: explicit choice (--kernel), then modules.kernel from the configuration (or
    $DRIVERD_MODULES_KERNEL). The simulated kernel is used only when asked for by name: nothing under
    the root (no marker file, no /host) switches a command to it, so a production host can never end up
    on it by accident. "auto" (older configurations) means real. Implementations other than the real
    one come from driverd.backends (the simulated kernel is registered there by driverd.sim).
    """
    from driverd import backends
    choice = choice or "auto"
    if choice not in KERNELS:
        raise ConfigError(f"unknown kernel {choice!r}", cause="the kernel boundary is real or sim",
                          fix="use --kernel-backend real|sim|auto (modules.kernel)")
    if choice == "auto":
        choice = "real"
    if choice == "real":
        return RealKernel(root, runner)
    if root.is_slash:
        raise ConfigError("the simulated kernel never runs on root /", cause="it would write into /proc and /sys",
                          fix="pass --root DIR with a simulated host tree (driverd demo makes one)")
    factory = backends.KERNELS.get(choice)
    if factory is None:
        raise ConfigError(f"the {choice} kernel is not available in this process",
                          cause="driverd.sim was not installed as a backend",
                          fix="run through the driverd command line, or call driverd.sim.install_backends()")
    return factory(root, runner)


def installed_dir(release: str) -> str:
    return f"/lib/modules/{release}/{INSTALL_DIR}"


__all__ = ["Kernel", "RealKernel", "LoadedModule", "select_kernel", "parse_modules_dep", "kernel_error",
           "installed_dir", "_signal"]
