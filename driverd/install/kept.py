"""The kept store: every package driverd installed or replaced, restorable by its sha256.

    <root><state_dir>/packages/kept/<sha256>/
        modules/                 the complete installed tree (*.ko, manifest.json, install.json)
        firmware/<version>/      the package's firmware files (when it has them and they were intact)

An entry is built in a temporary directory beside the others (`.driverd-staging-*`), every file and
directory fsync'd, then renamed into place: it is complete or absent. Files are hard links where the
source is on the same filesystem, copies otherwise. Entries leave the same way: renamed to a
`.driverd-old-*` name first, then deleted, so a half-deleted entry never looks like a kept one.

Every write and delete here (and in the staging trees beside /lib/modules and /lib/firmware) names a
host path and goes through the Root's confined writers (issue 30): a directory of the kept store or
of /lib replaced by a symlink, before or during an operation, leads only to another place inside the
root. Readers take the real path (`Root.real`, resolved inside the root).
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from driverd.errors import PackageError
from driverd.host.modules import INSTALL_DIR
from driverd.package.manifest import MANIFEST_NAME, Manifest
from driverd.driver.layout import MODULES_RECORD
from driverd.root import Root

KEPT_DIR = "packages/kept"          # under the state dir (/var/lib/driverd)
INSTALL_RECORD = MODULES_RECORD
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


def kept_hostdir(state_dir: str) -> str:
    """The kept store's host path (under the root)."""
    return f"{state_dir.rstrip('/')}/{KEPT_DIR}"


def kept_base(root: Root, state_dir: str) -> Path:
    """The kept store's real directory (resolved inside the root): for reading and reports."""
    return root.real(kept_hostdir(state_dir))


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
    from driverd.package.archive import file_entry
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
    path: Path                  # real path, for reading and reports
    manifest: Manifest
    hostpath: str = ""          # the entry's host path: what writers name

    @property
    def modules(self) -> Path:
        return self.path / "modules"

    @property
    def modules_hp(self) -> str:
        return f"{self.hostpath}/modules"

    @property
    def firmware_hp(self) -> str | None:
        return f"{self.hostpath}/firmware/{self.version}" if self.firmware is not None else None

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
    hp = f"{kept_hostdir(state_dir)}/{sha}"
    d = root.safe_real(hp)
    if d is None:
        return None
    m = tree_manifest(d / "modules")
    if m is None or tree_sha(d / "modules") != sha or not modules_intact(d / "modules", m):
        return None
    return Kept(sha, d, m, hp)


def kept_for(root: Root, state_dir: str, release: str | None) -> dict[tuple[str, str], str]:
    """(driver version, flavour) -> sha256 of the intact kept packages built for kernel `release`, the most
    recently used of each: what an install can come back from without fetching anything."""
    out: dict[tuple[str, str], tuple[float, str]] = {}
    if not release:
        return {}
    for sha in kept_shas(root, state_dir):
        k = lookup(root, state_dir, sha)
        if k is None or k.manifest.kernel_release != release:
            continue
        try:
            used = os.stat(k.path).st_mtime
        except OSError:
            continue
        key = (k.manifest.driver_version, k.manifest.flavor)
        if key not in out or used > out[key][0]:
            out[key] = (used, sha)
    return {key: sha for key, (_, sha) in out.items()}


def kept_shas(root: Root, state_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(kept_base(root, state_dir)) if valid_sha(n))
    except OSError:
        return []


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
