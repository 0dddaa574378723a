"""Building a companion package (driverd.package.companion) from NVIDIA's per-version redistributable archive.

NVIDIA publishes fabric manager, libnvidia-nscq, NVLSM and IMEX per driver version as binary archives beside
a JSON manifest — the NVIDIA Driver Installation Guide, "Tarballs and Zip Archive Deliverables"; the format as
NVIDIA's own sample parser reads it (NVIDIA/build-system-archive-import-examples, parse_redist.py):

    <key>-linux-<platform>-<version>-archive.tar.xz      key: fabricmanager | libnvidia_nscq | nvlsm | nvidia_imex
        <key>-linux-<platform>-<version>-archive/        one top directory named after the archive
            bin/ sbin/ lib/ etc/ share/ systemd/ include/ LICENSE third-party-notices.txt ...
    redistrib_<driver version>.json
        {"release_date": "...", "release_label": "<driver version>", "release_product": "nvidia-driver",
         "<key>": {"name": "...", "license": "...", "license_path": "...", "version": "<version>",
                   "linux-x86_64": {"relative_path": "<key>/linux-x86_64/<archive>", "sha256": "...",
                                    "md5": "...", "size": "<bytes>"},
                   "linux-sbsa": {...}}, ...}

The platforms are linux-x86_64 and linux-sbsa (Arm servers: the package's arch is aarch64, what a node's
uname says). The archive's version is the driver's for fabric manager, nscq and IMEX; NVLSM has its own
(2025.03.9), so its driver version comes from the JSON that lists it (release_label) or from --driver.

With the JSON, the archive's size and sha256 are checked against its entry before a byte of it is
decompressed. Every member is then checked while it is read (driverd.safetar: no absolute names, no `..`,
no hard links or devices; links only inside the top directory; no setuid or setgid file; bounded sizes) into
a private staging directory; the output directory sees the finished package only, renamed into place
(driverd.package.archive.pack). Modes become 0755 (executable) or 0644; NVIDIA's links are listed in the
manifest, not packed. The manifest carries no build time and nothing of the JSON: the same archive gives the
same package, byte for byte, with or without it.
"""
from __future__ import annotations

import lzma
import os
import posixpath
import re
import tarfile
import tempfile
from dataclasses import field
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.driver.files import elf_soname
from driverd.errors import PackageError
from driverd.package import companion as cp
from driverd.package.archive import PackageRef, file_entry, pack, sha256_file
from driverd.safetar import UnsafeMember, check_member

MAX_ARCHIVE_BYTES = 2 << 30        # NVIDIA's largest of these archives is tens of MB
MAX_ARCHIVE_MEMBERS = 20000
MAX_REDISTRIB_BYTES = 4 << 20      # a redistrib JSON lists a few dozen components
_ARCHIVE = re.compile(r"^(?P<key>[A-Za-z0-9_]+)-linux-(?P<platform>[A-Za-z0-9_]+)-(?P<version>[0-9][0-9.]*[0-9])"
                      r"-archive\.tar\.xz$")
_CHUNK = 1 << 20
# Parts of NVIDIA's archives a node does not run, and why (said in the build's notes).
LEFT_OUT = {"include": "headers: nothing on a node builds against them"}


def _refuse(where: str, why: str, fix: str, cause: str | None = None) -> PackageError:
    return PackageError(f"{where}: {why}", cause=cause, fix=fix)


@dataclass(frozen=True)
class ArchiveName:
    """What an archive's file name says: NVIDIA's key, platform and the component's version."""
    key: str                 # fabricmanager | libnvidia_nscq | nvlsm | nvidia_imex
    platform: str            # x86_64 | sbsa
    version: str
    component: cp.Component

    @property
    def file_name(self) -> str:
        return f"{self.top}.tar.xz"

    @property
    def top(self) -> str:
        return f"{self.key}-linux-{self.platform}-{self.version}-archive"

    @property
    def arch(self) -> str:
        return cp.PLATFORMS[self.platform]


