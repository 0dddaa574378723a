"""The kept store: every package driverd installed or replaced, restorable by its sha256.

    <root><state_dir>/packages/kept/<sha256>/
        modules/                 the complete installed tree (*.ko, manifest.json, install.json)
        firmware/<version>/      the package's firmware files (when it has them and they were intact)

An entry is built in a temporary directory beside the others (`.driverd-staging-*`), every file and
directory fsync'd, then renamed into place: it is complete or absent. Files are hard links where the
source is on the same filesystem, copies otherwise. Entries leave the same way: renamed to a
`.driverd-old-*` name first, then deleted, so a half-deleted entry never looks like a kept one.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from driverd.errors import PackageError
from driverd.fsutil import fsync_dir
from driverd.host.modules import INSTALL_DIR
from driverd.packages.manifest import MANIFEST_NAME, Manifest
from driverd.root import Root

KEPT_DIR = "packages/kept"          # under the state dir (/var/lib/driverd)
INSTALL_RECORD = "install.json"
STAGING_PREFIX = ".driverd-staging-"
OLD_PREFIX = ".driverd-old-"
_SHA = re.compile(r"[0-9a-f]{64}")


def valid_sha(sha: object) -> bool:
    return isinstance(sha, str) and _SHA.fullmatch(sha) is not None


def check_sha(sha: str) -> str:
    if not valid_sha(sha):
        raise PackageError(f"{sha!r} is not a package sha256", cause="expected 64 lower-case hex digits",
                           fix="pass the sha256 `driverd fetch` or the repository index printed")
    return sha


def kept_base(root: Root, state_dir: str) -> Path:
    return root.real(f"{state_dir}/{KEPT_DIR}")


# -- reading installed-shaped trees ----------------------------------------------------------------

def tree_manifest(d: Path) -> Manifest | None:
    try:
        return Manifest.loads((d / MANIFEST_NAME).read_bytes(), str(d / MANIFEST_NAME))
    except (OSError, ValueError, PackageError):
        return None


def tree_sha(d: Path) -> str | None:
    try:
        rec = json.loads((d / INSTALL_RECORD).read_text())
    except (OSError, ValueError):
        return None
    sha = rec.get("package_sha256") if isinstance(rec, dict) else None
    return sha if valid_sha(sha) else None


def modules_intact(d: Path, manifest: Manifest) -> bool:
    """Every module file the manifest lists is a regular file (not a link) of the listed size, and
    the install record is there."""
    try:
        for f in manifest.module_files:
            st = os.lstat(d / Path(f.path).name)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return False
        return stat.S_ISREG(os.lstat(d / INSTALL_RECORD).st_mode)
    except (OSError, ValueError):
        return False


def firmware_present(fdir: Path, manifest: Manifest) -> bool:
    """Names and sizes of the manifest's firmware files (cheap)."""
    try:
        for f in manifest.firmware_files:
            p = fdir / Path(f.path).name
            if not p.is_file() or p.is_symlink() or p.stat().st_size != f.size:
                return False
        return True
    except (OSError, ValueError):
        return False


def firmware_same(fdir: Path, manifest: Manifest) -> bool:
    """`fdir` holds exactly the manifest's firmware files (names, sizes, sha256)."""
    from driverd.packages.archive import file_entry
    try:
        if not fdir.is_dir():
            return False
        want = {Path(f.path).name: (f.size, f.sha256) for f in manifest.firmware_files}
        have = {n: (e.size, e.sha256) for n in os.listdir(fdir) if (fdir / n).is_file()
                for e in [file_entry(fdir / n, n)]}
        return want == have
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Kept:
    sha: str
    path: Path
    manifest: Manifest

    @property
    def modules(self) -> Path:
        return self.path / "modules"

    @property
    def version(self) -> str:
        return self.manifest.driver_version

    @property
    def firmware(self) -> Path | None:
        """The kept firmware directory, when the package has firmware and it was kept."""
        if not self.manifest.firmware_files:
            return None
        d = self.path / "firmware" / self.version
        return d if firmware_present(d, self.manifest) else None


def lookup(root: Root, state_dir: str, sha: str) -> Kept | None:
    """The kept entry for `sha` when it is there and intact (sizes per its manifest)."""
    if not valid_sha(sha):
        return None
    d = kept_base(root, state_dir) / sha
    m = tree_manifest(d / "modules")
    if m is None or tree_sha(d / "modules") != sha or not modules_intact(d / "modules", m):
        return None
    return Kept(sha, d, m)


def kept_shas(root: Root, state_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(kept_base(root, state_dir)) if valid_sha(n))
    except OSError:
        return []


# -- writing --------------------------------------------------------------------------------------

def mkdirs(d: Path) -> list[Path]:
    """mkdir -p; returns the directories it made, deepest first (for removal on failure)."""
    missing = []
    while not os.path.lexists(d):
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        os.mkdir(m, 0o755)
        os.chmod(m, 0o755)              # whatever the umask
    return missing


def rmdirs(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass


def fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(d: Path) -> None:
    """fsync every regular file under `d`, then every directory, deepest first."""
    dirs = []
    for dp, _dns, fns in os.walk(d):
        dirs.append(dp)
        for n in fns:
            p = Path(dp) / n
            if p.is_file() and not p.is_symlink():
                fsync_file(p)
    for dp in reversed(dirs):
        fsync_dir(dp)


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copy2(src, dst, follow_symlinks=False)


def fill(src: Path, dst: Path, names: list[str] | None = None) -> None:
    """Link or copy the regular files of `src` (or the given names) into the existing dir `dst`."""
    for n in sorted(names if names is not None else os.listdir(src)):
        p = src / n
        if p.is_file() and not p.is_symlink():
            link_or_copy(p, dst / n)


def temp_dir(parent: Path, mode: int = 0o755) -> Path:
    d = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent))
    os.chmod(d, mode)
    return d


