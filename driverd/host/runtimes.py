"""Container runtimes present on the host: containerd (incl. k3s/RKE2), CRI-O, Docker — binary,
version, config, socket, and the runtime handlers their configuration already defines."""
from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from driverd.host.facts import RuntimeFacts
from driverd.root import Root

CONTAINERD_CRI_PLUGINS = ("io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime")
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
    except tomllib.TOMLDecodeError:
        return {}


def containerd_handlers(root: Root, config_path: str) -> tuple[list[str], str | None]:
    docs = [_toml(root, config_path)]
    for pattern in docs[0].get("imports", []) or []:
        if not isinstance(pattern, str):
            continue
        d, _, glob = pattern.rpartition("/")
        docs.extend(_toml(root, f"{d}/{n}") for n in root.listdir(d) if fnmatch.fnmatch(n, glob))
    names: list[str] = []
    for doc in docs:
        plugins = doc.get("plugins", {}) if isinstance(doc.get("plugins"), dict) else {}
        for plugin in CONTAINERD_CRI_PLUGINS:
            runtimes = plugins.get(plugin, {}).get("containerd", {}).get("runtimes", {})
            if isinstance(runtimes, dict):
                names.extend(n for n in runtimes if n not in names)
    note = None if docs[0] or not root.read_text(config_path) else f"{config_path} is not valid TOML"
    return names, note


def crio_handlers(root: Root, config_path: str | None) -> list[str]:
    names: list[str] = []
    files = ([config_path] if config_path else []) + root.glob("/etc/crio/crio.conf.d", ".conf")
    for f in files:
        runtimes = _toml(root, f).get("crio", {}).get("runtime", {}).get("runtimes", {})
        if isinstance(runtimes, dict):
            names.extend(n for n in runtimes if n not in names)
    return names


def docker_handlers(root: Root, config_path: str) -> tuple[list[str], str | None]:
    try:
        doc = json.loads(root.read_text(config_path) or "{}")
    except ValueError:
        return [], f"{config_path} is not valid JSON"
    runtimes = doc.get("runtimes", {}) if isinstance(doc, dict) else {}
    return list(runtimes) if isinstance(runtimes, dict) else [], None


CAPTURED_VERSIONS = "/var/lib/driverd/capture/versions.json"


def _version(root: Root, binary: str) -> str | None:
    if not root.is_live():
        try:
            return json.loads(root.read_text(CAPTURED_VERSIONS) or "{}").get(binary)
        except (ValueError, AttributeError):
            return None
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
