"""The kernel half as it is on disk: the driverd package installed for a kernel release
(/lib/modules/<release>/updates/driverd/: its manifest and install record). Light on purpose: `driverd
detect` reads it on every call."""
from __future__ import annotations

import json

from driverd.datatypes import NamedTuple
from driverd.driver import layout
from driverd.driver.ident import DriverId
from driverd.driver.records import read_json
from driverd.root import Root


class InstalledModules(NamedTuple):
    """The kernel half driverd installed for one kernel release."""
    driver: DriverId
    kernel_release: str
    package_sha256: str | None
    path: str                               # host path of its manifest


def installed_modules(root: Root, release: str | None, warnings: list[str] | None = None) -> InstalledModules | None:
    """The driverd package installed for `release` (None: none, or a damaged manifest: not usable)."""
    if not release:
        return None
    base = layout.modules_dir(release)
    path = f"{base}/{layout.MODULES_MANIFEST}"
    text = root.read_text(path)
    if text is None:
        return None
    try:
        m = json.loads(text)
        fields = (m["kernel"]["release"], m["driver"]["version"], m["flavor"])
        if not all(isinstance(f, str) and f for f in fields):
            raise TypeError("manifest fields are not strings")
        rec = read_json(root, f"{base}/{layout.MODULES_RECORD}") or {}
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        if warnings is not None:
            warnings.append(f"{path}: unreadable driverd manifest ({e.__class__.__name__}); treated as not installed")
        return None
    sha = rec.get("package_sha256")
    return InstalledModules(DriverId(fields[1], fields[2]), fields[0], sha if isinstance(sha, str) else None, path)


# -- the kernel half's tree and records, as install/modules.py (through install/store.py) leaves them -----
# driver/kept.py (manifests, sizes) is imported when asked: detect reads only installed_modules().

class ModulesTree(NamedTuple):
    """The tree installed for a release now: there at all, its package, complete per its manifest."""
    exists: bool
    sha: str | None = None
    manifest: object = None                 # a driverd.package.manifest.Manifest
    intact: bool = False


def current_tree(root: Root, release: str) -> ModulesTree:
    from driverd.driver.kept import modules_intact, tree_manifest, tree_sha
    hp = layout.modules_dir(release)
    if not root.lexists(hp):
        return ModulesTree(False)
    d = root.real(hp)
    m, sha = tree_manifest(d), tree_sha(d)
    return ModulesTree(True, sha, m, m is not None and sha is not None and modules_intact(d, m))


def installed_sha256(root: Root, release: str) -> str | None:
    from driverd.driver.kept import tree_sha
    return tree_sha(root.real(layout.modules_dir(release)))


def is_installed(root: Root, release: str, sha256: str | None, state_dir: str = layout.DEFAULT_STATE_DIR) -> bool:
    """The package `sha256` (None: no driverd package) is installed for `release`, complete: its
    install record names it, no switch is pending and every module file has its manifest size."""
    if root.lexists(layout.modules_marker(state_dir, release)):
        return False
    cur = current_tree(root, release)
    return not cur.exists if sha256 is None else cur.intact and cur.sha == sha256


def previous_record(root: Root, release: str, state_dir: str = layout.DEFAULT_STATE_DIR) -> dict | None:
    """What the last install/restore for `release` replaced, as recorded (None: absent)."""
    return read_json(root, layout.modules_previous(state_dir, release))


def previous_sha(root: Root, release: str, state_dir: str = layout.DEFAULT_STATE_DIR) -> tuple[bool, str | None]:
    """(known, sha256) of what the last install/restore for `release` replaced; sha None means no
    driverd package was installed then. known is False when nothing was ever replaced."""
    from driverd.driver.records import valid_sha
    rec = previous_record(root, release, state_dir)
    if not rec or "sha256" not in rec:
        return False, None
    return True, rec["sha256"] if valid_sha(rec["sha256"]) else None
