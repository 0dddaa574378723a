"""Putting a package's versioned tree in place (the user-space's and the companions'): verified while it is
unpacked into a staging directory beside the trees, its links and install record made, every file and
directory fsync'd, then renamed to its name — a tree is complete or absent."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable

from driverd.fsutil import atomic_write_at, dump_json, fsync_fd
from driverd.root import Root

STAGING_PREFIX = ".driverd-staging-"
OLD_PREFIX = ".driverd-old-"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def subdir_fd(top: int, rel: str) -> int:
    fd = os.dup(top)
    for part in filter(None, rel.split("/")):
        nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=fd)
        os.close(fd)
        fd = nfd
    return fd


def fsync_tree(top: int) -> None:
    """Every regular file and directory under the directory open as `top` (links: their directory's)."""
    for _dp, _dns, fns, dfd in os.fwalk(".", dir_fd=top):
        for n in fns:
            try:
                fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:       # a symbolic link: fsync'd with its directory
                    continue
                raise
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_fd(dfd)
    fsync_fd(top)


def put_tree(root: Root, parent: str, name: str, package: Path, expected: str | None, kind: str, links,
             record_name: str, record: dict, check: Callable[[int], None] | None = None) -> None:
    """Unpack `package` (verified against its manifest: driverd.package.archive) into `<parent>/<name>`
    through a staging directory: `check(dir_fd)` may refuse what was unpacked; `links` (path, target) are
    made, the install record written, all fsync'd, then the staging directory renamed (never over an
    existing name). On any failure the staging directory is removed and nothing is left."""
    from driverd.package.archive import unpack_at
    root.makedirs(parent)
    staging = f"{parent}/{STAGING_PREFIX}{os.urandom(6).hex()}"
    try:
        with root.open_dir(staging, create=True) as fd:
            unpack_at(package, fd, expected, kind=kind)
            if check is not None:
                check(fd)
            for ln in links:
                d, _, leaf = ln.path.rpartition("/")
                dfd = subdir_fd(fd, d)
                try:
                    os.symlink(ln.target, leaf, dir_fd=dfd)
                finally:
                    os.close(dfd)
            atomic_write_at(fd, record_name, dump_json(record), 0o644)
            os.fchmod(fd, 0o755)
            fsync_tree(fd)
        root.rename(staging, f"{parent}/{name}", replace=False)
    except BaseException:
        try:
            root.rmtree(staging)
        except OSError:
            pass
        raise
