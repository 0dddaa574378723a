"""Installing a package's modules and firmware into a host root (loading them is driverd.kmod's job).

Installed layout (a contract with the module lifecycle and the host fact reader):
    <root>/lib/modules/<release>/updates/driverd/   *.ko, manifest.json, install.json
    <root>/lib/firmware/nvidia/<version>/           gsp_*.bin (open flavour, when the package has them)
    <root>/var/lib/driverd/packages/previous/<release>/
        modules/                the installation this one replaced (same shape as updates/driverd/)
        firmware/<version>/     firmware this one replaced (only when the same version's files differ)
        state.json              {"had_modules": bool, "saved_at": ..., "package_sha256": ...}

Order: the package's vermagic is checked against the target kernel first, then signatures against
the kernel's enforcement, then free space; only then is anything written. Files are unpacked and
verified in a staging directory beside the target and switched in atomically (renameat2 exchange);
the replaced tree is kept as `previous`. `depmod -b <root> <release>` runs for real and
`modprobe --show-depends nvidia` must resolve; if either fails the switch is undone.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from driverd.errors import PackageError
from driverd.fsutil import atomic_write_json, fsync_dir
from driverd.host.modules import INSTALL_DIR
from driverd.packages.archive import read_manifest, sha256_file, unpack
from driverd.packages.manifest import FIRMWARE_DIR, MANIFEST_NAME, MODULES_DIR, Manifest
from driverd.packages.modinfo import first, modinfo
from driverd.packages.switch import move, switch_in
from driverd.root import Root
from driverd.runner import Runner, which

INSTALL_RECORD = "install.json"
PREVIOUS_DIR = "packages/previous"      # under the state dir (/var/lib/driverd)
STAGING_PREFIX = ".driverd-staging-"
OLD_PREFIX = ".driverd-old-"


@dataclass
class InstallReport:
    package: str
    sha256: str
    driver_version: str
    flavor: str
    kernel_release: str
    modules_dir: str
    firmware_dir: str | None
    previous: str | None            # where the replaced installation was kept
    changed: bool
    depmod: str = ""
    resolves: list[str] = field(default_factory=list)   # modprobe --show-depends nvidia, in load order
    dry_run: bool = False

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _root(root: Root | str | os.PathLike) -> Root:
    return root if isinstance(root, Root) else Root(root)


def modules_dir(root: Root, release: str) -> Path:
    return root.real(f"/lib/modules/{release}/{INSTALL_DIR}")


def firmware_dir(root: Root, version: str) -> Path:
    return root.real(f"/lib/firmware/nvidia/{version}")


def previous_dir(root: Root, release: str, state_dir: str = "/var/lib/driverd") -> Path:
    return root.real(f"{state_dir}/{PREVIOUS_DIR}/{release}")


# -- preconditions ------------------------------------------------------------------------------

def target_release(root: Root, manifest: Manifest, kernel: str | None) -> str:
    if kernel:
        return kernel
    from driverd.host.kernel import running_release
    return running_release(root) or manifest.kernel_release


def kernel_vermagic(root: Root, release: str, runner: Runner | None = None) -> str | None:
    """The vermagic the target kernel's own modules carry (any in-tree .ko), when it has any."""
    base = root.real(f"/lib/modules/{release}/kernel")
    for dirpath, _dirs, files in os.walk(base):
        for f in sorted(files):
            if ".ko" in f and not f.endswith((".xz", ".zst", ".gz")):
                fields = next(iter(modinfo([Path(dirpath) / f], runner).values()), {})
                return first(fields, "vermagic")
    return None


def check_vermagic(root: Root, manifest: Manifest, release: str, runner: Runner | None = None) -> None:
    fix = f"fetch or build the package for kernel {release} (driverd fetch / driverd build --kernel {release})"
    if manifest.kernel_release != release:
        raise PackageError(f"package is for kernel {manifest.kernel_release}, the target kernel is {release}",
                           cause=f"vermagic {manifest.vermagic.strip()!r} does not match {release}", fix=fix)
    for m in manifest.modules:
        if not m.vermagic or m.vermagic.split()[0] != release:
            raise PackageError(f"module {m.name} has vermagic {m.vermagic!r}, the target kernel is {release}",
                               cause="the module was built for another kernel", fix=fix)
    want = kernel_vermagic(root, release, runner)
    if want is not None and want.split() != manifest.vermagic.split():
        raise PackageError(f"package vermagic {manifest.vermagic.strip()!r} differs from kernel {release}'s "
                           f"{want.strip()!r}", cause="same release name, different kernel configuration", fix=fix)


