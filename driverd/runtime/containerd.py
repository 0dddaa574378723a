"""containerd (1.x and 2.x, incl. k3s/RKE2 templates): add a runtime handler that containerd itself
loads with every runtime and setting the user had.

Facts this module is built on, measured with the real binaries (tests/runtime/test_containerd_real.py):
- The root config's `version` decides the CRI plugin path: 1 -> plugins.cri, 2 ->
  plugins."io.containerd.grpc.v1.cri", 3 (containerd 2.x) -> plugins."io.containerd.cri.v1.runtime".
- containerd 1.6 *replaces* a whole plugin table with the one from a later file (an import): a drop-in
  that only adds runtimes.nvidia wipes the user's runc/kata runtimes and settings, and the CRI plugin
  then fails ("no corresponding runtime configured ... default_runtime_name runc"). containerd 2.1
  merges plugin tables. So config versions 1/2 (which 1.x and 2.x both read) are edited in place, in
  the file whose CRI table containerd actually uses (the last one in load order that defines it);
  version 3 (2.x only) gets a drop-in under conf.d/ plus an `imports` entry.
- Within one file, a CRI table that defines `runtimes` replaces containerd's built-in map, so when the
  user defined no runtimes (containerd's default runc was in effect) we add runc back explicitly.
"""
from __future__ import annotations

import copy
import fnmatch
import os
import re
import tomllib
from typing import Any

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import adopt, textblock, tomldoc
from driverd.runtime.base import Runtime, dig, first, read_toml
from driverd.runtime.model import CdiFacts, Change, ChangeReport, FileEdit, Options, RuntimeFacts

CRI_PLUGIN = {1: ["plugins", "cri"], 2: ["plugins", "io.containerd.grpc.v1.cri"],
              3: ["plugins", "io.containerd.cri.v1.runtime"]}
RUNC_V2 = "io.containerd.runc.v2"
LINUX_V1 = "io.containerd.runtime.v1.linux"      # containerd 1.x's v1 shim: options are RuncOptions
RUNC_TYPES = (RUNC_V2, "io.containerd.runc.v1", LINUX_V1)
DEFAULT_RUNC = {"runtime_type": RUNC_V2}
CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]
K3S_DIRS = ("/var/lib/rancher/k3s/agent/etc/containerd/", "/var/lib/rancher/rke2/agent/etc/containerd/")
_VERSION_RE = re.compile(r"^\s*version\s*=\s*(\S+)", re.M)


def parse_version(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"v?(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def config_version(doc: dict, path: str) -> int:
    v = doc.get("version", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v not in CRI_PLUGIN:
        raise RuntimeConfigError(f"{path}: unsupported containerd config version {v!r}",
                                 cause="driverd knows versions 1, 2 (containerd 1.x/2.x) and 3 (containerd 2.x)",
                                 fix="set version = 2 or 3 (see `containerd config migrate`); nothing was written")
    return v


def handler_key(version: int, handler: str) -> list[str]:
    return CRI_PLUGIN[version] + ["containerd", "runtimes", handler]


# -- which files containerd loads ------------------------------------------------------------------
def import_patterns(doc: dict, config_path: str) -> list[str]:
    out = []
    for p in doc.get("imports", []) or []:
        if isinstance(p, str):
            out.append(p if p.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(config_path), p)))
    return out


def expand(root: Root, pattern: str) -> list[str]:
    d, _, glob = pattern.rpartition("/")
    if not any(c in glob for c in "*?["):
        return [pattern] if root.is_file(pattern) else []
    return [f"{d}/{n}" for n in root.listdir(d) if fnmatch.fnmatch(n, glob) and root.is_file(f"{d}/{n}")]


def load_order(root: Root, config_path: str, doc: dict) -> list[str]:
    files: list[str] = []
    for pat in import_patterns(doc, config_path):
        files.extend(f for f in expand(root, pat) if f not in files and f != config_path)
    return files


def _read(root: Root, path: str) -> str | None:
    data = root.read_bytes(path)
    return data.decode() if data is not None else None


def deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


