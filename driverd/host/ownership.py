"""Who owns the NVIDIA driver installed for the running kernel: driverd, a distribution package
(dpkg / rpm database), DKMS, NVIDIA's .run installer, or nobody known.

Many fleets run drivers baked into the image (cloud GPU images, DGX OS, Ubuntu's
linux-modules-nvidia-*, Debian's nvidia-kernel-dkms, RHEL's kmod-nvidia*). driverd must not
silently replace such a driver: the user-space libraries of that package would no longer match
the kernel modules, and the next package upgrade would fight driverd. The plan asks this module and
`driver.manage` (auto | always | never) decides.

Evidence, per NVIDIA module file installed for the running kernel (modules.dep, plus the places
installers write: updates/, extra/, kernel/nvidia*/, kernel/drivers/video/):
- driverd: the file is under /lib/modules/<release>/updates/driverd/ (driverd's install dir);
- a distribution package: each family of driverd.distro, in its table's order, reads its package
  database (dpkg: /var/lib/dpkg/info/<package>.list names the file; rpm: rpmdb.sqlite has a package
  whose file list names it; distro/debian.py and distro/rpm.py say exactly what is read);
- DKMS: /var/lib/dkms/<name>/kernel-<release>-<arch> marks <name>/<version> installed for this kernel
  (the package that ships /usr/src/<name>-<version> is named too);
- NVIDIA's .run installer: /usr/bin/nvidia-uninstall, for a file no package owns;
- the host itself (owner unknown): a driver is loaded but no NVIDIA module file is installed for the
  running kernel at all (a driver baked into the image by another packager, modules loaded from a
  path outside /lib/modules, a read-only or minimal root). driverd cannot reinstall or reload what
  it cannot find, so this counts as foreign: `driver.manage = auto` leaves it alone.

Read-only, bounded, never raises.
"""
from __future__ import annotations

import re

from driverd import distro
from driverd.datatypes import dataclass
from driverd.driver.layout import MODULES_DIR
from driverd.root import Root

INSTALL_DIR = MODULES_DIR
_KO = re.compile(r"^(nvidia[\w-]*)\.ko(\.xz|\.zst|\.gz)?$")
FOREIGN = ("dkms", "nvidia-installer", "host")      # besides every distribution family's package manager
_CORE_SUFFIXES = ("-uvm", "-modeset", "-drm", "-peermem", "_uvm", "_modeset", "_drm", "_peermem", "-fs", "_fs",
                  "-vgpu-vfio", "_vgpu_vfio")


@dataclass(frozen=True)
class DriverOwner:
    """Who installed a set of NVIDIA kernel-module files (a package manager, DKMS, NVIDIA's installer, driverd)."""
    manager: str                      # driverd | dpkg | rpm | dkms | nvidia-installer | host | unknown
    package: str | None               # "nvidia-kernel-dkms", "nvidia-current/535.261.03", ...
    version: str | None
    files: tuple[str, ...]
    evidence: str

    def describe(self) -> str:
        what = {**{f.manager: f.package_title for f in distro.FAMILIES}, "dkms": "DKMS module",
                "nvidia-installer": "NVIDIA's .run installer", "driverd": "driverd",
                "unknown": "no known package manager", "host": "the host (owner unknown)"}[self.manager]
        pkg = f" {self.package}" + (f" {self.version}" if self.version and self.version not in (self.package or "") else "") \
            if self.package else ""
        return f"{what}{pkg}"


@dataclass(frozen=True)
class OwnershipFacts:
    """The NVIDIA kernel-module files for the running kernel and who owns them."""
    release: str | None
    module_files: tuple[str, ...]     # NVIDIA kernel-module files installed for the running kernel
    owners: tuple[DriverOwner, ...]
    foreign: DriverOwner | None       # the package manager (not driverd) that owns the core module, if any
    summary: str


def _is_core(path: str) -> bool:
    m = _KO.match(path.rsplit("/", 1)[-1])
    return bool(m) and not m.group(1).endswith(_CORE_SUFFIXES)


def module_files(root: Root, release: str) -> list[str]:
    base = f"/lib/modules/{release}"
    found: set[str] = set()
    dep = root.read_text(f"{base}/modules.dep", 32 << 20) or ""
    for line in dep.splitlines():
        p = line.split(":", 1)[0].strip()
        if _KO.match(p.rsplit("/", 1)[-1]):
            found.add(p if p.startswith("/") else f"{base}/{p}")
    dirs = [f"{base}/updates", f"{base}/extra", f"{base}/kernel/drivers/video"]
    dirs += [f"{base}/kernel/{n}" for n in root.listdir(f"{base}/kernel") if n.startswith("nvidia")]
    for d in dirs:
        found.update(_walk(root, d))
    return sorted(p for p in found if root.is_file(p))


def _walk(root: Root, top: str, depth: int = 5, limit: int = 20000) -> list[str]:
    out, level, seen = [], [top], 0
    for _ in range(depth):
        nxt = []
        for d in level:
            for n in root.listdir(d):
                seen += 1
                if seen > limit:
                    return out
                p = f"{d}/{n}"
                if _KO.match(n):
                    out.append(p)
                elif root.is_dir(p) and root.readlink(p) is None:
                    nxt.append(p)
        level = nxt
    return out


