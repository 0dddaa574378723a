"""The one way driverd runs external commands (modprobe, depmod, make, systemctl, containerd...).

Argument lists only (never a shell string), a timeout on everything, output captured, and a dry-run
mode in which commands that change the host are recorded instead of run. Built on `sh`, imported
lazily so host-only reads stay fast.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import field
from typing import Callable, Sequence

from driverd.datatypes import dataclass
from driverd.errors import CommandError


@dataclass(frozen=True)
class Result:
    """One finished (or dry-run) command: its words, exit status and output."""
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration_s: float = 0.0
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def first_error_line(self) -> str:
        for stream in (self.stderr, self.stdout):
            for line in stream.splitlines():
                if line.strip():
                    return line.strip()
        return f"exit status {self.returncode}"


@dataclass
class Runner:
    """Runs host commands, records them, and can stop every one still running."""
    dry_run: bool = False
    env: dict[str, str] | None = None
    history: list[Result] = field(default_factory=list)
    # commands running now (from any thread), so that cancel() can stop them all
    _live: dict = field(default_factory=dict, repr=False)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop every command this runner is running (a build-matrix interrupted while cells compile in
        worker threads: the signal reaches the main thread only) and refuse new ones."""
        self._cancelled.set()
        for proc, group in list(self._live.values()):
            _stop(proc, group)

    def run(self, argv: Sequence[str | os.PathLike], *, timeout: float = 120, check: bool = True,
            input: str | bytes | None = None, cwd: str | os.PathLike | None = None,
            env: dict[str, str | None] | None = None, mutates: bool = True,
            on_line: Callable[[str], None] | None = None, group: bool = False) -> Result:
        """env: variables added to the command's environment; a None value removes the variable.
        `on_line` is called with each line of the command's stdout as it comes (its output is still
        captured). `group` runs the command in a process group of its own (make and the compilers it
        starts) so that a timeout or an interruption stops all of them, not only the first."""
        args = tuple(os.fspath(a) for a in argv)
        if not args:
            raise ValueError("empty argv")
        if self.dry_run and mutates:
            res = Result(args, 0, "", "", 0.0, dry_run=True)
            self.history.append(res)
            return res
        if self._cancelled.is_set():
            raise CommandError(f"{os.path.basename(args[0])} not started: interrupted",
                               cause="the command was interrupted", fix="run it again")
        import sh

        run_env = None
        if env is not None or self.env is not None:
            merged = {**os.environ, **(self.env or {}), **(env or {})}
            run_env = {k: v for k, v in merged.items() if v is not None}
        exe = args[0] if os.sep in args[0] else shutil.which(args[0])
        if exe is None or not os.access(exe, os.X_OK):
            raise CommandError(f"command not found: {args[0]}", cause="it is not installed or not on PATH",
                               fix=f"install the package that provides {os.path.basename(args[0])}")
        kwargs: dict = dict(_bg=True, _return_cmd=True, _ok_code=_ALL_EXITS, _tty_out=False,
                            _decode_errors="replace", _in=input if input is not None else "")
        if cwd is not None:
            kwargs["_cwd"] = os.fspath(cwd)
        if run_env is not None:
            kwargs["_env"] = run_env
        lines: list[str] = []
        if on_line is not None:
            def out(line: str) -> None:
                lines.append(line)
                try:
                    on_line(line.rstrip("\n"))
                except Exception:          # progress must never break the command it reports on
                    pass
            kwargs.update(_out=out, _out_bufsize=1)
        if group:
            kwargs.update(_new_group=True, _preexec_fn=_die_with_parent())
        start = time.monotonic()
        fired = threading.Event()
        try:
            # Started in the background and waited for without sh's own timeout: sh polls a timed
            # wait every 100 ms (and its _timeout= watcher costs ~100 ms per command), which
            # dominated package installs. A timer kills the command instead; waitpid returns at once.
            proc = sh.Command(exe)(*args[1:], **kwargs)
            key = object()
            self._live[key] = (proc, group)
            timer = threading.Timer(timeout, lambda: (fired.set(), _stop(proc, group, grace=0)))
            timer.start()
            try:
                proc.wait()
            except BaseException:
                # Interrupted while waiting (Ctrl-C, or SIGTERM turned into an exception): the command
                # must not outlive us, nor keep writing into a tree the caller is about to remove.
                _stop(proc, group)
                raise
            finally:
                timer.cancel()
                self._live.pop(key, None)
            if fired.is_set():
                raise CommandError(f"{' '.join(args[:3])} timed out after {timeout:g}s",
                                   cause="the command did not finish in time",
                                   fix="check the host load or raise the timeout")
            rc = proc.exit_code if proc.exit_code >= 0 else 128 - proc.exit_code   # killed by a signal
        except OSError as e:
            raise CommandError(f"cannot run {args[0]}: {e.strerror}", cause=str(e),
                               fix=f"check that {args[0]} is an executable") from None
        out = "".join(lines) if on_line is not None else _text(proc.stdout)
        err = _text(proc.stderr)
        res = Result(args, rc, out, err, time.monotonic() - start)
        self.history.append(res)
        if check and rc != 0:
            raise CommandError(f"{os.path.basename(args[0])} failed (exit {rc}): {res.first_error_line()}",
                               cause=" ".join(args), fix="see the command's output above")
        return res


