"""Building a user-space package (driverd.package.userspace) from the sources that exist.

- **Debian's packages** (`build_from_debs`): a directory of the .debs of one driver version (libcuda1,
  libnvidia-ml1, nvidia-smi, nvidia-persistenced, libnvidia-ptxjitcompiler1, firmware-nvidia-gsp, ...).
  Each .deb is read here (an `ar` archive: control.tar.*, data.tar.*; no dpkg needed on the build host)
  and its members are taken by where Debian puts them: the libraries in /usr/lib/<triplet>/nvidia/current/
  and /usr/lib/<triplet>/ (eglcore, glcore, ...), VDPAU in /usr/lib/<triplet>/vdpau/, the binaries in
  /usr/bin, /usr/sbin and /usr/lib/nvidia/current/ (nvidia-smi sits behind Debian's alternatives), the
  GSP firmware in /lib/firmware/nvidia/<version>/ (bookworm) or /usr/lib/firmware/... (sid), the ICD
  files in /usr/share/{glvnd/egl_vendor.d,vulkan/icd.d,vulkan/implicit_layer.d}. Everything else (docs,
  init scripts, units, lintian overrides) is left out.
- **NVIDIA's .run installer** (`build_from_run_dir`): the directory `sh NVIDIA-Linux-<arch>-<version>.run
  --extract-only` makes. NVIDIA's driver README (published per version next to the installer) documents
  it: chapter "Installing the NVIDIA Driver" (README/installdriver.html: the .run is a self-extracting
  archive; "Other Features of the Installer": --extract-only unpacks it without running
  nvidia-installer), appendix "Installed Components" (README/installedcomponents.html: each library,
  binary and ICD file and the soname links nvidia-installer makes for it), "Open Linux Kernel Modules"
  (README/kernel_open.html: the two flavours of module sources) and "GSP Firmware" (README/gsp.html).
  Its layout: the libraries (by their versioned names) and binaries at the top, `firmware/` (GSP
  firmware), `kernel/` and `kernel-open/` (the proprietary and open module sources: build those with
  `driverd build --source DIR/kernel-open`), `32/` (32-bit compatibility libraries, left out), the EGL
  vendor file `10_nvidia.json` and the Vulkan ICD file `nvidia_icd.json` (older drivers:
  `nvidia_icd.json.template`, whose `__NV_VK_ICD__` nvidia-installer replaces with libGLX_nvidia.so.0;
  so does this), `nvidia_layers.json`. driverd never runs a .run itself: extracting one executes its
  shell script, which is the operator's decision.

Both give the same package: the libraries named `*.so.<version>` of the one version libcuda and
libnvidia-ml carry (a directory holding two versions is refused), each with its ELF soname
(driverd.driver.files.elf_soname) and the links the loader and linkers use (the soname link, and the
development link `lib<x>.so` of the libraries Debian ships one for), the binaries, the firmware of that
version, and the ICD files whose `library_path` is one of the package's libraries. Setuid bits are
dropped (a package holds 0644 and 0755 files only). The manifest carries no build time: the same inputs
give the same bytes, hence the same sha256 (a repository never lists one version twice).

Fabric manager (nv-fabricmanager, fabricmanager.cfg), NVSwitch's libnvidia-nscq and nvidia-imex are
not part of this package: NVIDIA ships them separately (CUDA's repositories: nvidia-fabricmanager-<branch>,
libnvidia-nscq-<branch>, nvidia-imex-<branch>, each of the exact driver version). driverd does not fetch
them; docs/architecture.md says how they are found on a node.
"""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import tarfile
import tempfile
from dataclasses import field
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.driver.files import elf_soname
from driverd.errors import PackageError
from driverd.package import userspace as us
from driverd.package.archive import PackageRef, file_entry, pack, sha256_file
from driverd.safetar import UnsafeMember, check_member

TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
DEB_ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}
# Libraries a .run holds that are not the driver's user-space a node runs: the X server's GLX module,
# nvidia-settings' GUI and Wayland helpers.
RUN_SKIP_LIBS = ("libglxserver_nvidia", "libnvidia-gtk2", "libnvidia-gtk3", "libnvidia-wayland-client")
# The development links (lib<x>.so -> soname) Debian's packages ship; the same for every source.
DEV_LINKS = ("libcuda", "libnvidia-ml", "libnvcuvid", "libnvidia-encode", "libnvidia-opticalflow")
ICD_JSONS = {"10_nvidia.json": "share/glvnd/egl_vendor.d", "nvidia_icd.json": "share/vulkan/icd.d",
             "nvidia_layers.json": "share/vulkan/implicit_layer.d"}
MAX_DEB_BYTES = 1 << 30
MAX_DEB_MEMBERS = 20000
_VERSIONED_LIB = re.compile(r"^(lib[A-Za-z0-9_+-]+(?:\.[A-Za-z0-9_+-]+)*?)\.so\.(\d+(?:\.\d+)*)$")
_CHUNK = 1 << 20


@dataclass
class BuildResult:
    """A user-space package just built, with its manifest and the notes of its build."""
    ref: PackageRef
    manifest: us.UserspaceManifest
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        m = self.manifest
        return {"package": str(self.ref.path), "sha256": self.ref.sha256, "size": self.ref.size, "kind": us.KIND,
                "driver": m.driver_version, "arch": m.arch, "source": m.provenance.source,
                "files": len(m.files), "unpacked_bytes": sum(f.size for f in m.files),
                "libraries": {lib.path.rpartition("/")[2]: lib.soname for lib in m.libraries},
                "components": m.components(), "links": len(m.links),
                "binaries": [b.rpartition("/")[2] for b in m.binaries],
                "firmware": [f.path.rpartition("/")[2] for f in m.firmware_files],
                "icd": [f.path for f in m.files if f.path.startswith("share/")],
                "inputs": len(m.provenance.inputs), "notes": list(self.notes)}


def _bad(msg: str, fix: str, cause: str | None = None) -> PackageError:
    return PackageError(msg, cause=cause, fix=fix)


# -- the staging tree both sources fill ---------------------------------------------------------

