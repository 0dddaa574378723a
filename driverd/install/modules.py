"""Installing a package's modules and firmware into a host root (loading them is driverd.kmod's job).

Installed layout (a contract with the module lifecycle and the host fact reader):
    <root>/lib/modules/<release>/updates/driverd/   *.ko, manifest.json, install.json
    <root>/lib/firmware/nvidia/<version>/           gsp_*.bin (open flavour, when the package has them)
State (under the state dir, /var/lib/driverd):
    packages/kept/<sha256>/             every package installed or replaced, restorable by sha256
                                        (driverd.install.kept: complete or absent)
    packages/pending-<release>.json     an unfinished switch: {"target": sha|null, "replaced": ...}
    packages/previous/<release>.json    what the last install/restore replaced: {"sha256": sha|null}

Order: the package's vermagic is checked against the target kernel first, then signatures against
the kernel's enforcement, then free space; only then is anything written. The package is unpacked,
verified and kept by its sha256; the installed tree is kept too (when it is not kept yet) — all
before anything under /lib changes, so a refusal (disk full, read-only) changes nothing. Then:

    1. a staging directory beside the target is filled from the kept entry (hard links or copies);
    2. the pending marker names the target and what it replaces (atomic, fsync'd);
    3. the staging tree is switched in (renameat2 exchange), the replaced tree deleted (it is kept);
    4. firmware likewise, when the version's directory differs from the package's;
    5. the kernel's depmod runs and `modprobe --show-depends nvidia` must resolve; if either fails,
       the replaced package is switched back in the same way. Both come from the kernel boundary
       (`kernel_tools`: driverd.kmod.kernel.Kernel.depmod/show_depends): kmod's tools on a real
       host (the default), the simulated kernel's own modules.dep writer on a simulated host;
    6. the previous record is written and the marker removed: only now is the install complete.

A process killed anywhere leaves the marker or a finished switch; `recover()` (run first by every
install/restore/rollback) drives a marker to its target again (the target and the replaced package
are both kept, so this always can be done), re-runs depmod, and only then deletes leftovers, after
keeping any complete installation they hold.

Every write, rename and delete names a host path and goes through the Root's confined writers
(driverd.root: the parent opened with RESOLVE_IN_ROOT or the O_NOFOLLOW walk at each call, the
final name never followed, trees removed by file descriptor), so a symlink anywhere in these trees,
placed before or swapped in during an install, cannot lead a write or a delete out of the root
(issue 30). Reads and reports use the real path resolved inside the root.
"""
from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import field
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.errors import DriverdError, PackageError
from driverd.driver.records import read_json
from driverd.install import kept as kp
from driverd.install.checks import check_signatures, check_space, check_vermagic, os_errors, signature_enforced, target_release
from driverd.install.records import (FIRMWARE_BASE, _Ctx, _current, _now, _root, firmware_dir, installed_sha256,
                                     is_installed, kept_dir, modules_dir, previous_record, previous_sha)
from driverd.install.store import Current, Done, Part, Store, Switch
from driverd.install.kept import (INSTALL_RECORD, OLD_PREFIX, STAGING_PREFIX, Additions, Kept, kept_base, lookup,
                                   prune_kept)
from driverd.package.manifest import FIRMWARE_DIR, MANIFEST_NAME, MODULES_DIR, Manifest
# archive (tarfile, zstandard), modinfo and switch are imported where they are used: `driverd reboot-ready`
# and the daemon's pass read this module's queries (is_installed, kernel_vermagic) on every call
from driverd.root import Root
from driverd.runner import Runner

__all__ = ["InstallReport", "ModulesPart", "firmware_dir", "install", "installed_sha256", "is_installed", "kept_dir",
           "modules_dir", "previous_record", "previous_sha", "prune_kept", "put_previous_record", "recover", "restore",
           "rollback_install"]