def parse_archive_name(name: str) -> ArchiveName:
    """The component, platform and version NVIDIA's archive name carries; anything else is refused."""
    m = _ARCHIVE.match(name)
    keys = {k: c for c in cp.COMPONENTS.values() for k in c.archives}
    fix = ("pass one of NVIDIA's redistributable archives, by its own name: " +
           ", ".join(f"{c.archives[0]}-linux-<x86_64|sbsa>-<version>-archive.tar.xz" for c in cp.COMPONENTS.values()))
    if m is None:
        raise _refuse(name, "not the name of one of NVIDIA's redistributable archives "
                      "(<component>-linux-<platform>-<version>-archive.tar.xz)", fix)
    if m.group("key") not in keys:
        raise _refuse(name, f"unknown component {m.group('key')!r} (driverd builds companion packages of "
                      f"{', '.join(sorted(keys))})", fix, cause="only fabric manager, nscq, NVLSM and IMEX must match "
                      "the driver's version")
    if m.group("platform") not in cp.PLATFORMS:
        raise _refuse(name, f"unknown platform linux-{m.group('platform')} (NVIDIA publishes these for "
                      f"{', '.join('linux-' + p for p in cp.PLATFORMS)})", fix)
    return ArchiveName(m.group("key"), m.group("platform"), m.group("version"), keys[m.group("key")])


@dataclass(frozen=True)
class RedistEntry:
    """One archive's entry in NVIDIA's redistrib_<version>.json."""
    json_name: str           # redistrib_550.163.01.json (for messages)
    release_label: str | None
    release_product: str | None
    key: str
    version: str
    relative_path: str
    sha256: str
    size: int | None


def redistrib_entry(path: str | os.PathLike, archive: ArchiveName) -> RedistEntry:
    """The JSON's entry for `archive` (its key and platform, whose relative_path names this file)."""
    import json
    where = os.path.basename(os.fspath(path))
    fix = f"pass the redistrib_<version>.json NVIDIA publishes beside {archive.file_name}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_REDISTRIB_BYTES + 1)
    except OSError as e:
        raise _refuse(where, f"cannot be read ({e.strerror})", fix) from None
    if len(data) > MAX_REDISTRIB_BYTES:
        raise _refuse(where, f"is larger than {MAX_REDISTRIB_BYTES >> 20} MiB: not a redistrib JSON", fix)
    try:
        d = json.loads(data)
    except ValueError as e:
        raise _refuse(where, f"is not JSON ({' '.join(str(e).split())[:120]})", fix) from None
    if not isinstance(d, dict):
        raise _refuse(where, "is not a redistrib JSON (not an object)", fix)
    plat = f"linux-{archive.platform}"
    for key in (archive.key, *(k for k in d if k != archive.key)):
        comp = d.get(key)
        entry = comp.get(plat) if isinstance(comp, dict) else None
        if not isinstance(entry, dict) or posixpath.basename(str(entry.get("relative_path", ""))) != archive.file_name:
            continue
        sha, size = entry.get("sha256"), entry.get("size")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise _refuse(where, f"its {key} {plat} entry has no sha256", fix)
        try:
            n = None if size is None else int(size)       # NVIDIA writes the size as a string
        except (TypeError, ValueError, OverflowError):
            raise _refuse(where, f"its {key} {plat} entry has the size {size!r}, not a number", fix) from None
        label, product = d.get("release_label"), d.get("release_product")
        return RedistEntry(where, label if isinstance(label, str) else None,
                           product if isinstance(product, str) else None, key, str(comp.get("version", "")),
                           str(entry["relative_path"]), sha, n)
    raise _refuse(archive.file_name, f"{where} does not list it (no {archive.key} {plat} entry with this file name)",
                  fix, cause="the JSON is of another release, or the archive was renamed")


