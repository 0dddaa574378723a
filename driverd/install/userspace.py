"""Installing a user-space package (driverd.package.userspace) into a versioned driver root on a node.

Installed layout (host paths; `userspace.root`, default /var/lib/driverd/driver — writable on immutable
hosts, where /usr is read-only):

    <userspace.root>/<version>/          one complete tree per installed package: manifest.json,
        install.json, lib64/ (libraries, soname and development links), bin/, firmware/nvidia/<version>/,
        share/ (ICD files). A second package of a version already there goes to <version>-<sha12>/.
    <userspace.root>/current             a symbolic link to the tree in use (a relative name)
    /etc/ld.so.conf.d/00-driverd-nvidia.conf   names <userspace.root>/current/lib64 (driverfiles.DRIVERD_LDCONF)
    /etc/ld.so.cache                     rebuilt by `ldconfig -X` (with `-r ROOT` under a root other than /;
                                         -X: ldconfig makes no links anywhere, driverd made its own)
    <userspace.bin_dir>/<binary>         links to <userspace.root>/current/bin/<binary> (default /usr/local/bin)
    <userspace.driver_link>              /run/nvidia/driver: a relative link to <userspace.root>/current, the GPU
                                         Operator's driver root (nvidia-ctk --driver-root, NVIDIA_CTK_DRIVER_ROOT);
                                         made only where the name is free, removed only when it is driverd's
State (under the state dir):
    userspace/pending.json               an unfinished switch: {"target": sha|null, "replaced": sha|null, ...}
    userspace/previous.json              what the last install/restore replaced: {"sha256": sha|null, ...}

The tree `current` points to is what driverfiles.find() gives the workload validation and the CDI spec:
the loader configuration names `current/lib64`, find() reads it and resolves `current` to the tree. The
loader configuration, the PATH links and the driver-root link are written only when the host has no user-space of its own
(libcuda/libnvidia-ml in its library directories, /usr/local/nvidia or /run/nvidia/driver — files driverd
did not install, which it never touches): driverd never puts its libraries in front of the host's. Such a
host still gets the tree and `current` (a driver root to point validation.driver_root at); driverd's own
loader configuration and links are removed there.

Order of an install (each effect durable before the next):
    1. the package is verified while it is unpacked into `<root>/.driverd-staging-*` (bounded, checked
       against its manifest: driverd.package.archive), its links and install.json made, every file and
       directory fsync'd, then renamed to its tree name: a tree is complete or absent;
    2. the pending marker names the target and what it replaces;
    3. `current` is switched (a new link renamed over it: atomic);
    4. the loader configuration (when it differs), ldconfig, the PATH links, the driver-root link;
    5. verify: the tree is intact, find() resolves the driver root to it with its version, and the ld
       cache gives driverd's libcuda.so.1/libnvidia-ml.so.1 first; on failure the replaced tree is
       switched back the same way and the install fails with the reason;
    6. previous.json is written and the marker removed; trees beyond userspace.max_kept are pruned.
A process killed anywhere leaves a staging directory (removed by `recover()`), a complete unreferenced
tree (kept; found again by sha256) or the marker, which `recover()` drives to its target (the target
tree is complete before the marker exists) through the same checks.

For the transaction steps (part of the apply/reload/rollback lists): `is_installed()` is the check,
`install()` the do (its report's `replaced` is what an undo restores), `restore()` the undo; all are
idempotent, and each runs `recover()` first.
"""
from __future__ import annotations

import errno
import os
import platform
import shutil
from dataclasses import field
from datetime import UTC, datetime
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.driver import files as driverfiles
from driverd.driver import layout
from driverd.driver.layout import Places
from driverd.driver.records import read_json, valid_sha
from driverd.driver.userspace import (Tree, check_root, current, current_name, foreign_userspace,
                                      is_installed as _is_installed, ldconf_ours, link_state, lookup,
                                      our_links, previous_sha, read_tree, trees)
from driverd.errors import DriverdError, PackageError
from driverd.package import userspace as us
from driverd.install.checks import os_errors
from driverd.package.archive import check_file, read_manifest, sha256_file, verify_package
from driverd.install.activate import activate_tree, driver_link
from driverd.install.store import Current, Done, Part, Store, Switch
from driverd.install.tree import OLD_PREFIX, STAGING_PREFIX, put_tree
from driverd.root import Root
from driverd.runner import Runner