DEFAULT_STATE_DIR = "/var/lib/driverd"
PACKAGES_DIR = "packages"               # under the state dir
PREVIOUS_DIR = "packages/previous"      # <release>.json records (and, before, <release>/ trees)
MAX_KEPT = 3
_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


@dataclass
class InstallReport:
    """What an install, restore or rollback of a package's modules and firmware did for one kernel release."""
    package: str
    sha256: str
    driver_version: str
    flavor: str
    kernel_release: str
    modules_dir: str
    firmware_dir: str | None
    previous: str | None            # the kept entry of the package this one replaced
    changed: bool
    depmod: str = ""
    resolves: list[str] = field(default_factory=list)   # modprobe --show-depends nvidia, in load order
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)      # what recover() did first

    def to_json(self) -> dict:
        return dict(self.__dict__)


_os_errors = os_errors()


# -- paths and state ------------------------------------------------------------------------------

# -- the switch -----------------------------------------------------------------------------------

def _disk_error(e: OSError, where: Path) -> PackageError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackageError(f"disk full while installing into {where}; nothing was changed",
                            cause=os.strerror(e.errno), fix="free space there and install again")
    return PackageError(f"cannot write {e.filename or where}: {e.strerror or e}; nothing was changed",
                        cause=str(e), fix="check permissions and that the filesystem is writable")


def _drop(root: Root, d: str) -> None:
    """Delete a directory under /lib: renamed to a leftover name first, so a crash mid-delete leaves
    something recover() removes, never a half tree under the real name."""
    if root.lexists(d):
        gone = f"{os.path.dirname(d)}/{OLD_PREFIX}{os.path.basename(d)}-{os.getpid()}"
        root.rmtree(gone, ignore_errors=True)
        root.rename(d, gone)
        root.rmtree(gone, ignore_errors=True)


@dataclass
class _Staged:
    """What a switch readied before its marker."""
    mods_ok: bool                       # the modules directory is the target's already
    stage: str | None = None            # staging directory of the target's modules
    fw_stage: str | None = None         # of its firmware, when the version's directory differs
    fdir: str | None = None
    created_fw: str | None = None       # the firmware directory this switch creates (removed on a switch back)


