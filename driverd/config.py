"""Configuration: <root>/etc/driverd/config.toml, then DRIVERD_* environment overrides.

One schema below is the only place a key is defined: its type, allowed values, default and help.
Loading validates everything; a bad key or value is a one-line ConfigError naming the key, what was
found and what is allowed. Environment overrides use DRIVERD_<SECTION>_<KEY> (upper-case), e.g.
DRIVERD_DRIVER_VERSION=550.127.05, DRIVERD_RUNTIME_RUNTIMES=containerd,docker.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.errors import ConfigError
from driverd.fsutil import trusted_file
from driverd.runtime.model import HANDLER_NAME

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Mapping

CONFIG_PATH = "/etc/driverd/config.toml"
VERSION_RE = re.compile(r"^\d{3}(\.\d{1,3}){1,2}$")
LISTEN_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]*):\d{1,5}$")
# What driverd.repo.fetch can read: http(s) with a host, file:// (no host but localhost: the path is
# read on this machine) or an absolute directory. Anything else (ftp://, a typo like htps://) would only
# fail at the first fetch, far from the line that says it.
REPO_URL_RE = re.compile(r"^(?:https?://[^/?#\s]+(?:[/?#].*)?|file://(?:localhost)?/.*|/.*)$", re.IGNORECASE)
REPO_URL_HINT = "a repository URL: https://HOST/PATH, http://HOST/PATH, file:///PATH or an absolute directory"


@dataclass(frozen=True)
class Key:
    """One configuration key: its type, default, help and allowed values."""
    type: str                       # str | bool | int | list | params
    default: Any
    help: str
    # for str, and for each element of list; a function when a registry decides (the runtimes)
    allowed: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()
    pattern: re.Pattern | None = None           # for str, and for each element of list
    pattern_hint: str = ""
    # A driver setting: changing it changes what is loaded or running (modules, their parameters, the
    # user-space, the GPU daemons, what an unload does to GPU jobs). In a cluster only a rollout applies
    # one (daemon/cluster_mode.py pins them to what the node last converged to).
    driver: bool = False

    def choices(self) -> tuple[str, ...]:
        return self.allowed() if callable(self.allowed) else self.allowed


def _runtime_choices() -> tuple[str, ...]:
    """runtime.runtimes: every runtime of driverd.runtime's registry, auto and none."""
    from driverd.runtime.registry import names
    return ("auto", *names(), "none")


