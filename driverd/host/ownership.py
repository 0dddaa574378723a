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
- dpkg: /var/lib/dpkg/info/<package>.list names the file (only lists whose package name contains
  "nvidia" are read: nvidia-*, linux-modules-nvidia-*, linux-objects-nvidia-*);
- rpm: /var/lib/rpm/rpmdb.sqlite (opened read-only and immutable: nothing is written) has a package
  whose file list names it; a Berkeley-DB rpmdb (/var/lib/rpm/Packages) is not parsed, and a module
  under extra/ there is reported as rpm-owned with that caveat;
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

import os
import re
import sqlite3
import struct
from dataclasses import dataclass

from driverd.root import Root

INSTALL_DIR = "updates/driverd"       # driverd.host.modules.INSTALL_DIR (not imported: no cycle)
_KO = re.compile(r"^(nvidia[\w-]*)\.ko(\.xz|\.zst|\.gz)?$")
FOREIGN = ("dpkg", "rpm", "dkms", "nvidia-installer", "host")
_CORE_SUFFIXES = ("-uvm", "-modeset", "-drm", "-peermem", "_uvm", "_modeset", "_drm", "_peermem", "-fs", "_fs",
                  "-vgpu-vfio", "_vgpu_vfio")


@dataclass(frozen=True)
class DriverOwner:
    manager: str                      # driverd | dpkg | rpm | dkms | nvidia-installer | host | unknown
    package: str | None               # "nvidia-kernel-dkms", "nvidia-current/535.261.03", ...
    version: str | None
    files: tuple[str, ...]
    evidence: str

    def describe(self) -> str:
        what = {"dpkg": "Debian/Ubuntu package", "rpm": "RPM package", "dkms": "DKMS module",
                "nvidia-installer": "NVIDIA's .run installer", "driverd": "driverd",
                "unknown": "no known package manager", "host": "the host (owner unknown)"}[self.manager]
        pkg = f" {self.package}" + (f" {self.version}" if self.version and self.version not in (self.package or "") else "") \
            if self.package else ""
        return f"{what}{pkg}"


@dataclass(frozen=True)
class OwnershipFacts:
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


# -- dpkg ---------------------------------------------------------------------------------------

def dpkg_owners(root: Root, paths: list[str]) -> dict[str, str]:
    """path -> package, from the file lists of packages whose name contains "nvidia"."""
    out: dict[str, str] = {}
    want = set(paths) | {_canon(p) for p in paths}
    for lst in root.glob("/var/lib/dpkg/info", ".list"):
        name = lst.rsplit("/", 1)[-1][:-5]
        if "nvidia" not in name:
            continue
        for line in (root.read_text(lst, 16 << 20) or "").splitlines():
            if line in want or _canon(line) in want:
                out.setdefault(_match(line, paths), name.split(":", 1)[0])
    return out


def _canon(p: str) -> str:
    # merged /usr: /lib/modules and /usr/lib/modules are one directory on current distributions
    return p.removeprefix("/usr") if p.startswith("/usr/lib/modules/") else p


def _match(line: str, paths: list[str]) -> str:
    return next((p for p in paths if p == line or _canon(p) == _canon(line)), line)


def dpkg_version(root: Root, package: str) -> str | None:
    text = root.read_text("/var/lib/dpkg/status", 64 << 20) or ""
    m = re.search(rf"^Package: {re.escape(package)}\n(?:[^\n]+\n)*?Version: (\S+)", text, re.MULTILINE)
    return m.group(1) if m else None


def dpkg_owner_of_prefix(root: Root, prefix: str) -> str | None:
    for lst in root.glob("/var/lib/dpkg/info", ".list"):
        name = lst.rsplit("/", 1)[-1][:-5]
        if "nvidia" in name and any(line == prefix or line.startswith(prefix + "/")
                                    for line in (root.read_text(lst, 16 << 20) or "").splitlines()):
            return name.split(":", 1)[0]
    return None


# -- rpm ----------------------------------------------------------------------------------------

RPMTAG_NAME, RPMTAG_VERSION, RPMTAG_RELEASE = 1000, 1001, 1002
RPMTAG_DIRINDEXES, RPMTAG_BASENAMES, RPMTAG_DIRNAMES = 1116, 1117, 1118


def parse_rpm_header(blob: bytes) -> dict[int, object]:
    """The tags driverd needs from an rpm header blob as rpmdb.sqlite stores it (headerExport: il,
    dl, il 16-byte index entries tag/type/offset/count, then the data store; big-endian)."""
    il, dl = struct.unpack_from(">ii", blob, 0)
    if il < 0 or dl < 0 or 8 + il * 16 + dl > len(blob):
        raise ValueError("not an rpm header")
    store = 8 + il * 16
    out: dict[int, object] = {}
    for i in range(il):
        tag, typ, off, cnt = struct.unpack_from(">iiii", blob, 8 + i * 16)
        if tag not in (RPMTAG_NAME, RPMTAG_VERSION, RPMTAG_RELEASE, RPMTAG_DIRINDEXES, RPMTAG_BASENAMES,
                       RPMTAG_DIRNAMES):
            continue
        pos = store + off
        if typ in (6, 9):                                   # STRING, I18NSTRING
            end = blob.index(b"\0", pos)
            out[tag] = blob[pos:end].decode("utf-8", "replace")
        elif typ == 8:                                      # STRING_ARRAY
            vals = []
            for _ in range(cnt):
                end = blob.index(b"\0", pos)
                vals.append(blob[pos:end].decode("utf-8", "replace"))
                pos = end + 1
            out[tag] = vals
        elif typ == 4:                                      # INT32
            out[tag] = list(struct.unpack_from(f">{cnt}i", blob, pos))
    return out


