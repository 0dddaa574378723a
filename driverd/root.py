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

import contextlib
import ctypes
import errno
import io
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

_MAX_LINKS = 40
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
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

    # -- confined primitives: every call resolves its parent inside the root again ------------
    # For driverd's own trees under the root (the package cache, the kept store, staging trees
    # beside /lib/modules, trust state). Each call opens the parent with RESOLVE_IN_ROOT (or the
    # walk) at the time of the call and then acts on the final name relative to that directory fd,
    # never following it: a symlink placed or swapped in anywhere along the path, absolute or
    # relative, can redirect the operation only to another place inside the root.
    @contextlib.contextmanager
    def at(self, hostpath: str, *, create: bool = False, action: str = "write") -> Iterator[tuple[int, str]]:
        """(fd of the parent directory resolved inside the root, final name) for an *at() call of the
        caller's own (renameat2, say). The final name is not resolved; parents are created with
        `create`. The fd is closed on exit."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, action):
            dfd, leaf, _ = self._open_parent(hp, create=create, follow=False)
        try:
            yield dfd, leaf
        except OSError as e:
            if e.filename in (None, leaf):           # the caller's *at() call: name the host path
                raise OSError(e.errno, e.strerror, hp) from None
            raise
        finally:
            os.close(dfd)

    @contextlib.contextmanager
    def dir_fd(self, hostpath: str, *, create: bool = False) -> Iterator[int]:
        """An O_RDONLY|O_DIRECTORY fd of the directory `hostpath`, resolved inside the root (created with
        its parents when `create`), for writing a tree relative to it (archive.unpack_at)."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "open"):
            fd = self._open_dir(hp, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def lstat(self, hostpath: str) -> os.stat_result | None:
        """lstat of `hostpath` (parents resolved inside the root, the final name not followed);
        None when it does not exist or cannot be reached."""
        try:
            with self.at(hostpath, action="read") as (dfd, leaf):
                return os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
        except (OSError, ValueError, _host_path_error()):
            return None

    def lexists(self, hostpath: str) -> bool:
        return self.lstat(hostpath) is not None

    def open_write(self, hostpath: str, *, append: bool = False, exclusive: bool = False,
                   mode: int = 0o644) -> io.BufferedWriter:
        """A binary stream writing the regular file `hostpath` (parents created inside the root):
        truncated, or appended to with `append`, or created anew with `exclusive` (FileExistsError
        when the name exists). A final symlink, FIFO or device is refused; the mode is set exactly."""
        hp = self._norm(os.fspath(hostpath))
        flags = (os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | _CLOEXEC
                 | (os.O_EXCL if exclusive else os.O_APPEND if append else os.O_TRUNC))
        with self.at(hp, create=True) as (dfd, leaf):
            try:
                fd = os.open(leaf, flags, 0o600, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENXIO, errno.EEXIST) and _is_link(leaf, dfd):
                    raise self._not_through_link(hp, "write") from None
                raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise self._error(hp, "write", f"{hp} is not a regular file", "something else is in its place",
                                  f"remove {self.path(hp)}; nothing was written")
            os.set_blocking(fd, True)
            os.fchmod(fd, mode)
            return os.fdopen(fd, "ab" if append else "wb")
        except BaseException:
            os.close(fd)
            raise

    def rename(self, src: str, dst: str, *, durable: bool = True, replace: bool = True) -> None:
        """rename(2) the entry `src` to `dst` (replacing it, as rename does; `replace=False`: an existing
        `dst` is FileExistsError, nothing is replaced by accident), both resolved inside the root; neither
        final name is followed (a link is moved or replaced as itself). Parents of `dst` are created.
        `durable`: both directories are fsync'd."""
        from driverd.fsutil import fsync_fd
        with self.at(src, action="rename") as (sfd, sleaf), self.at(dst, create=True, action="rename") as (dfd, dleaf):
            if not replace:
                try:
                    os.stat(dleaf, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), self._norm(dst))
            os.rename(sleaf, dleaf, src_dir_fd=sfd, dst_dir_fd=dfd)     # replaces dst, as os.replace
            if durable:
                fsync_fd(dfd)
                if not _same_dir(sfd, dfd):
                    fsync_fd(sfd)

    def mkdir(self, hostpath: str, mode: int = 0o755, *, exist_ok: bool = False) -> bool:
        """Create the directory `hostpath` (parents inside the root, 0755) with exactly `mode`,
        whatever the umask; True when it was created. An existing directory is an error unless
        `exist_ok`; a symlink in its place always is."""
        with self.at(hostpath, create=True, action="create") as (dfd, leaf):
            try:
                os.mkdir(leaf, 0o700, dir_fd=dfd)
            except FileExistsError:
                st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                if exist_ok and stat.S_ISDIR(st.st_mode):
                    return False
                raise
            fd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            return True

    def mkdtemp(self, parent: str, prefix: str, mode: int = 0o700) -> str:
        """A new directory `<parent>/<prefix><random>` (parent created inside the root) with exactly
        `mode`; its host path."""
        base = self._norm(os.fspath(parent)).rstrip("/")
        for _ in range(100):
            hp = f"{base}/{prefix}{os.urandom(6).hex()}"
            try:
                self.mkdir(hp, mode)
                return hp
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "cannot create a temporary directory", base)   # pragma: no cover

    def rmdir(self, hostpath: str) -> bool:
        """Remove the empty directory `hostpath`; False when it is absent."""
        try:
            with self.at(hostpath, action="remove") as (dfd, leaf):
                os.rmdir(leaf, dir_fd=dfd)
                return True
        except FileNotFoundError:
            return False

    def rmtree(self, hostpath: str, *, ignore_errors: bool = False) -> bool:
        """Remove `hostpath` and everything under it; True when something was removed. The parent is
        resolved inside the root, the tree is walked by file descriptors (shutil.rmtree with dir_fd:
        never through a symlink, also one swapped in meanwhile), a final symlink is removed itself."""
        from driverd.fsutil import fsync_fd
        try:
            with self.at(hostpath, action="remove") as (dfd, leaf):
                try:
                    st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(leaf, dir_fd=dfd)
                else:
                    os.unlink(leaf, dir_fd=dfd)
                fsync_fd(dfd)
                return True
        except FileNotFoundError:
            return False
        except OSError:
            if ignore_errors:
                return False
            raise

    def link_or_copy(self, src: str, dst: str) -> None:
        """A hard link `dst` to the regular file `src` (both inside the root, neither followed; parents
        of `dst` created), or a copy (contents, mode, times) where a link cannot be made (another
        filesystem, say). `dst` must not exist."""
        with self.at(src, action="read") as (sfd, sleaf), self.at(dst, create=True) as (dfd, dleaf):
            try:
                os.link(sleaf, dleaf, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(os.stat(dleaf, dir_fd=dfd, follow_symlinks=False).st_mode):
                    os.unlink(dleaf, dir_fd=dfd)      # `src` was (swapped for) a link: never link a link
                    raise OSError(errno.EINVAL, "not a regular file", src)
                return
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                    raise
            fi = os.open(sleaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=sfd)
            try:
                st = os.fstat(fi)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file", src)
                fo = os.open(dleaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dfd)
                try:
                    while chunk := os.read(fi, 1 << 20):
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fo, view):]
                    os.fchmod(fo, stat.S_IMODE(st.st_mode))
                    os.utime(fo, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(fo)
            finally:
                os.close(fi)

    def utime(self, hostpath: str, times: tuple[float, float] | None = None) -> None:
        """os.utime of `hostpath` itself (a final symlink is not followed)."""
        with self.at(hostpath) as (dfd, leaf):
            os.utime(leaf, times, dir_fd=dfd, follow_symlinks=False)

    def chmod(self, hostpath: str, mode: int) -> None:
        """Set the mode of the file or directory `hostpath`, never through a final symlink."""
        fd = self._open_leaf(hostpath, "write")
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def fsync(self, hostpath: str) -> None:
        """fsync the file or directory `hostpath` (never through a final symlink). A file's failure is
        raised (its bytes may not be on disk); a directory's only where the filesystem cannot."""
        fd = self._open_leaf(hostpath, "sync")
        try:
            _fsync(fd)
        finally:
            os.close(fd)

    def fsync_tree(self, hostpath: str) -> None:
        """fsync every regular file under the directory `hostpath`, then every directory, deepest
        first; walked by file descriptors, symlinks are never followed."""
        from driverd.fsutil import fsync_fd
        with self.at(hostpath, action="sync") as (dfd, leaf):
            for _dp, _dns, fns, fd in os.fwalk(leaf, topdown=False, dir_fd=dfd):
                for n in fns:
                    try:
                        f = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=fd)
                    except OSError as e:
                        if e.errno == errno.ELOOP:
                            continue            # a symlink: nothing of ours to sync
                        raise
                    try:
                        if stat.S_ISREG(os.fstat(f).st_mode):
                            _fsync(f)
                    finally:
                        os.close(f)
                fsync_fd(fd)

    def _open_leaf(self, hostpath: str, action: str) -> int:
        hp = self._norm(os.fspath(hostpath))
        with self.at(hp, action=action) as (dfd, leaf):
            try:
                return os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP and _is_link(leaf, dfd):
                    raise self._not_through_link(hp, action) from None
                raise

    def _not_through_link(self, hp: str, action: str):
        return self._error(hp, action, f"{hp} is a symbolic link",
                           "driverd writes its own files under the root only into the file itself, never through a link",
                           f"remove the link {self.path(hp)} (nothing was written through it) and run again")

    def symlink(self, hostpath: str, target: str, *, replace: bool = True) -> str | None:
        """Make `hostpath` a symbolic link to `target`, atomically: a temporary link beside it renamed
        over the name, so a reader sees the old entry or the new link, never neither. Parents are
        created inside the root; the final name is never followed. It replaces nothing but a symbolic
        link, and with `replace=False` nothing at all (the link is created at the name itself, which
        fails if anything took the name meanwhile): FileExistsError — whose the entry is, the caller
        decides. Returns the replaced link's target, None when the name was free. Durable (directory fsync)."""
        from driverd.fsutil import fsync_fd
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "write"):
            dfd, leaf, _ = self._open_parent(hp, create=True, follow=False)
            try:
                if not replace:
                    os.symlink(target, leaf, dir_fd=dfd)         # EEXIST when anything is there
                    fsync_fd(dfd)
                    return None
                try:
                    st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    old = None
                else:
                    if not stat.S_ISLNK(st.st_mode):
                        raise FileExistsError(errno.EEXIST, "exists and is not a symbolic link", hp)
                    old = os.readlink(leaf, dir_fd=dfd)
                    if old == target:
                        return old
                for _ in range(100):
                    tmp = f".{leaf[:200]}.{os.urandom(4).hex()}.tmp"
                    try:
                        os.symlink(target, tmp, dir_fd=dfd)
                        break
                    except FileExistsError:
                        continue
                try:
                    os.replace(tmp, leaf, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except FileNotFoundError:
                        pass
                    raise
                fsync_fd(dfd)
                return old
            finally:
                os.close(dfd)

    @contextlib.contextmanager
    def open_dir(self, hostpath: str, create: bool = False, mode: int = 0o755) -> Iterator[int]:
        """An O_RDONLY|O_DIRECTORY fd of `hostpath` resolved inside the root (created with its parents
        when `create`), for writers that work relative to a directory (driverd.packages.archive.unpack_at)."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "create" if create else "open"):
            fd = self._open_dir(hp, create=create, mode=mode)
        try:
            yield fd
        finally:
            os.close(fd)

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

    @contextlib.contextmanager
    def _guard(self, hp: str, action: str) -> Iterator[None]:
        """Turn a symlink loop into a one-line HostPathError naming the link; other OSErrors pass."""
        try:
            yield
        except OSError as e:
            if e.errno != errno.ELOOP:   # same errno (and subclass), named by the host path asked for
                raise OSError(e.errno, e.strerror, hp) from None
            link = None
            try:
                self.resolve(hp)
            except OSError as r:
                link = r.filename
            where = link or hp
            try:
                dest = os.readlink(self.path(where))
                what = f"{where} -> {dest}"
            except OSError:
                what = where
            raise self._error(
                hp, action, "too many levels of symbolic links",
                f"{what} loops inside the host root {self.base} (an absolute link resolves inside the "
                "root, not on this machine)",
                f"replace {self.path(where)} with a real directory or a link that ends inside the root; "
                "nothing was written") from None

    def _error(self, hp: str, action: str, what: str, cause: str, fix: str):
        from driverd.errors import HostPathError
        return HostPathError(f"cannot {action} {hp} under {self.base}: {what}", cause=cause, fix=fix,
                             details={"path": hp, "root": self.base})

    # -- reads (never raise for a missing or unreadable file: facts report absence) ----------
    # Every query below answers "absent" rather than raising for a tree nobody has seen: symlink
    # loops (ELOOP), names the OS rejects (ENAMETOOLONG, NUL bytes -> ValueError), directories
    # where files belong, FIFOs and devices (which would block or never end).
    def safe_real(self, hostpath: str) -> Path | None:
        try:
            return self.real(hostpath)
        except (OSError, ValueError):
            return None

    def read_bytes(self, hostpath: str, limit: int = 4 << 20) -> bytes | None:
        real = self.safe_real(hostpath)
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
            return sorted(os.listdir(self.real(hostpath)))
        except (OSError, ValueError):
            return []

    def readlink(self, hostpath: str) -> str | None:
        try:
            hp = self._norm(hostpath)
            # Resolve the parent (it may itself be a link, e.g. /sys/bus/pci/devices/X), keep the leaf.
            parent = self.resolve(os.path.dirname(hp))
            leaf = parent.rstrip("/") + "/" + os.path.basename(hp)
            self._record(leaf)
            return os.readlink(self.path(leaf))
        except (OSError, ValueError):
            return None

    def _stat(self, hostpath: str) -> os.stat_result | None:
        real = self.safe_real(hostpath)
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
        theirs = _boot_id(str(self.path("/proc/sys/kernel/random/boot_id")))
        try:
            return mine is not None and mine == theirs and self.path("/proc/self").is_symlink()
        except (OSError, ValueError):
            return False


def _host_path_error():
    from driverd.errors import HostPathError
    return HostPathError


def _fsync(fd: int) -> None:
    """fsync a file (errors raised: its bytes may not be on disk) or a directory (errors ignored, as
    fsutil.fsync_fd does: some file systems cannot)."""
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        from driverd.fsutil import fsync_fd
        fsync_fd(fd)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


def _same_dir(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
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