SCHEMA: dict[str, Key] = {
    "driver.version": Key("str", None, "driver version to provision, e.g. 535.261.03",
                          pattern=VERSION_RE, pattern_hint="a driver version like 535.261.03", driver=True),
    "driver.flavor": Key("str", "auto", "kernel-module flavour", ("auto", "open", "proprietary"), driver=True),
    "driver.manage": Key("str", "auto", "who manages the driver: auto (leave a driver that a distribution package, "
                         "DKMS or NVIDIA's installer owns, still configure the runtimes), always (replace it), never "
                         "(never install, load or unload a driver)", ("auto", "always", "never"), driver=True),
    "modules.parameters": Key("params", {}, "module parameters: [modules.parameters.<module>] key = value",
                              driver=True),
    "modules.load_drm": Key("bool", None, "load nvidia-drm (needed for display / DRM consumers); unset: keep it "
                            "loaded across an upgrade when it was running", driver=True),
    "modules.load_modeset": Key("bool", None, "load nvidia-modeset (display, nvidia-drm); unset: when nvidia-drm is "
                                "loaded, when it was running, or when a GPU is a display controller", driver=True),
    "modules.load_peermem": Key("str", "auto", "load nvidia-peermem (auto: with a Mellanox NIC and MLNX_OFED's "
                                "peer-memory API; not with the open modules on kernel >= 5.12, which use DMA-BUF)",
                                ("auto", "true", "false"), driver=True),
    "modules.unload_policy": Key("str", "refuse", "what to do with processes holding the GPU on unload",
                                 ("refuse", "terminate"), driver=True),
    "modules.terminate_grace_s": Key("int", 30, "seconds between SIGTERM and SIGKILL when terminating", driver=True),
    "modules.kernel": Key("str", "real", "kernel boundary: real (kmod tools), sim (simulated kernel in a host "
                          "tree: tests, demo; only ever used when asked for here or by --kernel-backend sim); auto is "
                          "the same as real", ("auto", "real", "sim")),
    "signing.key": Key("str", None, "private key used to sign modules built on this host (a host path, under "
                       "--root)"),
    "signing.cert": Key("str", None, "certificate (DER or PEM) matching signing.key (a host path, under --root)"),
    "signing.trusted_certs": Key("list", [], "certificates (PEM or DER, host paths under --root) the operator "
                                 "declares the kernel trusts, for hosts whose keyrings cannot be read"),
    "packages.repositories": Key("list", [], "package repositories (https://, http://, file://)",
                                 pattern=REPO_URL_RE, pattern_hint=REPO_URL_HINT),
    "packages.cache_dir": Key("str", "/var/cache/driverd", "download cache, under the root"),
    "packages.cache_max_mb": Key("int", 4096, "size bound of the download cache in MiB"),
    "packages.build_fallback": Key("bool", True, "build locally when no repository holds the package"),
    "packages.source": Key("str", None, "NVIDIA kernel-module source (tree or tarball) for local builds"),
    "packages.index_public_key": Key("str", None, "public key (PEM, a host path under --root) that repository "
                                     "index signatures must verify against"),
    "packages.netrc": Key("str", None, "netrc file (a host path under --root) with the repositories' credentials; "
                          "used instead of user:password@ in a repository URL"),
    "packages.auth_header_file": Key("str", None, "file (a host path under --root) of `Name: value` lines sent "
                                     "to the repositories' exact origins (scheme, host, port) only, e.g. "
                                     "`Authorization: Bearer TOKEN`"),
    "packages.insecure": Key("bool", False, "accept an unsigned repository index over http(s):// (file:// is "
                             "always accepted unsigned); logged at every use"),
    "build.ccache": Key("str", "auto", "compile `driverd build` / build-matrix (and a node's local build) through "
                        "ccache: auto (when ccache is installed), on (required: a build without it fails, naming the "
                        "fix), off; a compile is served from the cache only when its source, options, compiler and "
                        "every header it read match, and every module is checked after the build (--ccache overrides)",
                        ("auto", "on", "off")),
    "build.ccache_dir": Key("str", None, "the compiler cache directory (a host path, under --root; unset: "
                            "<work dir>/ccache, by default <packages.cache_dir>/build/ccache; --ccache-dir "
                            "overrides with a path on this machine)"),
    "build.ccache_max_mb": Key("int", 4096, "size bound of the compiler cache in MiB (ccache's max_size; one "
                               "cell of NVIDIA's modules adds about 30 MiB)"),
    "runtime.runtimes": Key("list", ["auto"], "container runtimes to configure", _runtime_choices),
    "runtime.handler": Key("str", "nvidia", "runtime handler name", pattern=HANDLER_NAME,
                           pattern_hint="a lower-case name like nvidia"),
    "runtime.binary": Key("str", "/usr/bin/nvidia-container-runtime", "the handler's runtime binary"),
    "runtime.set_as_default": Key("bool", False, "make the handler the runtime's default"),
    "runtime.cdi": Key("bool", False, "enable CDI and write a CDI spec"),
    "runtime.adopt_foreign": Key("bool", False, "take over a handler of the same name that another tool pointed "
                                 "at something other than an NVIDIA container runtime"),
    "runtime.restart": Key("str", "systemd", "how to restart a runtime after a change", ("systemd", "signal", "none")),
    "daemons.persistenced": Key("bool", True, "run nvidia-persistenced", driver=True),
    "daemons.mode": Key("str", "auto", "how GPU daemons run: systemd (host), child (driver container), sim; "
                        "auto picks", ("auto", "systemd", "child", "sim"), driver=True),
    "daemons.fabricmanager": Key("str", "auto", "run fabric manager (auto: when NVSwitches exist, or NVLink5 switch "
                                 "trays managed from this host — there with NVLSM before it)",
                                 ("auto", "true", "false"), driver=True),
    "daemons.imex": Key("str", "auto", "run nvidia-imex of the driver's version (auto: on NVLink5 IMEX trays — "
                        "GB200/GB300 — unless NVIDIA's DRA driver's ComputeDomains own IMEX on the node; true: always, "
                        "refused while they do; false: never)", ("auto", "true", "false"), driver=True),
    "userspace.root": Key("str", "/var/lib/driverd/driver", "where driverd installs the driver's user-space: one "
                          "versioned tree per driver (<root>/<version>/lib64, bin, firmware) and the `current` link; a "
                          "host path under --root, writable on immutable hosts (a read-only /usr is never needed)",
                          pattern=re.compile(r"^/[^\0]*[^/\0]$"), pattern_hint="an absolute host path such as "
                          "/var/lib/driverd/driver", driver=True),
    "userspace.bin_dir": Key("str", "/usr/local/bin", "directory on PATH that gets links to the user-space's "
                             "binaries (nvidia-smi -> <userspace.root>/current/bin/nvidia-smi); only driverd's own "
                             "links are ever replaced or removed; none: no links",
                             pattern=re.compile(r"^(/[^\0]*|none)$"), pattern_hint="an absolute host path such as "
                             "/usr/local/bin, or none"),
    "userspace.driver_link": Key("str", "/run/nvidia/driver", "made a symbolic link to <userspace.root>/current when "
                                 "driverd's user-space is the host's (the GPU Operator's driver root, where "
                                 "nvidia-container-toolkit's NVIDIA_CTK_DRIVER_ROOT / --driver-root looks); only "
                                 "driverd's own link is ever replaced or removed; none: no link",
                                 pattern=re.compile(r"^(/[^\0]*[^/\0]|none)$"), pattern_hint="an absolute host path "
                                 "such as /run/nvidia/driver, or none"),
    "userspace.package": Key("str", None, "the driver's user-space for the transaction: a user-space package file "
                             "(driverd build-userspace) or a directory holding driverd-userspace-<version>-<arch>*.tar.zst "
                             "packages; the one of driver.version is switched with the modules (a host path under "
                             "--root; unset: none, unless userspace.fetch)", driver=True),
    "userspace.fetch": Key("bool", False, "fetch driver.version's user-space package from packages.repositories (their "
                           "index's \"userspace\" entries) when userspace.package has none, and switch it with the modules",
                           driver=True),
    "companions.fetch": Key("bool", False, "fetch driver.version's companion packages (the fabric manager, where the "
                            "host needs one) from packages.repositories (their index's \"companions\" entries) and switch "
                            "them with the modules (driverd build-companion makes them); a companion tree of the version "
                            "already installed is switched to without it", driver=True),
    "userspace.max_kept": Key("int", 3, "versioned user-space trees kept under userspace.root (the current one, the "
                              "previous one and a pending switch's are never removed)"),
    "state.dir": Key("str", "/var/lib/driverd", "journal and state directory, under the root"),
    "state.journal_keep": Key("int", 20, "finished runs kept in <state.dir>/journal.d (older ones are pruned)"),
    "state.lock_wait_s": Key("int", 0, "seconds a command waits for the host lock before exiting 3 "
                             "(--wait overrides; the daemon always waits)"),
    "cluster.node_name": Key("str", None, "this node's Kubernetes name (default: $NODE_NAME, then hostname)"),
    "cluster.enabled": Key("str", "auto", "take part in DriverRollouts (the node state machine and the coordinator "
                           "election) in `driverd daemon` / container-entrypoint; auto: when running in a pod or "
                           "cluster.kubeconfig is set", ("auto", "true", "false")),
    "cluster.coordinate": Key("bool", True, "a cluster-mode daemon also stands for the coordinator (the rollout Lease "
                              "holder that admits nodes and writes rollout status); false: this node's side of "
                              "rollouts only, a `driverd cluster coordinator` process coordinates (its own identity, "
                              "which no GPU node holds)"),
    "cluster.kubeconfig": Key("str", None, "kubeconfig a host-mode daemon uses to reach the API (a host path, under "
                              "the root); unset: in-cluster service account"),
    "cluster.allow_exec_credentials": Key("bool", False, "let the daemon's kubeconfig authenticate with an exec plugin "
                                          "or auth-provider (a program the daemon would run as root) or a tokenFile "
                                          "(a file whose content it would send); off: only a token or a client "
                                          "certificate in the kubeconfig"),
    "cluster.namespace": Key("str", "driverd", "namespace of the coordination Lease and of the daemon's pods "
                             "($POD_NAMESPACE wins)"),
    "log.format": Key("str", "text", "logs on stderr: text, or json (one object per line: time, level, msg and "
                      "fields such as step, node, reason); --log-format overrides", ("text", "json")),
    "validation.workload": Key("str", "auto", "the workload check after a driver change, at daemon start and every "
                               "validation.workload_interval_s: NVML and the loaded module agree, CUDA creates a context and "
                               "round-trips memory on every GPU, with the libraries containers get (auto: with the real "
                               "kernel on the live host or /host; on: always; off: never)", ("auto", "on", "off")),
    "validation.workload_timeout_s": Key("int", 60, "seconds the workload check may take before it is killed and the "
                                         "GPU or driver reported hung"),
    "validation.workload_interval_s": Key("int", 3600, "seconds between two workload checks of a daemon whose driver did "
                                          "not change (0: only at start and after a change)"),
    "validation.driver_root": Key("str", None, "where the driver's user-space is (a host path holding lib64/ or "
                                  "usr/lib/...; unset: /run/nvidia/driver, /usr/local/nvidia, then the system's library "
                                  "directories)"),
    "daemon.interval_s": Key("int", 300, "seconds between two reconciles of `driverd daemon` / container-entrypoint "
                             "when nothing else wakes it (config change, SIGHUP)"),
    "daemon.listen": Key("str", "127.0.0.1:9477", "ADDR:PORT of the daemon's /metrics, /healthz and /readyz (port 0: "
                         "any free port, printed at start)", pattern=LISTEN_RE,
                         pattern_hint="ADDR:PORT, e.g. 127.0.0.1:9477, 0.0.0.0:9477 or [::1]:9477"),
    "daemon.config_check_s": Key("int", 5, "seconds between two checks of the config file for a change "
                                 "(mtime, size, inode)"),
    "daemon.retry_min_s": Key("int", 10, "first retry delay after a failed or blocked reconcile (doubles each time)"),
    "daemon.retry_max_s": Key("int", 900, "longest retry delay after failed or blocked reconciles"),
    "daemon.unload_on_exit": Key("bool", False, "unload the driver (a journalled unload) when the daemon or the driver "
                                 "container stops"),
}

