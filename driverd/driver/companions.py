"""The driver's companions as they are on disk, read-only: the fabric manager, libnvidia-nscq, NVLSM and
nvidia-imex of one driver version (driverd.package.companion), each a versioned tree beside the
user-space's, with its own `current` (install/companion.py writes them, through install/store.py):

    <userspace.root>/companions/<component>/<version>[-<sha12>]/   manifest.json, install.json, bin/, lib/, etc/...
    <userspace.root>/companions/<component>/current                a relative link to the tree in use
    <state.dir>/companions/<component>/pending.json, previous.json the switch records (install/store.py)

The GPU daemons start the component's binary from `current/bin` (`current/sbin` for NVLSM; kmod/daemons.py's
bin_dirs): a fabric manager, NVLSM and IMEX of the loaded driver's version, switched with it in one transaction.
A component whose libraries other processes load (NSCQ: nvidia-smi and DCGM) has a loader configuration of its
own, `/etc/ld.so.conf.d/00-driverd-nvidia-<component>.conf`, naming `current/lib` while a tree is current."""
from __future__ import annotations

import re
import stat
from typing import NamedTuple

from driverd.datatypes import dataclass
from driverd.driver.layout import CURRENT, DEFAULT_STATE_DIR, USERSPACE_RECORD, USERSPACE_ROOT
from driverd.driver.records import read_json, valid_sha
from driverd.driver.userspace import tree_intact
from driverd.errors import DriverdError
from driverd.root import Root

COMPANIONS_DIR = "companions"                   # under userspace.root, and under state.dir for the records
RECORD = USERSPACE_RECORD                       # in each tree too: {"package_sha256", ...}
LDCONF_DIR = "/etc/ld.so.conf.d"
_TREE = re.compile(r"^[0-9][A-Za-z0-9._+-]*$")


class CompanionPlaces(NamedTuple):
    """Where one component's trees and records are (host paths)."""
    component: str
    userspace_root: str = USERSPACE_ROOT
    state_dir: str = DEFAULT_STATE_DIR
    max_kept: int = 3

    @classmethod
    def from_config(cls, cfg, component: str) -> "CompanionPlaces":
        return cls(component, cfg["userspace.root"], cfg["state.dir"], int(cfg["userspace.max_kept"]))

    @property
    def root(self) -> str:
        return f"{self.userspace_root.rstrip('/')}/{COMPANIONS_DIR}/{self.component}"

    def tree(self, name: str) -> str:
        return f"{self.root}/{name}"

    @property
    def current(self) -> str:
        return f"{self.root}/{CURRENT}"

    @property
    def bin_dir(self) -> str:
        return f"{self.current}/bin"

    @property
    def records(self) -> str:
        return f"{self.state_dir.rstrip('/')}/{COMPANIONS_DIR}/{self.component}"

    @property
    def pending(self) -> str:
        return f"{self.records}/pending.json"

    @property
    def previous(self) -> str:
        return f"{self.records}/previous.json"

    @property
    def ldconf(self) -> str | None:
        """The loader configuration that makes the component's libraries findable, as driverd's user-space's
        (driverd.driver.layout.LDCONF) does its own: one line naming `current/lib`; None for a component whose
        libraries only its own programs load (driverd.package.companion.Component.loader)."""
        from driverd.package.companion import COMPONENTS
        c = COMPONENTS.get(self.component)
        return f"{LDCONF_DIR}/00-driverd-nvidia-{self.component}.conf" if c is not None and c.loader else None

    def ldconf_text(self) -> str:
        return (f"# driverd: the NVIDIA driver's {self.component} it installed (the tree {self.current} points to).\n"
                f"# Written and removed by driverd; do not edit.\n{self.current}/lib\n")


@dataclass(frozen=True)
class CompanionTree:
    """One installed tree of a companion component as read from disk, and whether it is intact."""
    name: str
    sha: str | None
    manifest: object                # a driverd.package.companion.CompanionManifest, None: unreadable
    intact: bool

    @property
    def version(self) -> str | None:
        return self.manifest.driver_version if self.manifest is not None else None


def read_tree(root: Root, places: CompanionPlaces, name: str) -> CompanionTree | None:
    """The tree `name`, with whether it is intact: every file of its manifest a regular file of its size
    and mode class, every link where the manifest says, the install record naming a package."""
    from driverd.package import MANIFEST_NAME
    base = places.tree(name)
    st = root.lstat(base)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None
    try:
        from driverd.package.companion import CompanionManifest
        m = CompanionManifest.loads(root.read_bytes(f"{base}/{MANIFEST_NAME}", 1 << 20) or b"", f"{base}/{MANIFEST_NAME}")
    except DriverdError:
        return CompanionTree(name, None, None, False)
    rec = read_json(root, f"{base}/{RECORD}") or {}
    sha = rec.get("package_sha256") if valid_sha(rec.get("package_sha256")) else None
    return CompanionTree(name, sha, m, sha is not None and tree_intact(root, base, m))


def current_name(root: Root, places: CompanionPlaces) -> str | None:
    target = root.readlink(places.current)
    return target if target and _TREE.match(target) else None


def current(root: Root, places: CompanionPlaces) -> CompanionTree | None:
    name = current_name(root, places)
    return read_tree(root, places, name) if name else None


def trees(root: Root, places: CompanionPlaces) -> list[CompanionTree]:
    return [t for n in root.listdir(places.root) if _TREE.match(n) and (t := read_tree(root, places, n)) is not None]


def lookup(root: Root, places: CompanionPlaces, sha: str) -> CompanionTree | None:
    """The intact tree of the package `sha`, when there is one."""
    return next((t for t in trees(root, places) if t.sha == sha and t.intact), None)


def of_version(root: Root, places: CompanionPlaces, version: str) -> CompanionTree | None:
    """An intact tree of driver `version` (the current one first): what a node switches to without the network."""
    cur = current(root, places)
    if cur is not None and cur.intact and cur.version == version:
        return cur
    return next((t for t in trees(root, places) if t.intact and t.version == version), None)


def loader_ok(root: Root, places: CompanionPlaces) -> bool:
    """The component's loader configuration is driverd's exactly when a tree of it is current (always true for a
    component the loader need not find)."""
    if places.ldconf is None:
        return True
    return (root.read_text(places.ldconf, 64 << 10) == places.ldconf_text()) == (current_name(root, places) is not None)


def is_installed(root: Root, places: CompanionPlaces, sha: str | None) -> bool:
    """`sha` (None: none of this component) is current, intact, with no switch pending, and the loader finds its
    libraries when it must."""
    if root.lexists(places.pending) or not loader_ok(root, places):
        return False
    cur = current(root, places)
    return cur is None if sha is None else cur is not None and cur.intact and cur.sha == sha
