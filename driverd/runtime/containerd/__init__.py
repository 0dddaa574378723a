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

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import adopt, textblock, tomldoc
from driverd.runtime.base import Runtime, first
from driverd.runtime.containerd.detect import (
    _K3S_BIN,
    containerd_cdi,
    containerd_default_runtime,
    containerd_handlers,
    handler_table,
)
from driverd.runtime.containerd.tables import (
    CDI_DIRS,
    CRI_PLUGIN,
    DEFAULT_RUNC,
    adoption_fixes,
    binaries,
    config_version,
    deep_merge,
    derive,
    handler_key,
    legacy_default,
    parse_version,
    runc_family,
    runs,
)
from driverd.runtime.model import CdiFacts, RuntimeFacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from driverd.runtime.changes import Change, ChangeReport, FileEdit, Options

K3S_DIRS = ("/var/lib/rancher/k3s/agent/etc/containerd/", "/var/lib/rancher/rke2/agent/etc/containerd/")
_VERSION_RE = re.compile(r"^\s*version\s*=\s*(\S+)", re.M)


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
    from driverd.runtime.changes import FileEdit
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
    from driverd.runtime.changes import Change, FileEdit
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
    import tomllib  # not at the top: most hosts parse no TOML, and its import was ~4 ms of detect
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
    from driverd.runtime.changes import FileEdit
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