DEFAULT_ROOT = layout.USERSPACE_ROOT
DEFAULT_BIN_DIR = layout.USERSPACE_BIN_DIR
DEFAULT_STATE_DIR = layout.DEFAULT_STATE_DIR
DEFAULT_DRIVER_LINK = layout.USERSPACE_DRIVER_LINK
CURRENT = layout.CURRENT
STATE_SUBDIR = layout.USERSPACE_STATE
INSTALL_RECORD = layout.USERSPACE_RECORD
LDCONF = driverfiles.DRIVERD_LDCONF
LD_CACHE = driverfiles.LD_CACHE
MAX_KEPT = layout.USERSPACE_MAX_KEPT


@dataclass
class UserspaceReport:
    """What an install, restore or rollback of the user-space package did on this host."""
    package: str
    sha256: str | None
    driver_version: str | None
    tree: str | None                  # host path of the tree `current` points to (None: no user-space)
    changed: bool
    replaced: str | None = None       # sha256 of what this replaced (what an undo restores); None: nothing
    replaced_version: str | None = None
    activated: bool = False           # the loader configuration and PATH links are driverd's
    ld_conf: str | None = None
    bin_links: list[str] = field(default_factory=list)
    libraries: int = 0
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _root(root: Root | str | os.PathLike) -> Root:
    return root if isinstance(root, Root) else Root(root)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


_valid_sha = valid_sha


_os_errors = os_errors("user-space", disk_full=True)


# -- the previous record (read by driver/userspace.py) ----------------------------------------------------

def put_previous_record(root: Root | str | os.PathLike, rec: dict | None, places: Places = Places()) -> None:
    """Make the previous record `rec` again (None: none): a failed run's rollback, after its restore."""
    _store(_root(root), Runner(), places).put_previous(rec)


is_installed = _os_errors(_is_installed)


# -- install ------------------------------------------------------------------------------------------

def _check_arch(m: us.UserspaceManifest) -> None:
    node = platform.machine()
    if m.arch != node and not (m.arch, node) in (("x86_64", "amd64"), ("aarch64", "arm64")):
        raise PackageError(f"user-space package for {m.arch}, this node is {node}",
                           fix=f"build or fetch the {m.driver_version} user-space for {node}")


def _check_space(root: Root, places: Places, m: us.UserspaceManifest) -> None:
    need = sum(f.size for f in m.files) + (1 << 20)
    probe = root.path(root.resolve(places.root))
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise PackageError(f"not enough space for the {m.driver_version} user-space in {probe}: {need >> 20} MiB "
                           f"needed, {free >> 20} MiB free", cause="the filesystem is full",
                           fix="free space there (or set userspace.root to a larger filesystem) and install again")


def _tree_name(root: Root, places: Places, m: us.UserspaceManifest, sha: str) -> str:
    t = read_tree(root, places, m.driver_version)
    if t is None:
        return m.driver_version
    return m.driver_version if t.sha == sha else f"{m.driver_version}-{sha[:12]}"


def _keep(root: Root, places: Places, package: Path, m: us.UserspaceManifest, sha: str,
          expected: str | None) -> Tree:
    """Unpack and verify the package into a new complete tree (staging, then renamed: complete or absent)."""
    name = _tree_name(root, places, m, sha)
    if read_tree(root, places, name) is not None:      # damaged, or a leftover of that name: out of the way
        _retire(root, places, name)
    put_tree(root, places.root, name, package, expected, us.KIND, m.links, INSTALL_RECORD, {
        "package_sha256": sha, "package": package.name, "installed_at": _now(),
        "driver_version": m.driver_version, "arch": m.arch, "tree": name}, check=lambda fd: _check_sonames(fd, m))
    t = read_tree(root, places, name)
    if t is None or not t.intact or t.sha != sha:
        raise PackageError(f"the {m.driver_version} user-space tree {places.tree(name)} is incomplete right after "
                           "it was written", cause="it does not match its manifest", fix="check the filesystem")
    return t


def _check_sonames(fd: int, m: us.UserspaceManifest) -> None:
    """Every library's own DT_SONAME is the one its manifest names (which the manifest's check holds to
    NVIDIA's): the loader's cache files a library under what the file declares, not under what a
    manifest says, so a libnvidia-cfg.so.<v> declaring libz.so.1 would become every process's libz."""
    for lib in m.libraries:
        have = driverfiles.elf_soname(f"/proc/self/fd/{fd}/{lib.path}")
        if have != lib.soname:
            raise PackageError(f"{lib.path} declares the soname {have}, its manifest says {lib.soname}; nothing was "
                               "installed", cause="the package is not NVIDIA's files as built by driverd",
                               fix="rebuild the package with `driverd build-userspace` from NVIDIA's files")


