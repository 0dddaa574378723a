"""The kept store as it is on disk, read-only: every package of the kernel half driverd installed or
replaced, restorable by its sha256 (install/kept.py writes it, through install/store.py).

    <root><state_dir>/packages/kept/<sha256>/
        modules/                 the complete installed tree (*.ko, manifest.json, install.json)
        firmware/<version>/      the package's firmware files (when it has them and they were intact)

Readers take the real path (`Root.real`, resolved inside the root)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.driver.layout import KEPT_DIR, MODULES_DIR, MODULES_RECORD
from driverd.driver.records import valid_sha
from driverd.errors import PackageError
from driverd.package.manifest import MANIFEST_NAME, Manifest
from driverd.root import Root

INSTALL_RECORD = MODULES_RECORD


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
    """One package of the kernel half as kept on disk, restorable by its sha256."""
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



def protected(root: Root, state_dir: str) -> set[str]:
    """Shas in use: installed for any kernel, recorded as previous, or named by a pending switch."""
    out: set[str] = set()
    mods = root.safe_real("/lib/modules")
    try:
        releases = os.listdir(mods) if mods is not None else []
    except OSError:
        releases = []
    for rel in releases:
        d = root.safe_real(f"/lib/modules/{rel}/{MODULES_DIR}")
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
