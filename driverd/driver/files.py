"""Where the NVIDIA driver's user-space is on a host: the libraries (libcuda, libnvidia-ml, ...), their
version, the directory a container's loader must search. One finder for the workload validation (which
loads exactly these libraries in a child) and the CDI spec (which gives exactly these to containers).

`find()` says where the user-space is. It is looked for, in order, in: an explicit driver root
(configuration), the GPU Operator's driver root `/run/nvidia/driver`, the user-space driverd installed
(driverd.install.userspace: the loader configuration `DRIVERD_LDCONF` it writes names
`<userspace.root>/current/lib64`; the driver root is `current` resolved to its versioned tree, so a
switch during a read never mixes two versions), `/usr/local/nvidia` (the layout of GKE/COS-style hosts
and of the machines driverd is validated on: lib64/, bin/, firmware/), then the host's own library
directories (multiarch, lib64, Debian's `nvidia/current`), and last the ld cache (`/etc/ld.so.cache` of
each of those roots: libraries in a directory only ld.so.conf names). The first place that holds
libcuda.so.1 or libnvidia-ml.so.1 is the driver's user-space: a container gets the libraries of one
place, never a mixture. Paths are host paths, resolved under the Root; each driver root is resolved
first (driverd's `/run/nvidia/driver` is a link to its `current`): the user-space found through a link is
reported at its real tree, and nothing a link names can lead out of the Root.

`inventory()` lists the files of that user-space a container needs, the way NVIDIA's own CDI
generator finds them (nvidia-container-toolkit v1.20.2: pkg/nvcdi/driver-nvml.go
`newDriverVersionDiscoverer` — every library named `*.so.<version>` in the driver's library
directories and their `vdpau/`, the legacy `libnvidia-nvvm70.so.*`, the binaries nvidia-smi,
nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control, nvidia-cuda-mps-server, nvidia-imex,
nvidia-imex-ctl, the GSP firmware `nvidia/<version>/gsp*.bin` and `ucodes*.bin`; internal/discover/ipc.go
— the persistenced and fabric manager sockets and the MPS pipe directory; internal/lookup/root/root.go
— the version from libcuda's or libnvidia-ml's file name). Only files of the key libraries' version are
listed: a host with two versions side by side gives the one libcuda.so.1 points to, never a mixture.
"""
from __future__ import annotations

import os
import re
import stat
import struct
from dataclasses import field

from driverd.datatypes import NamedTuple, dataclass
from driverd.driver.layout import LDCONF, USERSPACE_DRIVER_LINK
from driverd.package import KEY_SONAMES
from driverd.root import Root

# The libraries every compute/utility container needs to talk to the driver: their presence decides
# where the user-space is; their real file names carry the driver version (libcuda.so.580.159.04).
KEY_LIBS = KEY_SONAMES
DRIVER_ROOTS = (USERSPACE_DRIVER_LINK, "/usr/local/nvidia")
# Relative to a driver root (or to / for the host's own directories).
LIB_SUBDIRS = ("lib64", "usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu/nvidia/current",
               "lib/x86_64-linux-gnu", "usr/lib", "lib")
# Where nvidia-ctk looks for the driver's versioned libraries under a driver root (its default
# library search paths, internal/lookup/library.go NewLibraryLocator; "" is the root itself).
VERSIONED_LIB_SUBDIRS = ("", "usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
                         "usr/lib/x86_64-linux-gnu/nvidia/current", "usr/lib/aarch64-linux-gnu/nvidia/current",
                         "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu",
                         "lib/x86_64-linux-gnu/nvidia/current", "lib/aarch64-linux-gnu/nvidia/current")
