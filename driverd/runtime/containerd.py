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
from driverd.runtime import textblock, tomldoc
from driverd.runtime.model import Change, ChangeReport, FileEdit, Options

CRI_PLUGIN = {1: ["plugins", "cri"], 2: ["plugins", "io.containerd.grpc.v1.cri"],
              3: ["plugins", "io.containerd.cri.v1.runtime"]}
RUNC_TYPES = ("io.containerd.runc.v2", "io.containerd.runc.v1", "io.containerd.runtime.v1.linux")
DEFAULT_RUNC = {"runtime_type": "io.containerd.runc.v2"}
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
def derive(runtimes: dict, default_name: str, handler: str, binary: str) -> tuple[dict, str]:
    """The handler's table: a copy of the runc-type runtime it derives from (default, else runc,
    else containerd's built-in runc), so SystemdCgroup and friends are inherited; BinaryName set."""
    base, name = None, "containerd's built-in runc"
    cand = runtimes.get(default_name) if default_name != handler else None
    if isinstance(cand, dict) and cand.get("runtime_type", "io.containerd.runc.v2") in RUNC_TYPES:
        base, name = cand, default_name
    elif isinstance(runtimes.get("runc"), dict) and handler != "runc":
        base, name = runtimes["runc"], "runc"
    new = copy.deepcopy(base) if base else dict(DEFAULT_RUNC)
    new.setdefault("runtime_type", "io.containerd.runc.v2")
    opts = new.get("options") if isinstance(new.get("options"), dict) else {}
    opts = dict(opts)
    opts["BinaryName"] = binary
    new["options"] = opts
    return new, name


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


def _check_taken(existing: Any, binary: str, where: str, handler: str) -> bool:
    """True when someone else's handler of that name already runs our binary (nothing to do)."""
    if not isinstance(existing, dict):
        return False
    got = (existing.get("options") or {}).get("BinaryName") if isinstance(existing.get("options"), dict) else None
    if got == binary:
        return True
    raise RuntimeConfigError(
        f"runtime handler '{handler}' already exists in {where} and is not driverd's (BinaryName {got!r})",
        cause="driverd never overwrites a handler it did not add",
        fix=f"choose another name with --handler (runtime.handler), or remove '{handler}' from {where}", exit_code=3)


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
    hkey = handler_key(version, opts.handler)
    if opts.handler in runtimes and not _is_ours(rec, owner, hkey):
        if _check_taken(runtimes[opts.handler], opts.binary, owner, opts.handler):
            report.notes.append(f"'{opts.handler}' already exists in {owner} with BinaryName {opts.binary} "
                                "(not added by driverd); left as it is")
            return []
    new, base_name = derive(runtimes, default_name, opts.handler, opts.binary)
    report.notes.append(f"handler '{opts.handler}' derives from {base_name}")
    changes: list[Change] = []
    _ensure(odoc, hkey, new, changes)
    if "runc" not in runtimes and (default_name == "runc" or not runtimes) and opts.handler != "runc":
        # Defining runtimes replaces containerd's built-in map: keep the runc every pod uses.
        _ensure(odoc, CRI_PLUGIN[version] + ["containerd", "runtimes", "runc"], dict(DEFAULT_RUNC), changes)
        report.notes.append("added containerd's default runc runtime explicitly (defining runtimes replaces "
                            "the built-in one)")
    if opts.set_as_default:
        _ensure(odoc, cri + ["containerd", "default_runtime_name"], opts.handler, changes)
    if opts.cdi:
        if binv and binv < (1, 7):
            report.notes.append(f"containerd {'.'.join(map(str, binv))} has no CDI support (added in 1.7): "
                                "enable_cdi not set; the CDI spec is still written")
        else:
            _ensure(odoc, cri + ["enable_cdi"], True, changes)
            if not isinstance(table.get("cdi_spec_dirs"), list):
                _ensure(odoc, cri + ["cdi_spec_dirs"], list(CDI_DIRS), changes)
    old = otext.encode() if root.exists(owner) else None
    return [FileEdit(owner, odoc.as_string().encode(), old, "toml", changes)]


def dropin_path(config_path: str, handler: str) -> str:
    return f"{os.path.dirname(config_path)}/conf.d/99-driverd-{handler}.toml"