# The driver settings, in schema order: what `Key.driver` marks (docs/rollouts.md lists them).
DRIVER_SETTINGS: tuple[str, ...] = tuple(k for k, spec in SCHEMA.items() if spec.driver)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(key: str) -> str:
    return "DRIVERD_" + key.replace(".", "_").upper()


def env_settable(key: str) -> bool:
    """Whether DRIVERD_<SECTION>_<KEY> can set `key`: not the tables of module parameters (file only)."""
    return SCHEMA[key].type != "params"


def env_syntax(key: str) -> str:
    """How the environment spells a value of `key` (load() reads it so)."""
    return {"list": "comma-separated", "bool": "true|false (1|0, yes|no, on|off)",
            "params": "file only: [modules.parameters.<module>]"}.get(SCHEMA[key].type, "")


_ENV_TO_KEY = {env_name(k): k for k in SCHEMA}
# Environment variables that are not configuration keys but share the prefix.
_ENV_NOT_KEYS = {"DRIVERD_ROOT", "DRIVERD_CONFIG", "DRIVERD_LOG_LEVEL", "DRIVERD_DEBUG"}
# The kubelet gives every pod variables for each Service of its namespace (unless the pod sets
# enableServiceLinks: false), named by kubernetes' pkg/kubelet/envvars: the Service's name (a DNS-1035
# label) upper-cased with '-' as '_', then _SERVICE_HOST, _SERVICE_PORT, _SERVICE_PORT_<port name> (an
# IANA service name: letters, digits, single '-', at least one letter), _PORT, and per port
# _PORT_<number>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR]. A Service `driverd` or `driverd-metrics` makes
# DRIVERD_* ones; they describe the cluster, not driverd's configuration.
_SERVICE_LINK = re.compile(
    r"DRIVERD(?:_[A-Z0-9_]*[A-Z0-9])?_(?:SERVICE_HOST|SERVICE_PORT(?:_(?=[A-Z0-9_]*[A-Z])[A-Z0-9]+(?:_[A-Z0-9]+)*)?"
    r"|PORT(?:_[1-9][0-9]{0,4}_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)")