# -- the handler we add ----------------------------------------------------------------------------
def runtime_type(table: dict) -> str:
    """The runtime_type containerd's CRI plugin sees ('' when the key is missing or empty)."""
    t = table.get("runtime_type") if isinstance(table, dict) else None
    return t if isinstance(t, str) else ""


def runc_family(table: dict) -> bool:
    """A runc-shim table (an empty runtime_type is a runc table someone wrote without the type)."""
    return runtime_type(table) in RUNC_TYPES + ("",)


def _options(table: dict) -> dict:
    o = table.get("options") if isinstance(table, dict) else None
    return o if isinstance(o, dict) else {}


def binaries(table: dict) -> list[str | None]:
    """The binaries a runtime table names, the one containerd executes first: the v1 shim
    (io.containerd.runtime.v1.linux) reads RuncOptions.Runtime (runtime_engine without options);
    the runc v1/v2 shims read BinaryName."""
    o = _options(table)
    if runtime_type(table) == LINUX_V1:
        first = o.get("Runtime") if o else table.get("runtime_engine")
        return [first, o.get("BinaryName")]
    return [o.get("BinaryName"), o.get("Runtime")]


def runs(table: dict) -> str:
    """What containerd actually runs for a runtime table, in words (for one-line messages)."""
    t = runtime_type(table)
    if not runc_family(table):
        return f"the {t} shim"
    first = binaries(table)[0]
    what = repr(first) if first else "plain runc (no binary set)"
    return f"{what} with an empty runtime_type (containerd then ignores BinaryName)" if not t else what


def legacy_default(ctd: dict, binv: tuple[int, int] | None) -> dict | None:
    """The deprecated [.containerd.default_runtime] table when containerd honours it: 1.x makes it
    runtime "default" and the default, overriding default_runtime_name, as soon as its runtime_type is
    set; 2.x ignores it (measured: "Ignoring unknown key ... default_runtime")."""
    t = ctd.get("default_runtime")
    if not isinstance(t, dict) or not runtime_type(t) or (binv and binv[0] >= 2):
        return None
    return t


def derive(runtimes: dict, default_name: str, handler: str, binary: str, legacy: dict | None = None,
           plugin_systemd: bool = False) -> tuple[dict, str, list[str]]:
    """The handler's table: a copy of the runc-type runtime it derives from (the runtime pods run by
    default, else runc, else containerd's built-in runc), so SystemdCgroup and friends are inherited;
    the binary set where that shim reads it. Returns (table, derived from, notes)."""
    cands = [(legacy, "the deprecated default_runtime table (containerd's effective default)")]
    if default_name != handler:
        cands.append((runtimes.get(default_name), default_name))
    if handler != "runc":
        cands.append((runtimes.get("runc"), "runc"))
    base, name = next(((t, n) for t, n in cands if isinstance(t, dict) and runc_family(t)),
                      (None, "containerd's built-in runc"))
    new = copy.deepcopy(base) if base else dict(DEFAULT_RUNC)
    notes: list[str] = []
    if not runtime_type(new):
        # containerd reads an empty type's options as generic runtime options: BinaryName would be lost.
        new["runtime_type"] = RUNC_V2
        for k in ("runtime_engine", "runtime_root"):     # 1.x accepts these only for the v1 shim
            if new.get(k):
                del new[k]
        if base is not None:
            notes.append(f"{name} has an empty runtime_type (containerd then ignores BinaryName); "
                         f"the handler uses {RUNC_V2}")
    opts = dict(_options(new))
    opts["BinaryName"] = binary
    if new["runtime_type"] == LINUX_V1:
        opts["Runtime"] = binary          # the v1 shim runs RuncOptions.Runtime, not BinaryName
        if plugin_systemd and "SystemdCgroup" not in opts:
            opts["SystemdCgroup"] = True  # what the plugin-wide systemd_cgroup gave the option-less table
        if new.get("runtime_engine"):
            del new["runtime_engine"]     # read only when a v1 table has no options; ours has
        notes.append(f"{name} uses the v1 shim ({LINUX_V1}): the handler sets options.Runtime, which that shim runs")
    new["options"] = opts
    return new, name, notes