def _retire(root: Root, places: Places, name: str) -> None:
    """Remove a tree so that it is never seen half-deleted under its own name."""
    gone = places.tree(f"{OLD_PREFIX}{name}-{os.getpid()}")
    root.rmtree(gone)
    root.rename(places.tree(name), gone, replace=False)
    root.rmtree(gone)


@_os_errors
def install(root: Root | str | os.PathLike, package_path: str | os.PathLike, runner: Runner | None = None, *,
            places: Places = Places(), expected_sha256: str | None = None) -> UserspaceReport:
    """Install the user-space package (module docstring). With `expected_sha256` (a repository index's)
    the file is checked before anything of it is decompressed. Installing what is installed, intact,
    with nothing pending, writes nothing."""
    root, runner = _root(root), runner or Runner()
    package = Path(package_path)
    check_root(root, places)
    if expected_sha256 is not None:
        if not _valid_sha(expected_sha256):
            raise PackageError(f"{expected_sha256!r} is not a package sha256", fix="pass 64 lower-case hex digits")
        check_file(package, expected_sha256)
    m = read_manifest(package, kind=us.KIND)
    _check_arch(m)
    sha = expected_sha256 or sha256_file(package)
    if runner.dry_run:
        verify_package(package, expected_sha256, kind=us.KIND)
        cur = current(root, places)
        return UserspaceReport(str(package), sha, m.driver_version, places.tree(_tree_name(root, places, m, sha)),
                               changed=not is_installed(root, sha, places), replaced=cur.sha if cur else None,
                               replaced_version=cur.version if cur else None, libraries=len(m.libraries),
                               dry_run=True, notes=["dry run: the package was verified; nothing was written"])

    def unpack(adds) -> Tree:
        _check_space(root, places, m)
        return _keep(root, places, package, m, sha, expected_sha256)
    target, done, notes = _store(root, runner, places).install(sha, unpack)
    if done is None:
        return _report(root, places, str(package), current(root, places), None, changed=False, notes=notes)
    return _report(root, places, str(package), target, done, changed=True, notes=notes + done.notes)


@_os_errors
def restore(root: Root | str | os.PathLike, sha256: str | None, runner: Runner | None = None, *,
            places: Places = Places()) -> UserspaceReport:
    """Make the user-space `current` points to exactly the installed tree of package `sha256` (None: no
    driverd user-space: `current`, the loader configuration and the PATH links removed, the trees kept).
    A no-op when it is so already; PackageError when no intact tree of that package is there."""
    root, runner = _root(root), runner or Runner()
    check_root(root, places)
    if sha256 is not None and not _valid_sha(sha256):
        raise PackageError(f"{sha256!r} is not a package sha256", fix="pass 64 lower-case hex digits")
    if runner.dry_run:
        cur = current(root, places)
        return UserspaceReport("", sha256, None, None, changed=not is_installed(root, sha256, places),
                               replaced=cur.sha if cur else None, replaced_version=cur.version if cur else None,
                               dry_run=True)
    notes = recover(root, runner, places=places)
    if is_installed(root, sha256, places):
        return _report(root, places, "", current(root, places), None, changed=False, notes=notes)
    target = None
    if sha256 is not None:
        target = lookup(root, places, sha256)
        if target is None:
            raise PackageError(f"user-space package {sha256[:12]} is not installed under {places.root}",
                               cause="no intact tree of it is there (pruned, or never installed)",
                               fix="install that package again")
    done = _store(root, runner, places).restore(target)
    return _report(root, places, "", target, done, changed=True, notes=notes + done.notes)


@_os_errors
def rollback(root: Root | str | os.PathLike, runner: Runner | None = None, *,
             places: Places = Places()) -> UserspaceReport:
    """restore() what the last install/restore replaced; the one rolled back from becomes the previous."""
    root = _root(root)
    notes = recover(root, runner, places=places)
    known, sha = previous_sha(root, places)
    if not known:
        raise PackageError("nothing to roll back to: no previous user-space is recorded",
                           cause=f"{places.previous} is missing", fix="install the wanted user-space package")
    rep = restore(root, sha, runner, places=places)
    rep.notes = notes + rep.notes
    return rep


# -- the switch ---------------------------------------------------------------------------------------