def _plan_dropin(root, config_path, text, doc, opts, report, rec) -> list[FileEdit]:
    cri = CRI_PLUGIN[3]
    dropin = dropin_path(config_path, opts.handler)
    merged = tomldoc.plain(doc)
    others = [f for f in load_order(root, config_path, doc) if f != dropin]
    for f in others:
        t = _read(root, f) or ""
        merged = deep_merge(merged, tomldoc.plain(tomldoc.parse(t, f)))
        d = tomllib.loads(t) if t.strip() else {}
        if isinstance(tomldoc.get(d, handler_key(3, opts.handler)), dict):
            if _check_taken(tomldoc.get(d, handler_key(3, opts.handler)), opts.binary, f, opts.handler):
                report.notes.append(f"'{opts.handler}' already exists in {f} (not added by driverd); left as it is")
                return []
    mine = tomldoc.get(doc, handler_key(3, opts.handler))
    if isinstance(mine, dict) and _check_taken(tomldoc.plain(mine), opts.binary, config_path, opts.handler):
        report.notes.append(f"'{opts.handler}' already exists in {config_path} (not added by driverd); left as it is")
        return []
    table = tomldoc.get(merged, cri, {}) or {}
    ctd = table.get("containerd", {}) if isinstance(table.get("containerd"), dict) else {}
    runtimes = ctd.get("runtimes", {}) if isinstance(ctd.get("runtimes"), dict) else {}
    new, base_name = derive(runtimes, ctd.get("default_runtime_name") or "runc", opts.handler, opts.binary)
    report.notes.append(f"handler '{opts.handler}' derives from {base_name}; written as a drop-in ({dropin})")
    import tomlkit
    d = tomlkit.document()
    d.add(tomlkit.comment(f"Written by driverd: the '{opts.handler}' runtime handler. "
                          "`driverd runtime revert` removes this file."))
    d.add("version", 3)
    ch: list[Change] = []
    tomldoc.set_key(d, handler_key(3, opts.handler), new)
    if opts.set_as_default:
        tomldoc.set_key(d, cri + ["containerd", "default_runtime_name"], opts.handler)
    if opts.cdi:
        tomldoc.set_key(d, cri + ["enable_cdi"], True)
        if not isinstance(table.get("cdi_spec_dirs"), list):
            tomldoc.set_key(d, cri + ["cdi_spec_dirs"], list(CDI_DIRS))
    old_drop = root.read_bytes(dropin)
    edits = [FileEdit(dropin, d.as_string().encode(), old_drop, "owned", ch)]
    patterns = import_patterns(doc, config_path)
    if not any(fnmatch.fnmatch(dropin, p) for p in patterns):
        changes: list[Change] = []
        imports = doc.get("imports")
        if isinstance(imports, list):
            imports.append(dropin)
            changes.append(Change("append", ["imports"], value=dropin))
        else:
            changes.append(tomldoc.set_key(doc, ["imports"], [dropin]))
        old = text.encode() if root.exists(config_path) else None
        edits.insert(0, FileEdit(config_path, doc.as_string().encode(), old, "toml", changes))
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
    for src in [_static_toml(without)] + ([gen] if base_included and not ours_before else []):
        existing = tomldoc.get(src, hkey)
        if isinstance(existing, dict) and _check_taken(existing, opts.binary, tmpl, opts.handler):
            report.notes.append(f"'{opts.handler}' already exists in {tmpl} (not added by driverd); left as it is")
            return []
    # k3s's last rendering (base + template) knows runc's options; the template's static part wins.
    runtimes = dict(tomldoc.get(gen, CRI_PLUGIN[version] + ["containerd", "runtimes"], {}) or {})
    runtimes.update(tomldoc.get(static, CRI_PLUGIN[version] + ["containerd", "runtimes"], {}) or {})
    runtimes.pop(opts.handler, None)
    default_name = tomldoc.get(gen, CRI_PLUGIN[version] + ["containerd", "default_runtime_name"]) or "runc"
    new, base_name = derive(runtimes, default_name, opts.handler, opts.binary)
    report.notes.append(f"handler '{opts.handler}' derives from {base_name}; appended to the template as a "
                        "marked block (template syntax untouched)")
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