def signature_enforced(root: Root) -> tuple[bool, tuple[str, ...]]:
    from driverd.host.kernel import read_kernel
    k = read_kernel(root, [])
    return k.module_signature_enforced, k.signature_enforcement_sources


def check_signatures(manifest: Manifest, enforced: bool, sources: tuple[str, ...] = ()) -> None:
    if not enforced:
        return
    unsigned = [m.name for m in manifest.modules if not m.signed]
    if unsigned:
        raise PackageError(f"refusing unsigned modules ({', '.join(unsigned)}): the kernel enforces module "
                           f"signatures", cause="; ".join(sources) or "signature enforcement is on",
                           fix="build with --sign-key/--sign-cert using a key enrolled in the kernel's keyring (MOK)")


def check_space(where: Path, manifest: Manifest) -> None:
    need = sum(f.size for f in manifest.files) + (1 << 20)
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise PackageError(f"not enough space in {probe}: {need >> 20} MiB needed, {free >> 20} MiB free",
                           cause="the filesystem is full", fix="free space there and install again")


def installed_sha256(root: Root, release: str) -> str | None:
    try:
        rec = json.loads((modules_dir(root, release) / INSTALL_RECORD).read_text())
        return rec.get("package_sha256")
    except (OSError, ValueError, AttributeError):
        return None


# -- install ------------------------------------------------------------------------------------

def _disk_error(e: OSError, where: Path) -> PackageError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return PackageError(f"disk full while installing into {where}; nothing was changed",
                            cause=os.strerror(e.errno), fix="free space there and install again")
    return PackageError(f"cannot write {where}: {e.strerror}; nothing was changed", cause=str(e),
                        fix="check permissions and the filesystem")


def _clean_stale(d: Path) -> None:
    if d.is_dir():
        for n in os.listdir(d):
            if n.startswith((STAGING_PREFIX, OLD_PREFIX)):
                shutil.rmtree(d / n, ignore_errors=True)


def install(root: Root | str | os.PathLike, package_path: str | os.PathLike, runner: Runner | None = None, *,
            kernel: str | None = None, enforce: bool | None = None,
            state_dir: str = "/var/lib/driverd", expected_sha256: str | None = None) -> InstallReport:
    """Install `package_path` (see the module docstring). With `expected_sha256` (from a repository
    index) the archive's hash is checked in the same pass that unpacks and verifies its files."""
    root, runner = _root(root), runner or Runner()
    package_path = Path(package_path)
    manifest = read_manifest(package_path)
    release = target_release(root, manifest, kernel)
    check_vermagic(root, manifest, release, runner)                   # before anything else
    if enforce is None:
        enforced, sources = signature_enforced(root)
    else:
        enforced, sources = enforce, ("--enforce-signatures",)
    check_signatures(manifest, enforced, sources)

    sha = expected_sha256 or sha256_file(package_path)
    mdir, fdir = modules_dir(root, release), firmware_dir(root, manifest.driver_version)
    prev = previous_dir(root, release, state_dir)
    if installed_sha256(root, release) == sha and _intact(mdir, manifest):
        return InstallReport(str(package_path), sha, manifest.driver_version, manifest.flavor, release,
                             str(mdir), str(fdir) if manifest.firmware_files else None,
                             str(prev) if prev.exists() else None, changed=False,
                             resolves=_resolves(root, release, runner))
    updates = mdir.parent
    if runner.dry_run:    # every check a real install makes before writing, and nothing written
        from driverd.packages.archive import verify_package
        verify_package(package_path, expected_sha256)
        return InstallReport(str(package_path), sha, manifest.driver_version, manifest.flavor, release, str(mdir),
                             str(fdir) if manifest.firmware_files else None, str(prev), changed=True, dry_run=True)
    check_space(updates, manifest)
    _clean_stale(updates)
    _clean_stale(fdir.parent)

    staging: Path | None = None
    fw_stage: Path | None = None
    created: list[Path] = []        # directories we made, removed again if we refuse
    try:
        created += _mkdirs(updates)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=updates))
        unpack(package_path, staging / "pkg", expected_sha256)
        newmods = staging / "pkg" / MODULES_DIR
        os.replace(staging / "pkg" / MANIFEST_NAME, newmods / MANIFEST_NAME)
        atomic_write_json(newmods / INSTALL_RECORD, {
            "package_sha256": sha, "package": package_path.name,
            "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "driver_version": manifest.driver_version, "flavor": manifest.flavor, "kernel_release": release})
        os.chmod(newmods, 0o755)
        fw_new = staging / "pkg" / FIRMWARE_DIR
        if manifest.firmware_files and not _same_firmware(fdir, manifest):
            created += _mkdirs(fdir.parent)
            fw_stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=fdir.parent))
            move(fw_new, fw_stage / "fw")
            os.chmod(fw_stage / "fw", 0o755)
    except PackageError:
        _rm(staging, fw_stage)
        _rmdirs(created)
        raise
    except OSError as e:
        _rm(staging, fw_stage)
        _rmdirs(created)
        raise _disk_error(e, updates) from None

    # Everything is verified and on disk: switch it in. What it replaces leaves /lib/modules at once
    # (depmod must never see two nvidia.ko) into a holding directory beside `previous`.
    hold = _holding(root, state_dir)
    old_mods: Path | None = None
    if switch_in(newmods, mdir, staging / "old-modules"):
        old_mods = hold / "modules"
        move(staging / "old-modules", old_mods)
    old_fw = None
    if fw_stage is not None and switch_in(fw_stage / "fw", fdir, fw_stage / "old"):
        old_fw = hold / "firmware"
        move(fw_stage / "old", old_fw)
    fw_switched = fw_stage is not None
    try:
        dep = _depmod(root, release, runner)
        resolves = _resolves(root, release, runner, strict=True)
    except Exception:
        _undo(mdir, old_mods, fdir if fw_switched else None, old_fw)
        _depmod(root, release, runner, check=False)
        _rm(staging, fw_stage, hold)
        raise
    _save_previous(prev, old_mods, old_fw, manifest.driver_version, sha)
    _rm(staging, fw_stage, hold)
    return InstallReport(str(package_path), sha, manifest.driver_version, manifest.flavor, release, str(mdir),
                         str(fdir) if manifest.firmware_files else None, str(prev), changed=True, depmod=dep,
                         resolves=resolves)


