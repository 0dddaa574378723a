"""Atomically putting a fully written directory in place of another.

Linux's renameat2(RENAME_EXCHANGE) swaps two directory entries in one step: a reader (depmod,
modprobe, the kernel's firmware loader) sees the old tree or the new one, never a mix. Where the
filesystem lacks it (EINVAL), two renames are used; the gap between them is one syscall.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil

from driverd.fsutil import fsync_dir

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


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths atomically. False when the kernel/filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(e, os.strerror(e), os.fspath(a))


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> str | None:
    """Make the directory `new` appear at `target` (same filesystem). Returns the path that now holds
    what `target` held, for the caller to delete (it is `new` itself after an exchange, `new` + ".old"
    after the two-rename fallback), or None when `target` did not exist."""
    new, target = os.fspath(new), os.fspath(target)
    if not os.path.lexists(target):
        os.rename(new, target)
        fsync_dir(os.path.dirname(target))
        return None
    if exchange(new, target):            # looked up at call time: tests wrap it
        fsync_dir(os.path.dirname(target))
        return new
    old = new + ".old"
    os.rename(target, old)
    os.rename(new, target)
    fsync_dir(os.path.dirname(target))
    return old


def switch_in(new: str | os.PathLike, target: str | os.PathLike, old_out: str | os.PathLike) -> bool:
    """Make `new` appear at `target`. When `target` existed its old contents end up at `old_out`
    (which must not exist; same filesystem as target). Returns True when there was an old tree."""
    new, target, old_out = os.fspath(new), os.fspath(target), os.fspath(old_out)
    if not os.path.lexists(target):
        os.rename(new, target)
        fsync_dir(os.path.dirname(target))
        return False
    if exchange(new, target):
        os.rename(new, old_out)          # `new` now names the old tree
    else:
        os.rename(target, old_out)
        os.rename(new, target)
    fsync_dir(os.path.dirname(target))
    return True


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """rename, or copy+delete across filesystems (e.g. /lib to /var on separate mounts)."""
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copytree(src, dst, symlinks=True)
        shutil.rmtree(src)
    fsync_dir(os.path.dirname(os.fspath(dst)))
