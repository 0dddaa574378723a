"""The download cache: packages under <packages.cache_dir>/packages/ by content-addressed names, found
again by name (the air-gapped host's source), checked again before use, kept under a size by removing
the least recently used."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from driverd.errors import PackageError
from driverd.package.archive import SUFFIX, verify_package
from driverd.repo.index import IndexEntry
from driverd.root import Root

_SHA_NAME = re.compile(r"[0-9a-f]{64}")


# -- cache --------------------------------------------------------------------------------------
# The cache is a tree under the root: every write and delete in it goes through the Root's confined
# writers (issue 30), so `<cache_dir>/packages` or anything above it being a symlink — placed before or
# swapped in meanwhile, absolute or relative — leads only to another directory inside the root.

CACHE_SUBDIR = "packages"


def cache_hostdir(configured: str = "/var/cache/driverd") -> str:
    """The cache's host path (under the root): <packages.cache_dir>/packages."""
    return f"{configured.rstrip('/')}/{CACHE_SUBDIR}"


def cache_dir(root: Root, configured: str = "/var/cache/driverd") -> Path:
    """The cache's real directory, resolved inside the root: for reading and for reports."""
    return root.real(cache_hostdir(configured))


def cache_name(e: IndexEntry) -> str:
    return f"{e.name}.{e.sha256}{SUFFIX}"


def cached_candidates(root: Root, cdir: str, name: str) -> list[tuple[str, str]]:
    """(file name, sha256) of the cache's entries for the package `name` (driverd's content-addressed
    names: `<name>.<sha256>.tar.zst`), newest first. Names only: nothing of them is read here."""
    try:
        d = root.real(cdir)
        names = os.listdir(d)
    except OSError:
        return []
    out = []
    for n in names:
        if n.startswith(name + ".") and n.endswith(SUFFIX):
            sha = n[len(name) + 1:-len(SUFFIX)]
            if _SHA_NAME.fullmatch(sha):
                try:
                    st = os.stat(d / n, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                    out.append((st.st_mtime, n, sha))
    return [(n, sha) for _, n, sha in sorted(out, reverse=True)]


def from_cache(root: Root, cdir: str, name: str, files: bool = True,
               kind: str | None = "kernel") -> tuple[Path, str] | None:
    """A package the cache already holds for `name`, checked again before it is used — its sha256 against
    its content-addressed name, then (with `files`) every member against its manifest — with no repository
    asked: what an earlier fetch verified against a repository's index (or `driverd fetch --repo` brought
    from a medium) serves when no repository can (none configured, none answering). A damaged entry is
    removed. None: none here."""
    from driverd.package.archive import check_file
    for n, sha in cached_candidates(root, cdir, name):
        dest = f"{cdir}/{n}"
        try:
            if files:
                verify_package(root.real(dest), sha, kind=kind)
            else:
                check_file(root.real(dest), sha)
        except PackageError:
            root.unlink(dest)               # never keep a bad package in the cache
            continue
        root.utime(dest)
        return root.real(dest), sha
    return None


def prune_cache(root: Root, cache: str, max_bytes: int, keep: str | None = None) -> list[str]:
    """Remove least recently used packages (regular files) from the cache directory `cache` (a host
    path) until it fits `max_bytes`; never the file named `keep`. Returns the names removed. The
    directory is opened once inside the root and every file is judged and removed relative to it."""
    import contextlib
    with contextlib.ExitStack() as stack:
        try:
            dfd = stack.enter_context(root.dir_fd(cache))
        except (FileNotFoundError, NotADirectoryError):
            return []                       # no cache yet: nothing to prune
        return _prune_at(dfd, max_bytes, keep)


def _prune_at(dfd: int, max_bytes: int, keep: str | None) -> list[str]:
    files: list[tuple[float, int, str]] = []
    for n in os.listdir(dfd):
        try:
            st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            files.append((max(st.st_atime, st.st_mtime), st.st_size, n))
    total = sum(size for _, size, _ in files)
    removed: list[str] = []
    for _, size, n in sorted(files):
        if total <= max_bytes:
            break
        if n == keep:
            continue
        try:
            os.unlink(n, dir_fd=dfd)
        except FileNotFoundError:
            pass
        total -= size
        removed.append(n)
    return removed
