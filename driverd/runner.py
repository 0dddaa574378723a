"""The one way driverd runs external commands (modprobe, depmod, make, systemctl, containerd...).

Argument lists only (never a shell string), a timeout on everything, output captured, and a dry-run
mode in which commands that change the host are recorded instead of run. Built on `sh`, imported
lazily so host-only reads stay fast.
"""
from __future__ import annotations

import os
import shutil
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
            env: dict[str, str] | None = None, mutates: bool = True) -> Result:
        args = tuple(os.fspath(a) for a in argv)
        if not args:
            raise ValueError("empty argv")
        if self.dry_run and mutates:
            res = Result(args, 0, "", "", 0.0, dry_run=True)
            self.history.append(res)
            return res
        import sh  # lazy: importing sh costs start-up time that `detect` does not pay

        run_env = None
        if env is not None or self.env is not None:
            run_env = {**os.environ, **(self.env or {}), **(env or {})}
        start = time.monotonic()
        try:
            cmd = sh.Command(args[0])
        except sh.CommandNotFound:
            raise CommandError(f"command not found: {args[0]}", cause="it is not installed or not on PATH",
                               fix=f"install the package that provides {os.path.basename(args[0])}") from None
        kwargs: dict = dict(_timeout=timeout, _ok_code=list(range(256)), _return_cmd=True,
                            _decode_errors="replace", _tty_out=False)
        if input is not None:
            kwargs["_in"] = input
        if cwd is not None:
            kwargs["_cwd"] = os.fspath(cwd)
        if run_env is not None:
            kwargs["_env"] = run_env
        try:
            proc = cmd(*args[1:], **kwargs)
            rc = proc.exit_code
            out = proc.stdout.decode(errors="replace") if isinstance(proc.stdout, bytes) else str(proc.stdout)
            err = proc.stderr.decode(errors="replace") if isinstance(proc.stderr, bytes) else str(proc.stderr)
        except sh.TimeoutException:
            raise CommandError(f"{' '.join(args[:3])} timed out after {timeout:g}s",
                               cause="the command did not finish in time",
                               fix="check the host load or raise the timeout") from None
        except sh.SignalException as e:  # killed by a signal: report it like a failure
            rc, out, err = 128 + abs(e.exit_code), "", str(e)
        res = Result(args, rc, out, err, time.monotonic() - start)
        self.history.append(res)
        if check and rc != 0:
            raise CommandError(f"{os.path.basename(args[0])} failed (exit {rc}): {res.first_error_line()}",
                               cause=" ".join(args), fix="see the command's output above")
        return res


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
