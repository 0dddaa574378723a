"""Container runtimes present on the host: containerd (incl. k3s/RKE2), CRI-O, Docker — binary,
version, config, socket, and the runtime handlers their configuration already defines."""
from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from driverd.host.facts import RuntimeFacts
from driverd.root import Root

# Where the CRI runtimes live, per containerd config version: v1 (containerd 1.x, the default when
# `version` is absent) keys plugins by short name `cri`; v2 by `io.containerd.grpc.v1.cri`; v3
# (containerd 2.x) by `io.containerd.cri.v1.runtime`. 2.x migrates v2 files, so both are read.
CONTAINERD_CRI_PLUGINS = ("io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime")
CONTAINERD_V1_CRI_PLUGIN = "cri"
# (name, binaries, configs, sockets) in order of preference; the first existing config/socket wins.
CANDIDATES = (
    ("containerd", ("/usr/bin/containerd", "/usr/local/bin/containerd", "/var/lib/rancher/rke2/bin/containerd"),
     ("/etc/containerd/config.toml", "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl",
      "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
      "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl",
      "/var/lib/rancher/rke2/agent/etc/containerd/config.toml"),
     ("/run/containerd/containerd.sock", "/run/k3s/containerd/containerd.sock")),
    ("crio", ("/usr/bin/crio", "/usr/local/bin/crio"), ("/etc/crio/crio.conf",), ("/var/run/crio/crio.sock",)),
    ("docker", ("/usr/bin/dockerd", "/usr/local/bin/dockerd"), ("/etc/docker/daemon.json",),
     ("/var/run/docker.sock",)),
)
_K3S_BIN = ("/usr/local/bin/k3s", "/usr/local/bin/rke2")


def _first(root: Root, paths: tuple[str, ...], want_file: bool = True) -> str | None:
    for p in paths:
        if (root.is_file(p) if want_file else root.exists(p)):
            return p
    return None


def _toml(root: Root, path: str) -> dict:
    text = root.read_text(path)
    if not text:
        return {}
    if path.endswith(".tmpl"):
        # Go-template lines ({{ ... }}) are not TOML; the static part still names the runtimes.
        text = "\n".join(ln for ln in text.splitlines() if "{{" not in ln)
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):   # deeply nested junk overflows the parser
        return {}


def _dig(doc: object, *keys: str) -> dict:
    """doc[k1][k2]...; {} as soon as a level is missing or not a table (a hostile file may put a
    string or an array where a table belongs)."""
    for k in keys:
        if not isinstance(doc, dict):
            return {}
        doc = doc.get(k, {})
    return doc if isinstance(doc, dict) else {}


_MAX_IMPORT_DEPTH = 8


def _containerd_docs(root: Root, path: str, depth: int = 0, seen: set[str] | None = None) -> list[dict]:
    """The config and the files its `imports` name (recursively, as containerd does). A relative
    import is relative to the importing file's directory; each pattern is a filepath.Glob."""
    seen = set() if seen is None else seen
    if path in seen or depth > _MAX_IMPORT_DEPTH:
        return []
    seen.add(path)
    doc = _toml(root, path)
    docs = [doc]
    imports = doc.get("imports", [])
    for pattern in imports if isinstance(imports, list) else []:
        if not isinstance(pattern, str) or not pattern:
            continue
        if not pattern.startswith("/"):
            pattern = f"{path.rpartition('/')[0]}/{pattern}"
        d, _, glob = pattern.rpartition("/")
        for n in root.listdir(d or "/"):
            if fnmatch.fnmatchcase(n, glob):
                docs.extend(_containerd_docs(root, f"{d}/{n}", depth + 1, seen))
    return docs


def containerd_handlers(root: Root, config_path: str) -> tuple[list[str], str | None]:
    docs = _containerd_docs(root, config_path)
    version = docs[0].get("version", 1)
    names: list[str] = []
    for doc in docs:
        plugins = _dig(doc, "plugins")
        keys = CONTAINERD_CRI_PLUGINS + ((CONTAINERD_V1_CRI_PLUGIN,) if version in (1, None) or
                                         not isinstance(version, int) else ())
        for plugin in keys:
            runtimes = _dig(plugins, plugin, "containerd", "runtimes")
            names.extend(n for n in runtimes if n not in names)
    note = None if docs[0] or not root.read_text(config_path) else f"{config_path} is not valid TOML"
    return names, note


def crio_handlers(root: Root, config_path: str | None) -> list[str]:
    # CRI-O reads every regular file of crio.conf.d, whatever its extension (nvidia-ctk writes
    # 99-nvidia.toml there), in lexical order.
    names: list[str] = []
    files = ([config_path] if config_path else []) + [
        p for p in root.glob("/etc/crio/crio.conf.d") if root.is_file(p)]
    for f in files:
        runtimes = _dig(_toml(root, f), "crio", "runtime", "runtimes")
        names.extend(n for n in runtimes if n not in names)
    return names


def docker_handlers(root: Root, config_path: str) -> tuple[list[str], str | None]:
    try:
        doc = json.loads(root.read_text(config_path) or "{}")
    except (ValueError, RecursionError):
        return [], f"{config_path} is not valid JSON"
    runtimes = doc.get("runtimes", {}) if isinstance(doc, dict) else {}
    return list(runtimes) if isinstance(runtimes, dict) else [], None


CAPTURED_VERSIONS = "/var/lib/driverd/capture/versions.json"


def _version(root: Root, binary: str) -> str | None:
    if not root.is_live():
        try:
            v = json.loads(root.read_text(CAPTURED_VERSIONS) or "{}").get(binary)
        except (ValueError, AttributeError, RecursionError):
            return None
        return v if isinstance(v, str) else None
    from driverd.runner import Runner
    from driverd.errors import CommandError
    try:
        res = Runner().run([str(root.real(binary)), "--version"], timeout=5, check=False, mutates=False)
    except CommandError:
        return None
    m = re.search(r"\bv?(\d+\.\d+\.\d+[\w.+~-]*)", res.stdout + res.stderr)
    return m.group(1) if m else None


def read_runtimes(root: Root, handler: str = "nvidia") -> list[RuntimeFacts]:
    out = []
    for name, bins, configs, sockets in CANDIDATES:
        binary = _first(root, bins)
        if name == "containerd" and binary is None and _first(root, _K3S_BIN):
            binary = _first(root, _K3S_BIN)
        config = _first(root, configs)
        socket = _first(root, sockets, want_file=False)
        if binary is None and config is None and socket is None:
            continue
        note = None
        if name == "containerd":
            handlers, note = containerd_handlers(root, config) if config else ([], None)
        elif name == "crio":
            handlers = crio_handlers(root, config)
        else:
            handlers, note = docker_handlers(root, config) if config else ([], None)
        out.append(RuntimeFacts(
            name=name, binary=binary, version=_version(root, binary) if binary else None,
            config_path=config or configs[0], config_exists=config is not None, socket=socket or sockets[0],
            socket_exists=socket is not None, handlers=tuple(handlers), nvidia_handler=handler in handlers,
            note=note))
    return out
