"""Companion packages: what NVSwitch/NVLink hosts run beside the driver and what must be exactly the loaded
driver's version — NVIDIA's fabric manager, libnvidia-nscq, NVLSM and nvidia-imex — one package per
(component, driver version, arch), kernel-independent like the user-space package (driverd.package.userspace):

    driverd-companion-<component>-<driver version>-<arch>.<sha256>.tar.zst
        manifest.json          kind "companion" (below), first member
        bin/, sbin/            the component's programs (nv-fabricmanager, nvswitch-audit, nvidia-imex, nvlsm), 0755
        lib/                   its libraries (libnvfm.so.1, libnvidia-nscq.so.<version>), each with its ELF soname
        etc/                   its configuration (fabricmanager.cfg, nvidia-imex/config.cfg)
        share/                 its data (share/nvidia/nvswitch/*_topology, share/nvidia/nvlsm/...)
        systemd/               its units as NVIDIA ships them (nvidia-fabricmanager.service, nvidia-imex.service)
        LICENSE, ...           NVIDIA's documents, at the top as in the archive

The layout is NVIDIA's redistributable archive's own (`fabricmanager-linux-x86_64-<version>-archive/bin/...`)
without its top directory and without include/ (headers: nothing on a node builds against them), so what an
installer finds under <root>/<component>/<version>/ is where NVIDIA's documentation says it is in the archive.
Symbolic links are never archive members (driverd.safetar refuses them in packages): NVIDIA's links
(lib/libnvfm.so -> libnvfm.so.1) are listed in `links` — relative, inside the tree, ending at a listed file —
and made by the installer.

manifest.json:
    {"schema": 1, "kind": "companion", "component": "fabricmanager", "component_version": "550.163.01",
     "driver": {"version": "550.163.01", "branch": "550"}, "arch": "x86_64",
     "files": [{"path": "bin/nv-fabricmanager", "size": ..., "mode": 493, "sha256": ...}, ...],
     "links": [{"path": "lib/libnvfm.so", "target": "libnvfm.so.1"}],
     "binaries": ["bin/nv-fabricmanager", ...], "libraries": [{"path": "lib/libnvfm.so.1", "soname": "libnvfm.so.1"}],
     "configs": ["etc/fabricmanager.cfg"], "share": [...], "units": ["systemd/nvidia-fabricmanager.service"],
     "docs": ["LICENSE", "third-party-notices.txt"],
     "provenance": {"source": "nvidia-redist", "archive": {"name", "sha256", "size"}, "builder": ...}}

`component_version` is the archive's own version: the driver's for fabric manager, nscq and IMEX; NVLSM is
versioned on its own (2025.03.9) and goes with the driver whose redistrib_<version>.json lists it. Every file is
0644 or 0755 (never setuid or setgid: the build refuses such an archive) and the lists (binaries, configs, ...)
say exactly which files are which: a manifest that says anything else is refused, at build and at install.
"""
from __future__ import annotations

import json
import posixpath
import re
from dataclasses import asdict, field
from typing import Any

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.package.manifest import MANIFEST_NAME, FileEntry, malformed, parse_json

KIND = "companion"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Component:
    """One companion component driverd packages from NVIDIA's per-driver-version redistributables."""
    name: str                  # driverd's name: fabricmanager | nscq | nvlsm | imex
    archives: tuple[str, ...]  # NVIDIA's archive (and redistrib key) names, the first the current one
    title: str
    own_version: bool = False  # versioned on its own, not by the driver's version (NVLSM)
    # its lib/ is loaded by other processes, so the loader must find it (NSCQ: nvidia-smi and DCGM dlopen
    # libnvidia-nscq.so.2); the others' libraries are their own programs' (libnvfm is the fabric manager's API
    # for its clients, which link it by path from the tree)
    loader: bool = False


# NVIDIA's per-version redistributables (the NVIDIA Driver Installation Guide, "Tarballs and Zip Archive
# Deliverables": <key>/linux-<platform>/<key>-linux-<platform>-<version>-archive.tar.xz, listed by
# redistrib_<driver version>.json). IMEX's archive is "nvidia_imex" there and "imex" in CUDA's own redist.
COMPONENTS: dict[str, Component] = {c.name: c for c in (
    Component("fabricmanager", ("fabricmanager",), "NVIDIA Fabric Manager"),
    Component("nscq", ("libnvidia_nscq",), "NVIDIA NSCQ library (libnvidia-nscq)", loader=True),
    Component("nvlsm", ("nvlsm",), "NVIDIA NVLink Subnet Manager", own_version=True),
    Component("imex", ("nvidia_imex", "imex"), "NVIDIA IMEX"),
)}
# NVIDIA's platform names -> the arch a node reports (os.uname().machine), which names the package
PLATFORMS = {"x86_64": "x86_64", "sbsa": "aarch64"}
ARCHES = tuple(PLATFORMS.values())