class UserspacePart(Part):
    """The user-space half as install/store.py switches it: the trees under userspace.root, `current`,
    the loader configuration and cache, the PATH links and the driver-root link."""
    noun = "user-space"
    gone = "its tree is gone"

    def __init__(self, root: Root, runner: Runner, places: Places) -> None:
        self.root, self.runner, self.places = root, runner, places
        self.marker, self.previous = places.pending, places.previous
        self.again_fix = "run the user-space install or rollback again"

    def current(self) -> Current:
        cur = current(self.root, self.places)
        return Current(cur is not None, cur.sha if cur else None, bool(cur and cur.intact))

    def lookup(self, sha: str) -> Tree | None:
        return lookup(self.root, self.places, sha)

    def installed(self, sha: str | None) -> bool:
        return is_installed(self.root, sha, self.places)

    def prepare(self, sw: Switch, adds) -> bool:
        """Whether the tree is activated: not where the host has a user-space of its own."""
        sw.extra["target_tree"] = sw.target.name if sw.target else None
        self.foreign = foreign_userspace(self.root, self.places)
        return sw.target is not None and self.foreign is None

    def make_current(self, sw: Switch, activate: bool) -> tuple[bool, list[str]]:
        notes = activate_tree(self.root, self.runner, self.places, sw.target, activate)
        if self.foreign is not None and sw.target is not None:
            notes.append(f"the host has its own NVIDIA user-space ({self.foreign.version or 'unknown version'} in "
                         f"{self.foreign.lib_dir}): driverd's loader configuration and PATH links are not written (the "
                         f"tree is at {self.places.tree(sw.target.name)}; validation.driver_root can point at it)")
        return True, notes

    def settle(self, sw: Switch, activate: bool) -> bool:
        if sw.verify and (problem := _verify(self.root, self.places, sw.target, activate)) is not None:
            raise PackageError(problem, cause="the switched user-space did not verify", fix=_VERIFY_FIX)
        return activate

    def clean(self, notes: list[str]) -> None:
        _clean(self.root, self.places, notes)

    def idle(self, notes: list[str]) -> None:
        # /run is a tmpfs: after a reboot the driver-root link of the user-space in use is made again
        root, places = self.root, self.places
        if link_state(root, places) == "free" and ldconf_ours(root, places):
            cur = current(root, places)
            if cur is not None and cur.intact and foreign_userspace(root, places) is None:
                notes += driver_link(root, places, True)

    def prune(self) -> list[str]:
        return _prune(self.root, self.places)

    def refused(self, e: OSError) -> Exception | None:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return PackageError(f"disk full while unpacking the user-space into {self.places.root}; nothing was "
                                "changed", cause=os.strerror(e.errno), fix="free space there and install again")
        return None

    def describe(self, entry: Tree | None, *, again: bool) -> str:
        if entry is None:
            return "no driverd user-space is current"
        return f"the {entry.version} user-space is current again" if again else \
            f"the {entry.version} user-space stays current"

    def switch_to(self, sha: str | None, entry: Tree | None) -> str:
        return f"user-space switch to {entry.version if entry else (sha or 'none')[:12]}"


def _store(root: Root, runner: Runner, places: Places) -> Store:
    check_root(root, places)
    return Store(UserspacePart(root, runner, places))


_VERIFY_FIX = ("check /etc/ld.so.conf includes /etc/ld.so.conf.d/*.conf and that no other directory ld.so.conf "
               "names holds libcuda.so.1 / libnvidia-ml.so.1; then install again")


def _verify(root: Root, places: Places, target: Tree | None, activate: bool) -> str | None:
    """Why the switched state is wrong, or None."""
    if target is None:
        return None
    t = read_tree(root, places, target.name)
    if t is None or not t.intact or t.sha != target.sha:
        return f"the user-space tree {places.tree(target.name)} is not intact"
    if current_name(root, places) != target.name:
        return f"{places.current} does not point to {target.name}"
    if not activate:
        return None
    found = driverfiles.find(root)
    tree = root.resolve(places.tree(target.name))
    if found.driver_root != tree or found.version != target.version:
        return (f"the driver's user-space is found at {found.lib_dir} ({found.version}), not driverd's "
                f"{tree} ({target.version})")
    for soname in us.KEY_SONAMES:
        paths = driverfiles.ld_cache_lookup(root, LD_CACHE, soname)
        mine = f"{places.ld_line}/{soname}"
        if not paths or root.resolve(paths[0]) != root.resolve(mine):
            return (f"the loader resolves {soname} to {paths[0] if paths else 'nothing'}, not driverd's {mine} "
                    f"(ld cache {LD_CACHE})")
    return None


