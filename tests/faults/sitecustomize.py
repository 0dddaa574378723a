"""Fault injector for crash tests: put tests/faults first on a subprocess's PYTHONPATH.

Does nothing unless one of these is set in the environment:

    FAULTS_TRACE=FILE            append "N label" to FILE for every durable effect (label: op and path,
                                 e.g. "replace /root/var/lib/driverd/x.json")
    FAULTS_KILL_AFTER=N          SIGKILL this process right after its Nth durable effect
    FAULTS_RAISE=OP:ERRNO:NTH    the NTH call of OP raises OSError(ERRNO) before doing anything
                                 (several, comma-separated; ERRNO by name: ENOSPC, EROFS, EDQUOT...)
    FAULTS_FAIL_CALL=MOD:FN      that function raises OSError(EIO) when called (comma-separated list)
    FAULTS_UNDER=DIR             count only effects on paths under DIR (the host tree), commands, and
                                 the simulated kernel's and daemons' operations

The simulated kernel's load/unload/spawn/signal/mknod/set_firmware_path and the simulated daemons'
start/stop are each ONE effect (the files the simulation renders inside them are not counted): a
real insmod or daemon start is not left half-way by a kill of the process that asked for it.

Durable effects, counted when the call returns without raising (wrapped once, here, by replacing
the module attributes, so every later `os.replace(...)` / `shutil.rmtree(...)` anywhere goes through
the wrapper): os.replace, rename, unlink, remove, rmdir, fsync, mknod, symlink, link, mkdir;
shutil.rmtree (one effect: what it calls inside is not counted separately); a successful
driverd.install.switch.exchange; driverd.runner.Runner.run with mutates=True outside dry-run (one
effect, after the command ran). The last two are wrapped when their module is first imported (a
meta path finder patches the module right after it executes, before anyone imports names from it).

OP names for FAULTS_RAISE are the effect names above (replace, rename, ..., rmtree, exchange, run)
plus `write`. `write` approximates "the disk is full": it counts calls of os.write AND os.fsync
together and makes the NTH of them fail. Writes through Python file objects (open().write) cannot be
intercepted here (io.FileIO is a C type); they reach the disk only through a later fsync, so failing
the fsync stands in for them (a `fsync:` spec counts fsync calls alone).

Python's own site.py imports this module at start-up; nothing else of driverd is imported here.
`configure()` resets the counters (for a test that forks children instead of starting processes:
start the parent with FAULTS_ARMED=1, then call configure_from_env() in each child).
"""
from __future__ import annotations

import errno as _errno
import importlib.abc
import importlib.machinery
import os
import shutil
import signal
import sys

_real = {n: getattr(os, n) for n in ("replace", "rename", "unlink", "remove", "rmdir", "fsync", "mknod", "symlink",
                                     "link", "mkdir", "write", "open", "close", "getpid", "kill")
         if hasattr(os, n)}
_real_rmtree = shutil.rmtree
_cfg: dict = {}
_busy = 0               # >0 while a counted operation runs: what it does inside is not counted again


def _parse_raise(spec: str) -> dict[str, tuple[int, int]]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        op, err, nth = part.split(":")
        code = int(err) if err.isdigit() else getattr(_errno, err)
        out[op] = (code, int(nth))
    return out


def configure(kill_after: int | None = None, trace: str | None = None, raise_spec: str = "") -> None:
    """(Re)start counting with these settings (the environment's, at import)."""
    _cfg.clear()
    _cfg.update(kill_after=kill_after, trace=trace, raise_=_parse_raise(raise_spec), count=0, calls={})


def configure_from_env() -> bool:
    """configure() from the FAULTS_* variables; False when none is set (FAULTS_ARMED=1 counts as set:
    wrap everything, inject nothing, for a parent that configures forked children later)."""
    k, t, r = os.environ.get("FAULTS_KILL_AFTER"), os.environ.get("FAULTS_TRACE"), os.environ.get("FAULTS_RAISE")
    configure(int(k) if k else None, t or None, r or "")
    return bool(k or t or r or os.environ.get("FAULTS_ARMED") or os.environ.get("FAULTS_FAIL_CALL"))


def _path(a) -> str:
    if isinstance(a, int):      # fsync(fd): name the file or directory it is open on
        try:
            return os.readlink(f"/proc/self/fd/{a}")
        except OSError:
            return f"fd:{a}"
    return os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else repr(a)


def _maybe_raise(op: str) -> None:
    spec = _cfg.get("raise_", {}).get(op)
    if spec is None:
        return
    calls = _cfg["calls"]
    calls[op] = calls.get(op, 0) + 1
    if calls[op] == spec[1]:
        raise OSError(spec[0], os.strerror(spec[0]))


