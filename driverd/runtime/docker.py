"""Docker: merge the handler into daemon.json, keeping every existing key (features included) and
its order; optional default-runtime and features.cdi."""
from __future__ import annotations

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import jsondoc
from driverd.runtime.model import Change, ChangeReport, FileEdit, Options

DEFAULT_CONFIG = "/etc/docker/daemon.json"
RESERVED = ("runc", "io.containerd.runc.v2", "io.containerd.runtime.v1.linux")


def plan(root: Root, config_path: str | None, opts: Options, report: ChangeReport, rec: dict | None) -> list[FileEdit]:
    path = config_path or DEFAULT_CONFIG
    raw = root.read_bytes(path)
    text = raw.decode() if raw is not None else ""
    doc = jsondoc.parse(text, path)
    if opts.handler in RESERVED:
        raise RuntimeConfigError(f"'{opts.handler}' is a runtime name Docker reserves", fix="use another --handler")
    runtimes = doc.get("runtimes")
    if runtimes is not None and not isinstance(runtimes, dict):
        raise RuntimeConfigError(f"{path}: 'runtimes' is not an object", fix="fix the file; nothing was written")
    mine = bool(rec and path in rec.get("files", {}) and any(
        c["key"][:2] == ["runtimes", opts.handler] or c["key"] == ["runtimes"] for c in rec["files"][path]["changes"]
        if not c.get("had_old")))
    existing = (runtimes or {}).get(opts.handler)
    if existing is not None and not mine:
        if isinstance(existing, dict) and existing.get("path") == opts.binary:
            report.notes.append(f"'{opts.handler}' already exists in {path} (not added by driverd); left as it is")
            return []
        raise RuntimeConfigError(
            f"runtime handler '{opts.handler}' already exists in {path} and is not driverd's ({existing!r})",
            cause="driverd never overwrites a handler it did not add",
            fix=f"choose another name with --handler, or remove it from {path}", exit_code=3)
    changes: list[Change] = []

    def ensure(key: list[str], value) -> None:
        cur = doc
        for k in key:
            cur = cur.get(k) if isinstance(cur, dict) else None
        if cur != value:
            changes.append(jsondoc.set_key(doc, key, value))

    ensure(["runtimes", opts.handler], {"path": opts.binary})
    if opts.set_as_default:
        ensure(["default-runtime"], opts.handler)
    if opts.cdi:
        if doc.get("features") is not None and not isinstance(doc["features"], dict):
            raise RuntimeConfigError(f"{path}: 'features' is not an object", fix="fix the file; nothing was written")
        ensure(["features", "cdi"], True)
    if not changes:
        return []
    new = jsondoc.dumps(doc, text or "{\n    \"x\": 1\n}")
    return [FileEdit(path, new.encode(), raw, "json", changes)]