def _report(root: Root, places: Places, package: str, t: Tree | None, done: Done | None, *, changed: bool,
            notes: list[str]) -> UserspaceReport:
    activated = bool(done.settled) if done else (t is not None and ldconf_ours(root, places))
    replaced = done.replaced if done and done.replaced != (t.sha if t else None) else None
    was = lookup(root, places, replaced) if replaced else None
    return UserspaceReport(
        package, t.sha if t else None, t.version if t else None, places.tree(t.name) if t else None, changed,
        replaced=replaced, replaced_version=was.version if was else None,
        activated=activated, ld_conf=LDCONF if activated else None,
        bin_links=sorted(f"{places.bin_dir}/{n}" for n in our_links(root, places)) if places.bin_dir else [],
        libraries=len(t.manifest.libraries) if t and t.manifest else 0, notes=notes)


# -- pruning and recovery -------------------------------------------------------------------------------

def _protected(root: Root, places: Places) -> set[str]:
    out = set()
    cur = current_name(root, places)
    for rec in (read_json(root, places.previous), read_json(root, places.pending)):
        for k in ("sha256", "target", "replaced"):
            if rec and _valid_sha(rec.get(k)):
                out.add(rec[k])
    return out | ({f"tree:{cur}"} if cur else set())


def _prune(root: Root, places: Places) -> list[str]:
    """Remove the oldest trees beyond userspace.max_kept, never the current, previous or pending ones."""
    try:
        keep = _protected(root, places)
        ts = trees(root, places)

        def mtime(t: Tree) -> float:
            st = root.lstat(places.tree(t.name))
            return st.st_mtime if st else 0.0
        removed = []
        for t in sorted(ts, key=mtime):
            if len(ts) - len(removed) <= max(places.max_kept, 1):
                break
            if f"tree:{t.name}" in keep or (t.sha in keep):
                continue
            _retire(root, places, t.name)
            removed.append(f"pruned the {t.version or '?'} user-space tree {places.tree(t.name)}")
        return removed
    except (OSError, DriverdError) as e:
        return [f"pruning user-space trees failed: {getattr(e, 'message', None) or e}"]


def _clean(root: Root, places: Places, notes: list[str]) -> None:
    """Leftovers of a killed install: staging and half-retired trees, temporary links and files."""
    for n in root.listdir(places.root):
        if n.startswith((STAGING_PREFIX, OLD_PREFIX)):
            root.rmtree(places.tree(n))
            notes.append(f"removed leftover {places.tree(n)}")
        elif n.startswith(f".{CURRENT}.") and n.endswith(".tmp"):
            root.unlink(places.tree(n))
    ldd = os.path.dirname(LDCONF)
    for n in root.listdir(ldd):
        if n.startswith(f".{os.path.basename(LDCONF)}.") and n.endswith(".tmp"):
            root.unlink(f"{ldd}/{n}")
    sd = os.path.dirname(places.pending)
    for n in root.listdir(sd):
        if n.startswith((".pending.json.", ".previous.json.", ".links.json.")) and n.endswith(".tmp"):
            root.unlink(f"{sd}/{n}")
    if places.driver_link:
        ld = os.path.dirname(places.driver_link.rstrip("/")) or "/"
        leaf = os.path.basename(places.driver_link.rstrip("/"))
        for n in root.listdir(ld):
            if n.startswith(f".{leaf}.") and n.endswith(".tmp") and root.readlink(f"{ld}/{n}") == places.link_target(root):
                root.unlink(f"{ld}/{n}")
    if places.bin_dir:
        for n in root.listdir(places.bin_dir):
            if n.startswith(".") and n.endswith(".tmp") and (root.readlink(f"{places.bin_dir}/{n}") or "").startswith(
                    f"{places.current}/bin/"):
                root.unlink(f"{places.bin_dir}/{n}")


@_os_errors
def recover(root: Root | str | os.PathLike, runner: Runner | None = None, *, places: Places = Places()) -> list[str]:
    """Finish what an interrupted install/restore left (module docstring): leftovers removed, a pending
    switch driven to its target (whose tree is complete) through the same checks — or, when the target
    is gone, back to what it replaced. Writes nothing when there is nothing to do (or on a dry run)."""
    return _store(_root(root), runner or Runner(), places).recover()
