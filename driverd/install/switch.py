"""Atomically putting a fully written directory in place of another.

Linux's renameat2(RENAME_EXCHANGE) swaps two directory entries in one step: a reader (depmod,
modprobe, the kernel's firmware loader) sees the old tree or the new one, never a mix. Where the
filesystem lacks it (EINVAL), two renames are used; the gap between them is one syscall. Both names
are host paths whose parents the Root resolves inside the root (driverd.root.Root.at).
"""
from __future__ import annotations

import ctypes
import errno
import os

from driverd.fsutil import fsync_fd
from driverd.root import Root

AT_FDCWD = -100
RENAME_EXCHANGE = 2
_libc = None


def _renameat2():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        except (OSError, AttributeError):
            _libc = False
    return _libc.renameat2 if _libc else None


def exchange(a: str, b: str, *, src_dir_fd: int = AT_FDCWD, dst_dir_fd: int = AT_FDCWD) -> bool:
    """Swap two existing entries atomically (names relative to the directory fds). False when the
    kernel/filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(src_dir_fd, os.fsencode(a), dst_dir_fd, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(e, os.strerror(e), os.fspath(a))


def replace_dir(root: Root, new: str, target: str) -> str | None:
    """Make the directory `new` appear at `target` (host paths under `root`, same filesystem; both
    parents resolved inside the root, neither final name followed). Returns the host path that now
    holds what `target` held, for the caller to delete (`new` itself after an exchange, `new` + ".old"
    after the two-rename fallback), or None when `target` did not exist."""
    if not root.lexists(target):
        root.rename(new, target)
        return None
    with root.at(new, action="rename") as (nfd, nleaf), root.at(target, action="rename") as (tfd, tleaf):
        if exchange(nleaf, tleaf, src_dir_fd=nfd, dst_dir_fd=tfd):      # looked up at call time: tests wrap it
            fsync_fd(tfd)
            return new
    old = new + ".old"
    root.rename(target, old, durable=False)
    root.rename(new, target)
    return old