class ModulesPart(Part):
    """The kernel half of one release as install/store.py switches it: the tree under
    /lib/modules/<release>/updates/driverd (and the version's firmware directory), its complete copies in
    the kept store."""
    noun = "package"
    gone = "it is not kept"
    again_fix = "run driverd install or rollback-install again"

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx, self.root, self.runner = ctx, ctx.root, ctx.runner
        self.marker, self.previous = ctx.marker_hp, ctx.prev_rec_hp

    def current(self) -> Current:
        cur = _current(self.ctx)
        return Current(cur.exists, cur.sha, cur.intact)

    def lookup(self, sha: str) -> Kept | None:
        return lookup(self.root, self.ctx.state_dir, sha)

    def prepare(self, sw: Switch, adds: Additions) -> _Staged:
        ctx, root, target = self.ctx, self.root, sw.target
        cur = _current(ctx)
        st = _Staged((cur.intact and cur.sha == sw.want) if target else not cur.exists,
                     created_fw=sw.extra.get("created_fw"))
        if not st.mods_ok and cur.exists and cur.sha is None and _has_files(root, ctx.mdir_hp):
            raise PackageError(f"{ctx.mdir} holds files driverd did not install (no install record); nothing was changed",
                               cause="every driverd installation has an install.json naming its package",
                               fix=f"move {ctx.mdir} away, then run the command again")
        try:
            if not st.mods_ok and cur.intact:          # keep what is about to be replaced, first
                kp.keep_tree(root, ctx.state_dir, ctx.mdir_hp, ctx.fw_hp(cur.manifest.driver_version), adds)
            if not st.mods_ok and target is not None:
                adds.dirs += kp.mkdirs(root, ctx.updates_hp)
                st.stage = kp.stage_from(root, target.modules_hp, ctx.updates_hp)
            if target is not None and target.firmware is not None:
                st.fdir = ctx.fw_hp(target.version)
                if not kp.firmware_same(ctx.fw(target.version), target.manifest):
                    adds.dirs += kp.mkdirs(root, FIRMWARE_BASE)
                    st.fw_stage = kp.stage_from(root, target.firmware_hp, FIRMWARE_BASE)
                    if not root.lexists(st.fdir):
                        st.created_fw = target.version
            adds.dirs += kp.mkdirs(root, ctx.pkgs_hp)
        except BaseException:
            self.discard(st)
            raise
        sw.extra.update(release=ctx.release, drop_fw=sw.extra.get("drop_fw"), created_fw=st.created_fw)
        return st

    def discard(self, st: _Staged | None) -> None:
        for d in (st.stage, st.fw_stage) if st is not None else ():
            if d is not None:
                self.root.rmtree(d, ignore_errors=True)

    def make_current(self, sw: Switch, st: _Staged) -> tuple[bool, list[str]]:
        from driverd.install.switch import replace_dir
        ctx, root, target = self.ctx, self.root, sw.target
        changed = not st.mods_ok or st.fw_stage is not None
        if not st.mods_ok:
            if target is not None:
                old = replace_dir(root, st.stage, ctx.mdir_hp)
                if old is not None:
                    root.rmtree(old, ignore_errors=True)
            else:
                _drop(root, ctx.mdir_hp)
        drop_fw = sw.extra.get("drop_fw")
        if drop_fw and (target is None or drop_fw != target.version):
            _drop(root, ctx.fw_hp(drop_fw))
            changed = True
        if st.fw_stage is not None:
            old = replace_dir(root, st.fw_stage, st.fdir)
            if old is not None:
                root.rmtree(old, ignore_errors=True)
        if target is not None:
            kp.touch(root, target.hostpath)
        return changed, []

    def settle(self, sw: Switch, st: _Staged) -> tuple[str, list[str]]:
        dep = self.ctx.tools.depmod(self.ctx.release, check=sw.verify)
        return dep, (_resolves(self.ctx, strict=sw.verify) if sw.target is not None else [])

    def back_extra(self, sw: Switch, st: _Staged | None) -> dict:
        return {"drop_fw": st.created_fw if st is not None else sw.extra.get("created_fw")}

    def resumed(self, marker: dict) -> dict:
        def version(v: object) -> str | None:
            return v if isinstance(v, str) and _RELEASE.fullmatch(v) else None
        return {"drop_fw": version(marker.get("drop_fw")), "created_fw": version(marker.get("created_fw"))}

    def clean(self, notes: list[str]) -> None:
        _migrate_legacy(self.ctx, notes)
        _clean(self.ctx, notes)     # depmod must not see a leftover tree (everything is kept by now)

    def prune(self) -> list[str]:
        return _prune(self.ctx)

    def describe(self, entry: Kept | None, *, again: bool) -> str:
        if entry is None:
            return "no driverd package is installed now"
        return f"package {entry.sha[:12]} is installed {'again' if again else 'still'}"

    def switch_to(self, sha: str | None, entry: Kept | None) -> str:
        return f"switch of kernel {self.ctx.release} to package {(sha or 'none')[:12]}"

    def interrupted(self, sw: Switch, e: OSError) -> Exception:
        return PackageError(f"switching kernel {self.ctx.release} to package {(sw.want or 'none')[:12]} was "
                            f"interrupted: {e.strerror or e} ({e.filename})", cause=str(e),
                            fix=f"fix the filesystem; the switch is recorded in {self.ctx.marker} and the next driverd "
                            "install/rollback-install completes or undoes it")

    def refused(self, e: OSError) -> Exception:
        return _disk_error(e, self.root.path(self.ctx.updates_hp))


def _store(ctx: _Ctx) -> Store:
    return Store(ModulesPart(ctx))