def _ensure(doc: Any, key: list[str], value: Any, changes: list[Change]) -> None:
    if tomldoc.plain(tomldoc.get(doc, key, tomldoc.MISSING)) != value:
        changes.append(tomldoc.set_key(doc, key, value))


def _is_ours(rec: dict | None, path: str, key: list[str]) -> bool:
    if not rec or path not in rec.get("files", {}):
        return False
    frec = rec["files"][path]
    if frec.get("fmt") in ("owned", "block"):
        return True
    return any(not c.get("had_old") and key[:len(c["key"])] == c["key"] for c in frec.get("changes", []))


def adoption_fixes(existing: dict, hkey: list[str], binary: str, derived: dict) -> list[tuple[list[str], Any]]:
    """The keys to set so another tool's handler runs `binary` with the shim it names; everything
    else it had (annotations, privileged_without_host_devices, other options) stays."""
    if not runc_family(existing):
        return [(hkey, derived)]          # another shim taken over with --adopt-foreign: driverd's table
    fixes: list[tuple[list[str], Any]] = []
    t = runtime_type(existing)
    if not t:
        fixes.append((hkey + ["runtime_type"], RUNC_V2))
    if t == LINUX_V1:
        fixes.append((hkey + ["options", "Runtime"], binary))
        if "BinaryName" in _options(existing):
            fixes.append((hkey + ["options", "BinaryName"], binary))
    else:
        fixes.append((hkey + ["options", "BinaryName"], binary))
    return fixes


# -- entry point -----------------------------------------------------------------------------------
def plan(root: Root, config_path: str, opts: Options, report: ChangeReport, version_text: str | None,
         rec: dict | None) -> list[FileEdit]:
    binv = parse_version(version_text)
    if config_path.endswith(".tmpl") or (config_path.startswith(K3S_DIRS) and config_path.endswith("config.toml")):
        return _plan_template(root, config_path, opts, report, binv, rec)
    text = _read(root, config_path)
    if text is None:
        text = ""
        report.notes.append(f"{config_path} does not exist; creating it")
    doc = tomldoc.parse(text, config_path)
    if text.strip() and "version" not in doc:
        # A file without `version` is version 1 for containerd; say so, it surprises people.
        report.notes.append(f"{config_path} has no 'version' key: containerd reads it as version 1")
    if not text.strip():
        version = 3 if binv and binv[0] >= 2 else 2
        doc["version"] = version
    else:
        version = config_version(doc, config_path)
    if version == 1 and binv and binv[0] >= 2:
        raise RuntimeConfigError(f"{config_path} is a version 1 config, which containerd {version_text} does not read",
                                 fix="migrate it with `containerd config migrate` first; nothing was written")
    if version == 3:
        return _plan_dropin(root, config_path, text, doc, opts, report, rec)
    return _plan_in_place(root, config_path, text, doc, version, opts, report, binv, rec)


