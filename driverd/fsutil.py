"""Writing files the way every driverd step must: atomically, durably, reversibly.

atomic_write: temp file in the same directory, fsync, rename, fsync the directory — a reader sees the
old file or the new one, never half of either, even across a power cut.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int | None = None) -> None:
    """Replace `path` with `data`. Keeps the existing file's mode unless `mode` is given."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: object, mode: int | None = None) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


def read_json(path: str | os.PathLike) -> object | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