BIN_DIRS = ("bin", "sbin")
LIB_DIR = "lib"
CONFIG_DIR = "etc"
SHARE_DIR = "share"
UNIT_DIR = "systemd"
DIRS = (*BIN_DIRS, LIB_DIR, CONFIG_DIR, SHARE_DIR, UNIT_DIR)
FILE_MODES = (0o644, 0o755)
# Bounds: NVIDIA's largest companion (NVLSM) unpacks to tens of MB in a few dozen files; these leave room
# and stay inside what driverd.package.archive unpacks at all (MAX_MEMBERS, MAX_UNPACKED_BYTES).
MAX_FILES = 512
MAX_DEPTH = 8
MAX_FILE_BYTES = 512 << 20
MAX_TOTAL_BYTES = 1 << 30
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+@-]*$")
DRIVER_VERSION = re.compile(r"^\d+\.\d+(\.\d+)?$")
COMPONENT_VERSION = re.compile(r"^\d+(\.\d+)+$")
_MAX_LINK_HOPS = 8


def package_basename(component: str, driver_version: str, arch: str) -> str:
    return f"driverd-companion-{component}-{driver_version}-{arch}"


def safe_path(path: str) -> bool:
    """A relative path of plain names (no '', '.', '..', nothing absolute), at most MAX_DEPTH deep."""
    parts = path.split("/")
    return 0 < len(parts) <= MAX_DEPTH and all(_SAFE_NAME.match(p) for p in parts)


def in_layout(path: str) -> bool:
    """Whether a file (or link) at `path` belongs to the layout: under one of DIRS, or a document at the top."""
    if not safe_path(path) or path == MANIFEST_NAME:
        return False
    parts = path.split("/")
    return len(parts) == 1 or parts[0] in DIRS


def stem(name: str) -> str:
    """libnvidia-nscq.so.550.163.01 -> libnvidia-nscq"""
    i = name.find(".so")
    return name[:i] if i > 0 else name


def soname_problem(name: str, soname: str | None) -> str | None:
    """Why the library file `name` may not declare DT_SONAME `soname` (None: it may): a library answers only to
    its own name's sonames (libnvfm.so.1, libnvidia-nscq.so.2); one declaring another's (libz.so.1) would be
    handed to every process asking for that one once the loader's cache lists it."""
    if soname is None:
        return None
    if not _SAFE_NAME.match(soname):
        return f"{name} declares the soname {soname!r}, not a plain file name"
    if not re.fullmatch(re.escape(stem(name)) + r"\.so(\.[0-9A-Za-z_]+)*", soname):
        return f"{name} declares the soname {soname}, not one of {stem(name)}'s"
    return None


def resolve_link(path: str, links: dict[str, str]) -> str | None:
    """Follow manifest links from `path` to the path they end at (None: a loop, or out of the tree).
    Targets are relative to the link's directory, as the kernel reads them."""
    for _ in range(_MAX_LINK_HOPS + 1):
        if path not in links:
            return path
        path = inside(posixpath.dirname(path), links[path])
        if path is None:
            return None
    return None


def inside(directory: str, target: str) -> str | None:
    """The tree path a link in `directory` to `target` names; None when it leaves the tree (absolute, or
    climbing above the top) — what no companion package holds."""
    if not target or target.startswith("/"):
        return None
    joined = posixpath.normpath(posixpath.join(directory, target)) if directory else posixpath.normpath(target)
    if joined in (".", "..") or joined.startswith("../"):
        return None
    return joined


@dataclass(frozen=True)
class Link:
    """A symbolic link in a companion package's tree, pointing inside the tree."""
    path: str            # lib/libnvfm.so
    target: str          # libnvfm.so.1: relative to the link's directory, staying in the tree


@dataclass(frozen=True)
class Library:
    """A shared library in a companion package, with the soname it declares."""
    path: str            # lib/libnvfm.so.1
    soname: str | None   # its ELF DT_SONAME; None: it declares none


