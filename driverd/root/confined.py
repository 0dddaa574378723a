"""The confined primitives of driverd.root.Root: driverd's own trees under the root (the package
cache, the kept store, staging trees beside /lib/modules, trust state) written, renamed and removed
by host path, each call resolving its parent inside the root again.

The resolver they stand on (`_open_dir`, `_open_parent`) is Root's own, in driverd/root/__init__.py:
it reads the openat2 switch that tests flip on that module, so it must be looked up there."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Callable

from driverd.root.paths import HostPaths

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterator

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ConfinedOps(HostPaths):
    _open_dir: Callable[..., int]
    _open_parent: Callable[..., tuple[int, str, str]]

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
        import shutil                   # here: not on the read-only commands' start (issue 47)

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
        when `create`), for writers that work relative to a directory (driverd.package.archive.unpack_at)."""
        hp = self._norm(os.fspath(hostpath))
        with self._guard(hp, "create" if create else "open"):
            fd = self._open_dir(hp, create=create, mode=mode)
        try:
            yield fd
        finally:
            os.close(fd)

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