def _plan_in_place(root, config_path, text, doc, version, opts, report, binv, rec) -> list[FileEdit]:
    cri = CRI_PLUGIN[version]
    docs = {config_path: (text, doc)}
    for f in load_order(root, config_path, doc):
        t = _read(root, f) or ""
        docs[f] = (t, tomldoc.parse(t, f))
    # containerd 1.x: the last file that defines the CRI table wins whole; edit that one.
    owner = config_path
    for f, (_, d) in docs.items():
        if isinstance(tomldoc.get(d, cri), dict):
            owner = f
    otext, odoc = docs[owner]
    if owner != config_path:
        report.notes.append(f"the CRI plugin table containerd uses comes from {owner} (an import); editing it there")
    table = tomldoc.plain(tomldoc.get(odoc, cri, {})) or {}
    ctd = table.get("containerd", {}) if isinstance(table.get("containerd"), dict) else {}
    runtimes = ctd.get("runtimes", {}) if isinstance(ctd.get("runtimes"), dict) else {}
    default_name = ctd.get("default_runtime_name") or "runc"
    legacy = legacy_default(ctd, binv)
    hkey = handler_key(version, opts.handler)
    changes: list[Change] = []
    existing = runtimes.get(opts.handler)
    adoption = None
    if isinstance(existing, dict):
        # Another tool's handler is adopted; driverd's own keeps what it was derived from (the default
        # may be the handler itself by now) and only its binary follows --binary.
        ours = _is_ours(rec, owner, hkey)
        if not ours:
            adoption = adopt.decide(root, "containerd", opts.handler, owner, binaries(existing), opts, runs(existing))
        binary = report.binary = opts.binary if ours else adoption.binary
        derived, _, _ = derive(runtimes, default_name, opts.handler, binary, legacy,
                               table.get("systemd_cgroup") is True)
        for key, value in adoption_fixes(existing, hkey, binary, derived):
            _ensure(odoc, key, value, changes)
    else:
        new, base_name, notes = derive(runtimes, default_name, opts.handler, opts.binary, legacy,
                                       table.get("systemd_cgroup") is True)
        report.notes.append(f"handler '{opts.handler}' derives from {base_name}")
        report.notes.extend(notes)
        _ensure(odoc, hkey, new, changes)
    handler_changed = bool(changes)
    if "runc" not in runtimes and (default_name == "runc" or not runtimes) and opts.handler != "runc":
        # Defining runtimes replaces containerd's built-in map: keep the runc every pod uses.
        before = len(changes)
        _ensure(odoc, CRI_PLUGIN[version] + ["containerd", "runtimes", "runc"], dict(DEFAULT_RUNC), changes)
        if len(changes) > before:
            report.notes.append("added containerd's default runc runtime explicitly (defining runtimes replaces "
                                "the built-in one)")
    if isinstance(ctd.get("default_runtime"), dict) and binv and binv[0] >= 2:
        report.notes.append(f"containerd {binv[0]}.{binv[1]} ignores the deprecated default_runtime table in {owner}; "
                            "default_runtime_name decides")
    if opts.set_as_default:
        _set_default(odoc, cri, ctd, legacy, opts.handler, changes, report)
    elif legacy is not None:
        report.notes.append(f"containerd 1.x runs pods without a runtime class with the deprecated default_runtime "
                            f"table (as runtime 'default'), not default_runtime_name = {default_name!r}; "
                            "--set-as-default migrates it")
    if opts.cdi:
        if binv and binv < (1, 7):
            report.notes.append(f"containerd {'.'.join(map(str, binv))} has no CDI support (added in 1.7): "
                                "enable_cdi not set; the CDI spec is still written")
        else:
            _ensure(odoc, cri + ["enable_cdi"], True, changes)
            if not isinstance(table.get("cdi_spec_dirs"), list):
                _ensure(odoc, cri + ["cdi_spec_dirs"], list(CDI_DIRS), changes)
    old = otext.encode() if root.exists(owner) else None
    edit = FileEdit(owner, odoc.as_string().encode(), old, "toml", changes)
    if adoption is not None:
        adopt.report_adoption(report, adoption, [owner] if handler_changed else [], rec, [edit])
    return [edit]


def _set_default(doc, cri, ctd, legacy, handler, changes, report) -> None:
    """default_runtime_name = handler; with containerd 1.x's deprecated default_runtime table in
    effect, that table first becomes runtimes.default (what containerd made of it in memory), so the
    default really changes and pods asking for 'default' keep what they had."""
    if legacy is not None:
        _ensure(doc, cri + ["containerd", "runtimes", "default"], copy.deepcopy(legacy), changes)
        changes.append(tomldoc.remove_key(doc, cri + ["containerd", "default_runtime"]))
        report.notes.append("migrated the deprecated default_runtime table to runtimes.default: containerd 1.x "
                            f"ignores default_runtime_name while that table is set; the default is now '{handler}'")
    _ensure(doc, cri + ["containerd", "default_runtime_name"], handler, changes)


def dropin_path(config_path: str, handler: str) -> str:
    return f"{os.path.dirname(config_path)}/conf.d/99-driverd-{handler}.toml"


