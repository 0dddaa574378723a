"""Writing files the way every driverd step must: atomically, durably, reversibly.

atomic_write: temp file in the same directory, fsync, rename, fsync the directory — a reader sees the
old file or the new one, never half of either, even across a power cut.

atomic_write_at does the same relative to an open directory (a dir fd): Root's writers resolve the
parent directory inside the host root first (driverd.root) and then never name it by path again, so
a symlink cannot redirect the write outside the root between the check and the write.
"""
from __future__ import annotations

import json
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int) -> None:
    """fsync an open directory (or file); file systems that cannot (EINVAL) are not an error."""
    try:
        os.fsync(fd)
    except OSError:
        pass


def dump_json(obj: object) -> str:
    """driverd's JSON file format: indent=2, sorted keys, a trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _temp_name(name: str) -> str:
    return f".{name[:200]}.{os.urandom(4).hex()}.tmp"


def atomic_write_at(dir_fd: int, name: str, data: bytes | str, mode: int | None = None) -> None:
    """Replace the entry `name` of the directory open as `dir_fd` (O_RDONLY|O_DIRECTORY) with `data`.

    The temp file is created O_CREAT|O_EXCL|O_NOFOLLOW in the same directory, written, fsynced and
    chmodded, renamed over `name` (renameat: a symlink called `name` is replaced, never followed), then
    the directory is fsynced. Keeps the existing file's mode unless `mode` is given (0o644 for a new file).
    """
    if isinstance(data, str):
        data = data.encode()
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"not a file name: {name!r}")
    if mode is None:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o644
        except FileNotFoundError:
            mode = 0o644
    for _ in range(100):
        tmp = _temp_name(name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:   # pragma: no cover - 100 collisions of 32 random bits
        raise FileExistsError(f"cannot create a temporary file next to {name}")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    fsync_fd(dir_fd)


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int | None = None) -> None:
    """Replace `path` with `data`. Keeps the existing file's mode unless `mode` is given.

    For driverd's own files (caches, journals, packages). Host paths under a Root go through
    Root.atomic_write, which resolves the path inside the root.
    """
    from pathlib import Path
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        atomic_write_at(dfd, path.name, data, mode)
    finally:
        os.close(dfd)


def atomic_write_json(path: str | os.PathLike, obj: object, mode: int | None = None) -> None:
    atomic_write(path, dump_json(obj), mode)


def read_json(path: str | os.PathLike) -> object | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


# -- files driverd trusts ----------------------------------------------------------------------------
#
# driverd runs as root. Its configuration, the kubeconfig the daemon talks to the API with (whose exec
# plugin it would run, whose token it would send), the repository credentials, the index key and the
# module-signing keys and certificates decide what root does: whoever can change one of them can make
# driverd load another driver, trust another index or run a program. `trusted_file` is the one check
# every reader of such a file goes through. It walks the path the way the kernel does — one component at
# a time from /, following each symbolic link — and accepts it only when no one but the trusted owners
# (root; and the user driverd runs as, when that is not root: a one-shot command on one's own files) can
# change what it finally reads:
#
# - the file: a regular file owned by a trusted owner, not writable by its group or others;
# - every directory a name is looked up in: owned by a trusted owner and not writable by its group or
#   others — except a sticky directory (/tmp), where only an entry's owner can replace it: there the
#   entry (a link or a directory on the way, or the file) must be a trusted owner's. A symbolic link
#   another user made in /tmp is therefore never followed.
# - a read-only file system (a ConfigMap or Secret mounted readOnly into the driver container) cannot be
#   changed through this mount: its files and directories pass whatever their owner and mode.
#
# A refusal is a ConfigError (exit 2) whose one line names the file, what is wrong and the command that
# fixes it.

_MAX_LINKS = 40        # the kernel's limit on links followed in one lookup (ELOOP)


def trusted_owners() -> frozenset[int]:
    """root, and the user driverd runs as (a one-shot command run by a user on the user's own files)."""
    return frozenset({0, os.geteuid()})


def _who(uid: int) -> str:
    if uid == 0:
        return "root"
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _owners_words() -> str:
    euid = os.geteuid()
    return "root" if euid == 0 else f"root or you ({_who(euid)})"


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _writers(mode: int) -> str:
    return {0o020: "its group", 0o002: "everyone", 0o022: "its group and everyone"}[mode & 0o022]


class Untrusted(Exception):
    """A path someone other than its trusted owners can change: `problem` says who and where, `fix` how."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def _judge_dir(d: str, st: os.stat_result, entry: str, est: os.stat_result | None, owners: frozenset[int]) -> None:
    """Raise Untrusted when someone outside `owners` can replace `entry` (lstat `est`; None: it does not
    exist yet, and whoever creates it owns it) in directory `d`."""
    if st.st_uid in owners and not st.st_mode & 0o022:
        return
    if _read_only(d):
        return
    if st.st_uid not in owners:
        raise Untrusted(f"the directory {d} is owned by {_who(st.st_uid)}, who can replace what is in it",
                        f"chown root {d} && chmod go-w {d}, or keep the file in a directory of root's")
    if st.st_mode & stat.S_ISVTX:               # /tmp: only an entry's owner can rename or remove it
        if est is None or est.st_uid in owners:
            return
        kind = "symbolic link" if stat.S_ISLNK(est.st_mode) else "entry"
        raise Untrusted(f"the {kind} {entry} in the shared directory {d} belongs to {_who(est.st_uid)}",
                        f"name a file of {_owners_words()} outside shared directories like {d} (never another "
                        "user's link)")
    raise Untrusted(f"the directory {d} is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o}, "
                    "no sticky bit), so its entries can be replaced",
                    f"chmod go-w {d}")


def walk_trusted(path: str | os.PathLike, *, follow_last: bool = True
                 ) -> tuple[str, os.stat_result, list[str]]:
    """Resolve `path` one component at a time from /, as the kernel does (.. after a link goes up from
    where the link led), judging every directory a name is looked up in (see above). Returns the real
    path of the deepest component that exists, its lstat, and the components after it that do not exist
    (empty when the whole path exists). `follow_last=False` stops at a final symbolic link. Raises
    Untrusted, or OSError for a path that cannot be walked (ELOOP, ENOTDIR, EACCES)."""
    import errno
    from collections import deque
    p = os.fspath(path)
    if not p.startswith("/"):
        p = os.getcwd() + "/" + p               # not os.path.abspath: its lexical '..' ignores links
    owners = trusted_owners()
    cur, st = "/", os.lstat("/")
    pending = deque(p.split("/"))
    links = 0
    while pending:
        name = pending.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            st = os.lstat(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            est = os.lstat(nxt)
        except FileNotFoundError:
            _judge_dir(cur, st, nxt, None, owners)     # what others could put there before it is made
            rest = [n for n in [name, *pending] if n not in ("", ".")]
            if ".." in rest:
                raise OSError(errno.ENOENT, "a missing directory is followed by '..'", p) from None
            return cur, st, rest
        _judge_dir(cur, st, nxt, est, owners)
        if stat.S_ISLNK(est.st_mode) and (follow_last or any(n not in ("", ".") for n in pending)):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, "too many levels of symbolic links", p)
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur, st = "/", os.lstat("/")
            pending.extendleft(reversed(target.split("/")))
            continue
        if not stat.S_ISDIR(est.st_mode) and any(n not in ("", ".") for n in pending):
            raise OSError(errno.ENOTDIR, "not a directory", nxt)
        cur, st = nxt, est
    return cur, st, []


def _cause(noun: str) -> str:
    verb = "says" if noun == "file" else "holds"
    return (f"driverd runs as root and acts on what this {noun} {verb}: whoever can change it controls root"
            if os.geteuid() == 0 else "anyone who can change it controls what driverd does as you")


def _walk(path: str | os.PathLike, what: str, shown: str, cause: str, kind: str
          ) -> tuple[str, os.stat_result, list[str]]:
    from driverd.errors import ConfigError
    try:
        return walk_trusted(path)
    except Untrusted as u:
        raise ConfigError(f"refusing {what} {shown}: {u.problem}", cause=cause, fix=u.fix) from None
    except OSError as e:
        raise ConfigError(f"cannot check {what} {shown}: {e.strerror or e}",
                          cause=f"the path does not resolve to a {kind}", fix=f"point {what} at a {kind}") from None


def _judge_owner(path: str | os.PathLike, real: str, st: os.stat_result, what: str, shown: str, cause: str) -> None:
    """The final file or directory itself: a trusted owner's, not writable by its group or others."""
    from driverd.errors import ConfigError
    if _read_only(real):
        return
    asked = os.fspath(path)
    there = "" if real == os.path.normpath(os.path.join(os.getcwd(), asked)) else f" (it leads to {real})"
    if st.st_uid not in trusted_owners():
        raise ConfigError(f"refusing {what} {shown}: it is owned by {_who(st.st_uid)}, not {_owners_words()}{there}",
                          cause=cause, fix=f"chown root:root {real} && chmod go-w {real}")
    if st.st_mode & 0o022:
        raise ConfigError(f"refusing {what} {shown}: it is writable by {_writers(st.st_mode)} (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}){there}", cause=cause, fix=f"chmod go-w {real}")


def trusted_file(path: str | os.PathLike, what: str, *, shown: str | None = None,
                 missing_ok: bool = False) -> Path | None:
    """The real path of `path` when only trusted owners can change what it reads (see above); else a
    one-line ConfigError naming `what` (e.g. "config file", "packages.netrc") and the fix. `shown` is the
    name to print (a host path under --root). A missing file raises too, unless `missing_ok` (then None:
    the reader reports the absence in its own words)."""
    return _trusted(path, what, shown, missing_ok, "file", "regular file", stat.S_ISREG,
                    "driverd reads configuration, keys and credentials from regular files only")


def trusted_dir(path: str | os.PathLike, what: str, *, shown: str | None = None,
                missing_ok: bool = False) -> Path | None:
    """trusted_file's check for a directory whose entries decide what root does (a directory of packages,
    the tree the loader is pointed at): every directory on the way judged as for a file, and the directory
    itself a trusted owner's and not writable by its group or others (no sticky-bit exception: whoever
    can add an entry there can add the one driverd picks). A missing directory raises unless `missing_ok`
    (then None); the directories on the way to where it would be made are judged either way."""
    return _trusted(path, what, shown, missing_ok, "directory", "directory", stat.S_ISDIR, "it must be a directory")


def _trusted(path, what: str, shown: str | None, missing_ok: bool, kind: str, noun: str, is_kind,
             why_kind: str) -> Path | None:
    from driverd.errors import ConfigError
    shown = shown or os.fspath(path)
    cause = _cause(kind)
    real, st, missing = _walk(path, what, shown, cause, noun)
    if missing:
        if missing_ok:
            return None
        raise ConfigError(f"{what} {shown} does not exist", cause=f"no {os.path.join(real, *missing)}",
                          fix=f"create it or change {what}")
    if not is_kind(st.st_mode):
        raise ConfigError(f"refusing {what} {shown}: {real} is not a {noun}", cause=why_kind,
                          fix=f"point {what} at a {noun}")
    _judge_owner(path, real, st, what, shown, cause)
    from pathlib import Path
    return Path(real)


def entry_problem(real: str, st: os.stat_result, owners: frozenset[int] | None = None) -> str | None:
    """Why someone other than `owners` (default: trusted_owners()) can change the file or directory at
    `real` itself (lstat `st`): its owner, or a group- or world-writable mode; None when nobody can (a
    read-only file system passes). The directories on the way are walk_trusted's part."""
    owners = trusted_owners() if owners is None else owners
    if (st.st_uid in owners and not st.st_mode & 0o022) or _read_only(real):
        return None
    if st.st_uid not in owners:
        return f"it is owned by {_who(st.st_uid)}, not {_owners_words()}"
    return f"it is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})"


def writable_dir(path: str | os.PathLike) -> str | None:
    """None when `path` is a directory this process can create files in (made, with its parents, when
    missing), else why not, in words. Tried with a real file: access() says yes to root on a read-only
    file system."""
    p = os.fspath(path)
    try:
        os.makedirs(p, exist_ok=True)
    except FileExistsError:
        return "it is not a directory"
    except OSError as e:
        return f"cannot create it: {e.strerror}"
    if not os.path.isdir(p):
        return "it is not a directory"
    probe = os.path.join(p, _temp_name("driverd-write-test"))
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600))
    except OSError as e:
        return f"cannot write to it: {e.strerror}"
    try:
        os.unlink(probe)
    except OSError:
        pass
    return None
