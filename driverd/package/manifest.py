"""The package manifest: what a package claims to hold, checked against what it actually holds.

One package = one (driver version, flavour, kernel release, arch). The manifest is `manifest.json`
at the top of the archive and is copied next to the installed modules, where the host fact reader
(driverd/host/modules.py) reads `driver.version`, `flavor` and `kernel.release` — keep those keys.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, field
from typing import Any

from driverd import package
from driverd.datatypes import dataclass
from driverd.errors import PackageError

SCHEMA_VERSION = 1
MANIFEST_NAME = package.MANIFEST_NAME
MODULES_DIR = "modules"        # archive dir -> <root>/lib/modules/<release>/updates/driverd/
FIRMWARE_DIR = "firmware"      # archive dir -> <root>/lib/firmware/nvidia/<version>/
FLAVORS = ("open", "proprietary")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class FileEntry:
    """One file of a package archive, as its manifest records it."""
    path: str          # relative to the archive root, e.g. modules/nvidia.ko
    size: int
    mode: int          # permission bits only, e.g. 0o644
    sha256: str


@dataclass(frozen=True)
class ModuleInfo:
    """The modinfo fields that decide whether a module fits a kernel, as `modinfo` printed them."""
    name: str
    path: str
    version: str | None = None
    vermagic: str | None = None
    srcversion: str | None = None
    depends: tuple[str, ...] = ()
    signer: str | None = None
    sig_key: str | None = None
    sig_hashalgo: str | None = None
    firmware: tuple[str, ...] = ()

    @property
    def signed(self) -> bool:
        return bool(self.signer or self.sig_key)


@dataclass(frozen=True)
class Provenance:
    """Where a kernel-module package's modules came from: their source, compiler and build."""
    source_sha256: str | None = None
    source: str | None = None
    compiler: str | None = None
    built_at: str | None = None
    builder: str | None = None


