"""The package archive: a deterministic tar, zstd-compressed, named after its own sha256.

Layout inside the tar (nothing else is accepted when unpacking):
    manifest.json          first member, so the manifest can be read without unpacking the rest
    modules/<name>.ko      kernel modules
    firmware/<name>.bin    GSP firmware for the open modules, when the source ships it

Why zstd: the archive is written once per build and read on every node; zstd level 3 decompresses
several times faster than xz or gzip at a ratio close to gzip -9 on `.ko` files (numbers in
bench/compression.py). The tar is deterministic (sorted names, mtime 0, root owner) so the same
inputs give the same bytes and therefore the same package identity.

Unpacking refuses, with one line naming the member: absolute paths, `..`, anything but regular files
and directories (symlinks, hard links, devices, FIFOs), names outside the layout, a manifest that
disagrees with the files (missing, extra, size, mode or sha256), and truncated or corrupt streams.
On any refusal the destination is removed, so nothing half-unpacked is ever left behind.

Nothing is decompressed before it is trusted or bounded (issue 21): with an expected sha256 (from
a verified index or a recorded install), the file's size and sha256 are checked on the compressed
bytes *first* — a decompression bomb or a huge manifest under the wrong hash costs one read of the
file. Without one (a local file), every stream is bounded: `MAX_MEMBERS` members, `MAX_MEMBER_BYTES`
each and `MAX_UNPACKED_BYTES` in all, a manifest of at most `MAX_MANIFEST_BYTES`, tar extension
headers (PAX, GNU long names) of at most `MAX_EXT_HEADER_BYTES` — each refused from the header that
declares it, before its bytes are read — and the zstd window at most `MAX_WINDOW_BYTES`.

File modes are never taken from the archive: every file is written 0644 and every directory 0755
(owned by the installing user, root on a node). A member whose mode differs (world-writable,
executable, setuid...) is still checked against the manifest, and `unusual_modes` reports it.

Three kinds of package share this format (`LAYOUTS`): the kernel-module package above (no `kind` in its
manifest), the user-space package (`"kind": "userspace"`, driverd.package.userspace: lib64/, bin/,
firmware/nvidia/<version>/, share/...) and the companion package (`"kind": "companion"`,
driverd.package.companion: fabric manager, nscq, NVLSM, IMEX — bin/, sbin/, lib/, etc/, share/, systemd/).
Each kind says which members it may hold and how its manifest is read; a user-space or companion
package's files are written 0755 when the member is executable and 0644 otherwise — what its verified
manifest says, since those manifests admit those two modes only. Every function takes `kind` ("kernel"
unless said otherwise; None: whichever the manifest names), so a package of another kind is refused
with one line, never half-read.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.fsutil import fsync_dir
from driverd.safetar import UnsafeMember, check_member
from driverd.package import companion as cp
from driverd.package import userspace as us
from driverd.package.manifest import FIRMWARE_DIR, MANIFEST_NAME, MODULES_DIR, FileEntry, Manifest

SUFFIX = ".tar.zst"
ZSTD_LEVEL = 3
_CHUNK = 1 << 20
MAX_MEMBER_BYTES = 1 << 30          # a kernel module or firmware image is far below 1 GiB
MAX_UNPACKED_BYTES = 2 << 30        # a whole driver package: ~100-300 MB of modules and firmware
MAX_MEMBERS = 1024                  # a package has a few modules and firmware files
MAX_MANIFEST_BYTES = 1 << 20        # the manifest lists those few files
MAX_EXT_HEADER_BYTES = 64 << 10     # PAX / GNU long-name headers: a name and a few keywords
MAX_WINDOW_BYTES = 1 << 27          # zstd's own default limit, stated: level 3 uses far less
FILE_MODE, DIR_MODE = 0o644, 0o755   # what unpacking writes, whatever the archive says


@dataclass(frozen=True)
class Layout:
    """What one kind of package may hold and how its manifest is read."""
    kind: str
    loads: Callable[[bytes, str], Any]            # manifest bytes, where -> manifest
    member_ok: Callable[[str, bool], bool]        # (relative path, is a directory) -> allowed
    holds: str                                     # for the refusal: "manifest.json, modules/ and firmware/"
    exec_modes: bool = False                       # files written 0755 when the member is executable


def _kernel_member_ok(rel: str, is_dir: bool) -> bool:
    parts = rel.split("/") if rel else []
    if is_dir:
        return rel in ("", MODULES_DIR, FIRMWARE_DIR)
    return rel == MANIFEST_NAME or (len(parts) == 2 and parts[0] in (MODULES_DIR, FIRMWARE_DIR))


KERNEL = Layout("kernel", Manifest.loads, _kernel_member_ok, "manifest.json, modules/ and firmware/")
USERSPACE = Layout(us.KIND, us.UserspaceManifest.loads, us.member_ok,
                   "manifest.json, lib64/, bin/, firmware/nvidia/<version>/ and share/", exec_modes=True)
COMPANION = Layout(cp.KIND, cp.CompanionManifest.loads, cp.member_ok,
                   "manifest.json, bin/, sbin/, lib/, etc/, share/, systemd/ and documents at the top", exec_modes=True)
LAYOUTS = {KERNEL.kind: KERNEL, USERSPACE.kind: USERSPACE, COMPANION.kind: COMPANION}


def _named(data: bytes) -> Layout:
    """The layout a manifest's `kind` names: a kernel package names none (and an unknown kind is read as
    one, whose reader then refuses it in one line)."""
    try:
        obj = json.loads(data)
    except ValueError:
        return KERNEL
    kind = obj.get("kind") if isinstance(obj, dict) else None
    return LAYOUTS.get(kind, KERNEL) if isinstance(kind, str) else KERNEL


def _layout(kind: str | None) -> Layout | None:
    if kind is None:
        return None
    try:
        return LAYOUTS[kind]
    except KeyError:
        raise ValueError(f"unknown package kind {kind!r}") from None


def _load_manifest(package, data: bytes, layout: Layout | None):
    """The manifest of `layout` (None: the kind the manifest names; none named is a kernel package)."""
    where = f"{os.path.basename(os.fspath(package))}: manifest.json"
    return (layout or _named(data)).loads(data, where)


@dataclass(frozen=True)
class PackageRef:
    """A package archive on disk, identified by its sha256, with the manifest read from it."""
    path: Path
    sha256: str
    size: int
    manifest: Manifest

    def to_json(self) -> dict:
        m = self.manifest
        if getattr(m, "kind", "kernel") == us.KIND:
            return {"package": str(self.path), "sha256": self.sha256, "size": self.size, "kind": us.KIND,
                    "driver": m.driver_version, "arch": m.arch}
        if getattr(m, "kind", "kernel") == cp.KIND:
            return {"package": str(self.path), "sha256": self.sha256, "size": self.size, "kind": cp.KIND,
                    "component": m.component, "driver": m.driver_version, "arch": m.arch}
        return {"package": str(self.path), "sha256": self.sha256, "size": self.size,
                "driver": m.driver_version, "flavor": m.flavor, "kernel_release": m.kernel_release,
                "arch": m.arch}


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path, rel: str) -> FileEntry:
    st = path.stat()
    return FileEntry(rel, st.st_size, st.st_mode & 0o777, sha256_file(path))


def package_filename(manifest, sha256: str) -> str:
    """<basename>.<sha256>.tar.zst for either kind of manifest."""
    return f"{manifest.basename()}.{sha256}{SUFFIX}"


# -- pack ---------------------------------------------------------------------------------------

class _HashingWriter(io.RawIOBase):
    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:   # type: ignore[override]
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)


def _tarinfo(name: str, size: int, mode: int, is_dir: bool = False) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = (0 if is_dir else size), mode, 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    return ti


def pack(staging: str | os.PathLike, manifest, out_dir: str | os.PathLike,
         level: int = ZSTD_LEVEL) -> PackageRef:
    """Write `manifest` (a kernel-module, user-space or companion one) and the files it lists (read from `staging`)
    as a package in `out_dir`."""
    import zstandard

    staging, out = Path(staging), Path(out_dir)
    manifest.validate()
    for f in manifest.files:   # the manifest must describe the staging tree exactly
        actual = file_entry(staging / f.path, f.path)
        if actual != f:
            raise PackageError(f"cannot pack {f.path}: it changed after the manifest was written",
                               cause=f"manifest says {f}, disk has {actual}", fix="rebuild")
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pack.", suffix=SUFFIX, dir=out)
    try:
        with os.fdopen(fd, "wb") as raw:
            hw = _HashingWriter(raw)
            cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
            with cctx.stream_writer(hw, closefd=False) as zw:
                with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    data = manifest.dumps()
                    tar.addfile(_tarinfo(MANIFEST_NAME, len(data), 0o644), io.BytesIO(data))
                    for d in manifest.archive_dirs():
                        tar.addfile(_tarinfo(d, 0, 0o755, is_dir=True))
                    for f in sorted(manifest.files, key=lambda e: e.path):
                        with open(staging / f.path, "rb") as src:
                            tar.addfile(_tarinfo(f.path, f.size, f.mode), src)
            raw.flush()
            os.fsync(raw.fileno())
            sha, size = hw.h.hexdigest(), hw.n
        final = out / package_filename(manifest, sha)
        os.replace(tmp, final)
        os.chmod(final, 0o644)
        fsync_dir(out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return PackageRef(final, sha, size, manifest)


# -- unpack -------------------------------------------------------------------------------------

def _refuse(package: str | os.PathLike, what: str, fix: str = "re-fetch or rebuild the package") -> PackageError:
    return PackageError(f"refusing package {os.path.basename(os.fspath(package))}: {what}",
                        cause="the archive is unsafe or does not match its manifest", fix=fix)


def _check_member(package, ti: tarfile.TarInfo, layout: Layout = KERNEL) -> str:
    # The generic refusals (absolute, '..', links, devices) are driverd.safetar's, shared with every
    # other archive driverd unpacks; the layout is the package kind's own.
    try:
        rel = check_member(ti, links="refuse")
    except UnsafeMember as e:
        raise _refuse(package, str(e)) from None
    name = ti.name
    if ti.isdir():
        if not layout.member_ok(rel, True):
            raise _refuse(package, f"unexpected directory {name!r}")
    elif not layout.member_ok(rel, False):
        raise _refuse(package, f"member {name!r} is outside {layout.holds}")
    if ti.size > MAX_MEMBER_BYTES:
        raise _refuse(package, f"member {name!r} is implausibly large ({ti.size} bytes)")
    return rel


class _HashingReader(io.RawIOBase):
    """Reads a file while hashing it: the archive's sha256 comes from the same pass that unpacks it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:   # type: ignore[override]
        data = self.f.read(len(b))
        n = len(data)
        b[:n] = data
        self.h.update(data)
        self.n += n
        return n

    def finish(self) -> str:
        while chunk := self.f.read(_CHUNK):
            self.h.update(chunk)
            self.n += len(chunk)
        return self.h.hexdigest()

    def close(self) -> None:
        self.f.close()
        super().close()