def retire(d: Path) -> None:
    """Remove a directory so that it is never seen half-deleted under its own name."""
    if not os.path.lexists(d):
        return
    if d.name.startswith((STAGING_PREFIX, OLD_PREFIX)):
        shutil.rmtree(d, ignore_errors=True)
        return
    gone = d.parent / f"{OLD_PREFIX}{d.name}-{os.getpid()}"
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(d, gone)
    shutil.rmtree(gone, ignore_errors=True)


def commit(tmp: Path, final: Path) -> None:
    """fsync `tmp` completely and rename it to `final` (replacing a damaged entry there)."""
    fsync_tree(tmp)
    if os.path.lexists(final):
        retire(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


class Additions:
    """What one operation added to the kept store (and which directories it made), so that a refused
    operation can take it all back."""

    def __init__(self) -> None:
        self.kept: list[Path] = []
        self.dirs: list[Path] = []

    def undo(self, keep: set[str] = frozenset()) -> None:
        for d in reversed(self.kept):
            if d.name not in keep:
                try:
                    retire(d)
                except OSError:
                    shutil.rmtree(d, ignore_errors=True)
        rmdirs(self.dirs)


def keep_tree(root: Root, state_dir: str, mods: Path, fw: Path | None, adds: Additions) -> Kept | None:
    """Keep an installed-shaped tree (with its firmware dir, when intact) unless its sha is kept
    already. None when the tree is not a complete driverd installation (nothing to keep)."""
    m, sha = tree_manifest(mods), tree_sha(mods)
    if m is None or sha is None or not modules_intact(mods, m):
        return None
    have = lookup(root, state_dir, sha)
    if have is not None:
        return have
    base = kept_base(root, state_dir)
    adds.dirs += mkdirs(base)
    tmp = temp_dir(base, 0o700)
    try:
        os.mkdir(tmp / "modules", 0o755)
        fill(mods, tmp / "modules", [Path(f.path).name for f in m.module_files] + [MANIFEST_NAME, INSTALL_RECORD])
        if m.firmware_files and fw is not None and firmware_same(fw, m):
            os.mkdir(tmp / "firmware", 0o755)
            os.mkdir(tmp / "firmware" / m.driver_version, 0o755)
            fill(fw, tmp / "firmware" / m.driver_version, [Path(f.path).name for f in m.firmware_files])
        commit(tmp, base / sha)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    adds.kept.append(base / sha)
    return Kept(sha, base / sha, m)


def stage_from(kept_dir: Path, parent: Path) -> Path:
    """A new directory in `parent` holding links/copies of `kept_dir`'s files, fsync'd."""
    d = temp_dir(parent)
    try:
        fill(kept_dir, d)
        for n in os.listdir(d):
            if not (kept_dir / n).samefile(d / n):
                fsync_file(d / n)
        fsync_dir(d)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d


# -- pruning --------------------------------------------------------------------------------------

def protected(root: Root, state_dir: str) -> set[str]:
    """Shas in use: installed for any kernel, recorded as previous, or named by a pending switch."""
    out: set[str] = set()
    mods = root.safe_real("/lib/modules")
    try:
        releases = os.listdir(mods) if mods is not None else []
    except OSError:
        releases = []
    for rel in releases:
        d = root.safe_real(f"/lib/modules/{rel}/{INSTALL_DIR}")
        sha = tree_sha(d) if d is not None else None
        if sha:
            out.add(sha)
    pk = root.safe_real(f"{state_dir}/packages")
    if pk is None:
        return out
    files = []
    for sub in (pk, pk / "previous"):
        try:
            files += [sub / n for n in os.listdir(sub) if n.endswith(".json")]
        except OSError:
            pass
    for f in files:
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            for k in ("sha256", "target", "replaced"):
                if valid_sha(rec.get(k)):
                    out.add(rec[k])
    return out


def prune_kept(root: Root | str | os.PathLike, state_dir: str = "/var/lib/driverd", keep: set[str] = frozenset(),
               max_kept: int = 3) -> list[str]:
    """Remove the least recently used kept packages until at most `max_kept` remain, never removing
    one installed for any kernel, recorded as previous, named by a pending switch, or in `keep`.
    Returns the removed shas."""
    root = root if isinstance(root, Root) else Root(root)
    base = kept_base(root, state_dir)
    try:
        shas = kept_shas(root, state_dir)
        safe = protected(root, state_dir) | set(keep)

        def used(s: str) -> float:
            try:
                return os.stat(base / s).st_mtime
            except OSError:
                return 0.0
        removed: list[str] = []
        for s in sorted((s for s in shas if s not in safe), key=used):
            if len(shas) - len(removed) <= max_kept:
                break
            retire(base / s)
            removed.append(s)
        if removed:
            fsync_dir(base)
        return removed
    except OSError as e:
        raise PackageError(f"cannot prune kept packages in {base}: {e.strerror}", cause=str(e),
                           fix="check the state directory's filesystem") from None


def touch(d: Path) -> None:
    """Mark a kept entry as recently used (pruning removes the least recently used first)."""
    try:
        os.utime(d)
    except OSError:
        pass
