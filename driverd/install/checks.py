"""What an install checks before it writes anything: the package's vermagic against the target kernel,
its signatures against the kernel's enforcement, free space; and how its failures read (a PackageError
naming the path, never a raw OSError)."""
from __future__ import annotations

import errno
import functools
import os
import shutil
from pathlib import Path

from driverd.errors import PackageError
from driverd.package.manifest import Manifest
from driverd.root import Root


def os_errors(subject: str = "", disk_full: bool = False):
    """Public entry points raise PackageError, never a raw OSError: `subject` prefixes the verb (the
    function's name); `disk_full` says ENOSPC/EDQUOT as such."""
    def deco(fn):
        verb = (subject + " " if subject else "") + fn.__name__.replace("_", " ")
        again = "run it again (an interrupted switch is completed or undone first)"

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            try:
                return fn(*a, **kw)
            except OSError as e:
                where = e.filename or "the host root"
                if disk_full and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise PackageError(f"{verb}: disk full at {where}", cause=os.strerror(e.errno),
                                       fix=f"free space there and {again}") from None
                raise PackageError(f"{verb} failed: {e.strerror or e} ({where})", cause=str(e),
                                   fix=f"check the filesystem and permissions, then {again}") from None
        return wrapper
    return deco


def target_release(root: Root, manifest: Manifest, kernel: str | None) -> str:
    if kernel:
        return kernel
    from driverd.host.kernel import running_release
    return running_release(root) or manifest.kernel_release


def kernel_vermagic(root: Root, release: str) -> str | None:
    """The vermagic the target kernel's own modules carry (any in-tree module, compressed or not),
    when it has any. Read from the file's .modinfo (no kmod needed)."""
    from driverd.modinfo import modinfo_of_bytes, module_bytes
    base = root.real(f"/lib/modules/{release}/kernel")
    for dirpath, _dirs, files in os.walk(base):
        for f in sorted(files):
            if f.endswith((".ko", ".ko.xz", ".ko.zst", ".ko.gz")):
                p = os.path.join(dirpath, f)
                try:
                    vm = modinfo_of_bytes(p, module_bytes(p)).vermagic      # ValueError says why, no path
                except (OSError, ValueError) as e:
                    raise PackageError(f"cannot read kernel {release}'s module {p}: {e}",
                                       cause="the kernel's module tree holds a damaged file",
                                       fix="reinstall the kernel's modules package") from None
                return vm.strip() if vm else None
    return None


def check_vermagic(root: Root, manifest: Manifest, release: str) -> None:
    fix = f"fetch or build the package for kernel {release} (driverd fetch / driverd build --kernel {release})"
    if manifest.kernel_release != release:
        raise PackageError(f"package is for kernel {manifest.kernel_release}, the target kernel is {release}",
                           cause=f"vermagic {manifest.vermagic.strip()!r} does not match {release}", fix=fix)
    for m in manifest.modules:
        if not m.vermagic or m.vermagic.split()[0] != release:
            raise PackageError(f"module {m.name} has vermagic {m.vermagic!r}, the target kernel is {release}",
                               cause="the module was built for another kernel", fix=fix)
    want = kernel_vermagic(root, release)
    if want is not None and want.split() != manifest.vermagic.split():
        raise PackageError(f"package vermagic {manifest.vermagic.strip()!r} differs from kernel {release}'s "
                           f"{want.strip()!r}", cause="same release name, different kernel configuration", fix=fix)


def signature_enforced(root: Root) -> tuple[bool, tuple[str, ...]]:
    from driverd.host.kernel import read_kernel
    k = read_kernel(root, [])
    return k.module_signature_enforced, k.signature_enforcement_sources


def check_signatures(root: Root, package: str | os.PathLike, release: str, enforced: bool,
                     sources: tuple[str, ...] = (), trusted_certs: list[str] | None = None) -> None:
    """The signer preflight on the package's own files (not the manifest's claim): refuse modules
    that are unsigned, damaged, or — for the running kernel, whose keyrings can be read — signed by a
    key the kernel does not hold (driverd.build.signers)."""
    if not enforced:
        return
    from driverd.host.kernel import running_release
    from driverd.host.keyrings import KeyringFacts, read_keyrings
    from driverd.build import signers
    sigs = signers.package_signatures(package)
    unsigned = [s.module for s in sigs if not s.signed]
    if unsigned:
        raise PackageError(f"refusing unsigned modules ({', '.join(unsigned)}): the kernel enforces module "
                           f"signatures", cause="; ".join(sources) or "signature enforcement is on",
                           fix="build with --sign-key/--sign-cert using a key enrolled in the kernel's keyring (MOK)")
    keyrings = read_keyrings(root) if release == running_release(root) else KeyringFacts(
        False, "unknown", notes=(f"kernel {release} is not running: its keyrings are not readable",))
    declared, _ = signers.declared_certs(root, trusted_certs)
    v = signers.judge(sigs, keyrings, declared, enforced=True, certs_for_enrol=declared)
    if v.blocks:
        raise PackageError(f"refusing {os.path.basename(os.fspath(package))}: {v.summary}",
                           cause="; ".join(sources) or "signature enforcement is on",
                           fix=v.enrol or "sign the modules with a key in the kernel's trusted keyrings")


def check_space(where: Path, manifest: Manifest) -> None:
    need = sum(f.size for f in manifest.files) + (1 << 20)
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise PackageError(f"not enough space in {probe}: {need >> 20} MiB needed, {free >> 20} MiB free",
                           cause="the filesystem is full", fix="free space there and install again")