def _switch(ctx: _Ctx, target: Kept | None, **kw) -> Done:
    return _store(ctx).switch(target, **kw)


def _has_files(root: Root, d: str) -> bool:
    st = root.lstat(d)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return True
    try:
        with root.dir_fd(d) as fd:
            return bool(os.listdir(fd))
    except OSError:
        return True


def _keep_package(ctx: _Ctx, package: Path, manifest: Manifest, sha: str, expected: str | None,
                  adds: Additions) -> Kept:
    """Unpack and verify the package into a new kept entry (complete or absent)."""
    from driverd.package.archive import unpack_at
    root = ctx.root
    base = kp.kept_hostdir(ctx.state_dir)
    adds.dirs += kp.mkdirs(root, base)
    tmp = kp.temp_dir(root, base, 0o700)
    try:
        root.mkdir(f"{tmp}/pkg", 0o700)
        with root.dir_fd(f"{tmp}/pkg") as fd:
            unpack_at(package, fd, expected)
        mods = f"{tmp}/{MODULES_DIR}"
        root.rename(f"{tmp}/pkg/{MODULES_DIR}", mods, durable=False)
        root.rename(f"{tmp}/pkg/{MANIFEST_NAME}", f"{mods}/{MANIFEST_NAME}", durable=False)
        root.atomic_write_json(f"{mods}/{INSTALL_RECORD}", {
            "package_sha256": sha, "package": package.name, "installed_at": _now(),
            "driver_version": manifest.driver_version, "flavor": manifest.flavor,
            "kernel_release": manifest.kernel_release})
        root.chmod(mods, 0o755)
        st = root.lstat(f"{tmp}/pkg/{FIRMWARE_DIR}")
        if st is not None and stat.S_ISDIR(st.st_mode):
            root.mkdir(f"{tmp}/firmware", 0o755)
            ctx.fw_hp(manifest.driver_version)             # a plain name: refused otherwise
            fw = f"{tmp}/firmware/{manifest.driver_version}"
            root.rename(f"{tmp}/pkg/{FIRMWARE_DIR}", fw, durable=False)
            root.chmod(fw, 0o755)
        root.rmdir(f"{tmp}/pkg")
        kp.commit(root, tmp, f"{base}/{sha}")
    except BaseException:
        root.rmtree(tmp, ignore_errors=True)
        raise
    adds.kept.append(f"{base}/{sha}")
    k = lookup(ctx.root, ctx.state_dir, sha)
    if k is None:
        raise PackageError(f"the kept copy of package {sha[:12]} is incomplete right after writing it",
                           cause=f"{kept_base(root, ctx.state_dir) / sha} does not match its manifest",
                           fix="check the filesystem")
    return k


def _prune(ctx: _Ctx) -> list[str]:
    try:
        return [f"pruned kept package {s[:12]}" for s in prune_kept(ctx.root, ctx.state_dir, max_kept=MAX_KEPT)]
    except PackageError as e:
        return [f"pruning kept packages failed: {e.message}"]


def _report(ctx: _Ctx, package: str, k: Kept | None, done: Done | None, notes: list[str], *,
            changed: bool, dry_run: bool = False) -> InstallReport:
    m = k.manifest if k else None
    fw = str(ctx.fw(m.driver_version)) if m and m.firmware_files else None
    prev = None
    if done is not None:
        prev = done.replaced
    else:
        prev = previous_sha(ctx.root, ctx.release, ctx.state_dir)[1]
    prev_dir = str(kept_base(ctx.root, ctx.state_dir) / prev) if prev and lookup(
        ctx.root, ctx.state_dir, prev) else None
    dep, resolves = done.settled if done and done.settled else ("", [] if done else (_resolves(ctx) if k else []))
    return InstallReport(package, k.sha if k else "", m.driver_version if m else "", m.flavor if m else "",
                         ctx.release, str(ctx.mdir), fw, prev_dir, changed=changed,
                         depmod=dep, resolves=resolves, dry_run=dry_run, notes=notes)