@dataclass(frozen=True)
class Manifest:
    """The manifest of a kernel-module package: one driver version and flavour for one kernel release and arch."""
    driver_version: str
    flavor: str
    kernel_release: str
    vermagic: str
    arch: str
    files: tuple[FileEntry, ...]
    modules: tuple[ModuleInfo, ...]
    provenance: Provenance = field(default_factory=Provenance)
    schema: int = SCHEMA_VERSION

    @property
    def branch(self) -> str:
        return self.driver_version.split(".", 1)[0]

    @property
    def signed(self) -> bool:
        return bool(self.modules) and all(m.signed for m in self.modules)

    @property
    def firmware_files(self) -> tuple[FileEntry, ...]:
        return tuple(f for f in self.files if f.path.startswith(FIRMWARE_DIR + "/"))

    @property
    def module_files(self) -> tuple[FileEntry, ...]:
        return tuple(f for f in self.files if f.path.startswith(MODULES_DIR + "/"))

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def basename(self) -> str:
        return package_basename(self.driver_version, self.flavor, self.kernel_release, self.arch)

    def archive_dirs(self) -> list[str]:
        """The archive's directory members, in the order driverd has always written them."""
        return [d for d in (MODULES_DIR, FIRMWARE_DIR) if any(f.path.startswith(d + "/") for f in self.files)]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "driver": {"version": self.driver_version, "branch": self.branch},
            "flavor": self.flavor,
            "kernel": {"release": self.kernel_release, "vermagic": self.vermagic},
            "arch": self.arch,
            "files": [asdict(f) for f in self.files],
            "modules": [{**asdict(m), "depends": list(m.depends), "firmware": list(m.firmware)}
                        for m in self.modules],
            "provenance": asdict(self.provenance),
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any, where: str = "manifest") -> "Manifest":
        try:
            if not isinstance(d, dict):
                raise TypeError("not an object")
            if d.get("kind") not in (None, "kernel"):
                raise PackageError(f"{where} is a {d.get('kind')} package's manifest, not a kernel-module package's",
                                   cause="user-space and companion packages (driverd-userspace-*, "
                                         "driverd-companion-*) hold no kernel modules",
                                   fix="pass a driverd-<version>-<flavor>-<release>-<arch> package here; a "
                                       "user-space or companion package is installed by its own install")
            schema = int(d.get("schema", 0))
            if schema != SCHEMA_VERSION:
                raise PackageError(f"{where}: unsupported manifest schema {schema}",
                                   cause=f"this driverd reads schema {SCHEMA_VERSION}",
                                   fix="rebuild the package with this driverd or upgrade driverd")
            m = cls(
                driver_version=str(d["driver"]["version"]), flavor=str(d["flavor"]),
                kernel_release=str(d["kernel"]["release"]), vermagic=str(d["kernel"]["vermagic"]),
                arch=str(d["arch"]),
                files=tuple(FileEntry(str(f["path"]), int(f["size"]), int(f["mode"]), str(f["sha256"]))
                            for f in d["files"]),
                modules=tuple(ModuleInfo(name=str(x["name"]), path=str(x["path"]), version=x.get("version"),
                                         vermagic=x.get("vermagic"), srcversion=x.get("srcversion"),
                                         depends=tuple(x.get("depends") or ()), signer=x.get("signer"),
                                         sig_key=x.get("sig_key"), sig_hashalgo=x.get("sig_hashalgo"),
                                         firmware=tuple(x.get("firmware") or ()))
                              for x in d["modules"]),
                provenance=Provenance(**{k: v for k, v in (d.get("provenance") or {}).items()
                                         if k in Provenance.__dataclass_fields__}),
                schema=schema)
        except PackageError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise malformed(where, e) from None
        m.validate(where)
        return m

    @classmethod
    def loads(cls, data: bytes | str, where: str = "manifest") -> "Manifest":
        return cls.from_json(parse_json(data, where), where)

    def validate(self, where: str = "manifest") -> None:
        """Internal consistency: names safe for paths, every module backed by a listed file."""
        def bad(msg: str) -> PackageError:
            return PackageError(f"{where}: {msg}", cause="the manifest is inconsistent",
                                fix="rebuild the package with `driverd build`")
        if self.flavor not in FLAVORS:
            raise bad(f"flavor {self.flavor!r} is not one of {', '.join(FLAVORS)}")
        for label, v in (("driver version", self.driver_version), ("kernel release", self.kernel_release),
                         ("arch", self.arch)):
            if not _SAFE_NAME.match(v):
                raise bad(f"{label} {v!r} is not a plain name")
        seen: set[str] = set()
        for f in self.files:
            parts = f.path.split("/")
            if (len(parts) != 2 or parts[0] not in (MODULES_DIR, FIRMWARE_DIR) or not _SAFE_NAME.match(parts[1])):
                raise bad(f"file path {f.path!r} is not modules/<name> or firmware/<name>")
            if f.path in seen:
                raise bad(f"file {f.path} is listed twice")
            if not re.fullmatch(r"[0-9a-f]{64}", f.sha256) or f.size < 0 or f.mode & ~0o777:
                raise bad(f"file {f.path} has an invalid size, mode or sha256")
            seen.add(f.path)
        for mod in self.modules:
            if mod.path not in seen:
                raise bad(f"module {mod.name} names {mod.path}, which the file list lacks")
        if not self.modules:
            raise bad("no kernel modules")


def package_basename(driver_version: str, flavor: str, kernel_release: str, arch: str) -> str:
    return f"driverd-{driver_version}-{flavor}-{kernel_release}-{arch}"


def parse_json(data: bytes | str, where: str) -> object:
    """A manifest's JSON (kernel-module and user-space packages alike); damaged: one PackageError."""
    try:
        return json.loads(data)
    except ValueError as e:
        raise PackageError(f"{where} is not JSON ({e})", cause="the package is damaged",
                           fix="rebuild or re-fetch the package") from None


def malformed(where: str, e: BaseException) -> PackageError:
    return PackageError(f"{where} is malformed ({e.__class__.__name__}: {e})",
                        cause="the package was not written by driverd or is damaged", fix="rebuild or re-fetch the package")