def is_service_link(name: str) -> bool:
    """Whether `name` is one of the variables the kubelet makes for a Service named driverd[-...]."""
    return _SERVICE_LINK.fullmatch(name) is not None


@dataclass
class Config:
    """A loaded configuration: each key's value and where it came from."""
    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    path: str | None = None
    found: bool | None = None           # whether `path` was there and read (None: not loaded from a file)
    explicit: bool = False              # `path` is a file on this machine (--config, $DRIVERD_CONFIG), not under the root

    def __getitem__(self, key: str) -> Any:
        if key not in SCHEMA:
            raise KeyError(key)
        return self.values.get(key, SCHEMA[key].default)

    def get(self, key: str, default: Any = None) -> Any:
        v = self[key]
        return default if v is None else v

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "command line") -> "Config":
        values = dict(self.values)
        sources = dict(self.sources)
        for k, v in overrides.items():
            if v is None:
                continue
            values[k] = _coerce(k, v, source)
            sources[k] = source
        return Config(values, sources, self.path, self.found, self.explicit)

    def to_json(self) -> dict:
        return {k: {"value": self[k], "source": self.sources.get(k, "default")} for k in SCHEMA}

    def driver_settings(self) -> dict[str, Any]:
        """The driver settings' effective values (DRIVER_SETTINGS): what a converge records."""
        return {k: self[k] for k in DRIVER_SETTINGS}

    def pinned_to(self, settings: Mapping[str, Any], source: str) -> "Config":
        """This configuration with the driver settings of `settings` (a recorded driver_settings()) instead
        of its own: unset values stay unset, keys the record lacks keep this configuration's value. A
        recorded value the schema refuses (the record is a file) raises ConfigError naming `source`."""
        values, sources = dict(self.values), dict(self.sources)
        for k in DRIVER_SETTINGS:
            if k not in settings:
                continue
            v = settings[k]
            if v is None:
                values.pop(k, None)
            else:
                values[k] = _coerce(k, v, source)
            sources[k] = source
        return Config(values, sources, self.path, self.found, self.explicit)


    def to_toml(self) -> str:
        """The effective configuration as a config file driverd would load to the same values: every
        key, where its value comes from as a comment, unset keys commented out; the first line says
        which file was read, or that it is absent."""
        state = "read" if self.found else "absent: defaults and the environment only"
        lines = [f"# driverd configuration: {self.path or CONFIG_PATH} ({state})",
                 "# the effective value of every key and where it comes from; unset keys are comments"]
        sections: dict[str, list[str]] = {}
        for key in SCHEMA:
            sections.setdefault(key.split(".", 1)[0], []).append(key)
        for section, keys in sections.items():
            lines += ["", f"[{section}]"]
            tables = []
            for key in keys:
                name, v, src = key.split(".", 1)[1], self[key], self.sources.get(key, "default")
                if SCHEMA[key].type == "params":
                    tables += [(f"[{key}.{_toml_key(m)}]", f"# {src}", *(f"{_toml_key(p)} = {_toml_value(x)}"
                                                                       for p, x in ps.items())) for m, ps in v.items()]
                    if not v:
                        lines.append(f"# [{key}.<module>] none set ({src})")
                elif v is None:
                    lines.append(f"# {name} = (unset, {src})")
                else:
                    lines.append(f"{name} = {_toml_value(v)}".ljust(40) + f" # {src}")
            for t in tables:
                lines += ["", *t]
        return "\n".join(lines) + "\n"