# The driver's binaries a compute/utility container gets (pkg/nvcdi/driver-nvml.go newDriverBinariesDiscoverer).
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server", "nvidia-imex", "nvidia-imex-ctl")
# Looked for under the driver root in PATH's default directories (pkg/lookup/path.go defaultPATH).
BIN_SUBDIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")
# The driver's IPC endpoints: (the path a container sees, the places it may be on the host).
IPC = (("/run/nvidia-persistenced/socket", ("/run/nvidia-persistenced/socket", "/var/run/nvidia-persistenced/socket")),
       ("/run/nvidia-fabricmanager/socket", ("/run/nvidia-fabricmanager/socket",
                                             "/var/run/nvidia-fabricmanager/socket")),
       ("/tmp/nvidia-mps", ("/tmp/nvidia-mps",)))
LD_CACHE = "/etc/ld.so.cache"
DRIVERD_LDCONF = LDCONF                    # driverd.install.userspace owns the file
FIRMWARE_PATTERNS = ("gsp", "ucodes")           # nvidia/<version>/gsp*.bin, ucodes*.bin
_VERSIONED = re.compile(r"^lib[\w+-]+\.so\.(\d+\.\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class UserSpace:
    """The driver user-space found on a host (all paths are host paths)."""
    driver_root: str | None                    # the root it was found under ("/" for the host's own dirs)
    lib_dir: str | None                        # the directory holding the key libraries
    libs: dict[str, str] = field(default_factory=dict)   # soname -> real file (host path)
    version: str | None = None                 # from the real file names of the key libraries
    versions: dict[str, str] = field(default_factory=dict)  # soname -> its own version (a mixed set shows)
    searched: tuple[str, ...] = ()
    via_ld_cache: bool = False                 # lib_dir was found through an ld.so.cache, not a known directory

    @property
    def found(self) -> bool:
        return bool(self.libs)

    def relative(self, path: str) -> str:
        """`path` as it is seen from the driver root: the path a container gets it at (nvidia-ctk maps
        /run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.X to /usr/lib/x86_64-linux-gnu/libcuda.so.X,
        pkg/lookup and internal/discover/mounts.go relativeTo). Paths outside the driver root stay as they are."""
        r = (self.driver_root or "/").rstrip("/")
        if r and (path == r or path.startswith(r + "/")):
            return path[len(r):] or "/"
        return path

    def to_json(self) -> dict:
        return {"driver_root": self.driver_root, "lib_dir": self.lib_dir, "libs": dict(self.libs),
                "version": self.version, "versions": dict(self.versions), "searched": list(self.searched)}


def _join(base: str, sub: str) -> str:
    """base/sub as one normal absolute path ("/" + "lib64" is "/lib64", never "//lib64")."""
    return os.path.normpath("/" + "/".join(x for x in (base.strip("/"), sub.strip("/")) if x))


def _candidates(roots: list[str]) -> list[tuple[str, str]]:
    out = [(r, _join(r, sub)) for r in roots for sub in LIB_SUBDIRS]
    seen: set[str] = set()
    return [(r, d) for r, d in out if not (d in seen or seen.add(d))]


def driverd_root(root: Root) -> str | None:
    """The driver root of the user-space driverd installed, from the loader configuration it wrote
    (`<userspace.root>/current/lib64` -> `current` resolved to its versioned tree); None without one."""
    text = root.read_text(DRIVERD_LDCONF, 64 << 10) or ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("/") and line.endswith("/lib64") and len(line) > len("/lib64"):
            try:
                return root.resolve(line[:-len("/lib64")])
            except (OSError, ValueError):
                return None
    return None


def _resolved(root: Root, base: str) -> str | None:
    """A driver root with its symbolic links followed inside the Root (/run/nvidia/driver may be
    driverd's link to its `current` tree): the libraries' paths, the directory the workload check's
    loader searches and the paths containers get are then real paths under the root, never a link an
    absolute target could take out of it. None when it cannot be resolved."""
    if base == "/":
        return base
    try:
        return root.resolve(base)
    except (OSError, ValueError):
        return None


def _under(path: str, prefix: str | None) -> bool:
    return bool(prefix) and (path == prefix.rstrip("/") or path.startswith(prefix.rstrip("/") + "/"))


def _roots(root: Root, driver_root: str | None, driverd: bool = True, exclude: str | None = None) -> list[str]:
    roots = [_join(driver_root, "")] if driver_root else []
    mine = driverd_root(root) if driverd else None
    order = (*roots, DRIVER_ROOTS[0], *([mine] if mine else []), *DRIVER_ROOTS[1:], "/")
    out: list[str] = []
    for r in order:
        real = _resolved(root, r)
        if real is not None and real not in out and not _under(real, exclude):
            out.append(real)
    return out


def library_version(root: Root, path: str) -> str | None:
    """The version in a library's real file name (libcuda.so.1 -> libcuda.so.580.159.04 -> 580.159.04)."""
    try:
        real = root.resolve(path)
    except (OSError, ValueError):
        return None
    m = _VERSIONED.match(os.path.basename(real))
    return m.group(1) if m and m.group(1).count(".") >= 1 and not m.group(1).isdigit() else None


def _found(root: Root, base: str, d: str, searched: list[str], via_cache: bool = False) -> UserSpace | None:
    present = [s for s in KEY_LIBS if root.is_file(f"{d}/{s}")]
    if not present:
        return None
    libs = {s: root.resolve(f"{d}/{s}") for s in present}
    versions = {s: v for s in present if (v := library_version(root, f"{d}/{s}"))}
    distinct = set(versions.values())
    version = distinct.pop() if len(distinct) == 1 else None
    return UserSpace(base, d, libs, version, versions, tuple(searched), via_cache)


def find(root: Root, driver_root: str | None = None, *, driverd: bool = True, exclude: str | None = None) -> UserSpace:
    """The driver's user-space on the host under `root`; `found` is False when no place holds it.
    `driverd` False leaves driverd's own installed user-space out (what else the host has); `exclude`
    (a resolved host path) leaves out every driver root that resolves under it (driverd's
    userspace.root: its /run/nvidia/driver link too). Driver roots are resolved (`_resolved`):
    `driver_root` and `lib_dir` are real paths."""
    searched = []
    roots = _roots(root, driver_root, driverd, exclude)
    for base, d in _candidates(roots):
        searched.append(d)
        if (us := _found(root, base, d, searched)) is not None:
            return us
    # Libraries in a directory only the ld cache knows (ld.so.conf.d): nvidia-ctk's last resort too.
    for base in roots:
        cache = _join(base, LD_CACHE.lstrip("/"))
        searched.append(cache)
        entries = ld_cache_entries(root, cache)         # read and parsed once for every library asked of it
        for soname in KEY_LIBS:
            for path in (p for k, p in entries if k == soname):
                d = _resolved(root, os.path.dirname(_join(base, path.lstrip("/"))))
                if d is None or _under(d, exclude):
                    continue
                if (us := _found(root, base, d, searched, via_cache=True)) is not None:
                    return us
    return UserSpace(None, None, {}, None, {}, tuple(searched))


# -- the ld cache -----------------------------------------------------------------------------------------
# glibc's /etc/ld.so.cache ("glibc-ld.so.cache1.1", glibc elf/cache.c and sysdeps/generic/dl-cache.h),
# optionally after the pre-2.2 "ld.so-1.7.0" table. Header: magic (17) + version (3), nlibs, len_strings,
# flags (1) + padding (3), extension_offset, 3 unused words = 48 bytes; then nlibs entries of 24 bytes
# (flags int32, key, value uint32 string offsets from the new header, osversion uint32, hwcap uint64).
_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_FLAG_ELF = 0x0001
_ARCH_64 = (0x0300, 0x0a00, 0x0500)            # x86-64, aarch64, ppc64le: the 64-bit library entries


def parse_ld_cache(data: bytes) -> list[tuple[str, str]]:
    """(soname, path) of every 64-bit ELF entry of an ld.so.cache; [] for anything else."""
    start = 0
    if data.startswith(_OLD_MAGIC):
        if len(data) < 16:
            return []
        nold = struct.unpack_from("<I", data, 12)[0]
        start = 16 + nold * 12
        start += (-start) % 8                      # the new table is 8-byte aligned after the old one
    if data[start:start + 20] != _NEW_MAGIC or len(data) < start + 48:
        return []
    nlibs = struct.unpack_from("<I", data, start + 20)[0]
    strings = data[start:]
    out = []
    for i in range(nlibs):
        off = start + 48 + i * 24
        if off + 24 > len(data):
            break
        flags, key, value = struct.unpack_from("<iII", data, off)
        if not flags & _FLAG_ELF or (flags & 0xff00) not in _ARCH_64:
            continue
        k, v = _cstr(strings, key), _cstr(strings, value)
        if k and v and v.startswith("/"):
            out.append((k, v))
    return out


def _cstr(buf: bytes, off: int) -> str | None:
    if off >= len(buf):
        return None
    end = buf.find(b"\0", off)
    return buf[off:end].decode("utf-8", "replace") if end > off else None


def ld_cache_entries(root: Root, cache: str) -> list[tuple[str, str]]:
    """(soname, path) of every entry of the ld cache at `cache` (a host path), each path as written in the
    cache (relative to the root the cache belongs to)."""
    return parse_ld_cache(root.read_bytes(cache, 16 << 20) or b"")


def ld_cache_lookup(root: Root, cache: str, soname: str) -> list[str]:
    """The paths the ld cache at `cache` gives for `soname` (ld_cache_entries)."""
    return [p for k, p in ld_cache_entries(root, cache) if k == soname]


# -- ELF: a library's DT_SONAME ----------------------------------------------------------------------------
def elf_soname(path: str) -> str | None:
    """DT_SONAME of the ELF shared object at the real path `path` (its .dynamic section and the string
    table that section links to); None when the file is not such an object or declares none. Reads the
    headers and the two sections only, never the whole (libcuda is ~100 MB)."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 52 or ident[:4] != b"\x7fELF":
                return None
            is64, end = ident[4] == 2, "<" if ident[5] == 1 else ">"
            if is64:
                shoff, = struct.unpack_from(end + "Q", ident, 0x28)
                shentsize, shnum = struct.unpack_from(end + "HH", ident, 0x3A)
            else:
                shoff, = struct.unpack_from(end + "I", ident, 0x20)
                shentsize, shnum = struct.unpack_from(end + "HH", ident, 0x2E)
            if not shoff or not shnum or shnum > 4096 or shentsize < (64 if is64 else 40):
                return None
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            sections = []
            for i in range(shnum):
                o = i * shentsize
                if o + shentsize > len(table):
                    return None
                if is64:
                    _, typ, _, _, off, size, link = struct.unpack_from(end + "IIQQQQI", table, o)
                else:
                    _, typ, _, _, off, size, link = struct.unpack_from(end + "IIIIIII", table, o)
                sections.append((typ, off, size, link))
            for typ, off, size, link in sections:
                if typ != 6 or link >= len(sections) or size > 1 << 20:      # SHT_DYNAMIC
                    continue
                f.seek(off)
                dyn = f.read(size)
                _, soff, ssize, _ = sections[link]
                fmt, step = (end + "qQ", 16) if is64 else (end + "iI", 8)
                for i in range(0, len(dyn) - step + 1, step):
                    tag, val = struct.unpack_from(fmt, dyn, i)
                    if tag == 0:
                        break
                    if tag == 14 and val < ssize:                                # DT_SONAME
                        f.seek(soff + val)
                        name = f.read(min(256, ssize - val)).split(b"\0", 1)[0]
                        return name.decode("utf-8", "replace") or None
            return None
    except (OSError, ValueError, struct.error):
        return None


# -- what a container needs of the user-space --------------------------------------------------------------
class Library(NamedTuple):       # a NamedTuple: cheaper to define than a dataclass, on detect's import path
    """One real library file of the driver and the links the host has for it in its directory."""
    path: str                                  # host path of the real file (libcuda.so.580.159.04)
    soname: str | None = None                  # its DT_SONAME (libcuda.so.1); None when unreadable
    # (link name, what it points to) for the soname link and the development link (libcuda.so) that
    # exist as symlinks next to the file: libcuda.so.1 -> libcuda.so.580.159.04, libcuda.so -> libcuda.so.1
    links: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass(frozen=True)
class Inventory:
    """The files of one user-space a container is given (host paths), all of one driver version."""
    userspace: UserSpace
    libraries: tuple[Library, ...] = ()
    lib_dirs: tuple[str, ...] = ()             # the directories of the real library files
    binaries: dict[str, str] = field(default_factory=dict)      # name -> host path
    firmware: tuple[str, ...] = ()             # host paths of nvidia/<version>/gsp*.bin, ucodes*.bin
    ipc: dict[str, str] = field(default_factory=dict)           # container path -> host path
    problem: str | None = None                 # why no library is listed although the user-space was found
    # host paths found but not given to containers, each with why: someone other than root could change
    # what every GPU container would get (mount_problem)
    left_out: tuple[str, ...] = ()

    @property
    def version(self) -> str | None:
        return self.userspace.version

    def to_json(self) -> dict:
        return {"userspace": self.userspace.to_json(), "version": self.version,
                "libraries": [{"path": lib.path, "soname": lib.soname, "links": [list(x) for x in lib.links]}
                              for lib in self.libraries],
                "lib_dirs": list(self.lib_dirs), "binaries": dict(self.binaries), "firmware": list(self.firmware),
                "ipc": dict(self.ipc), "problem": self.problem, "left_out": list(self.left_out)}


def _is_exec(root: Root, hostpath: str) -> bool:
    real = root.safe_on_disk(hostpath)
    try:
        st = os.stat(real) if real is not None else None
    except OSError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)


def _dir_links(root: Root, d: str, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for n in names:
        if n and (target := root.readlink(f"{d}/{n}")) is not None:
            out.append((n, target))
    return tuple(out)


def dev_link(name: str) -> str:
    """libcuda.so.1 -> libcuda.so (the name up to and including '.so')."""
    i = name.find(".so")
    return name[:i + 3] if i > 0 else ""


def _libraries(root: Root, us: UserSpace) -> tuple[list[Library], list[str]]:
    base = us.driver_root or "/"
    version = us.version
    dirs = []
    for d in [os.path.dirname(p) for p in us.libs.values()] + [_join(base, sub) for sub in VERSIONED_LIB_SUBDIRS]:
        if d not in dirs:
            dirs.append(d)
    found: dict[str, Library] = {}
    lib_dirs: list[str] = []
    for d in dirs:
        names = [n for n in root.listdir(d) if n.endswith(f".so.{version}")]
        # nvidia-ctk's driver library directories are those holding lib*.so.<version>
        # (internal/lookup/root/root.go updateInfo); every *.so.<version> in them and in their vdpau/ is mounted.
        if not any(n.startswith("lib") for n in names):
            continue
        names += [f"vdpau/{n}" for n in root.listdir(f"{d}/vdpau") if n.endswith(f".so.{version}")]
        for n in names:
            real = root.resolve(f"{d}/{n}")
            if real in found or not root.is_file(real):
                continue
            rd = os.path.dirname(real)
            if rd not in lib_dirs and not n.startswith("vdpau/"):
                lib_dirs.append(rd)
            soname = elf_soname(str(root.path(real)))
            name = os.path.basename(real)
            links = _dir_links(root, rd, tuple(dict.fromkeys(x for x in (soname if soname != name else None,
                                                                          dev_link(soname or name)) if x)))
            found[real] = Library(real, soname, links)
    # The legacy NVVM of older CUDA (libnvidia-nvvm70.so.4) is not named after the driver version.
    for d in list(lib_dirs):
        for n in root.listdir(d):
            if n.startswith("libnvidia-nvvm70.so."):
                real = root.resolve(f"{d}/{n}")
                if real not in found and root.is_file(real):
                    found[real] = Library(real, elf_soname(str(root.path(real))), ())
    return sorted(found.values(), key=lambda lib: lib.path), lib_dirs


def _binaries(root: Root, us: UserSpace) -> dict[str, str]:
    base = us.driver_root or "/"
    out = {}
    for name in BINARIES:
        for sub in BIN_SUBDIRS:
            p = _join(base, f"{sub}/{name}")
            if _is_exec(root, p):
                out[name] = p
                break
    return out


def firmware_dirs(root: Root, us: UserSpace) -> list[str]:
    """Where the GSP firmware of the user-space's version may be, in order: the kernel's custom
    firmware path (firmware_class.path), the standard /lib/firmware dirs under the driver root (with
    the running release, as nvidia-ctk's getFirmwareSearchPaths), the driver root's own firmware/
    (/usr/local/nvidia/firmware), then the host's /lib/firmware dirs — the kernel loads from those."""
    release = root.read_first_line("/proc/sys/kernel/osrelease") or ""
    custom = (root.read_first_line("/sys/module/firmware_class/parameters/path") or "").strip()
    standard = [f"/lib/firmware/updates/{release}", "/lib/firmware/updates", f"/lib/firmware/{release}",
                "/lib/firmware"] if release else ["/lib/firmware/updates", "/lib/firmware"]
    base = us.driver_root or "/"
    out = [custom] if custom.startswith("/") else []
    if base != "/":
        out += [_join(base, d.lstrip("/")) for d in standard] + [_join(base, "firmware")]
    out += standard
    return list(dict.fromkeys(out))


def _firmware(root: Root, us: UserSpace) -> list[str]:
    for d in firmware_dirs(root, us):
        fw = f"{d}/nvidia/{us.version}"
        files = [f"{fw}/{n}" for n in root.listdir(fw)
                 if n.endswith(".bin") and n.startswith(FIRMWARE_PATTERNS) and root.is_file(f"{fw}/{n}")]
        if files:
            return files                        # one directory: never the same file name twice
    return []


def _ipc(root: Root, us: UserSpace, left_out: list[str]) -> dict[str, str]:
    """The sockets and the MPS pipe directory that exist: under the driver root first (where nvidia-ctk
    looks), then on the host itself (a host's own nvidia-persistenced serves a /usr/local/nvidia driver).
    Each is taken only as it is (never through a link) and only when root vouches for it (mount_problem);
    otherwise `left_out` says why."""
    base = us.driver_root or "/"
    out = {}
    seen: set[str] = set()
    for target, places in IPC:
        kind = "socket" if target.endswith("socket") else "dir"
        for p in [_join(base, x.lstrip("/")) for x in places if base != "/"] + list(places):
            st = root.lstat(p)              # the directories on the way resolved inside the root
            parent = root.safe_on_disk(os.path.dirname(p))
            if st is None or parent is None or (here := f"{parent}/{os.path.basename(p)}") in seen:
                continue                    # absent, or one place seen already (/var/run is often /run)
            seen.add(here)
            right = stat.S_ISSOCK(st.st_mode) if kind == "socket" else stat.S_ISDIR(st.st_mode)
            if not (right or stat.S_ISLNK(st.st_mode)):
                continue
            why = mount_problem(root, p, kind)
            if why:
                left_out.append(f"{p}: {why}")
                continue
            out[target] = p
            break
    return out


def mount_problem(root: Root, hostpath: str, kind: str = "file") -> str | None:
    """Why the host path `hostpath` must not be bind-mounted into every GPU container, None when root
    vouches for it (driverd.fsutil's walk, as for the configuration and the keys): a container gets
    what the path holds when it starts, and a read-write IPC mount is a way into the host.
    - "file" (a library, binary or firmware file of the driver): the file, links followed as the runtime's
      mount follows them, a regular file of root's, not writable by group or others, in directories of
      root's that no one else can write (a sticky /tmp only for root's entries).
    - "dir" (the MPS pipe directory) and "socket" (persistenced, fabric manager): never reached through a
      symbolic link (a /tmp/nvidia-mps made a link to /etc would hand containers the host's /etc), the
      directories on the way as above; the pipe directory itself root's and not group/world-writable (its
      daemon runs as root), a socket and its own directory root's or both the account its daemon runs as
      (Debian starts nvidia-persistenced --user nvpd: only root can have given it that directory in
      /run); a socket's own mode is the right to connect, not to replace it, and is not judged."""
    from driverd.fsutil import Untrusted, entry_problem, trusted_owners, walk_trusted
    norm = os.path.normpath("/" + hostpath.lstrip("/"))
    try:
        if kind == "file":
            real = str(root.path(root.resolve(norm)))
            found, st, missing = walk_trusted(real)
            if missing:
                return "it does not exist"
            if not stat.S_ISREG(st.st_mode):
                return "it is not a regular file"
            return entry_problem(found, st)
        real = str(root.path(norm))
        st = os.lstat(real)
        if stat.S_ISLNK(st.st_mode):
            return "it is a symbolic link (IPC endpoints are mounted only where they are)"
        if root.resolve(norm) != norm:
            return "it is reached through a symbolic link (IPC endpoints are mounted only where they are)"
        if kind == "dir":
            _, st, _ = walk_trusted(real, follow_last=False)
            return entry_problem(real, st)
        parent = os.path.dirname(real)
        _, pst, _ = walk_trusted(parent, follow_last=False)
        owners = trusted_owners() | (frozenset({pst.st_uid}) if pst.st_uid == st.st_uid else frozenset())
        if st.st_uid not in owners:
            return f"it is owned by uid {st.st_uid}, not root nor the owner of its directory"
        why = entry_problem(parent, pst, owners)
        return f"its directory {os.path.dirname(norm)}: {why}" if why else None
    except Untrusted as u:
        return u.problem
    except (OSError, ValueError) as e:
        return f"it cannot be checked ({getattr(e, 'strerror', None) or e})"


def inventory(root: Root, us: UserSpace | None = None, driver_root: str | None = None) -> Inventory:
    """The files of the driver's user-space (found with `find` unless given) a container needs, all of
    the key libraries' version. A user-space whose key libraries disagree on the version (or carry none
    in their file names) lists no library, binary or firmware: `problem` says why."""
    us = us if us is not None else find(root, driver_root)
    left_out: list[str] = []
    ipc = _ipc(root, us, left_out)
    if not us.found:
        return Inventory(us, ipc=ipc, problem="no driver user-space found (libcuda.so.1 / libnvidia-ml.so.1) in "
                                               + ", ".join(us.searched[:6]) + (" ..." if len(us.searched) > 6 else ""),
                         left_out=tuple(left_out))
    if us.version is None:
        seen = ", ".join(f"{k} {v}" for k, v in sorted(us.versions.items())) or "no version in the file names"
        return Inventory(us, ipc=ipc, problem=f"the key libraries in {us.lib_dir} are not of one driver version "
                                              f"({seen}): a container would get a mixture", left_out=tuple(left_out))
    libs, dirs = _libraries(root, us)

    def vouched(path: str) -> bool:
        why = mount_problem(root, path)
        if why:
            left_out.append(f"{path}: {why}")
        return why is None
    libs = [lib for lib in libs if vouched(lib.path)]
    binaries = {n: p for n, p in _binaries(root, us).items() if vouched(p)}
    firmware = tuple(p for p in _firmware(root, us) if vouched(p))
    return Inventory(us, tuple(libs), tuple(dirs), binaries, firmware, ipc, left_out=tuple(left_out))