# -- install / restore / rollback -----------------------------------------------------------------

def preflight(root: Root, package_path: str | os.PathLike, runner: Runner | None = None, *,
              kernel: str | None = None, enforce: bool | None = None,
              trusted_certs: list[str] | None = None) -> tuple[Manifest, str]:
    """What decides, before anything is written (or a transaction is even started), whether the
    package can go onto this kernel: its manifest, its vermagic against the target kernel, its
    signatures against the kernel's enforcement. Returns (manifest, target release)."""
    from driverd.package.archive import read_manifest
    manifest = read_manifest(package_path)
    release = target_release(root, manifest, kernel)
    check_vermagic(root, manifest, release)
    if enforce is None:
        enforced, sources = signature_enforced(root)
    else:
        enforced, sources = enforce, ("--enforce-signatures",)
    check_signatures(root, package_path, release, enforced, sources, trusted_certs)
    return manifest, release


@_os_errors
def install(root: Root | str | os.PathLike, package_path: str | os.PathLike, runner: Runner | None = None, *,
            kernel: str | None = None, enforce: bool | None = None,
            state_dir: str = DEFAULT_STATE_DIR, expected_sha256: str | None = None,
            trusted_certs: list[str] | None = None, kernel_tools=None) -> InstallReport:
    """Install `package_path` (see the module docstring). With `expected_sha256` (from a repository
    index) the archive's hash is checked in the same pass that unpacks and verifies its files.
    Installing the package that is installed, intact, with no switch pending writes nothing.
    `kernel_tools` (a driverd.kmod.kernel.Kernel) runs depmod and resolves the modules; default:
    the real kernel's kmod tools."""
    from driverd.package.archive import sha256_file
    root, runner = _root(root), runner or Runner()
    package_path = Path(package_path)
    if expected_sha256 is not None:
        # The file is the one the index names before any of it is decompressed (issue 21).
        kp.check_sha(expected_sha256)
        from driverd.package.archive import check_file
        check_file(package_path, expected_sha256)
    manifest, release = preflight(root, package_path, runner, kernel=kernel, enforce=enforce,
                                  trusted_certs=trusted_certs)
    if expected_sha256 is not None:
        kp.check_sha(expected_sha256)
    from driverd.package.archive import unusual_modes
    odd = unusual_modes(manifest)
    sha = expected_sha256 or sha256_file(package_path)
    ctx = _Ctx(root, release, runner, state_dir, kernel_tools)
    if runner.dry_run:    # every check a real install makes before writing, and nothing written
        from driverd.package.archive import verify_package
        cur = _current(ctx)
        verify_package(package_path, expected_sha256)
        return _report(ctx, str(package_path), Kept(sha, ctx.mdir, manifest), Done(True, cur.sha), odd,
                       changed=not (cur.intact and cur.sha == sha), dry_run=True)

    def unpack(adds: Additions) -> Kept:
        check_space(kept_base(root, state_dir), manifest)
        return _keep_package(ctx, package_path, manifest, sha, expected_sha256, adds)
    have, done, notes = _store(ctx).install(sha, unpack)
    if done is None:
        cur = _current(ctx)
        return _report(ctx, str(package_path), have or Kept(sha, ctx.mdir.parent, cur.manifest), None, notes,
                       changed=False)
    return _report(ctx, str(package_path), have, done, notes + odd + done.notes, changed=True)


