"""Writing the kept store (driverd/driver/kept.py reads it, and says its layout): every package of the
kernel half driverd installed or replaced, restorable by its sha256.

An entry is built in a temporary directory beside the others (`.driverd-staging-*`), every file and
directory fsync'd, then renamed into place: it is complete or absent. Files are hard links where the
source is on the same filesystem, copies otherwise. Entries leave the same way: renamed to a
`.driverd-old-*` name first, then deleted, so a half-deleted entry never looks like a kept one.

Every write and delete here (and in the staging trees beside /lib/modules and /lib/firmware) names a
host path and goes through the Root's confined writers (issue 30): a directory of the kept store or
of /lib replaced by a symlink, before or during an operation, leads only to another place inside the
root.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from driverd.driver.kept import (INSTALL_RECORD, Kept, check_sha, firmware_present, firmware_same, kept_base,
                                 kept_for, kept_hostdir, kept_shas, lookup, modules_intact, protected, tree_manifest,
                                 tree_sha)
from driverd.driver.records import valid_sha
from driverd.errors import PackageError
from driverd.package.manifest import MANIFEST_NAME
from driverd.root import Root

# the readers this module's writers use, importable from here as before
__all__ = ["INSTALL_RECORD", "Kept", "check_sha", "firmware_present", "firmware_same", "kept_base", "kept_for",
           "kept_hostdir", "kept_shas", "lookup", "modules_intact", "protected", "tree_manifest", "tree_sha",
           "valid_sha", "Additions", "commit", "fill", "forget", "keep_tree", "mkdirs", "prune_kept", "retire",
           "rmdirs", "stage_from", "temp_dir", "touch"]

STAGING_PREFIX = ".driverd-staging-"
OLD_PREFIX = ".driverd-old-"


# -- writing (host paths, through the Root's confined writers) ------------------------------------

def mkdirs(root: Root, hp: str) -> list[str]:
    """mkdir -p inside the root (0755 whatever the umask); returns the host paths of the directories
    it made, deepest first (for removal on failure)."""
    missing = []
    d = hp.rstrip("/")
    while d and not root.lexists(d):
        missing.append(d)
        d = os.path.dirname(d).rstrip("/")
    for m in reversed(missing):
        root.mkdir(m, 0o755, exist_ok=True)
    return missing


def rmdirs(root: Root, dirs: list[str]) -> None:
    for d in dirs:
        try:
            root.rmdir(d)
        except OSError:
            pass


def _regular(root: Root, hp: str) -> bool:
    st = root.lstat(hp)
    return st is not None and stat.S_ISREG(st.st_mode)


def fill(root: Root, src: str, dst: str, names: list[str] | None = None) -> None:
    """Link or copy the regular files of `src` (or the given names) into the existing dir `dst`."""
    for n in sorted(names if names is not None else root.listdir(src)):
        if _regular(root, f"{src}/{n}"):
            root.link_or_copy(f"{src}/{n}", f"{dst}/{n}")


def temp_dir(root: Root, parent: str, mode: int = 0o755) -> str:
    return root.mkdtemp(parent, STAGING_PREFIX, mode)


def retire(root: Root, d: str) -> None:
    """Remove a directory so that it is never seen half-deleted under its own name."""
    if not root.lexists(d):
        return
    name = os.path.basename(d)
    if name.startswith((STAGING_PREFIX, OLD_PREFIX)):
        root.rmtree(d, ignore_errors=True)
        return
    gone = f"{os.path.dirname(d)}/{OLD_PREFIX}{name}-{os.getpid()}"
    root.rmtree(gone, ignore_errors=True)
    root.rename(d, gone, durable=False)
    root.rmtree(gone, ignore_errors=True)


def commit(root: Root, tmp: str, final: str) -> None:
    """fsync `tmp` completely and rename it to `final` (replacing a damaged entry there)."""
    root.fsync_tree(tmp)
    if root.lexists(final):
        retire(root, final)
    root.rename(tmp, final)


class Additions:
    """What one operation added to the kept store (and which directories it made), so that a refused
    operation can take it all back. Host paths under `root`."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.kept: list[str] = []
        self.dirs: list[str] = []

    def undo(self, keep: set[str] = frozenset()) -> None:
        for d in reversed(self.kept):
            if os.path.basename(d) not in keep:
                try:
                    retire(self.root, d)
                except OSError:
                    self.root.rmtree(d, ignore_errors=True)
        rmdirs(self.root, self.dirs)