class _Stage:
    """Files taken from a source, by their place in the package (lib64/..., bin/..., ...)."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.origin: dict[str, str] = {}          # package path -> where it came from (for messages)
        self.sha: dict[str, str] = {}
        self.notes: list[str] = []

    def put(self, rel: str, src: io.BufferedIOBase | Path, mode: int, origin: str, limit: int) -> None:
        dest = self.dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        h, n = hashlib.sha256(), 0
        f = open(src, "rb") if isinstance(src, Path) else src
        try:
            with open(tmp, "wb") as out:
                while chunk := f.read(_CHUNK):
                    n += len(chunk)
                    if n > limit:
                        raise _bad(f"{origin} is larger than {limit} bytes", "check the source: no driver file is "
                                   "that large")
                    h.update(chunk)
                    out.write(chunk)
        finally:
            if isinstance(src, Path):
                f.close()
        sha = h.hexdigest()
        if rel in self.sha:
            os.unlink(tmp)
            if self.sha[rel] != sha:
                raise _bad(f"{rel} comes from both {self.origin[rel]} and {origin}, with different contents",
                           "put the packages of one driver version (one build) in the directory")
            return
        os.replace(tmp, dest)
        os.chmod(dest, mode)
        self.origin[rel], self.sha[rel] = origin, sha

    def drop(self, rel: str, why: str) -> None:
        os.unlink(self.dir / rel)
        self.notes.append(f"left out {rel} ({self.origin.pop(rel)}): {why}")
        self.sha.pop(rel)

    def paths(self, prefix: str = "") -> list[str]:
        return sorted(p for p in self.origin if p.startswith(prefix))


def _version_of(stage: _Stage, where: str) -> str:
    """The driver version libcuda's and libnvidia-ml's file names carry (one, or refuse)."""
    found: dict[str, set[str]] = {}
    for p in stage.paths(us.LIB_DIR + "/"):
        m = _VERSIONED_LIB.match(p.rpartition("/")[2])
        if m and m.group(1) in ("libcuda", "libnvidia-ml"):
            found.setdefault(m.group(1), set()).add(m.group(2))
    missing = [s for s in ("libcuda", "libnvidia-ml") if s not in found]
    if missing:
        raise _bad(f"no {' or '.join(f'{s}.so.<version>' for s in missing)} in {where}",
                   "a user-space package needs libcuda and libnvidia-ml: add libcuda1 and libnvidia-ml1 (Debian) or "
                   "pass the directory the .run's --extract-only made")
    versions = sorted(set().union(*found.values()))
    if len(versions) != 1:
        raise _bad(f"{where} holds more than one driver version ({', '.join(versions)})",
                   "put the packages of one driver version in the directory (one directory per version)")
    return versions[0]


def _finish(stage: _Stage, version: str, arch: str, prov: us.Provenance, out: str | os.PathLike,
            level: int | None) -> BuildResult:
    """Keep what belongs to `version`, read the sonames, make the links, check the ICD files, pack."""
    for p in stage.paths(us.LIB_DIR + "/"):
        m = _VERSIONED_LIB.match(p.rpartition("/")[2])
        if not m or m.group(2) != version:
            stage.drop(p, f"not a library of driver {version}")
        elif us.stem(p.rpartition("/")[2]) not in us.NVIDIA_LIBRARIES:
            # a file that only looks like one (libz.so.<version>): the loader's cache would hand it to
            # every process on the node under its own soname
            stage.drop(p, "not one of NVIDIA's libraries (driverd.package.userspace.COMPONENTS)")
    for p in stage.paths("firmware/"):
        if not p.startswith(f"{us.FIRMWARE_BASE}/{version}/"):
            stage.drop(p, f"firmware of another driver version than {version}")
        elif not us.FIRMWARE_NAME.match(p.rpartition("/")[2]):
            stage.drop(p, "not NVIDIA's GSP firmware (gsp*.bin, ucodes*.bin)")
    for p in stage.paths("share/"):
        if not us.SHARE_NAME.match(p.rpartition("/")[2]):
            stage.drop(p, "not one of NVIDIA's ICD or layer files")
    libraries: list[us.Library] = []
    links: dict[str, str] = {}
    for p in stage.paths(us.LIB_DIR + "/"):
        name = p.rpartition("/")[2]
        with open(stage.dir / p, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise _bad(f"{name} ({stage.origin[p]}) is not an ELF shared object",
                           "check the source: it is damaged or not NVIDIA's", cause="no ELF header")
        # Most libraries declare a soname (libcuda.so.1); a few are loaded by their full name and declare
        # none (535's libnvidia-vulkan-producer.so.<version>): no soname link for those.
        soname = elf_soname(str(stage.dir / p))
        if soname is not None and ("/" in soname or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", soname)):
            raise _bad(f"{name} declares the soname {soname!r}", "check the source", cause="not a plain file name")
        why = us.library_problem(name, soname, version)
        if why:
            raise _bad(f"{why} ({stage.origin[p]})", "use NVIDIA's own files of one driver version: this one is "
                       "damaged or not NVIDIA's", cause="the loader would give it to every process under that soname")
        d = p.rpartition("/")[0]
        libraries.append(us.Library(p, soname, us.component_of(name)))
        if soname is not None and soname != name:
            have = links.get(f"{d}/{soname}")
            if have is not None and have != name:
                raise _bad(f"two libraries declare the soname {soname} ({have}, {name})",
                           "put the packages of one driver version in the directory")
            links[f"{d}/{soname}"] = name
        if us.stem(name) in DEV_LINKS and soname is not None and soname != name:
            links.setdefault(f"{d}/{us.stem(name)}.so", soname)
    sonames = {lib.soname for lib in libraries if lib.soname} | {lib.path.rpartition("/")[2] for lib in libraries}
    for p in stage.paths("share/"):
        lib = _icd_library(stage.dir / p)
        if lib is None:
            stage.drop(p, "not an ICD/layer file with a library_path")
        elif lib not in sonames:
            stage.drop(p, f"its library {lib} is not in the package")
    files = tuple(file_entry(stage.dir / p, p) for p in stage.paths())
    m = us.UserspaceManifest(
        driver_version=version, arch=arch, files=files, libraries=tuple(libraries),
        links=tuple(us.Link(k, v) for k, v in sorted(links.items())),
        binaries=tuple(stage.paths(us.BIN_DIR + "/")), provenance=prov)
    m.validate(f"the user-space of {version}")
    ref = pack(stage.dir, m, out, **({"level": level} if level is not None else {}))
    return BuildResult(ref, m, stage.notes)


def _icd_library(path: Path) -> str | None:
    try:
        d = json.loads(path.read_bytes()[:1 << 20])
    except (OSError, ValueError):
        return None
    for key in ("ICD", "layer"):
        lib = d.get(key, {}).get("library_path") if isinstance(d, dict) and isinstance(d.get(key), dict) else None
        if isinstance(lib, str) and lib:
            return lib
    return None


def _builder() -> str:
    try:
        from importlib.metadata import version
        return f"driverd {version('driverd')}"
    except Exception:   # noqa: BLE001 - an uninstalled tree
        return "driverd"


# -- Debian's .debs --------------------------------------------------------------------------------

class _Slice(io.RawIOBase):
    """`size` bytes of an open file from `offset`: one member of an ar archive."""

    def __init__(self, f, offset: int, size: int) -> None:
        self.f, self.pos, self.end = f, offset, offset + size

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:   # type: ignore[override]
        n = min(len(b), self.end - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.pos)
        data = self.f.read(n)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _ar_members(f, where: str) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) of an ar archive (a .deb)."""
    if f.read(8) != b"!<arch>\n":
        raise _bad(f"{where} is not a Debian package (no ar header)", "pass a directory of .deb files")
    out: dict[str, tuple[int, int]] = {}
    size_total = os.fstat(f.fileno()).st_size
    while True:
        head = f.read(60)
        if not head:
            return out
        if len(head) != 60 or head[58:60] != b"`\n":
            raise _bad(f"{where} is truncated or damaged (ar header)", "download the .deb again")
        name = head[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(head[48:58].decode("ascii").strip())
        except ValueError:
            raise _bad(f"{where} is damaged (ar member size)", "download the .deb again") from None
        off = f.tell()
        if size < 0 or off + size > size_total or len(out) > 16:
            raise _bad(f"{where} is truncated or damaged (ar member {name!r})", "download the .deb again")
        out[name] = (off, size)
        f.seek(off + size + (size & 1))


def _tar_stream(f, members: dict[str, tuple[int, int]], prefix: str, where: str):
    name = next((n for n in members if n == prefix or n.startswith(prefix + ".")), None)
    if name is None:
        raise _bad(f"{where} has no {prefix}.*", "download the .deb again")
    off, size = members[name]
    raw = io.BufferedReader(_Slice(f, off, size), _CHUNK)
    if name.endswith(".xz"):
        stream = lzma.LZMAFile(raw)
    elif name.endswith(".gz"):
        import gzip
        stream = gzip.GzipFile(fileobj=raw)
    elif name.endswith(".zst"):
        import zstandard
        stream = zstandard.ZstdDecompressor(max_window_size=1 << 27).stream_reader(raw, read_size=_CHUNK)
    elif name.endswith(".bz2"):
        import bz2
        stream = bz2.BZ2File(raw)
    elif name == prefix:
        stream = raw
    else:
        raise _bad(f"{where}: {name} is compressed in a way driverd does not read", "use Debian's own .debs")
    return tarfile.open(fileobj=stream, mode="r|")


def _control(f, members, where: str) -> dict[str, str]:
    with _tar_stream(f, members, "control.tar", where) as tar:
        for ti in tar:
            if ti.isreg() and ti.name.lstrip("./") == "control" and ti.size < 1 << 20:
                ef = tar.extractfile(ti)
                assert ef is not None
                text = ef.read().decode("utf-8", "replace")
                out: dict[str, str] = {}
                for line in text.splitlines():
                    if line and not line[0].isspace() and ":" in line:
                        k, v = line.split(":", 1)
                        out[k.strip()] = v.strip()
                return out
    raise _bad(f"{where} has no control file", "download the .deb again")


def _deb_rules(triplet: str) -> list[tuple[re.Pattern, str]]:
    t = re.escape(triplet)
    return [
        (re.compile(rf"^(?:usr/)?lib/{t}/(?:nvidia/current/)?(lib[^/]+\.so\.\d[\d.]*)$"), us.LIB_DIR),
        (re.compile(rf"^(?:usr/)?lib/{t}/vdpau/(libvdpau_nvidia\.so\.\d[\d.]*)$"), us.VDPAU_DIR),
        (re.compile(r"^(?:usr/)?(?:s?bin|lib/nvidia/current)/(" + "|".join(map(re.escape, us.BINARIES)) + r")$"),
         us.BIN_DIR),
        (re.compile(r"^(?:usr/)?lib/firmware/nvidia/([^/]+/[^/]+\.bin)$"), us.FIRMWARE_BASE),
        (re.compile(r"^usr/share/((?:glvnd/egl_vendor\.d|vulkan/icd\.d|vulkan/implicit_layer\.d|"
                    r"egl/egl_external_platform\.d)/[^/]*nvidia[^/]*\.json)$"), "share"),
    ]


def build_from_debs(debs_dir: str | os.PathLike, out: str | os.PathLike, *, arch: str | None = None,
                    level: int | None = None) -> BuildResult:
    """A user-space package from the .debs of one driver version in `debs_dir` (module docstring)."""
    d = Path(debs_dir)
    debs = sorted(p for p in d.glob("*.deb") if p.is_file()) if d.is_dir() else []
    if not debs:
        raise _bad(f"no .deb files in {d}", "pass the directory the user-space .debs were downloaded to "
                   "(apt-get download libcuda1 libnvidia-ml1 nvidia-smi ...)")
    with tempfile.TemporaryDirectory(prefix="driverd-userspace.") as t:
        stage = _Stage(Path(t) / "stage")
        stage.dir.mkdir()
        inputs: list[us.Source] = []
        want_arch = arch
        for deb in debs:
            where = deb.name
            with open(deb, "rb") as f:
                if os.fstat(f.fileno()).st_size > MAX_DEB_BYTES:
                    raise _bad(f"{where} is larger than {MAX_DEB_BYTES >> 20} MiB", "check the directory")
                members = _ar_members(f, where)
                ctl = _control(f, members, where)
                pkg, ver, deb_arch = ctl.get("Package"), ctl.get("Version"), ctl.get("Architecture")
                if not pkg or not ver:
                    raise _bad(f"{where}: its control file names no Package or Version", "download the .deb again")
                if deb_arch != "all":
                    a = DEB_ARCHES.get(deb_arch or "", deb_arch or "")
                    if want_arch is None:
                        want_arch = a
                    elif a != want_arch:
                        stage.notes.append(f"skipped {where}: architecture {deb_arch}, not {want_arch}")
                        continue
                triplet = TRIPLETS.get(want_arch or "x86_64", f"{want_arch}-linux-gnu")
                _take_deb(f, members, stage, _deb_rules(triplet), where)
            inputs.append(us.Source(pkg, ver, sha256_file(deb)))
            if pkg == "nvidia-modprobe":
                stage.notes.append("nvidia-modprobe is setuid root in Debian's package: the user-space package "
                                   "carries it 0755 (driverd creates the device nodes on a node)")
        version = _version_of(stage, str(d))
        for s in inputs:
            if s.version and not s.version.startswith(version) and s.name in ("nvidia-persistenced", "nvidia-modprobe"):
                stage.notes.append(f"{s.name} is Debian's {s.version} (built by Debian from NVIDIA's "
                                   f"{s.name} sources, versioned on its own), not {version}")
        prov = us.Provenance("debian", tuple(inputs), None, _builder())
        return _finish(stage, version, want_arch or "x86_64", prov, out, level)


def _take_deb(f, members, stage: _Stage, rules, where: str) -> None:
    try:
        with _tar_stream(f, members, "data.tar", where) as tar:
            n = 0
            for ti in tar:
                n += 1
                if n > MAX_DEB_MEMBERS:
                    raise _bad(f"{where} has more than {MAX_DEB_MEMBERS} files", "check the .deb")
                try:
                    rel = check_member(ti, links="rooted")
                except UnsafeMember as e:
                    raise _bad(f"{where}: {e}", "use Debian's own .debs", cause="an unsafe archive member") from None
                if not ti.isreg():
                    continue
                for rx, dest in rules:
                    m = rx.match(rel)
                    if m:
                        ef = tar.extractfile(ti)
                        assert ef is not None
                        mode = 0o755 if dest == us.BIN_DIR else 0o644
                        stage.put(f"{dest}/{m.group(1)}", ef, mode, f"{where}:/{rel}", MAX_DEB_BYTES)
                        break
    except PackageError:
        raise
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError, ValueError) as e:
        raise _bad(f"{where} is truncated or damaged ({' '.join(str(e).split())[:200]})",
                   "download the .deb again") from None