@_os_errors
def restore(root: Root | str | os.PathLike, release: str, sha256: str | None, runner: Runner | None = None, *,
            state_dir: str = DEFAULT_STATE_DIR, kernel_tools=None) -> InstallReport:
    """Make the installed driverd package for `release` exactly the kept package `sha256` (modules
    and firmware); None: no driverd package (the current one is kept, then removed). A no-op when it
    is so already. PackageError when that package is not kept."""
    root, runner = _root(root), runner or Runner()
    ctx = _Ctx(root, release, runner, state_dir, kernel_tools)
    if sha256 is not None:
        kp.check_sha(sha256)
    notes = recover(root, release, runner, state_dir, kernel_tools=kernel_tools)
    cur = _current(ctx)
    pending = root.lexists(ctx.marker_hp)
    if sha256 is None and not cur.exists and not pending:
        return _report(ctx, "", None, None, notes, changed=False)
    if not pending and cur.intact and cur.sha == sha256 and (not cur.manifest.firmware_files or kp.firmware_present(
            ctx.fw(cur.manifest.driver_version), cur.manifest)):         # so already: kept or not
        return _report(ctx, "", lookup(root, state_dir, sha256) or Kept(sha256, ctx.mdir.parent, cur.manifest),
                       None, notes, changed=False)
    k = None
    if sha256 is not None:
        k = lookup(root, state_dir, sha256)
        if k is None:
            raise PackageError(f"package {sha256[:12]} is not kept for kernel {release}",
                               cause=f"{kept_base(root, state_dir) / sha256} is missing or incomplete",
                               fix="install that package with driverd install <package>")
        if k.manifest.kernel_release != release:
            raise PackageError(f"kept package {sha256[:12]} is for kernel {k.manifest.kernel_release}, not {release}",
                               fix=f"restore a package built for {release}")
    if runner.dry_run:
        return _report(ctx, "", k, Done(True, cur.sha), notes, changed=True, dry_run=True)
    done = _store(ctx).restore(k)
    return _report(ctx, str(k.path) if k else "", k, done, notes + done.notes, changed=True)


@_os_errors
def rollback_install(root: Root | str | os.PathLike, release: str, runner: Runner | None = None, *,
                     state_dir: str = DEFAULT_STATE_DIR, kernel_tools=None) -> InstallReport:
    """restore() what the last install/restore replaced. The one rolled back from becomes the
    previous one, so a second rollback returns to it."""
    root, runner = _root(root), runner or Runner()
    ctx = _Ctx(root, release, runner, state_dir, kernel_tools)
    notes = recover(root, release, runner, state_dir, kernel_tools=kernel_tools)
    known, sha = previous_sha(root, release, state_dir)
    if not known:
        raise PackageError(f"nothing to roll back to: no previous installation is recorded for kernel {release}",
                           cause=f"{root.path(ctx.prev_rec_hp)} is missing", fix="install the wanted package with driverd install")
    rep = restore(root, release, sha, runner, state_dir=state_dir, kernel_tools=kernel_tools)
    rep.notes = notes + rep.notes
    return rep


@_os_errors
def put_previous_record(root: Root | str | os.PathLike, release: str, rec: dict | None,
                        state_dir: str = DEFAULT_STATE_DIR) -> None:
    """Make the previous record `rec` again (None: none). A failed run's rollback does this after its
    restore: the package the run failed with must not become what `driverd rollback` goes back to."""
    _store(_Ctx(_root(root), release, Runner(), state_dir)).put_previous(rec)


# -- recovery -------------------------------------------------------------------------------------

@_os_errors
def recover(root: Root | str | os.PathLike, release: str, runner: Runner | None = None,
            state_dir: str = DEFAULT_STATE_DIR, *, kernel_tools=None) -> list[str]:
    """Finish what an interrupted install/restore left: drive a pending switch to its target (and
    through its checks; a failing check switches back to what it replaced), re-running depmod; keep
    any complete installation found in leftover staging/holding directories, then delete them;
    move a `previous/<release>/` tree of older driverd versions into the kept store. Returns notes
    of what it did; writes nothing when there is nothing to do (or on a dry-run runner)."""
    return _store(_Ctx(_root(root), release, runner or Runner(), state_dir, kernel_tools)).recover()