def keep_tree(root: Root, state_dir: str, mods: str, fw: str | None, adds: Additions) -> Kept | None:
    """Keep an installed-shaped tree (host path `mods`, with its firmware dir `fw` when intact) unless its
    sha is kept already. None when the tree is not a complete driverd installation (nothing to keep)."""
    real = root.safe_real(mods)
    if real is None:
        return None
    m, sha = tree_manifest(real), tree_sha(real)
    if m is None or sha is None or not modules_intact(real, m):
        return None
    have = lookup(root, state_dir, sha)
    if have is not None:
        return have
    base = kept_hostdir(state_dir)
    adds.dirs += mkdirs(root, base)
    tmp = temp_dir(root, base, 0o700)
    try:
        root.mkdir(f"{tmp}/modules", 0o755)
        fill(root, mods, f"{tmp}/modules",
             [Path(f.path).name for f in m.module_files] + [MANIFEST_NAME, INSTALL_RECORD])
        fw_real = root.safe_real(fw) if fw is not None else None
        if m.firmware_files and fw_real is not None and firmware_same(fw_real, m):
            root.mkdir(f"{tmp}/firmware", 0o755)
            root.mkdir(f"{tmp}/firmware/{m.driver_version}", 0o755)
            fill(root, fw, f"{tmp}/firmware/{m.driver_version}", [Path(f.path).name for f in m.firmware_files])
        commit(root, tmp, f"{base}/{sha}")
    except BaseException:
        root.rmtree(tmp, ignore_errors=True)
        raise
    adds.kept.append(f"{base}/{sha}")
    return Kept(sha, kept_base(root, state_dir) / sha, m, f"{base}/{sha}")


def stage_from(root: Root, kept_dir: str, parent: str) -> str:
    """A new directory in `parent` holding links/copies of `kept_dir`'s files, fsync'd (host paths)."""
    d = temp_dir(root, parent)
    try:
        fill(root, kept_dir, d)
        for n in root.listdir(d):
            a, b = root.lstat(f"{kept_dir}/{n}"), root.lstat(f"{d}/{n}")
            if a is None or b is None or (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                root.fsync(f"{d}/{n}")
        root.fsync(d)
    except BaseException:
        root.rmtree(d, ignore_errors=True)
        raise
    return d


# -- pruning --------------------------------------------------------------------------------------

def prune_kept(root: Root | str | os.PathLike, state_dir: str = "/var/lib/driverd", keep: set[str] = frozenset(),
               max_kept: int = 3) -> list[str]:
    """Remove the least recently used kept packages until at most `max_kept` remain, never removing
    one installed for any kernel, recorded as previous, named by a pending switch, or in `keep`.
    Returns the removed shas."""
    root = root if isinstance(root, Root) else Root(root)
    base = kept_hostdir(state_dir)
    try:
        shas = kept_shas(root, state_dir)
        safe = protected(root, state_dir) | set(keep)

        def used(s: str) -> float:
            st = root.lstat(f"{base}/{s}")
            return st.st_mtime if st is not None else 0.0
        removed: list[str] = []
        for s in sorted((s for s in shas if s not in safe), key=used):
            if len(shas) - len(removed) <= max_kept:
                break
            retire(root, f"{base}/{s}")
            removed.append(s)
        if removed:
            root.fsync(base)
        return removed
    except OSError as e:
        raise PackageError(f"cannot prune kept packages in {root.path(base)}: {e.strerror}", cause=str(e),
                           fix="check the state directory's filesystem") from None


def forget(root: Root, state_dir: str, sha: str) -> bool:
    """Remove one kept package (a package that failed on this host), unless something still needs it
    (installed for a kernel, recorded as previous, named by a pending switch). True when removed."""
    if not valid_sha(sha) or sha in protected(root, state_dir) or sha not in kept_shas(root, state_dir):
        return False
    base = kept_hostdir(state_dir)
    retire(root, f"{base}/{sha}")
    root.fsync(base)
    return True


def touch(root: Root, d: str) -> None:
    """Mark a kept entry as recently used (pruning removes the least recently used first)."""
    try:
        root.utime(d)
    except OSError:
        pass