def _order_with(root: Root, config_path: str, doc: dict, dropin: str) -> tuple[list[str], bool]:
    """containerd 2.x's load order (the config, then each import pattern's matches in lexical order)
    with driverd's drop-in where containerd will read it; and whether an import already matches it."""
    order = [config_path]
    placed = False
    for pat in import_patterns(doc, config_path):
        matches = [f for f in expand(root, pat) if f != config_path]
        if not placed and fnmatch.fnmatch(dropin, pat):
            matches = sorted(set(matches) | {dropin})
            placed = True
        order.extend(f for f in matches if f not in order)
    if not placed:
        order.append(dropin)                 # appended to `imports`: read last
    return order, placed


def _plan_dropin(root, config_path, text, doc, opts, report, rec) -> list[FileEdit]:
    cri = CRI_PLUGIN[3]
    dropin = dropin_path(config_path, opts.handler)
    order, imported = _order_with(root, config_path, doc, dropin)
    docs: dict[str, tuple[str, Any]] = {config_path: (text, doc)}
    for f in order:
        if f not in docs and f != dropin:
            t = _read(root, f) or ""
            docs[f] = (t, tomldoc.parse(t, f))
    merged: dict = {}
    for f in order:
        if f != dropin:
            merged = deep_merge(merged, tomldoc.plain(docs[f][1]))
    later = order[order.index(dropin) + 1:]
    table = tomldoc.get(merged, cri, {}) or {}
    ctd = table.get("containerd", {}) if isinstance(table.get("containerd"), dict) else {}
    runtimes = ctd.get("runtimes", {}) if isinstance(ctd.get("runtimes"), dict) else {}
    default_name = ctd.get("default_runtime_name") or "runc"
    hkey = handler_key(3, opts.handler)

    import tomlkit
    d = tomlkit.document()
    d.add(tomlkit.comment(f"Written by driverd: the '{opts.handler}' runtime handler. "
                          "`driverd runtime revert` removes this file."))
    d.add("version", 3)
    inplace: dict[str, list[Change]] = {}

    def place(key: list[str], value: Any) -> str | None:
        """Set `key` where it takes effect: containerd 2.x merges files key by key in load order, so a
        file read after driverd's drop-in that sets the key is edited in place; else the drop-in.
        Returns the file that changes (None: already so)."""
        last = None
        for f in later:
            if tomldoc.get(docs[f][1], key, tomldoc.MISSING) is not tomldoc.MISSING:
                last = f
        if last is None:
            tomldoc.set_key(d, key, value)
            return dropin
        ch = inplace.setdefault(last, [])
        before = len(ch)
        _ensure(docs[last][1], key, value, ch)
        if len(ch) == before:
            return None
        report.notes.append(f"{'.'.join(key[-2:])} is set in {last}, which containerd reads after {dropin}: "
                            "changed there")
        return last

    existing = runtimes.get(opts.handler)
    adoption = None
    handler_files: list[str] = []
    if isinstance(existing, dict):
        # Defined by another tool in the config or an import (driverd's own drop-in is not in `merged`).
        where = [f for f in order if f != dropin and isinstance(tomldoc.get(docs[f][1], hkey), dict)][-1]
        adoption = adopt.decide(root, "containerd", opts.handler, where, binaries(existing), opts, runs(existing))
        report.binary = adoption.binary
        derived, _, _ = derive(runtimes, default_name, opts.handler, adoption.binary)
        for key, value in adoption_fixes(existing, hkey, adoption.binary, derived):
            if tomldoc.plain(tomldoc.get(merged, key, tomldoc.MISSING)) != value:
                f = place(key, value)
                if f and f not in handler_files:
                    handler_files.append(f)
    else:
        new, base_name, notes = derive(runtimes, default_name, opts.handler, opts.binary)
        report.notes.append(f"handler '{opts.handler}' derives from {base_name}; written as a drop-in ({dropin})")
        report.notes.extend(notes)
        place(hkey, new)
    if opts.set_as_default:
        place(cri + ["containerd", "default_runtime_name"], opts.handler)
    if opts.cdi:
        place(cri + ["enable_cdi"], True)
        if not isinstance(table.get("cdi_spec_dirs"), list):
            place(cri + ["cdi_spec_dirs"], list(CDI_DIRS))

    edits: list[FileEdit] = []
    old_drop = root.read_bytes(dropin)
    if any(k != "version" for k in d) or old_drop is not None:
        edits.append(FileEdit(dropin, d.as_string().encode(), old_drop, "owned", []))
        if not imported:
            changes: list[Change] = []
            imports = doc.get("imports")
            if isinstance(imports, list):
                imports.append(dropin)
                changes.append(Change("append", ["imports"], value=dropin))
            else:
                changes.append(tomldoc.set_key(doc, ["imports"], [dropin]))
            old = text.encode() if root.exists(config_path) else None
            edits.insert(0, FileEdit(config_path, doc.as_string().encode(), old, "toml", changes))
    for f, ch in inplace.items():
        if ch:
            t, fd = docs[f]
            edits.append(FileEdit(f, fd.as_string().encode(), t.encode(), "toml", ch))
    if adoption is not None:
        adopt.report_adoption(report, adoption, handler_files, rec, edits)
    return edits