class _HeaderTooLarge(tarfile.TarError):
    pass


_EXT_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
              tarfile.GNUTYPE_LONGLINK)


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a PAX or GNU long-name header's whole body into memory, however large its
    header says it is; this refuses one over MAX_EXT_HEADER_BYTES from the 512-byte header, before
    any of it is read. (_proc_member is tarfile's per-member hook in every Python >= 3.8.)"""

    def _proc_member(self, tarfile_):         # noqa: ANN001
        if self.type in _EXT_TYPES and self.size > MAX_EXT_HEADER_BYTES:
            raise _HeaderTooLarge(f"a tar extension header of {self.size} bytes (at most {MAX_EXT_HEADER_BYTES})")
        return super()._proc_member(tarfile_)


def _open_stream(package: str | os.PathLike, hashing: bool = False):
    import zstandard
    f = open(package, "rb")
    src = _HashingReader(f) if hashing else f
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES).stream_reader(
        src, closefd=True, read_size=_CHUNK)
    tar = tarfile.open(fileobj=reader, mode="r|", format=tarfile.PAX_FORMAT, tarinfo=_BoundedTarInfo)
    if hashing:
        tar._driverd_hasher = src      # type: ignore[attr-defined]
    return tar


def _stream_errors():
    import zstandard
    return (tarfile.TarError, zstandard.ZstdError, EOFError, UnicodeError, ValueError, OverflowError)


