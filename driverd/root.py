"""The host root: every host path driverd reads or writes is resolved under one directory.

`/` on a host, `/host` in the driver container, a temporary tree in tests. Absolute symlinks inside
the tree (e.g. /lib/modules/<release>/build -> /usr/src/linux-headers-...) are followed *inside* the
root, the way the host itself would see them, never on the machine running driverd.

A Root can record every host path it touched; `driverd debug capture-host` uses that to pack exactly
the files detect reads, so the capture never drifts from the readers.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_MAX_LINKS = 40


class Root:
    def __init__(self, path: str | os.PathLike = "/", *, record: bool = False) -> None:
        self.base = os.path.abspath(os.fspath(path))
        self.recorded: set[str] | None = set() if record else None

    def __repr__(self) -> str:
        return f"Root({self.base!r})"

    @property
    def is_slash(self) -> bool:
        return self.base == "/"

    # -- path mapping -------------------------------------------------------------------------
    @staticmethod
    def _norm(hostpath: str) -> str:
        if not hostpath.startswith("/"):
            hostpath = "/" + hostpath
        return os.path.normpath(hostpath).replace("//", "/")

    def path(self, hostpath: str) -> Path:
        """The real path of `hostpath` under the root, without following symlinks."""
        hp = self._norm(hostpath)
        return Path(self.base + hp) if not self.is_slash else Path(hp)

    def resolve(self, hostpath: str) -> str:
        """Follow symlinks the way the host would, keeping absolute targets inside the root.

        Returns the resolved *host* path (e.g. '/usr/src/linux-headers-6.1.0-47-cloud-amd64').
        """
        hp = self._norm(hostpath)
        if self.is_slash and self.recorded is None:
            return os.path.realpath(hp)
        parts = [p for p in hp.split("/") if p]
        done: list[str] = []
        links = 0
        while parts:
            name = parts.pop(0)
            if name == "..":
                if done:
                    done.pop()
                continue
            if name == ".":
                continue
            cur = "/" + "/".join(done + [name])
            real = self.base + cur
            try:
                st = os.lstat(real)
            except OSError:
                done.append(name)
                done.extend(p for p in parts)
                parts = []
                break
            if stat.S_ISLNK(st.st_mode):
                self._record(cur)
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many symbolic links", cur)
                target = os.readlink(real)
                if target.startswith("/"):
                    done = []
                parts = [p for p in target.split("/") if p] + parts
            else:
                done.append(name)
        out = "/" + "/".join(done)
        self._record(out)
        return out

    def real(self, hostpath: str) -> Path:
        """The real on-disk path of `hostpath`, symlinks resolved inside the root."""
        return self.path(self.resolve(hostpath))

    def _record(self, hp: str) -> None:
        if self.recorded is not None:
            self.recorded.add(hp)

    # -- reads (never raise for a missing or unreadable file: facts report absence) ----------
    def read_bytes(self, hostpath: str, limit: int = 4 << 20) -> bytes | None:
        try:
            with open(self.real(hostpath), "rb") as f:
                return f.read(limit)
        except (OSError, ValueError):
            return None

    def read_text(self, hostpath: str, limit: int = 4 << 20) -> str | None:
        data = self.read_bytes(hostpath, limit)
        if data is None:
            return None
        return data.decode("utf-8", errors="replace")

    def read_first_line(self, hostpath: str) -> str | None:
        text = self.read_text(hostpath, 64 << 10)
        if text is None:
            return None
        return text.splitlines()[0].strip() if text.strip() else ""

    def listdir(self, hostpath: str) -> list[str]:
        try:
            return sorted(os.listdir(self.real(hostpath)))
        except OSError:
            return []

    def readlink(self, hostpath: str) -> str | None:
        hp = self._norm(hostpath)
        # Resolve the parent (it may itself be a link, e.g. /sys/bus/pci/devices/X), keep the leaf.
        parent = self.resolve(os.path.dirname(hp))
        leaf = parent.rstrip("/") + "/" + os.path.basename(hp)
        self._record(leaf)
        try:
            return os.readlink(self.path(leaf))
        except OSError:
            return None

    def exists(self, hostpath: str) -> bool:
        return self.real(hostpath).exists()

    def is_dir(self, hostpath: str) -> bool:
        return self.real(hostpath).is_dir()

    def is_file(self, hostpath: str) -> bool:
        return self.real(hostpath).is_file()

    def glob(self, hostdir: str, suffix: str = "") -> list[str]:
        """Host paths of the entries of `hostdir` whose names end with `suffix`, sorted."""
        d = self._norm(hostdir).rstrip("/")
        return [f"{d}/{n}" for n in self.listdir(d) if n.endswith(suffix)]

    def is_live(self) -> bool:
        """True when the tree's /proc is this machine's live /proc (host, or /host in a container).

        Live-only sources (NVML, signals to processes) are used only then; a captured tree from
        another machine is never mixed with this machine's state.
        """
        if self.is_slash:
            return True
        mine = _boot_id("/proc/sys/kernel/random/boot_id")
        theirs = _boot_id(str(self.path("/proc/sys/kernel/random/boot_id")))
        return mine is not None and mine == theirs and self.path("/proc/self").is_symlink()


def _boot_id(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
