"""What driverd changed in runtime configuration, so that `revert` undoes exactly that.

<root>/<state.dir>/runtime/state.json (state.dir: /var/lib/driverd) records, per runtime, every file we edited or created: the
backup of the original (taken before our first recorded edit, one file per runtime and path; a failed
run leaves none), the hash of what we wrote and the changes we made, and the handlers another tool
wrote that driverd took over ("adopted"). Revert restores the backup byte for byte when nobody
touched the file since; when someone did (after our write, or between two of our writes), it removes
only our changes and keeps theirs — an adopted handler gets the values its tool wrote back. Files are
written atomically; a run that fails half-way puts back the files it already wrote.
"""
from __future__ import annotations

import difflib
import errno
import hashlib
import json

from driverd.errors import HostPathError, RuntimeConfigError
from driverd.root import Root
from driverd.runtime.changes import Change, ChangeReport, FileEdit

DEFAULT_STATE_DIR = "/var/lib/driverd"           # state.dir's default
STATE_FILE = f"{DEFAULT_STATE_DIR}/runtime/state.json"     # the record under the default state.dir


def state_file(state_dir: str = DEFAULT_STATE_DIR) -> str:
    return f"{state_dir.rstrip('/')}/runtime/state.json"


def backup_dir(state_dir: str = DEFAULT_STATE_DIR) -> str:
    return f"{state_dir.rstrip('/')}/runtime/backups"


def sha256(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _source(root: Root, state_dir: str) -> str:
    """The record to read: state.dir's; with another state.dir than the default and nothing recorded there
    yet, the default's, which driverd before issue 45 wrote whatever state.dir said (its backups are named
    in it by their full paths, so they are found where they are)."""
    path = state_file(state_dir)
    if path != STATE_FILE and root.lstat(path) is None and root.lstat(STATE_FILE) is not None:
        return STATE_FILE
    return path


def load(root: Root, state_dir: str = DEFAULT_STATE_DIR) -> dict:
    path = _source(root, state_dir)
    raw = root.read_text(path)
    if not raw:
        return {"version": 1, "runtimes": {}}
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise RuntimeConfigError(f"{path} is corrupt ({e})", fix=f"inspect or remove {path}") from None
    data.setdefault("runtimes", {})
    return data


def save(root: Root, data: dict, state_dir: str = DEFAULT_STATE_DIR) -> None:
    legacy = _source(root, state_dir)
    root.atomic_write_json(state_file(state_dir), data)
    if legacy != state_file(state_dir):
        root.unlink(legacy)           # moved: read once more from the default state.dir, it would be stale


def backup_path(hostpath: str, runtime: str, state_dir: str = DEFAULT_STATE_DIR) -> str:
    """The backup of `hostpath`'s original for `runtime`'s record: the path made flat to be read by a
    person, plus a hash of the exact (runtime, path), so that two files never share one backup
    ('/etc/a__b/c' and '/etc/a/b__c' flatten alike) and neither do two records of one file."""
    flat = hostpath.strip("/").replace("/", "__")[:150]
    key = hashlib.sha256(runtime.encode() + b"\0" + hostpath.encode()).hexdigest()[:16]
    return f"{backup_dir(state_dir)}/{flat}.{key}.orig"


def read(root: Root, hostpath: str) -> bytes | None:
    p = root.real(hostpath)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise RuntimeConfigError(f"{hostpath} is a directory, not a file", fix="pass the config file's path") from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise RuntimeConfigError(f"cannot read {hostpath} under {root.base}: too many levels of symbolic links",
                                 cause=f"a link on the way to {hostpath} loops inside the host root",
                                 fix="replace the looping link with a real directory or file; nothing was changed"
                                 ) from None


def unified_diff(path: str, old: bytes | None, new: bytes | None) -> str:
    a = (old or b"").decode(errors="replace").splitlines(keepends=True)
    b = (new or b"").decode(errors="replace").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"a{path}" if old is not None else "/dev/null",
                                        f"b{path}" if new is not None else "/dev/null"))


def _write_error(path: str, e: OSError) -> RuntimeConfigError:
    why = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
           errno.ENOSPC: "no space left on the device"}.get(e.errno, e.strerror or str(e))
    fix = ("mount the host's configuration read-write (the driver container needs /host/etc writable)"
           if e.errno == errno.EROFS else "check permissions and free space, then run again")
    return RuntimeConfigError(f"cannot write {path}: {why}", cause=why, fix=f"{fix}; nothing was changed")


def _put(root: Root, hostpath: str, data: bytes | None) -> None:
    """Write (or with None remove) `hostpath` inside the root. A symlinked config file is written
    through to its target inside the root, and removing undoes exactly that (the link stays)."""
    if data is None:
        root.unlink(hostpath, follow_symlink=True)
    else:
        root.atomic_write(hostpath, data)


