"""What detect reads of containerd's configuration (tomllib only: detect never pays for tomlkit):
the runtime handlers its config and imports define, a handler's table, the default runtime and the
CDI switch in effect."""
from __future__ import annotations

import fnmatch

from driverd.root import Root
from driverd.runtime.base import dig, read_toml
from driverd.runtime.containerd.tables import CDI_DIRS, deep_merge, legacy_default, parse_version
from driverd.runtime.model import CdiFacts, RuntimeFacts

# Where the CRI runtimes live, per containerd config version: v1 (containerd 1.x, the default when
# `version` is absent) keys plugins by short name `cri`; v2 by `io.containerd.grpc.v1.cri`; v3
# (containerd 2.x) by `io.containerd.cri.v1.runtime`. 2.x migrates v2 files, so both are read.
CONTAINERD_CRI_PLUGINS = ("io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime")
CONTAINERD_V1_CRI_PLUGIN = "cri"
_K3S_BIN = ("/usr/local/bin/k3s", "/usr/local/bin/rke2")
_MAX_IMPORT_DEPTH = 8


def _containerd_files(root: Root, path: str, depth: int = 0, seen: set[str] | None = None) -> list[tuple[str, dict]]:
    """The config and the files its `imports` name (recursively, as containerd does), in load order,
    each with its parsed content. A relative import is relative to the importing file's directory;
    each pattern is a filepath.Glob."""
    seen = set() if seen is None else seen
    if path in seen or depth > _MAX_IMPORT_DEPTH:
        return []
    seen.add(path)
    doc = read_toml(root, path)
    files = [(path, doc)]
    imports = doc.get("imports", [])
    for pattern in imports if isinstance(imports, list) else []:
        if not isinstance(pattern, str) or not pattern:
            continue
        if not pattern.startswith("/"):
            pattern = f"{path.rpartition('/')[0]}/{pattern}"
        d, _, glob = pattern.rpartition("/")
        for n in root.listdir(d or "/"):
            if fnmatch.fnmatchcase(n, glob):
                files.extend(_containerd_files(root, f"{d}/{n}", depth + 1, seen))
    return files


def _containerd_docs(root: Root, path: str) -> list[dict]:
    return [doc for _, doc in _containerd_files(root, path)]


def containerd_handlers(root: Root, config_path: str) -> tuple[list[str], str | None]:
    docs = _containerd_docs(root, config_path)
    version = docs[0].get("version", 1)
    names: list[str] = []
    for doc in docs:
        plugins = dig(doc, "plugins")
        keys = CONTAINERD_CRI_PLUGINS + ((CONTAINERD_V1_CRI_PLUGIN,) if version in (1, None) or
                                         not isinstance(version, int) else ())
        for plugin in keys:
            runtimes = dig(plugins, plugin, "containerd", "runtimes")
            names.extend(n for n in runtimes if n not in names)
    note = None if docs[0] or not root.read_text(config_path) else f"{config_path} is not valid TOML"
    return names, note


def _cri_tables(files: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(file, CRI plugin table) for every file of the load order that defines one (the short `cri`
    key only where the root config is version 1, as containerd_handlers reads it)."""
    version = files[0][1].get("version", 1) if files else 1
    keys = CONTAINERD_CRI_PLUGINS + ((CONTAINERD_V1_CRI_PLUGIN,) if version in (1, None) or
                                     not isinstance(version, int) else ())
    out = []
    for path, doc in files:
        plugins = dig(doc, "plugins")
        out.extend((path, plugins[k]) for k in keys if isinstance(plugins.get(k), dict))
    return out


def handler_table(root: Root, config_path: str, handler: str) -> dict:
    """The handler's runtime table as the configuration in effect defines it ({} when it does not)."""
    table: dict = {}
    for _, cri in _cri_tables(_containerd_files(root, config_path)):
        t = dig(cri, "containerd", "runtimes", handler)
        if t:
            table = deep_merge(table, t)
    return table


# CDI in containerd's CRI plugin — the facts and where they come from:
# - containerd 1.6 has no CDI: the 1.6.20 binary's `containerd config default` has no enable_cdi key
#   (measured: tests/runtime/test_handler_needs_real.py).
# - 1.7 added it, off by default: `enable_cdi` (false) and `cdi_spec_dirs` (["/etc/cdi", "/var/run/cdi"])
#   in the CRI plugin's table (containerd PR #6654 "CRI: add support for CDI device injection";
#   release/1.7 pkg/cri/config/config_unix.go DefaultConfig: EnableCDI false).
# - 2.0 turned it on by default (containerd PR #9621 "Enable CDI by default";
#   internal/cri/config/config_unix.go DefaultRuntimeConfig: EnableCDI true); measured: 2.1's `config
#   default` prints enable_cdi = true under plugins.'io.containerd.cri.v1.runtime', and `config dump`
#   carries an enable_cdi of a version 2 file (plugins."io.containerd.grpc.v1.cri") over.
# - Which file wins: 1.x replaces a whole plugin table with a later file's (services/server/config/
#   config.go mergeConfig, "Replace entire sections"; measured for runtimes on 1.6), 2.x merges key by key.
CDI_SINCE = (1, 7)
CDI_DEFAULT_ON_SINCE = (2, 0)


def _effective_cri(root: Root, facts: RuntimeFacts) -> tuple[tuple[int, int] | None, list[tuple[str, dict]]]:
    """containerd's (major, minor) (None for k3s/RKE2, whose binary is not containerd's) and the CRI
    tables that decide its settings, in load order: under 1.x only the last file that defines the CRI
    table (it replaces the table whole), under 2.x every one (merged key by key)."""
    k3s = facts.binary in _K3S_BIN
    binv = None if k3s else parse_version(facts.version)
    files = _containerd_files(root, facts.config_path) if facts.config_exists and facts.config_path else []
    tables = _cri_tables(files)
    return binv, tables[-1:] if binv and binv[0] < 2 else tables


def containerd_default_runtime(root: Root, facts: RuntimeFacts) -> str | None:
    binv, tables = _effective_cri(root, facts)
    name = "runc"
    for _, cri in tables:
        ctd = dig(cri, "containerd")
        if isinstance(ctd.get("default_runtime_name"), str) and ctd["default_runtime_name"]:
            name = ctd["default_runtime_name"]
        if legacy_default(ctd, binv) is not None:
            name = "default"        # 1.x: the deprecated default_runtime table wins (see legacy_default)
    return name


def containerd_cdi(root: Root, facts: RuntimeFacts) -> CdiFacts:
    k3s = facts.binary in _K3S_BIN
    binv, tables = _effective_cri(root, facts)
    enabled, where, dirs = None, None, tuple(CDI_DIRS)
    for path, cri in tables:
        if isinstance(cri.get("enable_cdi"), bool):
            enabled, where = cri["enable_cdi"], path
        spec_dirs = cri.get("cdi_spec_dirs")
        if isinstance(spec_dirs, list) and all(isinstance(d, str) for d in spec_dirs):
            dirs = tuple(spec_dirs)
    why = "k3s/RKE2 embed containerd, whose version is not known here" if k3s else "containerd's version is unknown"
    return CdiFacts.by_version("containerd", binv, "enable_cdi", enabled, where, dirs, since=CDI_SINCE,
                               since_word="1.7", default_on=CDI_DEFAULT_ON_SINCE, unknown=why,
                               off_word="defaults to false")
