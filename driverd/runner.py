"""The one way driverd runs external commands (modprobe, depmod, make, systemctl, containerd...).

Argument lists only (never a shell string), a timeout on everything, output captured, and a dry-run
mode in which commands that change the host are recorded instead of run. Built on `sh`, imported
lazily so host-only reads stay fast.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from driverd.errors import CommandError


@dataclass(frozen=True)
class Result:
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
    dry_run: bool = False
    env: dict[str, str] | None = None
    history: list[Result] = field(default_factory=list)

    def run(self, argv: Sequence[str | os.PathLike], *, timeout: float = 120, check: bool = True,
            input: str | bytes | None = None, cwd: str | os.PathLike | None = None,
            env: dict[str, str | None] | None = None, mutates: bool = True) -> Result:
        """env: variables added to the command's environment; a None value removes the variable."""
        args = tuple(os.fspath(a) for a in argv)
        if not args:
            raise ValueError("empty argv")
        if self.dry_run and mutates:
            res = Result(args, 0, "", "", 0.0, dry_run=True)
            self.history.append(res)
            return res
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
        start = time.monotonic()
        fired = threading.Event()
        try:
            # Started in the background and waited for without sh's own timeout: sh polls a timed
            # wait every 100 ms (and its _timeout= watcher costs ~100 ms per command), which
            # dominated package installs. A timer kills the command instead; waitpid returns at once.
            proc = sh.Command(exe)(*args[1:], **kwargs)
            timer = threading.Timer(timeout, lambda: (fired.set(), _kill(proc)))
            timer.start()
            try:
                proc.wait()
            finally:
                timer.cancel()
            if fired.is_set():
                raise CommandError(f"{' '.join(args[:3])} timed out after {timeout:g}s",
                                   cause="the command did not finish in time",
                                   fix="check the host load or raise the timeout")
            rc = proc.exit_code if proc.exit_code >= 0 else 128 - proc.exit_code   # killed by a signal
        except OSError as e:
            raise CommandError(f"cannot run {args[0]}: {e.strerror}", cause=str(e),
                               fix=f"check that {args[0]} is an executable") from None
        out = _text(proc.stdout)
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


def _kill(proc) -> None:
    try:
        proc.kill()
    except OSError:   # already gone
        pass


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