def apply(root: Root, runtime: str, handler: str, edits: list[FileEdit], report: ChangeReport,
          dry_run: bool, state_dir: str = DEFAULT_STATE_DIR) -> None:
    """Write `edits` (skipping those that change nothing), back up originals once, record state."""
    edits = [e for e in edits if not e.noop]
    for e in edits:
        report.diffs[e.path] = unified_diff(e.path, e.old, e.new)
    if dry_run or not edits:
        report.files_changed = [e.path for e in edits]
        if edits:                       # the backups a run would take (a transaction's preimage keeps them)
            have = (load(root, state_dir)["runtimes"].get(runtime) or {}).get("files") or {}
            report.backups = [backup_path(e.path, runtime, state_dir) for e in edits if e.path not in have and e.old is not None]
        return
    data = load(root, state_dir)
    rec = data["runtimes"].setdefault(runtime, {"handler": handler, "files": {}})
    done: list[FileEdit] = []
    made: list[str] = []                 # backups this run wrote: removed again when it fails
    try:
        for e in edits:
            frec = rec["files"].get(e.path)
            if frec is not None and sha256(e.old) != frec.get("written_sha256"):
                # Someone changed the file since driverd last wrote it: the backup no longer holds
                # their edit, so revert must remove only driverd's changes.
                frec["edited_between_runs"] = True
            if frec is None:
                frec = {"created": e.old is None, "backup": None, "fmt": e.fmt, "changes": [], "marker": e.marker}
                if e.old is not None:
                    # The original, taken before driverd's first recorded edit and kept while the record
                    # lives. Without a record, a file of that name can only be a failed run's leftover:
                    # what is there now (an admin's edit since, maybe) is the original.
                    bp = backup_path(e.path, runtime, state_dir)
                    root.atomic_write(bp, e.old, 0o600)
                    made.append(bp)
                    frec["backup"] = bp
                    report.backups.append(bp)
            _put(root, e.path, e.new)
            done.append(e)
            frec["changes"].extend(c.to_json() for c in e.changes)
            frec["written_sha256"] = sha256(e.new)
            rec["files"][e.path] = frec
            report.files_changed.append(e.path)
        for a in report.adopted:
            if a["file"] in report.files_changed:
                rec.setdefault("adopted", {}).setdefault(a["handler"], a)   # the first takeover is the record
        save(root, data, state_dir)
    except (OSError, HostPathError) as err:
        for e in reversed(done):          # put back what this run already wrote
            try:
                _put(root, e.path, e.old)
            except (OSError, HostPathError):
                pass
        for bp in made:                   # and no backup that no record names
            try:
                root.unlink(bp)
            except (OSError, HostPathError):
                pass
        report.files_changed, report.backups = [], []
        if isinstance(err, HostPathError):   # already one line naming the path, cause and fix
            raise
        raise _write_error(getattr(err, "filename", None) or (edits[len(done)].path if len(done) < len(edits)
                                                               else state_file(state_dir)), err) from None


def recorded(root: Root, runtime: str, state_dir: str = DEFAULT_STATE_DIR) -> dict | None:
    return load(root, state_dir)["runtimes"].get(runtime)


def revert(root: Root, runtime: str, report: ChangeReport, dry_run: bool, state_dir: str = DEFAULT_STATE_DIR) -> None:
    """Undo everything recorded for `runtime`; keep edits other people made since."""
    data = load(root, state_dir)
    rec = data["runtimes"].get(runtime)
    if not rec:
        report.skipped = (f"driverd has not changed {runtime}'s configuration (nothing recorded in "
                          f"{state_file(state_dir)})")
        return
    plans: list[tuple[str, bytes | None, bytes | None, str]] = []
    for path, frec in rec["files"].items():
        cur = read(root, path)
        if cur is not None and sha256(cur) == frec.get("written_sha256") and not frec.get("edited_between_runs"):
            # Untouched since our write: the original, byte for byte.
            orig = None if frec["created"] else root.read_bytes(frec["backup"])
            if not frec["created"] and orig is None:
                raise RuntimeConfigError(f"the backup of {path} ({frec['backup']}) is missing",
                                         fix="restore the file by hand; driverd changed nothing")
            plans.append((path, cur, orig, "restored the original"))
        elif cur is None:
            plans.append((path, None, None, "already removed by someone else"))
        else:
            new = _surgical(path, cur, frec)
            plans.append((path, cur, new, "edited since driverd's change: removed only driverd's changes"))
    for path, cur, new, how in plans:
        if cur == new:
            continue
        report.diffs[path] = unified_diff(path, cur, new)
        report.notes.append(f"{path}: {how}")
    for h, a in (rec.get("adopted") or {}).items():
        report.notes.append(f"'{h}' in {a['file']} goes back to what the other tool wrote (it ran {a['before']})")
    if dry_run:
        report.files_changed = [p for p, c, n, _ in plans if c != n]
        return
    for path, cur, new, _ in plans:
        if cur == new:
            continue
        try:
            _put(root, path, new)
        except OSError as err:
            raise _write_error(path, err) from None
        report.files_changed.append(path)
    for frec in rec["files"].values():
        if frec.get("backup"):
            root.unlink(frec["backup"])
    del data["runtimes"][runtime]
    save(root, data, state_dir)


def _surgical(path: str, cur: bytes, frec: dict) -> bytes | None:
    changes = [Change.from_json(c) for c in frec["changes"]]
    text = cur.decode()
    fmt = frec["fmt"]
    if fmt in ("toml", "owned") and path.endswith((".toml", ".conf")):
        from driverd.runtime import tomldoc
        doc = tomldoc.parse(text, path)
        tomldoc.undo(doc, changes)
        out = doc.as_string()
        if fmt == "owned" and not _has_content_toml(doc):
            return None
        return out.encode()
    if fmt == "json":
        from driverd.runtime import jsondoc
        return jsondoc.undo_text(text, changes, path).encode()
    if fmt == "block":
        from driverd.runtime.textblock import remove_block
        out = remove_block(text, frec["marker"])
        return None if frec["created"] and not out.strip() else out.encode()
    if fmt == "owned":
        return None
    raise RuntimeConfigError(f"do not know how to revert {path} ({fmt})")


def _has_content_toml(doc) -> bool:
    return any(k != "version" for k in doc.keys())