# -- NVIDIA's .run, extracted ------------------------------------------------------------------------

def build_from_run_dir(run_dir: str | os.PathLike, out: str | os.PathLike, *, arch: str | None = None,
                       level: int | None = None) -> BuildResult:
    """A user-space package from the directory `sh NVIDIA-Linux-<arch>-<version>.run --extract-only`
    made (module docstring)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise _bad(f"{d} is not a directory", "extract the installer first: sh NVIDIA-Linux-<arch>-<version>.run "
                   "--extract-only, then pass the NVIDIA-Linux-<arch>-<version> directory it made")
    m = re.match(r"^NVIDIA-Linux-([A-Za-z0-9_]+)-", d.name)
    arch = arch or (m.group(1) if m else "x86_64")
    with tempfile.TemporaryDirectory(prefix="driverd-userspace.") as t:
        stage = _Stage(Path(t) / "stage")
        stage.dir.mkdir()
        names = sorted(os.listdir(d))
        for n in names:
            p = d / n
            if p.is_symlink() or not p.is_file():
                continue
            lm = _VERSIONED_LIB.match(n)
            if lm and n.startswith("libvdpau_nvidia.so."):
                stage.put(f"{us.VDPAU_DIR}/{n}", p, 0o644, n, MAX_DEB_BYTES)
            elif lm and lm.group(1) not in RUN_SKIP_LIBS:
                stage.put(f"{us.LIB_DIR}/{n}", p, 0o644, n, MAX_DEB_BYTES)
            elif n in us.BINARIES:
                stage.put(f"{us.BIN_DIR}/{n}", p, 0o755, n, MAX_DEB_BYTES)
            elif n in ICD_JSONS:
                stage.put(f"{ICD_JSONS[n]}/{n}", p, 0o644, n, 1 << 20)
            elif n == "nvidia_icd.json.template" and "nvidia_icd.json" not in names:
                text = p.read_text(errors="replace").replace("__NV_VK_ICD__", "libGLX_nvidia.so.0")
                stage.put(f"{ICD_JSONS['nvidia_icd.json']}/nvidia_icd.json", io.BytesIO(text.encode()), 0o644,
                          n, 1 << 20)
        version = _version_of(stage, str(d))
        fw = d / "firmware"
        inside = os.path.realpath(fw).startswith(os.path.realpath(d) + os.sep)
        if fw.is_dir() and not inside:
            # never followed out of the directory given: a link there could hand the package any file
            stage.notes.append(f"firmware/ leads out of {d} (to {os.path.realpath(fw)}): not followed; the package "
                               "has no GSP firmware")
        elif fw.is_dir():
            for n in sorted(os.listdir(fw)):
                if n.endswith(".bin") and (fw / n).is_file() and not (fw / n).is_symlink():
                    stage.put(f"{us.FIRMWARE_BASE}/{version}/{n}", fw / n, 0o644, f"firmware/{n}", MAX_DEB_BYTES)
        for k in ("kernel", "kernel-open"):
            if (d / k).is_dir():
                stage.notes.append(f"{k}/ holds the {'open' if k == 'kernel-open' else 'proprietary'} kernel-module "
                                   f"sources: build their package with driverd build --source {d / k}")
        if (d / "32").is_dir():
            stage.notes.append("32/ (32-bit compatibility libraries) is left out")
        manifest_file = d / ".manifest"
        prov = us.Provenance("nvidia-run", (us.Source(d.name, version, sha256_file(manifest_file)
                                                      if manifest_file.is_file() else None),), None, _builder())
        return _finish(stage, version, arch, prov, out, level)
