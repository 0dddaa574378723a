"""Installing a companion package (driverd.package.companion: fabric manager, nscq, NVLSM, IMEX of one
driver version) into its versioned tree and switching the component's `current` to it — the third part
of the one driver under install/store.py's protocol (driver/companions.py says the layout):

    1. the package is verified while it is unpacked into `<component root>/.driverd-staging-*` (against
       its manifest: driverd.package.archive), its links and install.json made, everything fsync'd, then
       renamed to its tree name: a tree is complete or absent;
    2-5. install/store.py: the marker, `current` switched (a new link renamed over it), the check (the tree
       intact and `current` naming it; on failure what it replaced is switched back), the previous record.

Nothing outside the component's directory is written: the daemons start its binaries from `current/bin`."""
from __future__ import annotations

import os
from dataclasses import field
from datetime import UTC, datetime
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.driver.companions import (RECORD, CompanionPlaces, CompanionTree, current, current_name,
                                       is_installed, lookup, read_tree, trees)
from driverd.driver.records import valid_sha
from driverd.errors import PackageError
from driverd.install.checks import os_errors
from driverd.install.store import Current, Done, Part, Store, Switch
from driverd.install.tree import OLD_PREFIX, STAGING_PREFIX, put_tree
from driverd.root import Root
from driverd.runner import Runner

_os_errors = os_errors("companion", disk_full=True)


@dataclass
class CompanionReport:
    """What an install or restore of a companion component did: the tree now current and what it replaced."""
    component: str
    package: str
    sha256: str | None
    driver_version: str | None
    tree: str | None
    changed: bool
    replaced: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _root(root) -> Root:
    return root if isinstance(root, Root) else Root(root)


class CompanionPart(Part):
    noun = "companion"
    gone = "its tree is gone"

    def __init__(self, root: Root, runner: Runner, places: CompanionPlaces) -> None:
        self.root, self.runner, self.places = root, runner, places
        self.marker, self.previous = places.pending, places.previous
        self.again_fix = f"run the {places.component} install or rollback again"

    def current(self) -> Current:
        cur = current(self.root, self.places)
        return Current(cur is not None, cur.sha if cur else None, bool(cur and cur.intact))

    def lookup(self, sha: str) -> CompanionTree | None:
        return lookup(self.root, self.places, sha)

    def installed(self, sha: str | None) -> bool:
        return is_installed(self.root, self.places, sha)

    def prepare(self, sw: Switch, adds) -> None:
        sw.extra["component"] = self.places.component
        sw.extra["target_tree"] = sw.target.name if sw.target else None
        self.root.makedirs(self.places.records)

    def make_current(self, sw: Switch, prepared) -> tuple[bool, list[str]]:
        if sw.target is not None:
            self.root.symlink(self.places.current, sw.target.name)
        else:
            self.root.unlink(self.places.current)
        return True, self._loader(sw.target is not None)

    def _loader(self, active: bool) -> list[str]:
        """The loader configuration of a component other processes load (NSCQ), written while a tree of it is
        current and removed with the last one (each idempotent)."""
        conf = self.places.ldconf
        if conf is None:
            return []
        if active and self.root.read_text(conf, 64 << 10) != self.places.ldconf_text():
            self.root.atomic_write(conf, self.places.ldconf_text(), 0o644)
            return [f"wrote {conf}"]
        if not active and self.root.lstat(conf) is not None:
            self.root.unlink(conf)
            return [f"removed {conf}"]
        return []

    def settle(self, sw: Switch, prepared) -> None:
        if self.places.ldconf is not None:
            from driverd.install.activate import ldconfig
            ldconfig(self.root, self.runner)     # the cache names the files of the tree just switched to: rebuilt
        if not sw.verify or sw.target is None:
            return
        t = read_tree(self.root, self.places, sw.target.name)
        if t is None or not t.intact or t.sha != sw.target.sha:
            raise PackageError(f"the {self.places.component} tree {self.places.tree(sw.target.name)} is not intact",
                               cause="a file differs from its manifest", fix="install the companion package again")
        if current_name(self.root, self.places) != sw.target.name:
            raise PackageError(f"{self.places.current} does not point to {sw.target.name}",
                               fix="check the file system under userspace.root")

    def idle(self, notes: list[str]) -> None:
        """No switch pending: the loader configuration as `current` says (a file removed by hand, an install of
        an older driverd that wrote none)."""
        from driverd.driver.companions import loader_ok
        if not loader_ok(self.root, self.places):
            notes += self._loader(current_name(self.root, self.places) is not None)
            from driverd.install.activate import ldconfig
            ldconfig(self.root, self.runner)

    def clean(self, notes: list[str]) -> None:
        for n in self.root.listdir(self.places.root):
            if n.startswith((STAGING_PREFIX, OLD_PREFIX)):
                self.root.rmtree(self.places.tree(n))
                notes.append(f"removed leftover {self.places.tree(n)}")

    def prune(self) -> list[str]:
        keep = {current_name(self.root, self.places)}
        prev = Store(self).previous()[1]
        ts = sorted(trees(self.root, self.places), key=lambda t: (self.root.lstat(self.places.tree(t.name)) or
                                                                  os.stat_result((0,) * 10)).st_mtime)
        out = []
        for t in ts:
            if len(ts) - len(out) <= max(self.places.max_kept, 1):
                break
            if t.name in keep or t.sha == prev:
                continue
            _retire(self.root, self.places, t.name)
            out.append(f"pruned the {t.version or '?'} {self.places.component} tree {self.places.tree(t.name)}")
        return out

    def describe(self, entry: CompanionTree | None, *, again: bool) -> str:
        if entry is None:
            return f"no driverd {self.places.component} is current"
        return f"the {entry.version} {self.places.component} is current {'again' if again else 'still'}"

    def switch_to(self, sha: str | None, entry: CompanionTree | None) -> str:
        return f"{self.places.component} switch to {entry.version if entry else (sha or 'none')[:12]}"