# -- DKMS ---------------------------------------------------------------------------------------

def dkms_installed(root: Root, release: str) -> list[tuple[str, str, str]]:
    """(name, version, arch) of NVIDIA DKMS modules installed for `release`."""
    out = []
    for name in root.listdir("/var/lib/dkms"):
        if not name.startswith("nvidia"):
            continue
        for entry in root.listdir(f"/var/lib/dkms/{name}"):
            if not entry.startswith(f"kernel-{release}-"):
                continue
            target = root.readlink(f"/var/lib/dkms/{name}/{entry}") or ""
            version = target.strip("/").split("/")[0] if target else None
            if version:
                out.append((name, version, entry.removeprefix(f"kernel-{release}-")))
    return out


def dkms_module_names(root: Root, name: str, version: str, release: str, arch: str) -> set[str]:
    names = set()
    for d in (f"/var/lib/dkms/{name}/{version}/{release}/{arch}/module",):
        for n in root.listdir(d):
            m = _KO.match(n)
            if m:
                names.add(m.group(1))
    return names


# -- all together -------------------------------------------------------------------------------

def read_ownership(root: Root, release: str | None, loaded: tuple[str | None, str | None] | None = None) -> OwnershipFacts:
    """`loaded`: (version, flavour) of the driver in the kernel, or None when none is loaded."""
    if not release:
        return OwnershipFacts(None, (), (), None, "kernel release unknown: ownership not checked")
    files = module_files(root, release)
    if not files and loaded is not None:
        what = f"driver {loaded[0] or '?'}" + (f" ({loaded[1]})" if loaded[1] else "")
        host = DriverOwner("host", None, loaded[0], (),
                           f"{what} is loaded but no NVIDIA module file is installed for {release} under "
                           f"/lib/modules/{release}, and no package database records one")
        return OwnershipFacts(release, (), (host,), host, f"{what} loaded, not on disk: host-managed (owner unknown)")
    owners: list[DriverOwner] = []
    left = list(files)
    ours = [p for p in left if f"/lib/modules/{release}/{INSTALL_DIR}/" in p]
    if ours:
        owners.append(DriverOwner("driverd", None, None, tuple(ours), f"{INSTALL_DIR}/ is driverd's install dir"))
        left = [p for p in left if p not in ours]
    notes: dict[str, str] = {}          # family name -> why its package database was not read
    for fam in distro.FAMILIES:
        if not left:
            break
        owned, note = fam.package_owners(root, left)
        if note:
            notes[fam.name] = note
        for pkg in sorted({o.package for o in owned.values()}):
            fs = tuple(p for p in left if p in owned and owned[p].package == pkg)
            o = owned[fs[0]]
            owners.append(DriverOwner(fam.manager, pkg, o.version, fs, o.evidence.format(file=fs[0])))
        left = [p for p in left if p not in owned]
    if left:
        for name, version, arch in dkms_installed(root, release):
            mods = dkms_module_names(root, name, version, release, arch)
            fs = tuple(p for p in left if "/updates/dkms/" in p or
                       _KO.match(p.rsplit("/", 1)[-1]).group(1) in mods)
            if not fs:
                continue
            src = next((s for s in (f.package_of(root, f"/usr/src/{name}-{version}") for f in distro.FAMILIES)
                        if s), None)
            owners.append(DriverOwner("dkms", f"{name}/{version}", version, fs,
                                      f"/var/lib/dkms/{name}/kernel-{release}-{arch} -> {version}"
                                      + (f"; source from package {src}" if src else "")))
            left = [p for p in left if p not in fs]
    for fam in distro.FAMILIES:
        unread = fam.unread_owner(left, notes[fam.name]) if left and fam.name in notes else None
        if unread:
            fs, evidence = unread
            owners.append(DriverOwner(fam.manager, None, None, fs, evidence))
            left = [p for p in left if p not in fs]
    if left and (root.is_file("/usr/bin/nvidia-uninstall") or root.is_file("/usr/bin/nvidia-installer")):
        owners.append(DriverOwner("nvidia-installer", None, None, tuple(left),
                                  "/usr/bin/nvidia-uninstall: NVIDIA's .run installer put these files"))
        left = []
    if left:
        owners.append(DriverOwner("unknown", None, None, tuple(left), "no package database names these files"))
    managers = {*(f.manager for f in distro.FAMILIES), *FOREIGN}
    foreign = next((o for o in owners if o.manager in managers and any(_is_core(p) for p in o.files)), None) \
        or next((o for o in owners if o.manager in managers), None)
    if not files:
        summary = f"no NVIDIA kernel module is installed for {release}"
    else:
        summary = "; ".join(f"{o.describe()} ({len(o.files)} file{'s' if len(o.files) > 1 else ''})" for o in owners)
    return OwnershipFacts(release, tuple(files), tuple(owners), foreign, summary)