def settings_differences(have: Mapping[str, Any], want: "Config", keys: tuple[str, ...] | None = None) -> list[str]:
    """`key: A -> B` for each driver setting (of `keys`, default all) whose recorded value `have[key]`
    differs from `want`'s; module parameters one line per parameter. A key the record lacks is not
    called different (nothing says what the node runs with)."""
    out = []
    for k in keys or DRIVER_SETTINGS:
        if k not in have:
            continue
        a, b = have[k], want[k]
        if SCHEMA[k].type == "params":
            a, b = a or {}, b or {}
            for mod in sorted(set(a) | set(b)):
                pa, pb = a.get(mod) or {}, b.get(mod) or {}
                for p in sorted(set(pa) | set(pb)):
                    if pa.get(p) != pb.get(p):
                        out.append(f"{k}.{mod}.{p}: {_shown(pa.get(p))} -> {_shown(pb.get(p))}")
        elif a != b:
            out.append(f"{k}: {_shown(a)} -> {_shown(b)}")
    return out


def keep_settings(cfg: Config, recorded: Mapping[str, Any], source: str) -> tuple[Config, list[str]]:
    """`cfg` with the recorded driver settings of a converge instead of its own (all but the driver's
    version and flavour, which the caller decides), and how `cfg` differs from them (what waits for a
    rollout); `cfg` itself when nothing differs. A damaged record raises ConfigError."""
    keys = tuple(k for k in DRIVER_SETTINGS if k in recorded and k not in ("driver.version", "driver.flavor"))
    changed = settings_differences(recorded, cfg, keys)
    if not changed:
        return cfg, []
    return cfg.pinned_to({k: recorded[k] for k in keys}, source), changed