def check_archive(path: Path, entry: RedistEntry | None) -> tuple[str, int]:
    """The archive's sha256 and size — checked against the JSON's entry (size first, then sha256) before
    anything is decompressed."""
    size = path.stat().st_size
    if size > MAX_ARCHIVE_BYTES:
        raise _refuse(path.name, f"is {size} bytes, more than any of NVIDIA's companion archives "
                      f"({MAX_ARCHIVE_BYTES >> 20} MiB)", "check the file")
    fix = f"download {path.name} again (NVIDIA's redistrib JSON names its size and sha256)"
    if entry is not None and entry.size is not None and size != entry.size:
        raise _refuse(path.name, f"is {size} bytes, {entry.json_name} says {entry.size}", fix,
                      cause="the download is truncated or is not NVIDIA's")
    sha = sha256_file(path)
    if entry is not None and sha != entry.sha256:
        raise _refuse(path.name, f"has sha256 {sha}, {entry.json_name} says {entry.sha256}", fix,
                      cause="the download is damaged or is not NVIDIA's")
    return sha, size


def driver_version(name: ArchiveName, entry: RedistEntry | None, driver: str | None) -> str:
    """The driver version the companion goes with: the archive's own (nvlsm: the JSON's release or --driver),
    equal to `driver` when that is given."""
    fix = f"pass the {name.component.name} archive of the driver version you build for"
    if entry is not None and entry.version and entry.version != name.version:
        raise _refuse(name.file_name, f"{entry.json_name} lists version {entry.version} for it, its name says "
                      f"{name.version}", "pass the archive and the JSON NVIDIA published together")
    if not name.component.own_version:
        if driver is not None and driver != name.version:
            raise _refuse(name.file_name, f"is {name.component.name} {name.version}, not driver {driver}'s", fix,
                          cause=f"{name.component.name} must be exactly the loaded driver's version")
        return name.version
    label = entry.release_label if entry is not None and entry.release_product in (None, "nvidia-driver") else None
    if label is not None and not cp.DRIVER_VERSION.match(label):
        label = None
    if driver is not None and label is not None and driver != label:
        raise _refuse(name.file_name, f"is listed by {entry.json_name if entry else ''} of driver {label}, not {driver}",
                      f"pass redistrib_{driver}.json, or --driver {label}")
    got = driver or label
    if got is None:
        raise _refuse(name.file_name, f"{name.component.name} is versioned on its own ({name.version}): the driver "
                      "version it goes with is not in its name",
                      "pass --redistrib redistrib_<driver version>.json (the JSON that lists it) or --driver VERSION")
    return got


@dataclass
class BuildResult:
    """A companion package just built from NVIDIA's redistributable archive, with its manifest."""
    ref: PackageRef
    manifest: cp.CompanionManifest
    redistrib: str | None = None           # the JSON the archive was checked against
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        m = self.manifest
        return {"package": str(self.ref.path), "sha256": self.ref.sha256, "size": self.ref.size, "kind": cp.KIND,
                "component": m.component, "component_version": m.component_version, "driver": m.driver_version,
                "arch": m.arch, "files": len(m.files), "unpacked_bytes": sum(f.size for f in m.files),
                "binaries": list(m.binaries), "libraries": {lib.path: lib.soname for lib in m.libraries},
                "configs": list(m.configs), "share": len(m.share), "units": list(m.units), "docs": list(m.docs),
                "links": {ln.path: ln.target for ln in m.links},
                "archive": m.provenance.archive.name if m.provenance.archive else None,
                "checked_against": self.redistrib, "notes": list(self.notes)}


@dataclass
class _Read:
    """What the archive holds under its top directory: files written to the staging tree, links, directories."""
    files: dict[str, int] = field(default_factory=dict)         # path -> mode (0644/0755)
    links: dict[str, str] = field(default_factory=dict)         # path -> target
    dirs: set[str] = field(default_factory=set)