def _leftovers(root: Root, d: str, prefixes=(STAGING_PREFIX, OLD_PREFIX)) -> list[str]:
    """Host paths of the staging/holding entries in the directory `d` (listed through its fd)."""
    try:
        with root.dir_fd(d) as fd:
            names = os.listdir(fd)
    except (OSError, ValueError):
        return []
    return [f"{d}/{n}" for n in sorted(names) if n.startswith(prefixes)]


def _is_dir(root: Root, hp: str) -> bool:
    st = root.lstat(hp)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _rescue(ctx: _Ctx, d: str, fw: str | None = None) -> None:
    """Keep the installation a leftover directory holds, when it is complete and not kept yet. A
    leftover that is not a directory (a symlink, say) holds nothing of ours."""
    if not _is_dir(ctx.root, d):
        return
    for cand in (d, f"{d}/{MODULES_DIR}", f"{d}/old-modules"):
        real = ctx.root.safe_real(cand) if _is_dir(ctx.root, cand) else None
        m = kp.tree_manifest(real) if real is not None else None
        if m is not None:
            kp.keep_tree(ctx.root, ctx.state_dir, cand,
                         fw if fw is not None and _is_dir(ctx.root, fw) else ctx.fw_hp(m.driver_version),
                         Additions(ctx.root))


def _clean(ctx: _Ctx, notes: list[str]) -> None:
    root = ctx.root
    for d in _leftovers(root, ctx.updates_hp):
        _rescue(ctx, d)
        root.rmtree(d)
        notes.append(f"removed leftover {root.path(d)}")
    for d in _leftovers(root, FIRMWARE_BASE):
        root.rmtree(d)
        notes.append(f"removed leftover {root.path(d)}")
    for d in _leftovers(root, ctx.pkgs_hp, (OLD_PREFIX,)):       # holding directories of older driverd versions
        versions = [v for v in root.listdir(f"{d}/firmware") if _is_dir(root, f"{d}/firmware/{v}")] \
            if _is_dir(root, d) and _is_dir(root, f"{d}/firmware") else []
        for v in versions or [None]:
            _rescue(ctx, d, f"{d}/firmware/{v}" if v else None)
        root.rmtree(d)
        notes.append(f"removed leftover {root.path(d)}")
    for d in _leftovers(root, kp.kept_hostdir(ctx.state_dir)):
        root.rmtree(d)
        notes.append(f"removed incomplete kept entry {root.path(d)}")


def _migrate_legacy(ctx: _Ctx, notes: list[str]) -> None:
    """Older driverd kept the replaced tree in previous/<release>/ with a state.json."""
    root = ctx.root
    legacy = f"{ctx.prev_dir_hp}/{ctx.release}"
    if not _is_dir(root, legacy):
        return
    st = read_json(root, f"{legacy}/state.json")
    if st and read_json(root, ctx.prev_rec_hp) is None:
        if st.get("had_modules"):
            real = root.safe_real(f"{legacy}/{MODULES_DIR}")
            m = kp.tree_manifest(real) if real is not None else None
            fw = f"{legacy}/{FIRMWARE_DIR}/{m.driver_version}" if m and ctx.fw_hp(m.driver_version) else None
            k = kp.keep_tree(root, ctx.state_dir, f"{legacy}/{MODULES_DIR}",
                             fw if fw is not None and _is_dir(root, fw) else (ctx.fw_hp(m.driver_version) if m else None),
                             Additions(root))
            if k is not None:
                _store(ctx).record_previous(k.sha)
        else:
            _store(ctx).record_previous(None)
    root.rmtree(legacy)
    notes.append(f"moved the previous installation of {ctx.release} from {root.path(legacy)} into the kept store")


# -- modprobe's resolution --------------------------------------------------------------------------

def _resolves(ctx: _Ctx, strict: bool = False) -> list[str]:
    """The files `modprobe nvidia` would insert, in load order. Strict: a failure raises (the switch
    is undone); else a report that cannot say gets []."""
    try:
        return ctx.tools.show_depends(ctx.release, "nvidia")
    except DriverdError:
        if strict:
            raise
        return []