# -- k3s / RKE2 Go templates -----------------------------------------------------------------------
def _static_toml(text: str) -> dict:
    try:
        return tomllib.loads("\n".join(ln for ln in text.splitlines() if "{{" not in ln))
    except tomllib.TOMLDecodeError:
        return {}


def _render_table(prefix: list[str], value: dict) -> str:
    def q(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else '"' + k.replace('"', '\\"') + '"'
    import tomlkit
    scalars = {k: v for k, v in value.items() if not isinstance(v, dict)}
    out = [f"[{'.'.join(q(k) for k in prefix)}]"]
    out.extend(f"  {q(k)} = {tomlkit.item(v).as_string()}" for k, v in scalars.items())
    for k, v in value.items():
        if isinstance(v, dict):
            out.append(_render_table(prefix + [k], v))
    return "\n".join(out)


def _plan_template(root, config_path, opts, report, binv, rec) -> list[FileEdit]:
    tmpl = config_path if config_path.endswith(".tmpl") else config_path + ".tmpl"
    generated = tmpl[:-len(".tmpl")]
    text = _read(root, tmpl)
    created = text is None
    if created:
        # k3s/RKE2 rewrite config.toml at every start: changes go into the template, which renders
        # k3s's own config first ("base") and then our table.
        text = '{{ template "base" . }}\n'
        report.notes.append(f"created {tmpl} (k3s/RKE2 regenerate {generated} at start)")
    m = next((mm for mm in _VERSION_RE.finditer(text) if "{{" not in mm.group(0)), None)
    gen = _static_toml(_read(root, generated) or "")
    if m:
        version = int(m.group(1)) if m.group(1).isdigit() else -1
    elif isinstance(gen.get("version"), int):
        version = gen["version"]
    else:
        version = 3 if binv and binv[0] >= 2 else 2
    config_version({"version": version}, tmpl)
    static = _static_toml(text)
    hkey = handler_key(version, opts.handler)
    marker = f"runtime {opts.handler}"
    without = textblock.remove_block(text, marker)
    base_included = created or '{{ template "base"' in text
    ours_before = textblock.has_block(text, marker)   # k3s's rendered config then holds our own table
    for src, where in [(_static_toml(without), tmpl)] + ([(gen, generated)] if base_included and not ours_before
                                                          else []):
        existing = tomldoc.get(src, hkey)
        if not isinstance(existing, dict):
            continue
        # k3s/RKE2 add an 'nvidia' handler themselves when they find nvidia-container-runtime; a table
        # in the template cannot be redefined by another one (containerd refuses duplicate tables).
        if any(adopt.is_nvidia_runtime(b) for b in binaries(existing)):
            report.binary = next(b for b in binaries(existing) if adopt.is_nvidia_runtime(b))
            report.notes.append(f"'{opts.handler}' already exists in {where} (not added by driverd) and runs "
                                f"{runs(existing)}; left as it is")
            if opts.set_as_default or opts.cdi:
                report.notes.append("k3s/RKE2 templates: default runtime and enable_cdi live in a table k3s's base "
                                    "template already defines; set them with k3s's own options (--default-runtime)")
            return []
        raise RuntimeConfigError(
            f"runtime handler '{opts.handler}' already exists in {where} and is not driverd's: it runs "
            f"{runs(existing)}, not an NVIDIA container runtime",
            cause="a k3s/RKE2 template cannot define the same runtime table twice, so driverd cannot take it over",
            fix=f"change or remove '{opts.handler}' in {tmpl} by hand, or choose another name with --handler; "
                "nothing was written", exit_code=3)
    # k3s's last rendering (base + template) knows runc's options; the template's static part wins.
    runtimes = dict(tomldoc.get(gen, CRI_PLUGIN[version] + ["containerd", "runtimes"], {}) or {})
    runtimes.update(tomldoc.get(static, CRI_PLUGIN[version] + ["containerd", "runtimes"], {}) or {})
    runtimes.pop(opts.handler, None)
    default_name = tomldoc.get(gen, CRI_PLUGIN[version] + ["containerd", "default_runtime_name"]) or "runc"
    new, base_name, notes = derive(runtimes, default_name, opts.handler, opts.binary)
    report.notes.append(f"handler '{opts.handler}' derives from {base_name}; appended to the template as a "
                        "marked block (template syntax untouched)")
    report.notes.extend(notes)
    if opts.set_as_default or opts.cdi:
        report.notes.append("k3s/RKE2 templates: default runtime and enable_cdi live in a table k3s's base "
                            "template already defines; set them with k3s's own options (--default-runtime)")
    new_text = textblock.add_block(text, marker, _render_table(hkey, new))
    return [FileEdit(tmpl, new_text.encode(), None if created else text.encode(), "block", [], marker)]


def restart_unit(root: Root, config_path: str) -> str:
    for product in ("k3s", "rke2"):
        if f"/rancher/{product}/" in config_path:
            units = ("k3s", "k3s-agent") if product == "k3s" else ("rke2-server", "rke2-agent")
            for u in units:
                for d in ("/etc/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system",
                          "/lib/systemd/system"):
                    if root.exists(f"{d}/{u}.service"):
                        return u
            return units[0]
    return "containerd"


# -- what detect reads (tomllib only: detect never pays for tomlkit) --------------------------------
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


class Containerd(Runtime):
    """containerd 1.x/2.x, and the one k3s and RKE2 run (their config templates)."""
    name = "containerd"
    title = "containerd"
    detail = "1.x/2.x, k3s/RKE2 templates"
    binaries = ("/usr/bin/containerd", "/usr/local/bin/containerd", "/var/lib/rancher/rke2/bin/containerd")
    configs = ("/etc/containerd/config.toml", "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl",
               "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
               "/var/lib/rancher/rke2/agent/etc/containerd/config.toml.tmpl",
               "/var/lib/rancher/rke2/agent/etc/containerd/config.toml")
    sockets = ("/run/containerd/containerd.sock", "/run/k3s/containerd/containerd.sock")
    process_names = ("containerd", "k3s-server", "k3s-agent", "rke2")
    reloads_on_signal = False       # containerd has no reload: a restart is the only way
    handler_failure = "pods with runtimeClassName {handler} will fail to start"

    def find_binary(self, root: Root) -> str | None:
        # k3s and RKE2 embed containerd in their own binary.
        return first(root, self.binaries) or first(root, _K3S_BIN)

    def effective_handlers(self, root: Root, config_path: str | None) -> tuple[list[str], str | None]:
        return containerd_handlers(root, config_path) if config_path else ([], None)

    def handler_binary(self, root: Root, facts: RuntimeFacts, handler: str) -> str | None:
        table = handler_table(root, facts.config_path, handler) if facts.config_path else {}
        first = binaries(table)[0] if table and runc_family(table) else None
        return first if isinstance(first, str) and first else None

    def default_runtime(self, root: Root, facts: RuntimeFacts) -> str | None:
        return containerd_default_runtime(root, facts)

    def cdi(self, root: Root, facts: RuntimeFacts) -> CdiFacts:
        return containerd_cdi(root, facts)

    def configure(self, root: Root, config_path: str, options: Options, report: ChangeReport,
                  facts: RuntimeFacts | None, record: dict | None) -> list[FileEdit]:
        return plan(root, config_path, options, report, facts.version if facts else None, record)

    def unit(self, root: Root, config_path: str) -> str:
        return restart_unit(root, config_path)