def _read_archive(path: Path, name: ArchiveName, stage: Path) -> _Read:
    where = path.name
    fix = f"download {where} again from NVIDIA (its redistrib JSON names its sha256): this one is damaged or not NVIDIA's"
    out = _Read()
    members = total = 0
    try:
        with tarfile.open(path, mode="r|xz") as tar:
            for ti in tar:
                members += 1
                if members > MAX_ARCHIVE_MEMBERS:
                    raise _refuse(where, f"has more than {MAX_ARCHIVE_MEMBERS} members", fix)
                if ti.issym():
                    # the link's own check first, against the top directory (safetar's is against the archive's
                    # root): a link may not lead out of the tree the package is made of
                    parts = [p for p in ti.name.split("/") if p not in ("", ".")]
                    if ".." not in parts and not ti.name.startswith("/") and \
                            cp.inside("/".join(parts[1:-1]), ti.linkname) is None:
                        raise _refuse(where, f"link {'/'.join(parts[1:]) or ti.name} -> {ti.linkname} points out of "
                                      "the tree", fix, cause="a companion package's links stay inside it")
                try:
                    rel = check_member(ti, links="inside")
                except UnsafeMember as e:
                    raise _refuse(where, str(e), fix) from None
                if rel != name.top and not rel.startswith(name.top + "/"):
                    raise _refuse(where, f"member {ti.name!r} is outside its top directory {name.top}/", fix,
                                  cause="NVIDIA's archives hold one directory named after the archive")
                inner = rel[len(name.top) + 1:]
                if not inner:
                    if not ti.isdir():
                        raise _refuse(where, f"its top directory {name.top} is not a directory", fix)
                    continue
                if not cp.safe_path(inner):
                    raise _refuse(where, f"member {ti.name!r} is not a path of plain names", fix)
                if inner in out.files or inner in out.links:
                    raise _refuse(where, f"member {inner!r} appears twice", fix)
                if ti.isdir():
                    out.dirs.add(inner)
                elif ti.issym():
                    out.links[inner] = ti.linkname
                else:
                    if ti.mode & 0o6000:
                        raise _refuse(where, f"{inner} is setuid or setgid (mode {ti.mode & 0o7777:04o})",
                                      "use NVIDIA's archive as published: a companion package never carries a "
                                      "set-id file", cause="driverd runs what it installs as root")
                    if ti.size > cp.MAX_FILE_BYTES:
                        raise _refuse(where, f"{inner} is {ti.size} bytes (at most {cp.MAX_FILE_BYTES})", fix)
                    total += ti.size
                    if total > cp.MAX_TOTAL_BYTES:
                        raise _refuse(where, f"it unpacks to more than {cp.MAX_TOTAL_BYTES} bytes (at {inner})", fix)
                    dest = stage / inner
                    src = tar.extractfile(ti)
                    assert src is not None
                    try:
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        with open(dest, "xb") as f:
                            while chunk := src.read(_CHUNK):
                                f.write(chunk)
                    except (FileExistsError, NotADirectoryError, IsADirectoryError):
                        raise _refuse(where, f"member {inner!r} collides with another member's path", fix) from None
                    if dest.stat().st_size != ti.size:
                        raise _refuse(where, f"{inner} is shorter than its header says", fix)
                    out.files[inner] = 0o755 if ti.mode & 0o111 else 0o644
                    os.chmod(dest, out.files[inner])
    except PackageError:
        raise
    except (tarfile.TarError, lzma.LZMAError, EOFError, ValueError, UnicodeError, OverflowError) as e:
        raise _refuse(where, f"is truncated or corrupt ({' '.join(str(e).split())[:200]})", fix) from None
    if members == 0:
        raise _refuse(where, "is empty", fix)
    return out


