"""Safe tar extraction, the same on every Python driverd supports.

tarfile's own safety (`extractall(filter="data")`) exists only from Python 3.12 and in 3.11.4+; Debian
12's python3 (the driver and builder images' interpreter) is 3.11.2, where `filter=` is a TypeError and
plain `extractall` follows `..`, absolute paths and links out of the destination. So driverd never calls
`extract`/`extractall`: every archive it unpacks goes through `check_member` (and, to write files,
`extract`), which refuses with one line naming the member:

- absolute names and names with `..`;
- hard links, device nodes, FIFOs and anything but regular files, directories and (by policy) symlinks;
- symlinks, by `links` policy:
    "refuse"  none at all (driver packages: only manifest.json, modules/, firmware/);
    "inside"  relative targets that stay inside the destination, climbing only with leading `..`
              (NVIDIA's source tarballs);
    "rooted"  also absolute targets, which name a path inside the destination the way driverd's Root
              resolves them (captured host trees: `var/run -> /run`);
- writing through a symlink: a member whose parent directory in the destination is a symlink (one
  extracted earlier, or planted) is refused, so no link ever redirects a write outside.

Modes: files keep their permission bits less setuid/setgid/sticky and group/other write, and stay
readable and writable by the owner; directories are 0755. Owners are never taken from the archive.
"""
from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path
from typing import BinaryIO, Literal

Links = Literal["refuse", "inside", "rooted"]
_CHUNK = 1 << 20


class UnsafeMember(Exception):
    """An archive member driverd will not write; `str()` is one line naming it."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"member {name!r} {what}")
        self.name, self.what = name, what


def check_member(ti: tarfile.TarInfo, links: Links = "refuse") -> str:
    """The member's normalised relative path ("" for the archive's top directory), or UnsafeMember."""
    name = ti.name
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeMember(name, "has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeMember(name, "contains '..'")
    rel = "/".join(parts)
    if ti.islnk():
        raise UnsafeMember(name, f"is a hard link (to {ti.linkname!r})")
    if ti.issym():
        if links == "refuse":
            raise UnsafeMember(name, f"is a symlink (to {ti.linkname!r})")
        target = ti.linkname
        if target.startswith("/") and links != "rooted":
            raise UnsafeMember(name, f"is a symlink to the absolute path {target!r}")
        if not rel:
            raise UnsafeMember(name, "is a symlink in place of the top directory")
        # Only leading ".." may climb, and not above the destination: every link then resolves inside it
        # whatever other links it passes through (a later ".." after a link could climb out of where
        # that link points, which a purely textual check cannot see).
        depth = 0 if target.startswith("/") else len(parts) - 1
        descended = False
        for p in target.split("/"):
            if p in ("", "."):
                continue
            if p != "..":
                descended = True
            elif descended:
                raise UnsafeMember(name, f"is a symlink with '..' after a directory name (to {target!r})")
            else:
                depth -= 1
                if depth < 0:
                    raise UnsafeMember(name, f"is a symlink leading outside the archive (to {target!r})")
        return rel
    if ti.ischr() or ti.isblk() or ti.isfifo() or ti.isdev():
        raise UnsafeMember(name, "is a device node or FIFO")
    if not (ti.isreg() or ti.isdir()):
        raise UnsafeMember(name, "is not a regular file, directory or symlink")
    return rel


def file_mode(ti: tarfile.TarInfo) -> int:
    """What a regular file is written with: the archive's bits, less set-id/sticky and group/other
    write, always owner read/write."""
    return (ti.mode & 0o755) | 0o600


def _parent_dirs(dest: Path, rel: str, member: str) -> Path:
    """Create (0755) the member's parent directories under dest, refusing any that is not a real
    directory (a symlink extracted earlier, or a file)."""
    cur = dest
    for p in rel.split("/")[:-1]:
        cur = cur / p
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            os.mkdir(cur, 0o755)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeMember(member, f"would be written through the symlink {str(cur.relative_to(dest))!r}")
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeMember(member, f"would be written under the file {str(cur.relative_to(dest))!r}")
    return cur


def _clear(target: Path, member: str) -> None:
    """A later member of the same name replaces a file or link; never a directory."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise UnsafeMember(member, "would replace a directory")
    os.unlink(target)


def extract(tar: tarfile.TarFile, dest: str | os.PathLike, links: Links = "refuse") -> int:
    """Write every member of the open archive `tar` under `dest` (an existing directory), checked as
    described above; returns the number of members written. On UnsafeMember the destination holds what
    was written so far: callers extract into a fresh directory and remove it on failure."""
    dest = Path(dest)
    n = 0
    for ti in tar:
        rel = check_member(ti, links)
        if not rel:
            continue
        _parent_dirs(dest, rel, ti.name)
        target = dest / rel
        if ti.isdir():
            try:
                st = os.lstat(target)
            except FileNotFoundError:
                os.mkdir(target, 0o755)
            else:
                if not stat.S_ISDIR(st.st_mode):
                    raise UnsafeMember(ti.name, "is a directory where the archive already put a file or link")
        elif ti.issym():
            _clear(target, ti.name)
            os.symlink(ti.linkname, target)
        else:
            _clear(target, ti.name)
            src = tar.extractfile(ti)
            assert src is not None
            # O_EXCL|O_NOFOLLOW: never write through anything that appeared meanwhile.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                _copy(src, out)
                os.fchmod(out.fileno(), file_mode(ti))
                os.utime(out.fileno(), (ti.mtime, ti.mtime))
        n += 1
    return n


def _copy(src: BinaryIO, out: BinaryIO) -> None:
    while chunk := src.read(_CHUNK):
        out.write(chunk)


def extract_file(archive: str | os.PathLike, dest: str | os.PathLike, links: Links = "refuse") -> int:
    """`extract` for an archive file in any compression tarfile reads (gzip, xz, bzip2, none)."""
    with tarfile.open(archive) as tar:
        return extract(tar, dest, links)
