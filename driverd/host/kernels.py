"""The kernels installed on a host (read-only): every release the boot loader could start, as the host's
distribution family installs them (driverd.distro: Debian/Ubuntu /boot/vmlinuz-<r> and the dpkg database,
RPM-based hosts /lib/modules/<r>/vmlinuz and kernel-install's copy in /boot), with what their installation
left undone — a package the database does not call installed, a boot image without modules, modules
without modules.dep — each one line naming the fix. `driverd reboot-ready` and the daemon's kernel watch
read it; nothing here writes or runs anything."""
from __future__ import annotations

from dataclasses import field

from driverd.datatypes import dataclass
from driverd.distro import DEFAULT, Distro, choose
from driverd.distro.base import KernelPackage
from driverd.root import Root


@dataclass(frozen=True)
class InstalledKernel:
    """A kernel installed on the host: its image, modules and package record."""
    release: str
    image: str | None                       # the boot image (host path); None: none
    modules: bool                           # /lib/modules/<r>/kernel: the kernel's own modules are there
    modules_dep: bool                       # /lib/modules/<r>/modules.dep: depmod has indexed them
    package: KernelPackage | None           # the package database's record; None: unknown or not from a package
    problems: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {"release": self.release, "image": self.image, "modules": self.modules,
                "modules_dep": self.modules_dep, "package": None if self.package is None else
                {"names": list(self.package.names), "state": self.package.state}, "problems": list(self.problems)}


def family(root: Root) -> Distro:
    """The host's distribution family (os-release), the default family's rules when none knows it."""
    from driverd.host.osrelease import read_os
    o = read_os(root, [])
    return choose(o.id, o.id_like) or DEFAULT


def installed_kernels(root: Root, fam: Distro | None = None) -> list[InstalledKernel]:
    """Every release with a boot image or a kernel package record, oldest first by the family's order. A
    /lib/modules/<r> that only holds what others put there (driverd's updates/driverd left after the kernel
    package was removed) is not an installed kernel."""
    fam = fam or family(root)
    images = fam.kernel_images(root)
    pkgs = fam.kernel_packages(root)
    releases = set(images) | {r for r, p in pkgs.items() if root.is_dir(f"/lib/modules/{r}") or not p.installed}
    out = []
    for rel in releases:
        image = images.get(rel)
        mods = root.is_dir(f"/lib/modules/{rel}/kernel")
        dep = root.is_file(f"/lib/modules/{rel}/modules.dep")
        pkg = pkgs.get(rel)
        problems: list[str] = []
        reinstall = _reinstall(fam, rel, pkg)
        if pkg is not None and not pkg.installed:
            problems.append(f"its package {', '.join(pkg.names)} is {pkg.state} in the {fam.manager} database (the "
                            f"kernel's installation did not finish); fix: {_finish(fam)}")
        if image is None:
            problems.append(f"no boot image (/boot/vmlinuz-{rel}); fix: {reinstall}")
        if not mods:
            problems.append(f"no modules: /lib/modules/{rel}/kernel is missing, the kernel would boot without its own "
                            f"drivers (and driverd's package could not be indexed); fix: {reinstall}")
        elif not dep:
            problems.append(f"/lib/modules/{rel}/modules.dep is missing: depmod has not indexed its modules (the "
                            f"kernel package's configuration did not finish); fix: depmod {rel}, or {_finish(fam)}")
        problems += fam.kernel_install_problems(root, rel)
        out.append(InstalledKernel(rel, image, mods, dep, pkg, tuple(problems)))
    return sorted(out, key=_Key(fam))


class _Key:
    def __init__(self, fam: Distro) -> None:
        self.fam = fam

    def __call__(self, k: InstalledKernel):
        import functools
        return functools.cmp_to_key(self.fam.compare_releases)(k.release)


def _finish(fam: Distro) -> str:
    return "dpkg --configure -a" if fam.manager == "dpkg" else f"finish the {fam.manager} transaction (reinstall it)"


def _reinstall(fam: Distro, rel: str, pkg: KernelPackage | None) -> str:
    if fam.manager == "dpkg":
        return f"apt-get install --reinstall {pkg.names[0] if pkg else f'linux-image-{rel}'}"
    return f"reinstall the kernel package of {rel} (dnf reinstall kernel-core-{rel})"


def newer_than(kernels: list[InstalledKernel], running: str, fam: Distro) -> list[InstalledKernel]:
    """The kernels the boot loader would rather start than `running` (GRUB and systemd-boot default to the
    newest): every installed release the family orders after it."""
    return [k for k in kernels if fam.compare_releases(k.release, running) > 0]
