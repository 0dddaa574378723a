"""The host root's path mapping and its read-only queries: the part of driverd.root.Root that every
reader uses (detect, facts, the capture of a host), which never writes and never raises for a tree
nobody has seen."""
from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

_MAX_LINKS = 40


class HostPaths:
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
        # pathlib here, not at the top: detect on the live root makes no Path, and pathlib's import (with the
        # urllib.parse and ipaddress it brings) was ~3 ms of it.
        from pathlib import Path
        return Path(self.on_disk(hostpath))

    def on_disk(self, hostpath: str) -> str:
        """path() as a string."""
        hp = self._norm(hostpath)
        return self.base + hp if not self.is_slash else hp

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

    def real_on_disk(self, hostpath: str) -> str:
        """real() as a string."""
        return self.on_disk(self.resolve(hostpath))

    def _record(self, hp: str) -> None:
        if self.recorded is not None:
            self.recorded.add(hp)

    # -- reads (never raise for a missing or unreadable file: facts report absence) ----------
    # Every query below answers "absent" rather than raising for a tree nobody has seen: symlink
    # loops (ELOOP), names the OS rejects (ENAMETOOLONG, NUL bytes -> ValueError), directories
    # where files belong, FIFOs and devices (which would block or never end).
    def safe_real(self, hostpath: str) -> Path | None:
        real = self.safe_on_disk(hostpath)
        if real is None:
            return None
        from pathlib import Path
        return Path(real)

    def safe_on_disk(self, hostpath: str) -> str | None:
        """safe_real() as a string."""
        try:
            return self.real_on_disk(hostpath)
        except (OSError, ValueError):
            return None

    def _direct(self, hostpath: str) -> str | None:
        """On the live root, not recording: the host path itself. The kernel follows its links as the host
        does, and nothing can lead out of "/"; resolving each component in Python first (os.path.realpath,
        an lstat each) was a third of `detect`'s reads on a GPU host."""
        if self.base == "/" and self.recorded is None:
            try:
                return self._norm(hostpath)
            except (TypeError, ValueError):
                return None
        return None

    def read_bytes(self, hostpath: str, limit: int = 4 << 20) -> bytes | None:
        real = self._direct(hostpath) or self.safe_on_disk(hostpath)
        return None if real is None else read_regular(real, limit)

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
            return sorted(os.listdir(self._direct(hostpath) or self.real_on_disk(hostpath)))
        except (OSError, ValueError):
            return []

    def readlink(self, hostpath: str) -> str | None:
        try:
            direct = self._direct(hostpath)
            if direct is not None:
                return os.readlink(direct)
            hp = self._norm(hostpath)
            # Resolve the parent (it may itself be a link, e.g. /sys/bus/pci/devices/X), keep the leaf.
            parent = self.resolve(os.path.dirname(hp))
            leaf = parent.rstrip("/") + "/" + os.path.basename(hp)
            self._record(leaf)
            return os.readlink(self.on_disk(leaf))
        except (OSError, ValueError):
            return None

    def link_targets(self, hostdir: str) -> dict[str, str]:
        """The target of each symbolic link in `hostdir`, by name (a process's open files: /proc/PID/fd).
        The directory is resolved once, not once a link (in the driver container each path under
        /host/proc was an lstat a component: a GPU-user scan read every open file of every process that
        way); the links themselves are read, never followed."""
        if self.recorded is not None:                 # a capture records each link it reads
            d = self._norm(hostdir).rstrip("/")
            return {n: t for n in self.listdir(d) if (t := self.readlink(f"{d}/{n}")) is not None}
        real = self._direct(hostdir) or self.safe_on_disk(hostdir)
        if real is None:
            return {}
        try:
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, ValueError):
            return {}
        out: dict[str, str] = {}
        try:
            # each link read relative to the open directory: /proc/PID/fd is not walked (and its PID
            # revalidated) again for every link, a quarter of the kernel's time on a busy host
            for name in os.listdir(fd):
                try:
                    out[name] = os.readlink(name, dir_fd=fd)
                except OSError:                       # not a link, or the file was closed meanwhile
                    pass
        except OSError:
            return {}
        finally:
            os.close(fd)
        return out

    def _stat(self, hostpath: str) -> os.stat_result | None:
        real = self._direct(hostpath) or self.safe_on_disk(hostpath)
        if real is None:
            return None
        try:
            return os.stat(real)
        except (OSError, ValueError):
            return None

    def exists(self, hostpath: str) -> bool:
        return self._stat(hostpath) is not None

    def is_dir(self, hostpath: str) -> bool:
        st = self._stat(hostpath)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def is_file(self, hostpath: str) -> bool:
        st = self._stat(hostpath)
        return st is not None and stat.S_ISREG(st.st_mode)

    def is_executable(self, hostpath: str) -> bool:
        """A regular file with an execute bit: what a runtime can exec (root ignores the other bits)."""
        st = self._stat(hostpath)
        return st is not None and stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)

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
        theirs = _boot_id(self.on_disk("/proc/sys/kernel/random/boot_id"))
        try:
            return mine is not None and mine == theirs and os.path.islink(self.on_disk("/proc/self"))
        except (OSError, ValueError):
            return False


def read_regular(path: str | os.PathLike, limit: int) -> bytes | None:
    """At most `limit` bytes of a regular file; None for anything else.

    procfs and sysfs attributes are regular files; a FIFO or device in their place (a damaged or
    hostile tree) is refused without blocking: opened non-blocking, checked with fstat.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _boot_id(path: str) -> str | None:
    data = read_regular(path, 4096)
    if data is None:
        return None
    return data.decode("ascii", errors="replace").strip() or None