def check_file(package: str | os.PathLike, expected_sha256: str, expected_size: int | None = None) -> None:
    """The compressed file is the one expected: its size (when known: no read at all), then its
    sha256 — before a single byte of it is decompressed."""
    try:
        size = os.stat(package).st_size
    except FileNotFoundError:
        raise PackageError(f"package {package} does not exist", fix="check the path") from None
    if expected_size is not None and size != expected_size:
        raise PackageError(f"package {os.path.basename(os.fspath(package))} is {size} bytes, expected "
                           f"{expected_size}", cause="the download is damaged or was replaced",
                           fix="delete it and fetch again; if it persists, the repository index is stale")
    got = sha256_file(package)
    if got != expected_sha256:
        raise _wrong_sha(package, got, expected_sha256)


def read_manifest(package: str | os.PathLike, kind: str | None = "kernel"):
    """The manifest of a package, reading only the archive's first member. `kind` "kernel" (a
    Manifest), "userspace" (a UserspaceManifest), "companion" (a CompanionManifest) or None (whichever
    the package is); a package of another kind is refused with one line."""
    layout = _layout(kind)
    try:
        with _open_stream(package) as tar:
            ti = tar.next()
            if ti is None or ti.name != MANIFEST_NAME or not ti.isreg():
                raise _refuse(package, "the first member is not manifest.json")
            if ti.size > MAX_MANIFEST_BYTES:
                raise _refuse(package, f"manifest.json is {ti.size} bytes (at most {MAX_MANIFEST_BYTES})")
            ef = tar.extractfile(ti)
            assert ef is not None
            data = ef.read()
    except PackageError:
        raise
    except _HeaderTooLarge as e:
        raise _refuse(package, str(e)) from None
    except _stream_errors() as e:
        raise _refuse(package, f"the archive is truncated or corrupt ({_one_line(e)})") from None
    except FileNotFoundError:
        raise PackageError(f"package {package} does not exist", fix="check the path") from None
    return _load_manifest(package, data, layout)