def _mkdirs(d: Path) -> list[Path]:
    missing = []
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir()
    return missing


def _rmdirs(dirs: list[Path]) -> None:
    for d in dirs:          # deepest first, as _mkdirs listed them
        try:
            d.rmdir()
        except OSError:
            pass


def _holding(root: Root, state_dir: str) -> Path:
    base = root.real(f"{state_dir}/{PREVIOUS_DIR}").parent
    base.mkdir(parents=True, exist_ok=True)
    _clean_stale(base)
    return Path(tempfile.mkdtemp(prefix=OLD_PREFIX, dir=base))


def _intact(mdir: Path, manifest: Manifest) -> bool:
    for f in manifest.module_files:
        p = mdir / Path(f.path).name
        if not p.is_file() or p.stat().st_size != f.size:
            return False
    return True


def _same_firmware(fdir: Path, manifest: Manifest) -> bool:
    from driverd.packages.archive import file_entry
    if not fdir.is_dir():
        return False
    want = {Path(f.path).name: (f.size, f.sha256) for f in manifest.firmware_files}
    have = {n: (e.size, e.sha256) for n in os.listdir(fdir) if (fdir / n).is_file()
            for e in [file_entry(fdir / n, n)]}
    return want == have


def _rm(*paths: Path | None) -> None:
    for p in paths:
        if p is not None:
            shutil.rmtree(p, ignore_errors=True)


def _undo(mdir: Path, old_mods: Path | None, fdir: Path | None, old_fw: Path | None) -> None:
    """Put back what the switch replaced; the refused new tree is moved out of /lib for deletion."""
    failed = mdir.parent / f"{OLD_PREFIX}failed"
    if old_mods is not None:
        back = mdir.parent / f"{STAGING_PREFIX}undo"
        move(old_mods, back)
        switch_in(back, mdir, failed)
    else:
        os.rename(mdir, failed)
    shutil.rmtree(failed, ignore_errors=True)
    if fdir is None:
        return
    if old_fw is not None:
        back = fdir.parent / f"{STAGING_PREFIX}undo"
        move(old_fw, back)
        switch_in(back, fdir, fdir.parent / f"{OLD_PREFIX}failed")
    else:
        os.rename(fdir, fdir.parent / f"{OLD_PREFIX}failed")
    shutil.rmtree(fdir.parent / f"{OLD_PREFIX}failed", ignore_errors=True)


def _save_previous(prev: Path, old_mods: Path | None, old_fw: Path | None, version: str, sha: str) -> None:
    if prev.exists():
        shutil.rmtree(prev)
    prev.mkdir(parents=True)
    if old_mods is not None:
        move(old_mods, prev / "modules")
    if old_fw is not None:
        (prev / "firmware").mkdir()
        move(old_fw, prev / "firmware" / version)
    old_sha = None
    if old_mods is not None:
        try:
            old_sha = json.loads((prev / "modules" / INSTALL_RECORD).read_text()).get("package_sha256")
        except (OSError, ValueError, AttributeError):
            pass
    atomic_write_json(prev / "state.json", {
        "had_modules": old_mods is not None, "package_sha256": old_sha, "replaced_by_sha256": sha,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})


