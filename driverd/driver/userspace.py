"""The user-space half as it is on the host: driverd's trees under userspace.root, the one `current`
points to, the records of its last switch, whether a tree is active (the loader configuration, the PATH
links and the driver-root link as driverd makes them) and a user-space driverd did not install. Read-only:
install/ writes it, and verifies its writes with these same readers."""
from __future__ import annotations

import os
import re
import stat
from typing import TYPE_CHECKING

from driverd.datatypes import dataclass
from driverd.driver.layout import LDCONF, USERSPACE_RECORD, Places
from driverd.driver.records import read_json, valid_sha
from driverd.errors import DriverdError
from driverd.package import MANIFEST_NAME
from driverd.root import Root

if TYPE_CHECKING:
    from driverd.driver import files as driverfiles
    from driverd.package import userspace as us

# The user-space package's format and the finder are imported where a tree is read: `driverd detect`
# and `status` read what is loaded and installed without them.

_TREE = re.compile(r"^[0-9][A-Za-z0-9._+-]*$")


def _root(root: Root | str | os.PathLike) -> Root:
    return root if isinstance(root, Root) else Root(root)


@dataclass(frozen=True)
class Tree:
    """One user-space tree under userspace.root."""
    name: str
    sha: str | None
    manifest: us.UserspaceManifest | None
    intact: bool

    @property
    def version(self) -> str | None:
        return self.manifest.driver_version if self.manifest else None


def read_tree(root: Root, places: Places, name: str) -> Tree | None:
    """The tree `name` under the install root, with whether it is intact: every file of its manifest a
    regular file of its size and mode class, every link pointing where the manifest says, the install
    record naming a package. None when there is no directory of that name."""
    base = places.tree(name)
    st = root.lstat(base)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None
    try:
        from driverd.package import userspace as us
        m = us.UserspaceManifest.loads(root.read_bytes(f"{base}/{MANIFEST_NAME}", 1 << 20) or b"",
                                       f"{base}/{MANIFEST_NAME}")
    except DriverdError:
        return Tree(name, None, None, False)
    rec = read_json(root, f"{base}/{USERSPACE_RECORD}") or {}
    sha = rec.get("package_sha256") if valid_sha(rec.get("package_sha256")) else None
    return Tree(name, sha, m, sha is not None and tree_intact(root, base, m))


def tree_intact(root: Root, base: str, m) -> bool:
    """Every file of the manifest a regular file of its size and mode class, every link where it says (the
    user-space's and the companions' trees)."""
    for f in m.files:
        st = root.lstat(f"{base}/{f.path}")
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
            return False
        if bool(st.st_mode & 0o111) != bool(f.mode & 0o111):
            return False
    return all(root.readlink(f"{base}/{ln.path}") == ln.target for ln in m.links)


def current_name(root: Root, places: Places) -> str | None:
    """The tree name `current` points to (a plain name), None when there is no such link."""
    target = root.readlink(places.current)
    return target if target and _TREE.match(target) else None


def trees(root: Root, places: Places) -> list[Tree]:
    """Every user-space tree under userspace.root."""
    out = []
    for n in root.listdir(places.root):
        if _TREE.match(n) and (t := read_tree(root, places, n)) is not None:
            out.append(t)
    return out


def lookup(root: Root, places: Places, sha: str) -> Tree | None:
    """The intact tree of the package `sha`, when there is one."""
    return next((t for t in trees(root, places) if t.sha == sha and t.intact), None)


def current(root: Root | str | os.PathLike, places: Places = Places()) -> Tree | None:
    root = _root(root)
    name = current_name(root, places)
    return read_tree(root, places, name) if name else None


def installed_sha256(root: Root | str | os.PathLike, places: Places = Places()) -> str | None:
    t = current(root, places)
    return t.sha if t and t.intact else None


def previous_record(root: Root | str | os.PathLike, places: Places = Places()) -> dict | None:
    """The previous record as it is (None: absent), for a run's snapshot to put back when it rolls back."""
    return read_json(_root(root), places.previous)


def previous_sha(root: Root | str | os.PathLike, places: Places = Places()) -> tuple[bool, str | None]:
    """(known, sha256) of what the last install/restore replaced (sha None: no user-space then)."""
    rec = read_json(_root(root), places.previous)
    if not rec or "sha256" not in rec:
        return False, None
    return True, rec["sha256"] if valid_sha(rec["sha256"]) else None


def foreign_userspace(root: Root, places: Places) -> driverfiles.UserSpace | None:
    """A user-space on the host that driverd did not install (its library directories, /usr/local/nvidia,
    /run/nvidia/driver, the ld cache), or None."""
    try:
        mine = root.resolve(places.root).rstrip("/") + "/"
    except (OSError, ValueError):
        mine = None
    # driverd's own trees are not foreign, nor its driver-root link to them (left out of the search, so
    # that a host's own libraries behind that link are still seen)
    from driverd.driver import files as driverfiles
    found = driverfiles.find(root, driverd=False, exclude=mine)
    if not found.found or found.lib_dir is None:
        return None
    try:
        assert mine is not None
        where = root.resolve(found.lib_dir)
    except (OSError, ValueError):
        return found
    return None if where.startswith(mine) else found