# sh reports a signal death as a negative exit code; accepting them all keeps sh from raising (and
# from printing tracebacks in its background thread): the runner judges exit codes itself.
_ALL_EXITS = list(range(-64, 256))


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec function for the child: SIGTERM when driverd dies, even by SIGKILL (prctl
    PR_SET_PDEATHSIG), so that a command in a group of its own is never left running. ctypes is
    loaded here, only for such commands."""
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)         # 1: PR_SET_PDEATHSIG


def _stop(proc, group: bool, grace: float = 3.0) -> None:
    """End a command: SIGTERM (make then removes its half-written targets and stops its jobs), SIGKILL
    after `grace` seconds; to its whole process group when it has one. Waits until it is gone."""
    pid = proc.pid

    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(pid, sig)     # pgid == pid: still valid while any member lives
            else:
                os.kill(pid, sig)
        except OSError:                 # already gone
            pass
    if grace > 0:
        send(signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end and _alive(pid, group):
            time.sleep(0.05)
    send(signal.SIGKILL)
    end = time.monotonic() + 10
    while time.monotonic() < end and _alive(pid, group):
        time.sleep(0.02)


def _alive(pid: int, group: bool) -> bool:
    """Whether the process (or any member of its group) still runs; zombies do not count."""
    if not group:
        return _state(pid) not in (None, "Z")
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    for n in names:
        if n.isdigit():
            st = _stat(int(n))
            if st is not None and st[2] == str(pid) and st[0] != "Z":
                return True
    return False


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _state(pid: int) -> str | None:
    st = _stat(pid)
    return st[0] if st else None


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else (v or "")


def which(name: str, root=None, extra: Sequence[str] = ()) -> str | None:
    """Path of an executable on the host's standard PATH inside `root` (a Root), or on ours."""
    dirs = list(extra) + ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
    if root is None or root.is_slash:
        found = shutil.which(name, path=os.pathsep.join(dirs + os.environ.get("PATH", "").split(os.pathsep)))
        return found
    for d in dirs:
        real = root.real(f"{d}/{name}")
        if real.is_file() and os.access(real, os.X_OK):
            return str(real)
    return None


# The directory driverd itself was imported from (site-packages, or a source checkout).
_HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What an isolated child runs: driverd's own directory, and those of the modules named (python_child's
# site_modules), are appended (never prepended: the standard library and site-packages come first) where
# the interpreter's own path does not have them, then the module runs as __main__ with its arguments.
_BOOT = ("import os, sys, runpy; homes, module = sys.argv.pop(1), sys.argv.pop(1); "
         "[h in sys.path or sys.path.append(h) for h in homes.split(os.pathsep)]; "
         "runpy.run_module(module, run_name='__main__', alter_sys=True)")

# Where driverd's own children run: never the caller's working directory, which another user may write.
CHILD_CWD = "/"


def python_child(module: str, *args: str, python: str | None = None, site_modules: Sequence[str] = ()) -> list[str]:
    """The argv of a Python child of driverd's own (the workload probe, the NVML query), which runs as
    root. `-I` (isolated): neither the working directory nor the script's nor the user's site directory
    is on its module path and no PYTHON* variable is read, so a `json.py` planted where the caller
    stood, or a PYTHONPATH/PYTHONSTARTUP in root's environment, is never imported. Run it with
    `cwd=CHILD_CWD`. The module name travels as an argument, as runpy's `alter_sys` expects: the child
    sees `sys.argv == [<module file>, *args]`.

    `site_modules`: the only third-party modules the child imports. Given, it starts without `site`
    (`-S`) and gets just their directories, as this process found them: no `.pth` file of the machine's
    site-packages runs in it (issue 47: one such file cost the GPU hosts' workload check 40 ms a start)."""
    if not site_modules:
        return [python or sys.executable, "-I", "-c", _BOOT, _HOME, module, *args]
    homes = [_HOME] + [d for d in dict.fromkeys(_module_dir(m) for m in site_modules) if d]
    return [python or sys.executable, "-I", "-S", "-c", _BOOT, os.pathsep.join(homes), module, *args]


def _module_dir(name: str) -> str | None:
    """The sys.path entry a top-level module is found in, without importing it (None: not installed)."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    origin = os.path.dirname(spec.origin)
    return os.path.dirname(origin) if spec.submodule_search_locations else origin