def _depmod(root: Root, release: str, runner: Runner, check: bool = True) -> str:
    exe = which("depmod")
    if exe is None:
        raise PackageError("depmod is not installed", cause="kmod is missing", fix="install kmod")
    res = runner.run([exe, "-b", root.base, release], timeout=300, check=False)
    if check and not res.ok:
        raise PackageError(f"depmod failed for {release}: {res.first_error_line()}",
                           cause=f"depmod -b {root.base} {release} exited {res.returncode}",
                           fix="see the depmod message; the previous installation was restored")
    return " ".join(res.argv)


def _resolves(root: Root, release: str, runner: Runner, strict: bool = False) -> list[str]:
    exe = which("modprobe")
    if exe is None:
        if strict:
            raise PackageError("modprobe is not installed", cause="kmod is missing", fix="install kmod")
        return []
    res = runner.run([exe, "-d", root.base, "-S", release, "--show-depends", "nvidia"], timeout=60,
                     check=False, mutates=False)
    if res.dry_run:
        return []
    if not res.ok:
        if strict:
            raise PackageError(f"installed modules do not resolve: {res.first_error_line()}",
                               cause="modprobe --show-depends nvidia failed after depmod",
                               fix="the previous installation was restored; check the package")
        return []
    return [ln.split()[-1] for ln in res.stdout.splitlines() if ln.startswith("insmod ")]


def rollback_install(root: Root | str | os.PathLike, release: str, runner: Runner | None = None, *,
                     state_dir: str = "/var/lib/driverd") -> InstallReport:
    """Put the previous installation back. The one rolled back from becomes `previous`, so a second
    rollback returns to it."""
    root, runner = _root(root), runner or Runner()
    prev = previous_dir(root, release, state_dir)
    state = None
    try:
        state = json.loads((prev / "state.json").read_text())
    except (OSError, ValueError):
        pass
    if state is None:
        raise PackageError(f"no previous installation is kept for kernel {release}",
                           cause=f"{prev} is missing", fix="install the wanted package with driverd install")
    mdir = modules_dir(root, release)
    cur_sha = installed_sha256(root, release)
    mdir.parent.mkdir(parents=True, exist_ok=True)
    hold = _holding(root, state_dir)          # becomes the new `previous`
    try:
        had_cur = False
        if (prev / "modules").is_dir():
            stage = mdir.parent / f"{STAGING_PREFIX}rollback"
            shutil.rmtree(stage, ignore_errors=True)
            move(prev / "modules", stage)
            if switch_in(stage, mdir, mdir.parent / f"{OLD_PREFIX}rollback"):
                had_cur = True
                move(mdir.parent / f"{OLD_PREFIX}rollback", hold / "modules")
        elif mdir.exists():
            move(mdir, hold / "modules")
            had_cur = True
        if (prev / "firmware").is_dir():
            for v in os.listdir(prev / "firmware"):
                fd = firmware_dir(root, v)
                fd.parent.mkdir(parents=True, exist_ok=True)
                stage = fd.parent / f"{STAGING_PREFIX}rollback"
                shutil.rmtree(stage, ignore_errors=True)
                move(prev / "firmware" / v, stage)
                if switch_in(stage, fd, fd.parent / f"{OLD_PREFIX}rollback"):
                    (hold / "firmware").mkdir(exist_ok=True)
                    move(fd.parent / f"{OLD_PREFIX}rollback", hold / "firmware" / v)
        dep = _depmod(root, release, runner)
        atomic_write_json(hold / "state.json", {
            "had_modules": had_cur, "package_sha256": cur_sha, "replaced_by_sha256": state.get("package_sha256"),
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        shutil.rmtree(prev)
        move(hold, prev)
    finally:
        shutil.rmtree(hold, ignore_errors=True)
    m = _installed_manifest(mdir)
    return InstallReport("", installed_sha256(root, release) or "", m.driver_version if m else "",
                         m.flavor if m else "", release, str(mdir), None, str(prev), changed=True, depmod=dep,
                         resolves=_resolves(root, release, runner) if m else [])


def _installed_manifest(mdir: Path) -> Manifest | None:
    try:
        return Manifest.loads((mdir / MANIFEST_NAME).read_bytes(), str(mdir / MANIFEST_NAME))
    except (OSError, PackageError):
        return None
