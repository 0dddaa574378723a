"""The user-space package: NVIDIA's user-space of one driver version for one arch, kernel-independent.

The kernel-module package (driverd.package.manifest) is one (version, flavour, kernel release, arch);
the user-space does not depend on the kernel, so it is its own package, one per (version, arch):

    driverd-userspace-<version>-<arch>.<sha256>.tar.zst
        manifest.json                       kind "userspace" (below), first member
        lib64/<lib>.so.<version>            the libraries, by their versioned names
        lib64/vdpau/libvdpau_nvidia.so.<v>  (where present)
        bin/<binary>                        nvidia-smi, nvidia-persistenced, nvidia-modprobe, the MPS tools,
                                            nvidia-debugdump (those the source has), mode 0755
        firmware/nvidia/<version>/*.bin     GSP firmware
        share/glvnd/egl_vendor.d/*.json     EGL vendor (ICD) file; share/vulkan/icd.d, implicit_layer.d

The archive layout is the layout of the installed tree (driverd.install.userspace puts it
under <userspace.root>/<version>/ as it is), so nothing is renamed on the node. Symbolic links are
never archive members (driverd.safetar refuses them in packages): the soname links (libcuda.so.1 ->
libcuda.so.<version>) and development links (libcuda.so -> libcuda.so.1) are listed in the manifest's
`links` and made by the installer, each checked to end at a listed file of the same directory.

manifest.json:
    {"schema": 1, "kind": "userspace", "driver": {"version": "550.163.01", "branch": "550"},
     "arch": "x86_64",
     "files": [{"path": "lib64/libcuda.so.550.163.01", "size": ..., "mode": 420, "sha256": ...}, ...],
     "libraries": [{"path": "lib64/libcuda.so.550.163.01", "soname": "libcuda.so.1", "component": "compute"}],
     "links": [{"path": "lib64/libcuda.so.1", "target": "libcuda.so.550.163.01"}, ...],
     "binaries": ["bin/nvidia-smi", ...],
     "provenance": {"source": "debian" | "nvidia-run", "inputs": [{"name", "version", "sha256"}],
                    "built_at", "builder"}}

Every file's mode is 0644 or 0755 (binaries 0755; setuid is never carried: Debian's nvidia-modprobe
is 4755, the package's is 0755) and is what the installer writes, after the archive's bytes were
checked against this list (driverd.package.archive). A manifest that says anything else is refused.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, field
from typing import Any

from driverd import package
from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.package.manifest import MANIFEST_NAME, FileEntry, malformed, parse_json

KIND = "userspace"
SCHEMA_VERSION = 1
LIB_DIR = "lib64"
VDPAU_DIR = "lib64/vdpau"
BIN_DIR = "bin"
FIRMWARE_BASE = "firmware/nvidia"           # + /<version>
SHARE_DIRS = ("share/glvnd/egl_vendor.d", "share/vulkan/icd.d", "share/vulkan/implicit_layer.d",
              "share/egl/egl_external_platform.d")
LIB_DIRS = (LIB_DIR, VDPAU_DIR)
FILE_MODES = (0o644, 0o755)
KEY_SONAMES = package.KEY_SONAMES
# What NVIDIA ships, by name: a user-space package holds these and nothing else (checked when it is built
# and again when a node installs it: a library of another name or soname would be given to every process
# on the node by the loader's cache, a binary of another name would be linked onto root's PATH).
# The driver's binaries a package carries when its source has them: NVIDIA's own lists —
# libnvidia-container src/nvc_info.c `utility_bins` (nvidia-smi, nvidia-debugdump, nvidia-persistenced)
# and `compute_bins` (the MPS pair), and nvidia-modprobe (driver README, "Installed Components"); Debian's
# nvidia-smi, nvidia-persistenced, nvidia-modprobe and nvidia-cuda-mps packages hold the same names.
# nvidia-imex, nv-fabricmanager and nscq ship separately from NVIDIA (docs/architecture.md).
BINARIES = ("nvidia-smi", "nvidia-persistenced", "nvidia-modprobe", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server", "nvidia-debugdump")
# NVIDIA's libraries (their file-name stems: lib<x>.so.<driver version>), by what each is for (the
# NVIDIA_DRIVER_CAPABILITIES a container asks for). Sources: libnvidia-container src/nvc_info.c
# (`utility_libs`, `compute_libs`, `video_libs`, `graphics_libs`, `graphics_libs_glvnd`, `ngx_libs` — not
# `graphics_libs_compat`: libGL/libEGL/libGLES* of that name are GLVND's loaders, every process's, never
# the driver's to replace); nvidia-container-toolkit (libnvidia-sandboxutils: internal/nvsandboxutils;
# libnvidia-vulkan-producer, libnvidia-nvvm70, libnvidia-api: internal/discover); and Debian's packages of
# 535.261.03 and 550.163.01 (libnvidia-glsi, libnvidia-vulkan-producer, libnvidia-gpucomp, ... with the
# sonames tests/packages/test_userspace_nvidia_only.py reads from them). A stem not here is not packed.
COMPONENTS = {
    "utility": ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq", "libnvidia-sandboxutils"),
    "compute": ("libcuda", "libcudadebugger", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libnvidia-nvvm70",
                "libnvidia-gpucomp", "libnvidia-pkcs11", "libnvidia-pkcs11-openssl3", "libnvidia-opencl",
                "libnvidia-fatbinaryloader", "libnvidia-compiler", "libnvidia-tileiras"),
    "video": ("libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow", "libvdpau_nvidia"),
    "graphics": ("libEGL_nvidia", "libGLX_nvidia", "libGLESv1_CM_nvidia", "libGLESv2_nvidia", "libnvidia-eglcore",
                 "libnvidia-glcore", "libnvidia-glsi", "libnvidia-tls", "libnvidia-glvkspirv", "libnvidia-allocator",
                 "libnvidia-vulkan-producer", "libnvidia-rtcore", "libnvoptix", "libnvidia-ngx", "libnvidia-fbc",
                 "libnvidia-ifr", "libnvidia-cbl", "libnvidia-api"),
}
NVIDIA_LIBRARIES = frozenset(x for stems in COMPONENTS.values() for x in stems)
# GSP firmware by NVIDIA's own globs: libnvidia-container `NV_FIRMWARE_GLOB` "gsp*.bin"; nvidia-ctk
# (pkg/nvcdi/driver-nvml.go newDriverFirmwareDiscoverer) "gsp*.bin" and "ucodes*.bin".
FIRMWARE_NAME = re.compile(r"^(?:gsp|ucodes)[A-Za-z0-9_.+-]*\.bin$")
# ICD and layer files (EGL vendor, Vulkan ICD and implicit layer): NVIDIA's names all say nvidia
# (10_nvidia.json, nvidia_icd.json, nvidia_layers.json).
SHARE_NAME = re.compile(r"^[A-Za-z0-9_.+-]*nvidia[A-Za-z0-9_.+-]*\.json$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
_MAX_LINK_HOPS = 8


def stem(name: str) -> str:
    """libcuda.so.550.163.01 -> libcuda"""
    i = name.find(".so")
    return name[:i] if i > 0 else name


def component_of(name: str) -> str:
    s = stem(name)
    return next((c for c, stems in COMPONENTS.items() if s in stems), "other")


def library_problem(name: str, soname: str | None, version: str) -> str | None:
    """Why the library file `name` with DT_SONAME `soname` is not one of NVIDIA's for driver `version`
    (None when it is): its name must be <NVIDIA's stem>.so.<version>, its soname that stem's (libcuda.so.1,
    libnvidia-glcore.so.<version>) or none — a soname of another library (libz.so.1) would make the
    loader's cache give this file to every process that asks for that one."""
    st = stem(name)
    if st not in NVIDIA_LIBRARIES:
        return f"{name} is not one of NVIDIA's libraries"
    if name != f"{st}.so.{version}":
        return f"{name} is not named {st}.so.{version}"
    if soname is not None and not re.fullmatch(re.escape(st) + r"\.so(\.\d+)+", soname):
        return f"{name} declares the soname {soname}, not one of {st}'s"
    return None