def link_state(root: Root, places: Places) -> str | None:
    """The driver-root link's name: None (no link configured), "free", "ours" (a link to driverd's
    `current`, relative or absolute) or "other" (a directory, file or link driverd did not make)."""
    if not places.driver_link:
        return None
    st = root.lstat(places.driver_link)
    if st is None:
        return "free"
    if stat.S_ISLNK(st.st_mode) and root.readlink(places.driver_link) in (places.link_target(root), places.current):
        return "ours"
    return "other"


def link_ok(root: Root, places: Places, activate: bool) -> bool:
    state = link_state(root, places)
    return state in (None, "ours", "other") if activate else state != "ours"


def ldconf_ours(root: Root, places: Places) -> bool:
    return root.read_text(LDCONF, 64 << 10) == places.ldconf_text()


def our_links(root: Root, places: Places) -> dict[str, str]:
    """name -> target of the PATH links that are driverd's: a link in userspace.bin_dir that points exactly
    at <current>/bin/<name>, whether the record (`links_record`) names it or not (a link an older driverd
    made for any name is found by its target, so a restore removes every one)."""
    if not places.bin_dir:
        return {}
    rec = read_json(root, places.links_record) or {}
    from driverd.package.userspace import BINARIES
    names = set(rec.get("links") or []) | set(BINARIES)
    names |= {n for n in root.listdir(places.bin_dir) if not n.startswith(".")}
    out = {}
    for name in sorted(names):
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            continue
        t = root.readlink(f"{places.bin_dir}/{name}")
        if t == places.bin_target(name):
            out[name] = t
    return out


# The PATH root's commands and systemd's services get (systemd's default; Debian's root PATH): a link in
# userspace.bin_dir must neither hide another file of its name there nor be hidden by one.
PATH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def path_clash(root: Root, places: Places, name: str) -> str | None:
    """Another file of the name `name` on PATH (or a file driverd did not make at the link's own place):
    a link there would shadow it or be shadowed by it. None when the name is free."""
    assert places.bin_dir
    own = f"{places.bin_dir}/{name}"
    if root.lstat(own) is not None and root.readlink(own) != places.bin_target(name):
        return own
    here = root.resolve(places.bin_dir)
    for d in PATH_DIRS:
        if root.resolve(d) != here and root.lstat(f"{d}/{name}") is not None:
            return f"{d}/{name}"
    return None


def wanted_links(root: Root, places: Places, m: us.UserspaceManifest | None) -> set[str]:
    """The PATH links a tree gets: NVIDIA's binaries it holds (the manifest's check already refuses any
    other name), each only where the name is free on PATH."""
    from driverd.package.userspace import BINARIES
    if m is None or not places.bin_dir:
        return set()
    return {n for b in m.binaries for n in [b.rpartition("/")[2]]
            if n in BINARIES and path_clash(root, places, n) is None}


def activation_ok(root: Root, places: Places, target: Tree | None, activate: bool) -> bool:
    if not activate or target is None:
        return root.lstat(LDCONF) is None and not our_links(root, places) and link_ok(root, places, False)
    if not ldconf_ours(root, places) or not link_ok(root, places, True):
        return False
    return not places.bin_dir or set(our_links(root, places)) == wanted_links(root, places, target.manifest)


def is_installed(root: Root | str | os.PathLike, sha256: str | None, places: Places = Places()) -> bool:
    """The check: the package `sha256` (None: no driverd user-space) is what `current` points to, its
    tree intact, no switch pending, and driverd's loader configuration and PATH links are as they must be."""
    root = _root(root)
    if root.lstat(places.pending) is not None:
        return False
    cur = current(root, places)
    if sha256 is None:
        return cur is None and activation_ok(root, places, None, False)
    if cur is None or not cur.intact or cur.sha != sha256:
        return False
    return activation_ok(root, places, cur, foreign_userspace(root, places) is None)


def check_root(root: Root, places: Places) -> None:
    """userspace.root holds the trees the loader configuration and the PATH links point into: whoever can
    rename an entry in it, or in any directory on the way to it, can swap the libraries every process on
    the node loads. Refused (ConfigError, one line) unless root owns it and every directory on the way
    and none of them is group- or world-writable (driverd.fsutil.trusted_dir; a missing root is judged by
    the directories it would be made in)."""
    from driverd.fsutil import trusted_dir
    real = places.root if root.is_slash else str(root.real(places.root))
    trusted_dir(real, "userspace.root", shown=places.root, missing_ok=True)