@dataclass(frozen=True)
class Source:
    """The NVIDIA redistributable archive a companion package was built from."""
    name: str            # fabricmanager-linux-x86_64-550.163.01-archive.tar.xz
    sha256: str
    size: int


@dataclass(frozen=True)
class Provenance:
    """Where a companion package came from and what built it."""
    source: str = "nvidia-redist"
    archive: Source | None = None
    builder: str | None = None


@dataclass(frozen=True)
class CompanionManifest:
    """The manifest of a companion package: one component of one driver version for one arch."""
    component: str
    component_version: str
    driver_version: str
    arch: str
    files: tuple[FileEntry, ...]
    links: tuple[Link, ...] = ()
    binaries: tuple[str, ...] = ()
    libraries: tuple[Library, ...] = ()
    configs: tuple[str, ...] = ()
    share: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    docs: tuple[str, ...] = ()
    provenance: Provenance = field(default_factory=Provenance)
    schema: int = SCHEMA_VERSION
    kind: str = KIND

    @property
    def branch(self) -> str:
        return self.driver_version.split(".", 1)[0]

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def library(self, soname: str) -> Library | None:
        return next((lib for lib in self.libraries if lib.soname == soname), None)

    def basename(self) -> str:
        return package_basename(self.component, self.driver_version, self.arch)

    def archive_dirs(self) -> list[str]:
        """Every directory of the archive, parents first (the tar's directory members)."""
        out: set[str] = set()
        for f in self.files:
            parts = f.path.split("/")[:-1]
            out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        return sorted(out)

    def to_json(self) -> dict[str, Any]:
        p = self.provenance
        return {
            "schema": self.schema, "kind": self.kind, "component": self.component,
            "component_version": self.component_version,
            "driver": {"version": self.driver_version, "branch": self.branch}, "arch": self.arch,
            "files": [asdict(f) for f in self.files],
            "links": [asdict(ln) for ln in self.links],
            "binaries": list(self.binaries), "libraries": [asdict(lib) for lib in self.libraries],
            "configs": list(self.configs), "share": list(self.share), "units": list(self.units),
            "docs": list(self.docs),
            "provenance": {"source": p.source, "archive": asdict(p.archive) if p.archive else None,
                           "builder": p.builder},
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any, where: str = "manifest") -> "CompanionManifest":
        try:
            if not isinstance(d, dict):
                raise TypeError("not an object")
            if d.get("kind") != KIND:
                raise PackageError(f"{where} is not a companion package's manifest (kind {d.get('kind')!r})",
                                   cause="kernel-module and user-space packages hold no fabric manager, nscq, NVLSM "
                                         "or IMEX",
                                   fix="pass a driverd-companion-<component>-<version>-<arch> package here "
                                       "(driverd build-companion)")
            schema = int(d.get("schema", 0))
            if schema != SCHEMA_VERSION:
                raise PackageError(f"{where}: unsupported companion manifest schema {schema}",
                                   cause=f"this driverd reads schema {SCHEMA_VERSION}",
                                   fix="rebuild the package with this driverd or upgrade driverd")
            prov = d.get("provenance") or {}
            src = prov.get("archive")

            def names(key: str) -> tuple[str, ...]:
                return tuple(str(x) for x in d.get(key) or ())
            m = cls(
                component=str(d["component"]), component_version=str(d["component_version"]),
                driver_version=str(d["driver"]["version"]), arch=str(d["arch"]),
                files=tuple(FileEntry(str(f["path"]), int(f["size"]), int(f["mode"]), str(f["sha256"]))
                            for f in d["files"]),
                links=tuple(Link(str(x["path"]), str(x["target"])) for x in d.get("links") or ()),
                binaries=names("binaries"),
                libraries=tuple(Library(str(x["path"]), None if x.get("soname") is None else str(x["soname"]))
                                for x in d.get("libraries") or ()),
                configs=names("configs"), share=names("share"), units=names("units"), docs=names("docs"),
                provenance=Provenance(
                    source=str(prov.get("source") or ""),
                    archive=Source(str(src["name"]), str(src["sha256"]), int(src["size"])) if src else None,
                    builder=prov.get("builder")),
                schema=schema)
        except PackageError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise malformed(where, e) from None
        m.validate(where)
        return m

    @classmethod
    def loads(cls, data: bytes | str, where: str = "manifest") -> "CompanionManifest":
        return cls.from_json(parse_json(data, where), where)

    def validate(self, where: str = "manifest") -> None:
        """A known component and versions; every path a plain relative one in the layout; modes 0644/0755;
        bounded sizes; the lists exactly the files of their directories; every link inside the tree, ending at
        a listed file; every library's soname its own."""
        def bad(msg: str) -> PackageError:
            return PackageError(f"{where}: {msg}", cause="the companion manifest is inconsistent",
                                fix="rebuild the package with `driverd build-companion`")
        comp = COMPONENTS.get(self.component)
        if comp is None:
            raise bad(f"unknown component {self.component!r} (driverd knows {', '.join(COMPONENTS)})")
        if not DRIVER_VERSION.match(self.driver_version):
            raise bad(f"driver version {self.driver_version!r} is not a version like 550.163.01")
        if not COMPONENT_VERSION.match(self.component_version):
            raise bad(f"component version {self.component_version!r} is not a version")
        if not comp.own_version and self.component_version != self.driver_version:
            raise bad(f"{self.component} {self.component_version} is not driver {self.driver_version}'s: it must be "
                      "exactly the driver's version")
        if self.arch not in ARCHES:
            raise bad(f"arch {self.arch!r} is not one of {', '.join(ARCHES)}")
        if len(self.files) > MAX_FILES:
            raise bad(f"{len(self.files)} files (at most {MAX_FILES})")
        files: dict[str, FileEntry] = {}
        total = 0
        for f in self.files:
            if not in_layout(f.path):
                raise bad(f"file path {f.path!r} is outside the companion layout ({', '.join(d + '/' for d in DIRS)} "
                          "and documents at the top)")
            if f.path in files:
                raise bad(f"file {f.path} is listed twice")
            if not re.fullmatch(r"[0-9a-f]{64}", f.sha256) or not 0 <= f.size <= MAX_FILE_BYTES:
                raise bad(f"file {f.path} has an invalid size or sha256")
            if f.mode not in FILE_MODES:
                raise bad(f"file {f.path} has mode {f.mode:04o}; a companion package holds 0644 and 0755 only")
            total += f.size
            files[f.path] = f
        if total > MAX_TOTAL_BYTES:
            raise bad(f"its files hold {total} bytes (at most {MAX_TOTAL_BYTES})")
        dirs = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}

        def top(path: str) -> str:
            return path.split("/")[0] if "/" in path else ""
        expected = {
            "binaries": sorted(p for p, f in files.items() if top(p) in BIN_DIRS and f.mode == 0o755),
            "configs": sorted(p for p in files if top(p) == CONFIG_DIR),
            "share": sorted(p for p in files if top(p) == SHARE_DIR),
            "units": sorted(p for p in files if top(p) == UNIT_DIR),
            "docs": sorted(p for p in files if "/" not in p),
        }
        for key, want in expected.items():
            got = list(getattr(self, key))
            if sorted(got) != want or len(set(got)) != len(got):
                diff = sorted(set(got) ^ set(want)) or [x for x in got if got.count(x) > 1]
                raise bad(f"its {key} list disagrees with its files at {diff[0]} (each of those files listed once, "
                          "nothing else)")
        libs: set[str] = set()
        for lib in self.libraries:
            if lib.path not in files or top(lib.path) != LIB_DIR:
                raise bad(f"library {lib.path} is not a listed file under {LIB_DIR}/")
            if lib.path in libs:
                raise bad(f"library {lib.path} is listed twice")
            why = soname_problem(lib.path.rpartition("/")[2], lib.soname)
            if why:
                raise bad(why)
            libs.add(lib.path)
        links: dict[str, str] = {}
        for ln in self.links:
            if not in_layout(ln.path):
                raise bad(f"link {ln.path!r} is outside the companion layout")
            if ln.path in files or ln.path in links or ln.path in dirs:
                raise bad(f"link {ln.path} collides with a file, a directory or another link")
            if inside(posixpath.dirname(ln.path), ln.target) is None:
                raise bad(f"link {ln.path} -> {ln.target} points out of the tree")
            links[ln.path] = ln.target
        for ln in self.links:
            end = resolve_link(ln.path, links)
            if end is None or end not in files:
                raise bad(f"link {ln.path} -> {ln.target} does not end at a listed file of the package")


def member_ok(rel: str, is_dir: bool) -> bool:
    """Whether an archive member may be in a companion package (before its manifest is read)."""
    if rel == "":
        return is_dir
    if not safe_path(rel):
        return False
    if is_dir:
        return rel.split("/")[0] in DIRS
    return rel == MANIFEST_NAME or in_layout(rel)


def is_companion_json(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == KIND