def _shown(v: Any) -> str:
    return "(unset)" if v is None else _toml_value(v)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _toml_value(k)


def _toml_value(v: Any) -> str:
    """A TOML value for what the schema holds (str, bool, int, list of str): JSON's string escapes are
    TOML's basic-string escapes."""
    import json
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v), ensure_ascii=False)


def _fail(key: str, found: Any, where: str, allowed: str) -> ConfigError:
    return ConfigError(f"invalid value {found!r} for {key} in {where}", cause=f"{key} must be {allowed}",
                       fix=f"set {key} to {allowed}")


def _coerce(key: str, value: Any, where: str) -> Any:
    spec = SCHEMA[key]
    if spec.type == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise _fail(key, value, where, "true or false")
    if spec.type == "int":
        if isinstance(value, bool):
            raise _fail(key, value, where, "a whole number")
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise _fail(key, value, where, "a whole number") from None
        if n < 0:
            raise _fail(key, value, where, "a whole number >= 0")
        return n
    if spec.type == "list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _fail(key, value, where, "a list of strings")
        allowed = spec.choices()
        for v in value:
            if allowed and v not in allowed:
                raise _fail(key, v, where, "one of " + ", ".join(allowed))
            if spec.pattern and not spec.pattern.match(v):
                raise _fail(key, v, where, spec.pattern_hint)
        return list(value)
    if spec.type == "params":
        if not isinstance(value, dict):
            raise _fail(key, value, where, "a table of [modules.parameters.<module>] tables")
        out: dict[str, dict[str, str]] = {}
        for mod, params in value.items():
            if not isinstance(params, dict):
                raise _fail(f"{key}.{mod}", params, where, "a table of parameter = value")
            for p, v in params.items():
                if isinstance(v, (dict, list)):
                    raise _fail(f"{key}.{mod}.{p}", v, where, "a string, number or boolean")
            out[mod.replace("-", "_")] = {p: _param_str(v) for p, v in params.items()}
        return out
    # str
    allowed = spec.choices()
    if not isinstance(value, str) or value == "":
        raise _fail(key, value, where, "a non-empty string" if not allowed else "one of " + ", ".join(allowed))
    if allowed and value not in allowed:
        raise _fail(key, value, where, "one of " + ", ".join(allowed))
    if spec.pattern and not spec.pattern.match(value):
        raise _fail(key, value, where, spec.pattern_hint)
    return value