def _select(read: _Read, where: str, notes: list[str]) -> tuple[list[str], dict[str, str]]:
    """The files and links of the companion layout; the rest left out with a note. A link that leaves the
    tree was refused while reading; one that ends at nothing (or a directory) is refused here."""
    keep = sorted(p for p in read.files if cp.in_layout(p))
    left: dict[str, int] = {}
    for p in read.files:
        if not cp.in_layout(p):
            left[p.split("/")[0]] = left.get(p.split("/")[0], 0) + 1
    for d, n in sorted(left.items()):
        why = LEFT_OUT.get(d, f"not part of a companion package ({', '.join(x + '/' for x in cp.DIRS)}, documents)")
        notes.append(f"left out {d}/ ({n} file{'s' * (n != 1)}): {why}")
    kept = set(keep)
    links: dict[str, str] = {}
    fix = "use NVIDIA's archive as published"
    for p, target in sorted(read.links.items()):
        end = cp.resolve_link(p, read.links)
        if end is None:
            raise _refuse(where, f"link {p} -> {target} loops or leaves the tree", fix)
        if end in read.dirs or any(f.startswith(end + "/") for f in read.files):
            raise _refuse(where, f"link {p} -> {target} ends at the directory {end}/", fix,
                          cause="a companion package's links name files")
        if end not in read.files:
            raise _refuse(where, f"link {p} -> {target} ends at nothing in the archive", fix)
        if not cp.in_layout(p):
            continue                                        # with the rest of its directory
        if end not in kept:
            notes.append(f"left out the link {p} -> {target}: {end} is not in the package")
            continue
        links[p] = target
    return keep, links


def build_from_archive(archive: str | os.PathLike, out: str | os.PathLike, *, redistrib: str | os.PathLike | None = None,
                       driver: str | None = None, level: int | None = None) -> BuildResult:
    """A companion package from NVIDIA's archive `archive` (module docstring) into `out`; checked against the
    redistrib JSON `redistrib` when given, for driver `driver` when given. Any refusal leaves `out` untouched."""
    path = Path(archive)
    if not path.is_file():
        raise PackageError(f"{path} is not a file", fix="pass NVIDIA's <component>-linux-<platform>-<version>-archive"
                           ".tar.xz")
    name = parse_archive_name(path.name)
    if driver is not None and not cp.DRIVER_VERSION.match(driver):
        raise _refuse(path.name, f"--driver {driver!r} is not a driver version like 550.163.01",
                      "pass the driver version the companion goes with")
    entry = redistrib_entry(redistrib, name) if redistrib is not None else None
    sha, size = check_archive(path, entry)
    version = driver_version(name, entry, driver)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="driverd-companion.") as t:
        stage = Path(t) / "stage"
        stage.mkdir()
        read = _read_archive(path, name, stage)
        keep, links = _select(read, path.name, notes)
        libraries = []
        for p in keep:
            if p.split("/")[0] != cp.LIB_DIR or "/" not in p:
                continue
            with open(stage / p, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    continue                                # a plain file under lib/ (data), not a library
            soname = elf_soname(str(stage / p))
            why = cp.soname_problem(p.rpartition("/")[2], soname)
            if why:
                raise _refuse(path.name, why, "use NVIDIA's archive as published: this one is damaged or not NVIDIA's",
                              cause="the loader would give it to every process asking for that soname")
            libraries.append(cp.Library(p, soname))
        if not keep:
            raise _refuse(path.name, "holds nothing of a companion package", "check the archive")
        files = tuple(file_entry(stage / p, p) for p in keep)

        def under(*tops: str, mode: int | None = None) -> tuple[str, ...]:
            return tuple(f.path for f in files if "/" in f.path and f.path.split("/")[0] in tops
                         and (mode is None or f.mode == mode))
        m = cp.CompanionManifest(
            component=name.component.name, component_version=name.version, driver_version=version, arch=name.arch,
            files=files, links=tuple(cp.Link(p, t) for p, t in sorted(links.items())),
            binaries=under(*cp.BIN_DIRS, mode=0o755), libraries=tuple(libraries), configs=under(cp.CONFIG_DIR),
            share=under(cp.SHARE_DIR), units=under(cp.UNIT_DIR), docs=tuple(f.path for f in files if "/" not in f.path),
            provenance=cp.Provenance("nvidia-redist", cp.Source(path.name, sha, size), _builder()))
        m.validate(path.name)
        ref = pack(stage, m, out, **({"level": level} if level is not None else {}))
    return BuildResult(ref, m, entry.json_name if entry else None, notes)


def _builder() -> str:
    try:
        from importlib.metadata import version
        return f"driverd {version('driverd')}"
    except Exception:   # noqa: BLE001 - an uninstalled tree
        return "driverd"
