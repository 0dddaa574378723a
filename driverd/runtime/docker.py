"""Docker: merge the handler into daemon.json, keeping every existing key (features included) and
its order; optional default-runtime and features.cdi."""
from __future__ import annotations

import json

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import adopt, jsondoc
from driverd.runtime.base import Runtime, version_tuple
from driverd.runtime.model import CDI_SPEC_DIRS, CdiFacts, RuntimeFacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.runtime.changes import Change, ChangeReport, FileEdit, Options

DEFAULT_CONFIG = "/etc/docker/daemon.json"
RESERVED = ("runc", "io.containerd.runc.v2", "io.containerd.runtime.v1.linux")


def plan(root: Root, config_path: str | None, opts: Options, report: ChangeReport, rec: dict | None) -> list[FileEdit]:
    from driverd.runtime.changes import FileEdit
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
    changes: list[Change] = []

    def ensure(key: list[str], value) -> None:
        cur = doc
        for k in key:
            cur = cur.get(k) if isinstance(cur, dict) else None
        if cur != value:
            changes.append(jsondoc.set_key(doc, key, value))

    adoption = None
    if existing is not None and not mine:
        # Another tool's handler (nvidia-ctk writes {"args": [], "path": "nvidia-container-runtime"}).
        ex = existing if isinstance(existing, dict) else {}
        named = [ex.get("path"), (ex.get("options") or {}).get("BinaryName") if isinstance(ex.get("options"), dict)
                 else None]
        what = repr(named[0] or named[1]) if (named[0] or named[1]) else f"{existing!r}"
        adoption = adopt.decide(root, "docker", opts.handler, path, named, opts, what)
        report.binary = adoption.binary
        if adoption.foreign:        # its args belong to the other binary: driverd's entry replaces it
            ensure(["runtimes", opts.handler], {"path": adoption.binary})
        elif ex.get("runtimeType") and isinstance(ex.get("options"), dict):
            ensure(["runtimes", opts.handler, "options", "BinaryName"], adoption.binary)
        else:
            ensure(["runtimes", opts.handler, "path"], adoption.binary)     # args and the rest stay theirs
    else:
        ensure(["runtimes", opts.handler], {"path": opts.binary})
    handler_changed = bool(changes)
    if opts.set_as_default:
        ensure(["default-runtime"], opts.handler)
    if opts.cdi:
        if doc.get("features") is not None and not isinstance(doc["features"], dict):
            raise RuntimeConfigError(f"{path}: 'features' is not an object", fix="fix the file; nothing was written")
        ensure(["features", "cdi"], True)
    edits = [FileEdit(path, jsondoc.dumps(doc, text or "{\n    \"x\": 1\n}").encode(), raw, "json", changes)
             ] if changes else []
    if adoption is not None:
        adopt.report_adoption(report, adoption, [path] if handler_changed else [], rec, edits)
    return edits


def _daemon_json(root: Root, config_path: str | None) -> dict:
    try:
        doc = json.loads(root.read_text(config_path) or "{}") if config_path else {}
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


# CDI in Docker — the facts and where they come from: Docker 25 added CDI as an opt-in,
# "features": {"cdi": true} in daemon.json (moby PR #45134; cncf-tags/container-device-interface
# issue #84: "CDI is available as an opt-in feature in Docker as of Docker 25"); Docker 28.2.0 turned
# it on by default (release notes 28.2.0: "CDI is now enabled by default", moby PR #49963), and only an
# explicit false turns it off (moby's dockerd startup, cdiEnabled(): "true if CDI feature wasn't
# explicitly disabled via features"; cmd/dockerd/daemon.go, now daemon/command/daemon.go). Spec directories: daemon.json "cdi-spec-dirs", default /etc/cdi and /var/run/cdi.
CDI_SINCE = (25, 0)
CDI_DEFAULT_ON_SINCE = (28, 2)


def docker_cdi(root: Root, facts: RuntimeFacts) -> CdiFacts:
    doc = _daemon_json(root, facts.config_path if facts.config_exists else None)
    features = doc.get("features")
    flag = features.get("cdi") if isinstance(features, dict) else None
    flag = flag if isinstance(flag, bool) else None
    spec_dirs = doc.get("cdi-spec-dirs")
    dirs = tuple(spec_dirs) if isinstance(spec_dirs, list) and all(isinstance(d, str) for d in spec_dirs) \
        else CDI_SPEC_DIRS
    return CdiFacts.by_version("Docker", version_tuple(facts.version), "features.cdi", flag, facts.config_path, dirs,
                               since=CDI_SINCE, since_word="25", default_on=CDI_DEFAULT_ON_SINCE,
                               unknown="Docker's version is unknown (CDI: opt-in from 25.0, on by default from 28.2)",
                               off_word="needs it (opt-in before 28.2)")


def docker_handlers(root: Root, config_path: str) -> tuple[list[str], str | None]:
    try:
        doc = json.loads(root.read_text(config_path) or "{}")
    except (ValueError, RecursionError):
        return [], f"{config_path} is not valid JSON"
    runtimes = doc.get("runtimes", {}) if isinstance(doc, dict) else {}
    return list(runtimes) if isinstance(runtimes, dict) else [], None


class Docker(Runtime):
    name = "docker"
    title = "Docker"
    binaries = ("/usr/bin/dockerd", "/usr/local/bin/dockerd")
    configs = (DEFAULT_CONFIG,)
    sockets = ("/var/run/docker.sock",)
    process_names = ("dockerd",)
    reloads_on_signal = True        # SIGHUP: dockerd reloads daemon.json (runtimes included)
    handler_failure = "containers run with --runtime {handler} will fail to start"

    def effective_handlers(self, root: Root, config_path: str | None) -> tuple[list[str], str | None]:
        return docker_handlers(root, config_path) if config_path else ([], None)

    def handler_binary(self, root: Root, facts: RuntimeFacts, handler: str) -> str | None:
        runtimes = _daemon_json(root, facts.config_path).get("runtimes")
        entry = runtimes.get(handler) if isinstance(runtimes, dict) else None
        if not isinstance(entry, dict):
            return None
        options = entry.get("options")
        named = (options.get("BinaryName") if entry.get("runtimeType") and isinstance(options, dict)
                 else entry.get("path"))
        return named if isinstance(named, str) and named else None

    def default_runtime(self, root: Root, facts: RuntimeFacts) -> str | None:
        name = _daemon_json(root, facts.config_path).get("default-runtime")
        return name if isinstance(name, str) and name else "runc"

    def cdi(self, root: Root, facts: RuntimeFacts) -> CdiFacts:
        return docker_cdi(root, facts)

    def configure(self, root: Root, config_path: str, options: Options, report: ChangeReport,
                  facts: RuntimeFacts | None, record: dict | None) -> list[FileEdit]:
        return plan(root, config_path, options, report, record)