def rpm_owners(root: Root, paths: list[str]) -> tuple[dict[str, tuple[str, str]], str | None]:
    """(path -> (package, version-release), note). Only rpmdb.sqlite is read."""
    real = root.safe_real("/var/lib/rpm/rpmdb.sqlite")
    if real is None or not os.path.isfile(real):
        if root.is_file("/var/lib/rpm/Packages"):
            return {}, "Berkeley-DB rpmdb (/var/lib/rpm/Packages) not parsed"
        return {}, None
    want = {_canon(p): p for p in paths}
    out: dict[str, tuple[str, str]] = {}
    try:
        con = sqlite3.connect(f"file:{real}?mode=ro&immutable=1", uri=True)
        try:
            for (blob,) in con.execute("SELECT blob FROM Packages"):
                try:
                    h = parse_rpm_header(bytes(blob))
                except (ValueError, struct.error):
                    continue
                name = h.get(RPMTAG_NAME)
                if not isinstance(name, str) or "nvidia" not in name:
                    continue
                dirs, bases, idx = h.get(RPMTAG_DIRNAMES) or [], h.get(RPMTAG_BASENAMES) or [], h.get(RPMTAG_DIRINDEXES) or []
                for b, i in zip(bases, idx):
                    if 0 <= i < len(dirs):
                        full = _canon(dirs[i] + b)
                        if full in want:
                            out[want[full]] = (name, f"{h.get(RPMTAG_VERSION)}-{h.get(RPMTAG_RELEASE)}")
        finally:
            con.close()
    except sqlite3.Error as e:
        return {}, f"rpmdb.sqlite unreadable ({e.__class__.__name__})"
    return out, None


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
    if left:
        dp = dpkg_owners(root, left)
        for pkg in sorted(set(dp.values())):
            fs = tuple(p for p in left if dp.get(p) == pkg)
            owners.append(DriverOwner("dpkg", pkg, dpkg_version(root, pkg), fs,
                                      f"/var/lib/dpkg/info/{pkg}.list names {fs[0]}"))
        left = [p for p in left if p not in dp]
    rpm_note = None
    if left:
        rp, rpm_note = rpm_owners(root, left)
        for pkg in sorted({v[0] for v in rp.values()}):
            fs = tuple(p for p in left if rp.get(p, ("",))[0] == pkg)
            ver = next(v[1] for p, v in rp.items() if v[0] == pkg)
            owners.append(DriverOwner("rpm", pkg, ver, fs, f"rpmdb.sqlite: {pkg} owns {fs[0]}"))
        left = [p for p in left if p not in rp]
    if left:
        for name, version, arch in dkms_installed(root, release):
            mods = dkms_module_names(root, name, version, release, arch)
            fs = tuple(p for p in left if "/updates/dkms/" in p or
                       _KO.match(p.rsplit("/", 1)[-1]).group(1) in mods)
            if not fs:
                continue
            src = dpkg_owner_of_prefix(root, f"/usr/src/{name}-{version}")
            owners.append(DriverOwner("dkms", f"{name}/{version}", version, fs,
                                      f"/var/lib/dkms/{name}/kernel-{release}-{arch} -> {version}"
                                      + (f"; source from package {src}" if src else "")))
            left = [p for p in left if p not in fs]
    if left and rpm_note and any("/extra/" in p for p in left):
        fs = tuple(p for p in left if "/extra/" in p)
        owners.append(DriverOwner("rpm", None, None, fs, f"{fs[0]} is where kmod packages install; {rpm_note}"))
        left = [p for p in left if p not in fs]
    if left and (root.is_file("/usr/bin/nvidia-uninstall") or root.is_file("/usr/bin/nvidia-installer")):
        owners.append(DriverOwner("nvidia-installer", None, None, tuple(left),
                                  "/usr/bin/nvidia-uninstall: NVIDIA's .run installer put these files"))
        left = []
    if left:
        owners.append(DriverOwner("unknown", None, None, tuple(left), "no package database names these files"))
    foreign = next((o for o in owners if o.manager in FOREIGN and any(_is_core(p) for p in o.files)), None) \
        or next((o for o in owners if o.manager in FOREIGN), None)
    if not files:
        summary = f"no NVIDIA kernel module is installed for {release}"
    else:
        summary = "; ".join(f"{o.describe()} ({len(o.files)} file{'s' if len(o.files) > 1 else ''})" for o in owners)
    return OwnershipFacts(release, tuple(files), tuple(owners), foreign, summary)