def unpack(package: str | os.PathLike, dest: str | os.PathLike, expected_sha256: str | None = None,
           expected_size: int | None = None, kind: str | None = "kernel"):
    """Unpack and verify `package` into `dest` (created; must not exist). Removes `dest` on any refusal.
    With `expected_sha256` (and `expected_size`) the compressed file is checked before anything is
    decompressed."""
    dest = Path(dest)
    if expected_sha256 is not None:
        check_file(package, expected_sha256, expected_size)
    dest.mkdir(parents=True)
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC)
        try:
            return _unpack_into(package, fd, expected_sha256, _layout(kind))
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def unpack_at(package: str | os.PathLike, dir_fd: int, expected_sha256: str | None = None,
              expected_size: int | None = None, kind: str | None = "kernel"):
    """Unpack and verify `package` into the empty directory open as `dir_fd` (O_RDONLY|O_DIRECTORY):
    every file and directory is created relative to it (O_EXCL|O_NOFOLLOW, never through a link), so a
    caller that opened the directory inside a host root (driverd.root.Root.open_dir) never writes
    outside it. On a refusal what was written stays: the caller removes the directory."""
    if expected_sha256 is not None:
        check_file(package, expected_sha256, expected_size)
    return _unpack_into(package, dir_fd, expected_sha256, _layout(kind))


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _subdir(top: int, rel_dir: str, cache: dict[str, int]) -> int:
    """A directory fd for `rel_dir` under `top` (created 0755 as needed, never through a link)."""
    if not rel_dir:
        return top
    if rel_dir in cache:
        return cache[rel_dir]
    parent, _, name = rel_dir.rpartition("/")
    pfd = _subdir(top, parent, cache)
    try:
        os.mkdir(name, DIR_MODE, dir_fd=pfd)
        created = True
    except FileExistsError:
        created = False
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=pfd)
    if created:
        os.fchmod(fd, DIR_MODE)             # whatever the umask
    cache[rel_dir] = fd
    return fd


def _unpack_into(package, dest: int | None, expected_sha256: str | None = None, layout: Layout | None = KERNEL):
    """One pass over the archive: hash it, check each member, hash each file (writing it under the
    directory open as `dest` unless dest is None, which only verifies), then compare everything with
    the manifest. `layout` None: the kind the first member (manifest.json) names."""
    dirs: dict[str, int] = {}
    try:
        return _unpack_pass(package, dest, expected_sha256, layout, dirs)
    finally:
        for fd in dirs.values():
            os.close(fd)