def _effect(label: str, always: bool = False) -> None:
    under = os.environ.get("FAULTS_UNDER")
    if under and not always and not label.startswith("run ") and under not in label:
        return                  # scratch space outside the host tree (temp dirs): not durable state
    _cfg["count"] += 1
    n = _cfg["count"]
    if _cfg.get("trace"):
        fd = _real["open"](_cfg["trace"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _real["write"](fd, f"{n} {label}\n".encode())
        finally:
            _real["close"](fd)
    if _cfg.get("kill_after") == n:
        _real["kill"](_real["getpid"](), signal.SIGKILL)


def _counted(op: str, fn, label_args=1):
    def wrapper(*args, **kwargs):
        if _busy:               # inside rmtree / a command (any thread): one effect for the whole
            return fn(*args, **kwargs)
        _maybe_raise(op)
        if op == "fsync":
            _maybe_raise("write")
        res = _inside(fn, *args, **kwargs)
        if op == "exchange" and res is not True:
            return res
        dfd = kwargs.get("dir_fd", kwargs.get("src_dir_fd"))
        names = [_path(a) for a in args[:label_args]]
        if isinstance(dfd, int):     # *at() calls: name the files by their directory's path
            base = _path(dfd)
            names = [n if n.startswith("/") else f"{base}/{n}" for n in names]
        _effect(" ".join([op] + names))
        return res
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", op)
    return wrapper


def _inside(fn, *args, **kwargs):
    global _busy
    _busy += 1
    try:
        return fn(*args, **kwargs)
    finally:
        _busy -= 1


def _write(fd, data):
    if not _busy:
        _maybe_raise("write")
    return _real["write"](fd, data)


def _run_wrapper(run):
    def wrapper(self, argv, *a, **kw):
        if _busy:
            return run(self, argv, *a, **kw)
        if not kw.get("mutates", True) or self.dry_run:     # not an effect; nor is anything inside it
            return _inside(run, self, argv, *a, **kw)
        _maybe_raise("run")
        res = _inside(run, self, argv, *a, **kw)
        _effect("run " + " ".join(os.fspath(x) for x in list(argv)[:4]))
        return res
    wrapper.__wrapped__ = run
    return wrapper


def _atomic_method(op: str, fn):
    """A method of the simulated kernel or its daemons is one effect, as the real operation is: a
    process killed during insmod or while starting a daemon does not leave the kernel half-way, so
    the files the simulation renders inside it are not kill points of their own."""
    def wrapper(self, *args, **kwargs):
        if _busy:
            return fn(self, *args, **kwargs)
        _maybe_raise(op)
        res = _inside(fn, self, *args, **kwargs)
        _effect(f"{op} {fn.__name__} " + " ".join(str(a) for a in args[:1]), always=True)
        return res
    wrapper.__wrapped__ = fn
    return wrapper


def _quiet_method(fn):
    """The simulated kernel re-rendering its /proc and /sys views from its own state (idempotent,
    on every read): no effect of driverd's at all."""
    def wrapper(self, *args, **kwargs):
        return _inside(fn, self, *args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


def _patch_methods(cls, op: str, names: tuple[str, ...], quiet: tuple[str, ...] = ()) -> None:
    for n in names:
        if n in cls.__dict__:
            setattr(cls, n, _atomic_method(op, cls.__dict__[n]))
    for n in quiet:
        if n in cls.__dict__:
            setattr(cls, n, _quiet_method(cls.__dict__[n]))


_LATE = {
    "driverd.runner": lambda m: setattr(m.Runner, "run", _run_wrapper(m.Runner.run)),
    "driverd.install.switch": lambda m: setattr(m, "exchange", _counted("exchange", m.exchange, 2)),
    "driverd.sim.kernel": lambda m: _patch_methods(m.SimKernel, "kernel", (
        "load", "unload", "spawn", "signal", "mknod", "set_firmware_path"), quiet=("__init__", "modules", "_render")),
    "driverd.sim.services": lambda m: (_patch_methods(m.SimServices, "daemon", ("start", "stop")),
                                       _patch_methods(m.SimMig, "mig", ("create",))),
}


def _failing(fn, where: str):
    def wrapper(*args, **kwargs):
        raise OSError(_errno.EIO, f"injected failure in {where}")
    wrapper.__wrapped__ = fn
    return wrapper


def _fail_calls() -> None:
    """FAULTS_FAIL_CALL=module:function[,...]: that function raises OSError(EIO) when called (e.g. a
    runtime restart that fails after its configuration was written)."""
    for spec in filter(None, os.environ.get("FAULTS_FAIL_CALL", "").split(",")):
        mod, _, fn = spec.partition(":")
        prev = _LATE.get(mod)

        def patch(m, _fn=fn, _prev=prev, _spec=spec):
            if _prev:
                _prev(m)
            setattr(m, _fn, _failing(getattr(m, _fn), _spec))
        _LATE[mod] = patch


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds the modules in _LATE with the normal finders and patches them right after they execute."""

    def find_spec(self, name, path=None, target=None):
        if name not in _LATE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                real_exec = spec.loader.exec_module

                def exec_module(module, _real_exec=real_exec, _patch=_LATE[name]):
                    _real_exec(module)
                    _patch(module)
                spec.loader.exec_module = exec_module
                return spec
        return None


def _install() -> None:
    _fail_calls()
    for op in ("replace", "rename", "symlink", "link"):
        setattr(os, op, _counted(op, _real[op], 2))
    for op in ("unlink", "remove", "rmdir", "fsync", "mknod", "mkdir"):
        if op in _real:
            setattr(os, op, _counted(op, _real[op]))
    os.write = _write
    shutil.rmtree = _counted("rmtree", _real_rmtree)
    for name, patch in _LATE.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchAfterLoad())


if configure_from_env():
    _install()
