"""The host root: every host path driverd reads or writes is resolved under one directory.

`/` on a host, `/host` in the driver container, a temporary tree in tests. Absolute symlinks inside
the tree (e.g. /lib/modules/<release>/build -> /usr/src/linux-headers-...) are followed *inside* the
root, the way the host itself would see them, never on the machine running driverd.

A Root can record every host path it touched; `driverd debug capture-host` uses that to pack exactly
the files detect reads, so the capture never drifts from the readers.

Writes resolve the same way, and are made relative to directory file descriptors so that nothing is
ever written outside the root (e.g. `var/run -> /run` on a host tree lands in <root>/run, not in the
driver container's /run). The parent directory is opened with openat2(RESOLVE_IN_ROOT) where the
kernel has it (Linux >= 5.6), otherwise by a component-by-component walk (O_PATH|O_NOFOLLOW, each
symlink followed by hand inside the root); both give the same directory. A symlink loop is a
HostPathError, never a write elsewhere.

The final component of atomic_write / write_target, when it is a symlink, is resolved inside the root
and its target replaced, as editors do: an admin's `config.toml -> /etc/site/containerd.toml` (or an
/etc/alternatives chain) keeps working and stays managed where it is; replacing the link with a file
would silently fork the configuration. The target is always inside the root, so following is safe.
unlink removes the name itself (rm semantics) unless follow_symlink=True; write_existing refuses a
final symlink (sysfs attributes never are links).
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat

from driverd.root.confined import _CLOEXEC, ConfinedOps, _is_link
from driverd.root.paths import _MAX_LINKS, read_regular

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

_O_PATH = getattr(os, "O_PATH", 0)

# openat2(2): the same number on every architecture that has it, except alpha/ia64/mips (not listed:
# they use the walk). struct open_how {u64 flags; u64 mode; u64 resolve}.
_OPENAT2_NR = dict.fromkeys(("x86_64", "amd64", "i386", "i686", "aarch64", "arm64", "armv6l", "armv7l",
                             "armv8l", "riscv64", "ppc64le", "ppc64", "ppc", "s390x", "loongarch64"), 437)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_AT_FDCWD = -100

# None: use openat2 when the kernel has it; False: always walk (tests force the fallback with this).
OPENAT2: bool | None = None
_openat2_probe: bool | None = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = None


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    global _libc
    nr = _OPENAT2_NR.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, "openat2 is not known on this architecture")
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return int(fd)


def openat2_available() -> bool:
    """Whether openat2(RESOLVE_IN_ROOT) works here (kernel >= 5.6, not blocked by seccomp)."""
    global _openat2_probe
    if OPENAT2 is False:
        return False
    if _openat2_probe is None:
        try:
            os.close(_openat2(_AT_FDCWD, "/", _O_PATH | os.O_DIRECTORY | _CLOEXEC,
                              RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS))
            _openat2_probe = True
        except (OSError, AttributeError):
            _openat2_probe = False
    return _openat2_probe


# The class is spread over this package by subject (paths.py: the path mapping and the reads;
# confined.py: the confined primitives); the resolver stays here, beside the openat2 switch above,
# which tests flip on this module.
class Root(ConfinedOps):
    # -- writes (every one stays inside the root; see the module docstring) --------------------
    def atomic_write(self, hostpath: str, data: bytes | str, mode: int | None = None) -> None:
        """Replace `hostpath` atomically and durably (fsync file and directory).

        Parents are created inside the root; a final symlink is followed inside the root and its
        target replaced. Keeps the existing file's mode when `mode` is None (0o644 for a new file).
        """
        from driverd.fsutil import atomic_write_at
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "write"):
            dfd, leaf, _ = self._open_parent(hp, create=True, follow=True)
            try:
                atomic_write_at(dfd, leaf, data, mode)
            finally:
                os.close(dfd)

    def atomic_write_json(self, hostpath: str, obj: object, mode: int | None = None) -> None:
        from driverd.fsutil import dump_json
        self.atomic_write(hostpath, dump_json(obj), mode)

    def makedirs(self, hostpath: str, mode: int = 0o755) -> Path:
        """Create `hostpath` and its parents inside the root; the directory's real on-disk path."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "create"):
            fd = self._open_dir(hp, create=True, mode=mode)
            try:
                return self.path(self._hostpath_of(fd, hp))
            finally:
                os.close(fd)

    def unlink(self, hostpath: str, missing_ok: bool = True, *, follow_symlink: bool = False) -> bool:
        """Remove `hostpath`; True when something was removed. A final symlink is removed itself
        (rm semantics) unless follow_symlink, which removes its target inside the root instead."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "remove"):
            try:
                dfd, leaf, _ = self._open_parent(hp, create=False, follow=follow_symlink)
            except FileNotFoundError:
                if missing_ok:
                    return False
                raise
            try:
                os.unlink(leaf, dir_fd=dfd)
            except FileNotFoundError:
                if missing_ok:
                    return False
                raise
            else:
                from driverd.fsutil import fsync_fd
                fsync_fd(dfd)
                return True
            finally:
                os.close(dfd)

    def write_existing(self, hostpath: str, text: str | bytes) -> None:
        """Write `text` into an existing file in place, in one write (sysfs/procfs attributes such as
        /sys/module/firmware_class/parameters/path). Never creates the file or follows a final link."""
        hp = self._norm(os.fspath(hostpath))
        data = text.encode() if isinstance(text, str) else text
        with self._guard(hp, "write"):
            dfd, leaf, _ = self._open_parent(hp, create=False, follow=False)
            try:
                if _is_link(leaf, dfd):
                    raise self._error(hp, "write", f"{hp} is a symbolic link",
                                      "driverd writes attributes only into the file itself, never through a link",
                                      f"check {self.path(hp)}; nothing was written")
                fd = os.open(leaf, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_NOCTTY | _CLOEXEC, dir_fd=dfd)
            finally:
                os.close(dfd)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def mknod(self, hostpath: str, mode: int, device: int = 0) -> None:
        """os.mknod inside the root (parents created); permissions set exactly to mode & 0o7777,
        whatever the umask. FileExistsError when the name exists (also as a symlink)."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "create"):
            dfd, leaf, _ = self._open_parent(hp, create=True, follow=False)
            try:
                os.mknod(leaf, mode, device, dir_fd=dfd)
                try:
                    os.chmod(leaf, stat.S_IMODE(mode), dir_fd=dfd, follow_symlinks=False)
                except (NotImplementedError, OSError) as e:
                    if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                        raise
                    if _is_link(leaf, dfd):      # swapped for a link since mknod: never chmod through it
                        raise FileExistsError(errno.EEXIST, "replaced by a symlink", hp) from None
                    os.chmod(leaf, stat.S_IMODE(mode), dir_fd=dfd)
            finally:
                os.close(dfd)

    def write_target(self, hostpath: str) -> Path:
        """The real on-disk path to hand to another tool that will write `hostpath`: parents created
        inside the root, symlinks (a final one too) resolved inside it, and every component of the
        returned path checked not to be a symlink."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "write"):
            dfd, leaf, parent = self._open_parent(hp, create=True, follow=True)
            try:
                phost = self._hostpath_of(dfd, parent)
            finally:
                os.close(dfd)
            target = (phost.rstrip("/") + "/" + leaf)
            cur = self.base
            for part in [p for p in target.split("/") if p]:
                cur = os.path.join(cur, part)
                try:
                    st = os.lstat(cur)
                except FileNotFoundError:
                    break
                if stat.S_ISLNK(st.st_mode):
                    raise self._error(hp, "write", f"{cur} is a symbolic link",
                                      "it changed while driverd resolved the path",
                                      "run again; if it persists, check who rewrites the link")
            return self.path(target)

    # -- the resolver behind the writes -------------------------------------------------------
    def _root_fd(self) -> int:
        return os.open(self.base, _O_PATH | os.O_DIRECTORY | _CLOEXEC)

    def _open_dir(self, raw: str, create: bool = False, mode: int = 0o755) -> int:
        """An O_RDONLY|O_DIRECTORY fd of host directory `raw`, every component resolved inside the root.

        `raw` is not normalised here: '..' after a symlink climbs from the link's target, as the kernel
        does (the public methods normalise what callers pass, exactly as the readers do).
        """
        if "\0" in raw:
            raise ValueError(f"embedded null byte in {raw!r}")
        if openat2_available():
            rfd = self._root_fd()
            try:
                for _ in range(3):           # EAGAIN: a rename raced the lookup; try again, then walk
                    try:
                        return _openat2(rfd, raw.lstrip("/") or ".", os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC,
                                        RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
                    except OSError as e:
                        if e.errno == errno.ENOENT and create:
                            break            # the walk creates what is missing, through links too
                        if e.errno not in (errno.EAGAIN, errno.EXDEV):
                            raise OSError(e.errno, e.strerror, raw) from None
            finally:
                os.close(rfd)
        fd, _ = self._walk(raw, create, mode)
        return fd

    def _walk(self, raw: str, create: bool = False, mode: int = 0o755) -> tuple[int, str]:
        """Open `raw` component by component with O_PATH|O_NOFOLLOW; follow each symlink by hand
        (absolute targets restart at the root, '..' never climbs above it, at most 40 links).
        Returns (O_RDONLY|O_DIRECTORY fd, resolved host path)."""
        rfd = self._root_fd()
        stack: list[tuple[str, int]] = [("", rfd)]
        parts = [p for p in raw.split("/") if p]
        links = retries = 0
        try:
            while parts:
                name = parts.pop(0)
                if name == ".":
                    continue
                if name == "..":
                    if len(stack) > 1:
                        os.close(stack.pop()[1])
                    continue
                cur = stack[-1][1]
                where = "/" + "/".join([n for n, _ in stack[1:]] + [name])
                try:
                    fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | _CLOEXEC, dir_fd=cur)
                except FileNotFoundError:
                    if not create:
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), where) from None
                    retries += 1
                    if retries > 100:
                        raise
                    try:
                        os.mkdir(name, mode, dir_fd=cur)
                    except FileExistsError:
                        pass                 # raced by someone else, or a dangling link: look again
                    parts.insert(0, name)
                    continue
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise OSError(e.errno, e.strerror, where) from None
                    try:
                        target = os.readlink(name, dir_fd=cur)
                    except OSError:
                        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), where) from None
                    links += 1
                    if links > _MAX_LINKS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), where) from None
                    if target.startswith("/"):
                        while len(stack) > 1:
                            os.close(stack.pop()[1])
                    parts = [p for p in target.split("/") if p] + parts
                    continue
                stack.append((name, fd))
            out = os.open(".", os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC, dir_fd=stack[-1][1])
            return out, "/" + "/".join(n for n, _ in stack[1:])
        finally:
            for _, fd in stack:
                os.close(fd)

    def _open_parent(self, hp: str, create: bool, follow: bool) -> tuple[int, str, str]:
        """(fd of the resolved parent directory, final name, the parent as a raw host path).

        With `follow`, a final symlink is resolved inside the root (dangling ones too: the write
        creates the target), so the returned name is never a link at the time of the call."""
        raw = hp
        links = 0
        while True:
            raw = raw.rstrip("/") or "/"
            parent, leaf = raw.rsplit("/", 1)
            parent = parent or "/"
            if leaf in ("", ".", ".."):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), hp)
            dfd = self._open_dir(parent, create)
            if not follow:
                return dfd, leaf, parent
            try:
                target = os.readlink(leaf, dir_fd=dfd)
            except OSError:                  # not a link, or missing
                return dfd, leaf, parent
            os.close(dfd)
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), hp)
            raw = target if target.startswith("/") else f"{parent.rstrip('/')}/{target}"

    def _hostpath_of(self, fd: int, raw: str) -> str:
        """The resolved host path of the directory open as `fd` (opened from `raw`)."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
            base = os.path.realpath(self.base).rstrip("/")
            if real == base or real.startswith(base + "/"):
                hp = "/" + real[len(base):].strip("/")
                a, b = os.stat(self.path(hp), follow_symlinks=False), os.fstat(fd)
                if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                    return hp
        except OSError:
            pass
        wfd, hp = self._walk(raw)          # no /proc, or it disagrees: the walk knows the names
        os.close(wfd)
        return hp


__all__ = ["OPENAT2", "RESOLVE_IN_ROOT", "RESOLVE_NO_MAGICLINKS", "Root", "openat2_available", "read_regular"]