def _param_str(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def _flatten(doc: dict, where: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    sections = sorted({k.split(".")[0] for k in SCHEMA})
    for section, body in doc.items():
        if section not in sections:
            raise ConfigError(f"unknown section [{section}] in {where}", cause="driverd does not know this section",
                              fix="use one of: " + ", ".join(f"[{s}]" for s in sections))
        if not isinstance(body, dict):
            raise ConfigError(f"{section} in {where} must be a table", cause=f"found {body!r}",
                              fix=f"write it as [{section}] with keys below it")
        for k, v in body.items():
            key = f"{section}.{k}"
            if key not in SCHEMA:
                known = [s.split(".", 1)[1] for s in SCHEMA if s.startswith(section + ".")]
                import difflib
                near = difflib.get_close_matches(k, known, 1)       # flavour -> flavor
                raise ConfigError(f"unknown key {key} in {where}", cause=f"[{section}] has no key {k!r}",
                                  fix=(f"did you mean {near[0]}? " if near else "") + "use one of: " + ", ".join(known))
            flat[key] = v
    return flat


def set_value(root, cfg: Config, key: str, value: Any) -> str:
    """Write `key = value` into the configuration file `cfg` was read from (created when absent),
    keeping every other line and comment; atomic, the file's mode kept. The path written back. A key
    the environment sets is refused: the file would not decide it."""
    import tomlkit
    value = _coerce(key, value, "the value to write")
    src = cfg.sources.get(key, "")
    if src.startswith("env"):
        raise ConfigError(f"cannot set {key} in the configuration file: {src} sets it",
                          cause="the environment overrides the file", fix=f"change or unset {env_name(key)}")
    section, name = key.split(".", 1)
    shown = cfg.path or (CONFIG_PATH if root.is_slash else f"{root.base}{CONFIG_PATH}")
    try:
        if cfg.explicit:
            try:
                with open(shown) as f:
                    text = f.read()
            except FileNotFoundError:
                text = ""
        else:
            text = root.read_text(CONFIG_PATH) or ""
        import tomllib
        doc = tomlkit.parse(text)
        doc.setdefault(section, tomlkit.table())[name] = value
        out = tomlkit.dumps(doc)
        if _coerce(key, tomllib.loads(out)[section][name], shown) != value:     # what driverd will read back
            raise ConfigError(f"writing {key} to {shown} would not set it", cause="the file did not read back "
                              "the value", fix=f"set {key} = {_toml_value(value)} there by hand")
        if cfg.explicit:
            from driverd.fsutil import atomic_write
            atomic_write(shown, out)
        else:
            root.atomic_write(CONFIG_PATH, out)
        return shown
    except (OSError, ValueError, tomlkit.exceptions.TOMLKitError) as e:
        raise ConfigError(f"cannot set {key} in {shown}: {e}", cause="the file cannot be read or written",
                          fix=f"set {key} = {_toml_value(value)} there by hand") from None


def load(root, path: str | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read the config file under `root` (absent file = defaults) and apply DRIVERD_* overrides."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("DRIVERD_CONFIG")
    if path:  # an explicit file is a path on the machine running driverd, not under the root
        real, shown = os.fspath(path), path
    else:
        shown = CONFIG_PATH if root.is_slash else f"{root.base}{CONFIG_PATH}"
        try:
            real = root.real_on_disk(CONFIG_PATH)
        except OSError as e:   # e.g. a symlink loop under the root
            raise ConfigError(f"cannot read {shown}: {e.strerror}", cause="the path does not resolve to a file",
                              fix=f"replace {shown} with a regular file") from None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    try:
        mode = os.stat(real).st_mode
        if not stat.S_ISREG(mode):                 # a directory, FIFO or device: never block on it
            raise IsADirectoryError(21, "not a regular file") if stat.S_ISDIR(mode) else OSError(22, "not a regular file")
        # Only root (or the user running a one-shot command on their own file) may be able to change
        # it: a config another user can write decides what root loads, trusts and runs.
        real = trusted_file(real, "config file", shown=shown) or real
        with open(real, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if path:
            raise ConfigError(f"config file {shown} does not exist", cause="--config names a missing file",
                              fix="create it or drop --config") from None
        raw = None
    except OSError as e:
        raise ConfigError(f"cannot read {shown}: {e.strerror}", cause="the file is not readable",
                          fix="check its permissions") from None
    if raw is not None:
        import tomllib  # not at the top: most hosts parse no TOML, and its import was ~4 ms of detect
        try:
            doc = tomllib.loads(raw.decode("utf-8", errors="replace"))
        except RecursionError:
            raise ConfigError(f"{shown} is not valid TOML: nested too deeply", cause="a syntax error in the config file",
                              fix="fix the config file (see `driverd config --help` for the keys)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{shown} is not valid TOML: {e}", cause="a syntax error in the config file",
                              fix="fix the line named above (see `driverd config --help` for the keys)") from None
        for key, v in _flatten(doc, shown).items():
            values[key] = _coerce(key, v, shown)
            sources[key] = shown
    for name, v in environ.items():
        if not name.startswith("DRIVERD_") or name in _ENV_NOT_KEYS:
            continue
        key = _ENV_TO_KEY.get(name)
        if key is None and is_service_link(name):
            continue
        if key is None:
            raise ConfigError(f"unknown environment variable {name}", cause="it is not a driverd setting",
                              fix="unset it or use one of: " + ", ".join(sorted(_ENV_TO_KEY)))
        if SCHEMA[key].type == "params":
            raise ConfigError(f"{name} cannot be set from the environment", cause="module parameters are tables",
                              fix="set [modules.parameters.<module>] in the config file")
        values[key] = _coerce(key, v, f"environment {name}")
        sources[key] = f"env {name}"
    return Config(values, sources, shown, found=raw is not None, explicit=bool(path))