def _unpack_pass(package, dest: int | None, expected_sha256: str | None, layout: Layout | None,
                 dirs: dict[str, int]):
    actual: dict[str, FileEntry] = {}
    manifest_bytes: bytes | None = None
    got_sha: str | None = None
    members = total = 0
    try:
        with _open_stream(package, hashing=expected_sha256 is not None) as tar:
            for ti in tar:
                members += 1
                if members > MAX_MEMBERS:
                    raise _refuse(package, f"it has more than {MAX_MEMBERS} members")
                if members == 1 and ti.name == MANIFEST_NAME and ti.isreg() and ti.size <= MAX_MANIFEST_BYTES:
                    # the first member names the kind: the rest is checked by that kind's layout, and a
                    # package of another kind than asked for is refused by its manifest, in one line
                    ef = tar.extractfile(ti)
                    assert ef is not None
                    manifest_bytes = ef.read()
                    named = _named(manifest_bytes)
                    if layout is None:
                        layout = named
                    elif named is not layout:
                        _load_manifest(package, manifest_bytes, layout)      # raises: wrong kind
                    continue
                rel = _check_member(package, ti, layout or KERNEL)
                if ti.isdir():
                    continue
                if rel in actual or (rel == MANIFEST_NAME and manifest_bytes is not None):
                    raise _refuse(package, f"member {rel!r} appears twice")
                total += ti.size
                if total > MAX_UNPACKED_BYTES:
                    raise _refuse(package, f"it unpacks to more than {MAX_UNPACKED_BYTES} bytes (at {rel!r})")
                src = tar.extractfile(ti)
                assert src is not None
                if rel == MANIFEST_NAME:
                    if ti.size > MAX_MANIFEST_BYTES:
                        raise _refuse(package, f"manifest.json is {ti.size} bytes (at most {MAX_MANIFEST_BYTES})")
                    manifest_bytes = src.read()
                    continue
                h, n = hashlib.sha256(), 0
                mode = ti.mode & 0o777
                if dest is None:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        n += len(chunk)
                else:
                    parent, _, leaf = rel.rpartition("/")
                    pfd = _subdir(dest, parent, dirs)
                    # O_EXCL|O_NOFOLLOW: never write through anything that appeared in dest meanwhile.
                    fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600,
                                 dir_fd=pfd)
                    with os.fdopen(fd, "wb") as out:
                        while chunk := src.read(_CHUNK):
                            h.update(chunk)
                            n += len(chunk)
                            out.write(chunk)
                        # never the archive's mode: 0644 (a kernel package reports other modes), or
                        # 0644/0755 as a user-space or companion package's verified manifest must say
                        os.fchmod(out.fileno(), 0o755 if (layout is not None and layout.exec_modes
                                                          and mode & 0o111) else FILE_MODE)
                actual[rel] = FileEntry(rel, n, mode, h.hexdigest())
            hasher = getattr(tar, "_driverd_hasher", None)
            if hasher is not None:
                got_sha = hasher.finish()
    except PackageError:
        raise
    except _HeaderTooLarge as e:
        raise _refuse(package, str(e)) from None
    except _stream_errors() as e:
        raise _refuse(package, f"the archive is truncated or corrupt ({_one_line(e)})") from None
    if expected_sha256 is not None and got_sha != expected_sha256:
        raise _wrong_sha(package, got_sha, expected_sha256)
    if manifest_bytes is None:
        raise _refuse(package, "it has no manifest.json")
    manifest = _load_manifest(package, manifest_bytes, layout)
    verify_files(package, manifest, actual)
    if dest is not None:
        fd = os.open(MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600,
                     dir_fd=dest)
        with os.fdopen(fd, "wb") as out:
            out.write(manifest_bytes)
            os.fchmod(out.fileno(), FILE_MODE)
    return manifest


def unusual_modes(manifest: Manifest) -> list[str]:
    """Files whose mode in the package is not 0644: reported, not obeyed (they are written 0644)."""
    return [f"{f.path} has mode {f.mode:04o} in the package (installed {FILE_MODE:04o})"
            for f in manifest.files if f.mode != FILE_MODE]


def _wrong_sha(package, got: str | None, want: str) -> PackageError:
    return PackageError(f"package {os.path.basename(os.fspath(package))} has sha256 {got}, expected {want}",
                        cause="the download is damaged or was replaced",
                        fix="delete it and fetch again; if it persists, the repository index is stale")


def verify_files(package, manifest: Manifest, actual: dict[str, FileEntry]) -> None:
    """Every file the manifest lists is present with its size, mode and sha256; nothing else is."""
    listed = {f.path: f for f in manifest.files}
    for path, want in listed.items():
        got = actual.get(path)
        if got is None:
            raise _refuse(package, f"manifest lists {path}, which the archive lacks")
        for attr in ("size", "sha256", "mode"):
            if getattr(got, attr) != getattr(want, attr):
                w, g = getattr(want, attr), getattr(got, attr)
                if attr == "mode":
                    w, g = oct(w), oct(g)
                raise _refuse(package, f"{path}: {attr} is {g}, the manifest says {w}")
    extra = sorted(set(actual) - set(listed))
    if extra:
        raise _refuse(package, f"{extra[0]} is in the archive but not in the manifest")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def verify_package(package: str | os.PathLike, expected_sha256: str | None = None,
                   expected_size: int | None = None, kind: str | None = "kernel"):
    """Check the compressed file's size and sha256 (when given) before decompressing anything, then
    every member against the manifest in one bounded streaming pass that writes nothing to disk."""
    if expected_sha256 is not None:
        check_file(package, expected_sha256, expected_size)
    # Hashed again in the decompressing pass: the bytes unpacked are the bytes checked.
    return _unpack_into(package, None, expected_sha256, _layout(kind))