def package_basename(driver_version: str, arch: str) -> str:
    return f"driverd-userspace-{driver_version}-{arch}"


@dataclass(frozen=True)
class Link:
    """A symbolic link in a user-space package's tree, naming a file in the same directory."""
    path: str            # lib64/libcuda.so.1
    target: str          # libcuda.so.550.163.01: a name in the same directory


@dataclass(frozen=True)
class Library:
    """A shared library of a user-space package, with its soname and the component it belongs to."""
    path: str            # lib64/libcuda.so.550.163.01
    soname: str | None   # its ELF DT_SONAME, libcuda.so.1; None: it declares none (loaded by its file name)
    component: str       # utility | compute | video | graphics | other


@dataclass(frozen=True)
class Source:
    """One input a user-space package was built from: a Debian package or a .run installer's directory."""
    name: str            # a .deb's package name, or the .run's directory name
    version: str | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class Provenance:
    """Where a user-space package came from (Debian's packages or NVIDIA's .run installer) and what built it."""
    source: str = ""                     # debian | nvidia-run
    inputs: tuple[Source, ...] = ()
    built_at: str | None = None
    builder: str | None = None


@dataclass(frozen=True)
class UserspaceManifest:
    """The manifest of a user-space package: NVIDIA's user-space of one driver version for one arch."""
    driver_version: str
    arch: str
    files: tuple[FileEntry, ...]
    libraries: tuple[Library, ...]
    links: tuple[Link, ...] = ()
    binaries: tuple[str, ...] = ()
    provenance: Provenance = field(default_factory=Provenance)
    schema: int = SCHEMA_VERSION
    kind: str = KIND

    @property
    def branch(self) -> str:
        return self.driver_version.split(".", 1)[0]

    @property
    def firmware_dir(self) -> str:
        return f"{FIRMWARE_BASE}/{self.driver_version}"

    @property
    def firmware_files(self) -> tuple[FileEntry, ...]:
        return tuple(f for f in self.files if f.path.startswith(self.firmware_dir + "/"))

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def library(self, soname: str) -> Library | None:
        return next((lib for lib in self.libraries if lib.soname == soname), None)

    def basename(self) -> str:
        return package_basename(self.driver_version, self.arch)

    def archive_dirs(self) -> list[str]:
        """Every directory of the archive, parents first (the tar's directory members)."""
        out: set[str] = set()
        for f in self.files:
            parts = f.path.split("/")[:-1]
            out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        return sorted(out)

    def components(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lib in self.libraries:
            out[lib.component] = out.get(lib.component, 0) + 1
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema, "kind": self.kind,
            "driver": {"version": self.driver_version, "branch": self.branch},
            "arch": self.arch,
            "files": [asdict(f) for f in self.files],
            "libraries": [asdict(lib) for lib in self.libraries],
            "links": [asdict(ln) for ln in self.links],
            "binaries": list(self.binaries),
            "provenance": {"source": self.provenance.source,
                           "inputs": [asdict(s) for s in self.provenance.inputs],
                           "built_at": self.provenance.built_at, "builder": self.provenance.builder},
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any, where: str = "manifest") -> "UserspaceManifest":
        try:
            if not isinstance(d, dict):
                raise TypeError("not an object")
            if d.get("kind") != KIND:
                raise PackageError(f"{where} is not a user-space package's manifest (kind {d.get('kind')!r})",
                                   cause="a kernel-module package has no kind \"userspace\"",
                                   fix="install a kernel-module package with `driverd install`, a user-space "
                                       "package with the user-space install")
            schema = int(d.get("schema", 0))
            if schema != SCHEMA_VERSION:
                raise PackageError(f"{where}: unsupported user-space manifest schema {schema}",
                                   cause=f"this driverd reads schema {SCHEMA_VERSION}",
                                   fix="rebuild the package with this driverd or upgrade driverd")
            prov = d.get("provenance") or {}
            m = cls(
                driver_version=str(d["driver"]["version"]), arch=str(d["arch"]),
                files=tuple(FileEntry(str(f["path"]), int(f["size"]), int(f["mode"]), str(f["sha256"]))
                            for f in d["files"]),
                libraries=tuple(Library(str(x["path"]), None if x["soname"] is None else str(x["soname"]),
                                        str(x.get("component") or "other"))
                                for x in d["libraries"]),
                links=tuple(Link(str(x["path"]), str(x["target"])) for x in d.get("links") or ()),
                binaries=tuple(str(b) for b in d.get("binaries") or ()),
                provenance=Provenance(
                    source=str(prov.get("source") or ""),
                    inputs=tuple(Source(str(s["name"]), s.get("version"), s.get("sha256"))
                                 for s in prov.get("inputs") or ()),
                    built_at=prov.get("built_at"), builder=prov.get("builder")),
                schema=schema)
        except PackageError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise malformed(where, e) from None
        m.validate(where)
        return m

    @classmethod
    def loads(cls, data: bytes | str, where: str = "manifest") -> "UserspaceManifest":
        return cls.from_json(parse_json(data, where), where)

    def validate(self, where: str = "manifest") -> None:
        """Names safe for paths, every path in the layout, modes 0644/0755, every library backed by a
        listed file, every link ending at a listed file of its own directory, both key libraries there."""
        def bad(msg: str) -> PackageError:
            return PackageError(f"{where}: {msg}", cause="the user-space manifest is inconsistent",
                                fix="rebuild the package with `driverd build-userspace`")
        if not _VERSION.match(self.driver_version):
            raise bad(f"driver version {self.driver_version!r} is not a version like 550.163.01")
        if not _SAFE_NAME.match(self.arch):
            raise bad(f"arch {self.arch!r} is not a plain name")
        dirs = allowed_dirs(self.driver_version)
        files: dict[str, FileEntry] = {}
        for f in self.files:
            parent, _, name = f.path.rpartition("/")
            if parent not in dirs or not _SAFE_NAME.match(name):
                raise bad(f"file path {f.path!r} is outside the user-space layout ({', '.join(sorted(dirs))})")
            if f.path in files:
                raise bad(f"file {f.path} is listed twice")
            if not re.fullmatch(r"[0-9a-f]{64}", f.sha256) or f.size < 0:
                raise bad(f"file {f.path} has an invalid size or sha256")
            if f.mode not in FILE_MODES:
                raise bad(f"file {f.path} has mode {f.mode:04o}; a user-space package holds 0644 and 0755 only")
            files[f.path] = f
        nvidia = "a user-space package holds NVIDIA's files only"
        for path in files:
            parent, _, name = path.rpartition("/")
            if parent == self.firmware_dir and not FIRMWARE_NAME.match(name):
                raise bad(f"firmware {path} is not NVIDIA's GSP firmware (gsp*.bin, ucodes*.bin): {nvidia}")
            if parent.startswith("share/") and not SHARE_NAME.match(name):
                raise bad(f"{path} is not one of NVIDIA's ICD or layer files (*nvidia*.json): {nvidia}")
        bins = set(self.binaries)
        for b in self.binaries:
            if b not in files or not b.startswith(BIN_DIR + "/"):
                raise bad(f"binary {b} is not a listed file under {BIN_DIR}/")
            if b.rpartition("/")[2] not in BINARIES:
                raise bad(f"binary {b} is not one of NVIDIA's driver binaries ({', '.join(BINARIES)}): {nvidia}")
            if files[b].mode != 0o755:
                raise bad(f"binary {b} has mode {files[b].mode:04o}, not 0755")
        extra_bins = sorted(p for p in files if p.startswith(BIN_DIR + "/") and p not in bins)
        if extra_bins:
            raise bad(f"{extra_bins[0]} is under {BIN_DIR}/ but not listed as a binary")
        libs: set[str] = set()
        for lib in self.libraries:
            if lib.path not in files or lib.path.rpartition("/")[0] not in LIB_DIRS:
                raise bad(f"library {lib.path} is not a listed file under {LIB_DIR}/")
            if lib.soname is not None and not _SAFE_NAME.match(lib.soname):
                raise bad(f"library {lib.path} has soname {lib.soname!r}, not a plain name")
            if lib.path in libs:
                raise bad(f"library {lib.path} is listed twice")
            why = library_problem(lib.path.rpartition("/")[2], lib.soname, self.driver_version)
            if why is None and (lib.path.rpartition("/")[0] == VDPAU_DIR) != (stem(lib.path.rpartition("/")[2])
                                                                             == "libvdpau_nvidia"):
                why = f"{lib.path} is not where NVIDIA's installer puts it"
            if why:
                raise bad(f"{why}: {nvidia}")
            libs.add(lib.path)

        links: dict[str, str] = {}
        for ln in self.links:
            parent, _, name = ln.path.rpartition("/")
            if parent not in LIB_DIRS or not _SAFE_NAME.match(name) or not _SAFE_NAME.match(ln.target):
                raise bad(f"link {ln.path} -> {ln.target} is not a name in {LIB_DIR}/ pointing at a name beside it")
            if ln.path in files or ln.path in links:
                raise bad(f"link {ln.path} collides with a file or another link")
            links[ln.path] = ln.target
        for ln in self.links:
            end = self.resolve_link(ln.path, links)
            if end is None or end not in files:
                raise bad(f"link {ln.path} -> {ln.target} does not end at a listed file of its directory")
        for lib in self.libraries:
            name = lib.path.rpartition("/")[2]
            if lib.soname is not None and lib.soname != name:
                sl = f"{lib.path.rpartition('/')[0]}/{lib.soname}"
                if self.resolve_link(sl, links) != lib.path:
                    raise bad(f"library {lib.path} (soname {lib.soname}) has no link {sl} to it: the loader "
                              "would not find it")
        for soname in KEY_SONAMES:
            lib = self.library(soname)
            if lib is None:
                raise bad(f"no {soname}: a user-space package needs libcuda and libnvidia-ml")
            if not lib.path.endswith(f".so.{self.driver_version}"):
                raise bad(f"{lib.path} ({soname}) is not named after the driver version {self.driver_version}")
        stray = sorted(p for p in files if p.rpartition("/")[0] in LIB_DIRS and p not in libs)
        if stray:
            # the loader's cache takes every library file of the directory, by its own soname
            raise bad(f"{stray[0]} is in {stray[0].rpartition('/')[0]}/ but not listed as a library: {nvidia}")
        by_path = {lib.path: lib for lib in self.libraries}
        for ln in self.links:
            end = self.resolve_link(ln.path, links)
            lib = by_path.get(end or "")
            name = ln.path.rpartition("/")[2]
            if lib is None or name not in (lib.soname, f"{stem(lib.path.rpartition('/')[2])}.so"):
                # a link is a name the loader's cache and linkers answer with: only the library's own
                raise bad(f"link {ln.path} -> {ln.target} is neither the soname nor the development link of the "
                          f"library it ends at: {nvidia}")

    @staticmethod
    def resolve_link(path: str, links: dict[str, str]) -> str | None:
        """Follow manifest links from `path` (same directory only) to the name they end at."""
        seen = 0
        while path in links:
            seen += 1
            if seen > _MAX_LINK_HOPS:
                return None
            path = f"{path.rpartition('/')[0]}/{links[path]}"
        return path


def allowed_dirs(version: str) -> set[str]:
    return {LIB_DIR, VDPAU_DIR, BIN_DIR, f"{FIRMWARE_BASE}/{version}", *SHARE_DIRS}


def member_ok(rel: str, is_dir: bool) -> bool:
    """Whether an archive member may be in a user-space package (before its manifest is read: the
    firmware directory's version is any plain name here, the manifest's own check pins it)."""
    if rel == "":
        return is_dir
    if not is_dir and rel == MANIFEST_NAME:
        return True
    fixed = {LIB_DIR, VDPAU_DIR, BIN_DIR, *SHARE_DIRS}
    parents = {"/".join(d.split("/")[:i]) for d in (*fixed, FIRMWARE_BASE) for i in range(1, d.count("/") + 2)}
    parts = rel.split("/")
    if not all(_SAFE_NAME.match(p) for p in parts):
        return False
    fw = len(parts) >= 3 and "/".join(parts[:2]) == FIRMWARE_BASE
    if is_dir:
        return rel in parents or (fw and len(parts) == 3)
    parent = "/".join(parts[:-1])
    return parent in fixed or (fw and len(parts) == 4)


def is_userspace_json(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == KIND
