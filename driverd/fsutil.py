"""Writing files the way every driverd step must: atomically, durably, reversibly.

atomic_write: temp file in the same directory, fsync, rename, fsync the directory — a reader sees the
old file or the new one, never half of either, even across a power cut.

atomic_write_at does the same relative to an open directory (a dir fd): Root's writers resolve the
parent directory inside the host root first (driverd.root) and then never name it by path again, so
a symlink cannot redirect the write outside the root between the check and the write.
"""
from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int) -> None:
    """fsync an open directory (or file); file systems that cannot (EINVAL) are not an error."""
    try:
        os.fsync(fd)
    except OSError:
        pass


def dump_json(obj: object) -> str:
    """driverd's JSON file format: indent=2, sorted keys, a trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _temp_name(name: str) -> str:
    return f".{name[:200]}.{secrets.token_hex(4)}.tmp"


def atomic_write_at(dir_fd: int, name: str, data: bytes | str, mode: int | None = None) -> None:
    """Replace the entry `name` of the directory open as `dir_fd` (O_RDONLY|O_DIRECTORY) with `data`.

    The temp file is created O_CREAT|O_EXCL|O_NOFOLLOW in the same directory, written, fsynced and
    chmodded, renamed over `name` (renameat: a symlink called `name` is replaced, never followed), then
    the directory is fsynced. Keeps the existing file's mode unless `mode` is given (0o644 for a new file).
    """
    if isinstance(data, str):
        data = data.encode()
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"not a file name: {name!r}")
    if mode is None:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o644
        except FileNotFoundError:
            mode = 0o644
    for _ in range(100):
        tmp = _temp_name(name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:   # pragma: no cover - 100 collisions of 32 random bits
        raise FileExistsError(f"cannot create a temporary file next to {name}")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    fsync_fd(dir_fd)


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int | None = None) -> None:
    """Replace `path` with `data`. Keeps the existing file's mode unless `mode` is given.

    For driverd's own files (caches, journals, packages). Host paths under a Root go through
    Root.atomic_write, which resolves the path inside the root.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        atomic_write_at(dfd, path.name, data, mode)
    finally:
        os.close(dfd)


def atomic_write_json(path: str | os.PathLike, obj: object, mode: int | None = None) -> None:
    atomic_write(path, dump_json(obj), mode)


def read_json(path: str | os.PathLike) -> object | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