def _retire(root: Root, places: CompanionPlaces, name: str) -> None:
    gone = places.tree(f"{OLD_PREFIX}{name}-{os.getpid()}")
    root.rmtree(gone)
    root.rename(places.tree(name), gone, replace=False)
    root.rmtree(gone)


def _store(root: Root, runner: Runner, places: CompanionPlaces) -> Store:
    return Store(CompanionPart(root, runner, places))


def _unpack(root: Root, places: CompanionPlaces, package: Path, m, sha: str, expected: str | None) -> CompanionTree:
    from driverd.package.companion import KIND
    t = read_tree(root, places, m.driver_version)
    name = m.driver_version if t is None or t.sha == sha else f"{m.driver_version}-{sha[:12]}"
    if read_tree(root, places, name) is not None:          # damaged, or a leftover of that name: out of the way
        _retire(root, places, name)
    put_tree(root, places.root, name, package, expected, KIND, m.links, RECORD, {
        "package_sha256": sha, "package": package.name, "component": m.component,
        "installed_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "driver_version": m.driver_version, "arch": m.arch, "tree": name})
    t = read_tree(root, places, name)
    if t is None or not t.intact or t.sha != sha:
        raise PackageError(f"the {m.driver_version} {m.component} tree {places.tree(name)} is incomplete right after "
                           "it was written", cause="it does not match its manifest", fix="check the filesystem")
    return t


def _report(places: CompanionPlaces, package: str, t: CompanionTree | None, done: Done | None, notes: list[str],
            changed: bool) -> CompanionReport:
    return CompanionReport(places.component, package, t.sha if t else None, t.version if t else None,
                           places.tree(t.name) if t else None, changed,
                           replaced=done.replaced if done else None, notes=notes)


@_os_errors
def install(root, package_path, runner: Runner | None = None, *, places: CompanionPlaces,
            driver: str | None = None, expected_sha256: str | None = None) -> CompanionReport:
    """Install the companion package and make it the component's `current`. `driver`: the driver version
    it must be of (refused otherwise, before anything is written)."""
    from driverd.package.archive import check_file, read_manifest, sha256_file
    from driverd.package.companion import KIND
    root, runner, package = _root(root), runner or Runner(), Path(package_path)
    if expected_sha256 is not None:
        if not valid_sha(expected_sha256):
            raise PackageError(f"{expected_sha256!r} is not a package sha256", fix="pass 64 lower-case hex digits")
        check_file(package, expected_sha256)
    m = read_manifest(package, kind=KIND)
    if m.component != places.component:
        raise PackageError(f"{package.name} is a {m.component} package, not {places.component}",
                           fix=f"give the {places.component} companion package")
    if driver and m.driver_version != driver:
        raise PackageError(f"{package.name} is the {m.driver_version} {m.component}, the driver is {driver}",
                           cause="a companion of another version refuses the driver (NVIDIA's fabric manager exits)",
                           fix=f"give the {driver} {m.component} companion package (driverd build-companion)")
    sha = expected_sha256 or sha256_file(package)
    t, done, notes = _store(root, runner, places).install(
        sha, lambda adds: _unpack(root, places, package, m, sha, expected_sha256))
    if done is None:
        return _report(places, str(package), current(root, places), None, notes, False)
    return _report(places, str(package), t, done, notes + done.notes, True)


@_os_errors
def restore(root, sha256: str | None, runner: Runner | None = None, *, places: CompanionPlaces) -> CompanionReport:
    """Make the component's `current` the installed tree of package `sha256` (None: none); a no-op when so."""
    root, runner = _root(root), runner or Runner()
    store = _store(root, runner, places)
    notes = store.recover()
    if is_installed(root, places, sha256):
        return _report(places, "", current(root, places), None, notes, False)
    target = None
    if sha256 is not None:
        target = lookup(root, places, sha256)
        if target is None:
            raise PackageError(f"{places.component} package {sha256[:12]} is not installed under {places.root}",
                               cause="no intact tree of it is there", fix="install that package again")
    done = store.restore(target)
    return _report(places, "", target, done, notes + done.notes, True)


@_os_errors
def recover(root, runner: Runner | None = None, *, places: CompanionPlaces) -> list[str]:
    return _store(_root(root), runner or Runner(), places).recover()
