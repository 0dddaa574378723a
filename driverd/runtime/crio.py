"""CRI-O: a drop-in in the directory CRI-O actually reads (crio.conf.d, or the --config-dir its
service passes) declaring [crio.runtime.runtimes.<handler>].

CRI-O reads crio.conf first, then every file of the drop-in directory in lexical order, later files
winning per option; runtime tables are merged by name. Our file is 99-driverd-<handler>.conf so it
sorts last. CRI-O refuses to start when a runtime's runtime_path does not exist, so we refuse to add
one whose binary is missing.
"""
from __future__ import annotations

import os
import re
import shlex

from driverd.errors import EXIT_USAGE, RuntimeConfigError
from driverd.root import Root
from driverd.runtime import adopt, tomldoc
from driverd.runtime.base import Runtime, dig, read_toml, version_tuple
from driverd.runtime.model import CDI_SPEC_DIRS, CdiFacts, RuntimeFacts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.runtime.changes import ChangeReport, FileEdit, Options

DEFAULT_CONFIG = "/etc/crio/crio.conf"
DEFAULT_DIR = "/etc/crio/crio.conf.d"
ENV_FILES = ("/etc/sysconfig/crio", "/etc/default/crio")
UNIT_FILES = ("/etc/systemd/system/crio.service", "/usr/lib/systemd/system/crio.service",
              "/lib/systemd/system/crio.service")
INHERITED = ("runtime_root", "monitor_path", "monitor_cgroup", "monitor_env", "runtime_config_path")


def config_dir(root: Root) -> str:
    """The drop-in directory CRI-O's service uses: --config-dir/-d or CONTAINER_CONFIG_DIR, else the default."""
    for f in ENV_FILES + UNIT_FILES + tuple(root.glob("/etc/systemd/system/crio.service.d", ".conf")):
        text = root.read_text(f) or ""
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("#"):
                continue
            m = re.match(r"(?:Environment=)?\"?CONTAINER_CONFIG_DIR=\"?([^\"\s]+)", line)
            if m:
                return m.group(1)
            if "--config-dir" in line or re.search(r"(^|\s)-d\s", line):
                try:
                    words = shlex.split(line.split("=", 1)[1] if line.startswith(("ExecStart=", "CRIO_")) else line)
                except ValueError:
                    continue
                for i, w in enumerate(words):
                    if w.startswith("--config-dir="):
                        return w.split("=", 1)[1]
                    if w in ("--config-dir", "-d") and i + 1 < len(words):
                        return words[i + 1]
    return DEFAULT_DIR


def _load(root: Root, path: str) -> dict:
    text = root.read_text(path)
    if not text or not text.strip():
        return {}
    import tomllib  # not at the top: most hosts parse no TOML, and its import was ~4 ms of detect
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        where = f" (line {m.group(1)}, column {m.group(2)})" if m else ""
        raise RuntimeConfigError(f"{path} is not valid TOML{where}", cause=str(e),
                                 fix=f"fix {path}; CRI-O would refuse it too; driverd wrote nothing",
                                 exit_code=EXIT_USAGE) from None


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dropin_path(cdir: str, handler: str) -> str:
    return f"{cdir.rstrip('/')}/99-driverd-{handler}.conf"


def _read_files(root: Root, config_path: str | None, cdir: str, ours: str) -> list[str]:
    """The files CRI-O reads, in its order: the main config, then every regular file of the drop-in
    directory in lexical order (CRI-O walks the directory; the extension does not matter, so
    nvidia-ctk's 99-nvidia.toml counts), driverd's own drop-in where it sorts."""
    files = sorted([p for p in root.glob(cdir) if p != ours and root.is_file(p)] + [ours])
    return [config_path or DEFAULT_CONFIG] + files


def plan(root: Root, config_path: str | None, opts: Options, report: ChangeReport,
         rec: dict | None = None) -> list[FileEdit]:
    from driverd.runtime.changes import FileEdit
    cdir = config_dir(root)
    ours = dropin_path(cdir, opts.handler)
    order = _read_files(root, config_path, cdir, ours)
    later = order[order.index(ours) + 1:]
    docs = {f: _load(root, f) for f in order if f != ours}
    merged: dict = {}
    for f in order:
        if f != ours:
            merged = _merge(merged, docs[f])
    hkey = ["crio", "runtime", "runtimes", opts.handler]
    # A runtime table in a later file replaces an earlier one whole (CRI-O decodes each file onto a
    # fresh handler), so the handler CRI-O uses is the one in the last file that defines it.
    defs = [f for f in order if f != ours and isinstance(tomldoc.get(docs[f], hkey), dict)]
    inplace: dict[str, list] = {}
    table = None
    adoption = None
    handler_in: list[str] = []              # where the adopted handler changes
    if defs:
        where = defs[-1]
        theirs = tomldoc.get(docs[where], hkey)
        path = theirs.get("runtime_path")
        runs = repr(path) if path else f"whatever '{opts.handler}' is on CRI-O's PATH (no runtime_path)"
        adoption = adopt.decide(root, "crio", opts.handler, where, [path], opts, runs)
        binary = adoption.binary
        if path != binary and where in later:   # read after driverd's drop-in: change it there
            inplace[where] = [("runtime_path", binary)]
            handler_in.append(where)
        elif path != binary:    # driverd's drop-in (read later) carries their table with the new path
            table = {**theirs, "runtime_path": binary}
            handler_in.append(ours)
    else:
        binary = opts.binary
    report.binary = binary
    if not root.exists(binary):
        raise RuntimeConfigError(f"{binary} does not exist on the host",
                                 cause="CRI-O refuses to start when a runtime's runtime_path is missing",
                                 fix="install nvidia-container-toolkit first, or pass --binary PATH; nothing was written")
    if not defs:
        rt = tomldoc.get(merged, ["crio", "runtime"], {}) or {}
        runtimes = rt.get("runtimes", {}) if isinstance(rt.get("runtimes"), dict) else {}
        base_name = rt.get("default_runtime") or ("runc" if "runc" in runtimes else "crun" if "crun" in runtimes
                                                  else "runc")
        base = runtimes.get(base_name, {}) if isinstance(runtimes.get(base_name), dict) else {}
        table = {"runtime_path": opts.binary, "runtime_type": "oci"}
        table.update({k: base[k] for k in INHERITED if k in base})
        report.notes.append(f"handler '{opts.handler}' inherits "
                            f"{', '.join(k for k in INHERITED if k in base) or 'nothing'} from {base_name}; "
                            f"drop-in {ours} (CRI-O reads {cdir})")
    import tomlkit
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"Written by driverd: the '{opts.handler}' runtime handler. "
                            "`driverd runtime revert` removes this file."))
    if opts.set_as_default:
        dkey = ["crio", "runtime", "default_runtime"]
        setter = [f for f in later if tomldoc.get(docs[f], dkey) is not None]
        if setter:              # a file CRI-O reads after driverd's drop-in names the default: change it there
            if tomldoc.get(docs[setter[-1]], dkey) != opts.handler:
                inplace.setdefault(setter[-1], []).append(("default_runtime", opts.handler))
        else:
            tomldoc.set_key(doc, dkey, opts.handler)
    if table is not None:
        tomldoc.set_key(doc, hkey, table)
    if opts.cdi:
        report.notes.append("CRI-O reads CDI specs from /etc/cdi and /var/run/cdi without a switch")
    edits: list[FileEdit] = []
    old_ours = root.read_bytes(ours)
    if len(doc.keys()) or old_ours is not None:
        edits.append(FileEdit(ours, doc.as_string().encode(), old_ours, "owned"))
    for f, sets in inplace.items():
        text = root.read_text(f) or ""
        fd = tomldoc.parse(text, f)
        changes = []
        for k, v in sets:
            key = (hkey + [k]) if k == "runtime_path" else ["crio", "runtime", k]
            changes.append(tomldoc.set_key(fd, key, v))
        report.notes.append(f"{f} is read after {ours}: changed {', '.join(k for k, _ in sets)} there")
        edits.append(FileEdit(f, fd.as_string().encode(), text.encode(), "toml", changes))
    if adoption is not None:
        adopt.report_adoption(report, adoption, handler_in, rec, edits)
    return edits


def crio_files(root: Root, config_path: str | None) -> list[tuple[str, dict]]:
    """The files CRI-O reads, in its order — the main config, then every regular file of its drop-in
    directory (config_dir: whatever the extension; nvidia-ctk writes 99-nvidia.toml there) in lexical
    order —, each parsed (tomllib; {} when missing or invalid: detection never raises)."""
    files = ([config_path] if config_path else []) + [p for p in root.glob(config_dir(root)) if root.is_file(p)]
    return [(f, read_toml(root, f)) for f in files]


def crio_handlers(root: Root, config_path: str | None) -> list[str]:
    names: list[str] = []
    for _, doc in crio_files(root, config_path):
        runtimes = dig(doc, "crio", "runtime", "runtimes")
        names.extend(n for n in runtimes if n not in names)
    return names


# CDI in CRI-O — the facts and where they come from: CRI-O injects CDI devices from 1.24 on, with no
# switch (cri-o PR #5571 "server: add support for CDI device injection", merged 2022-03-07; the first
# tag that contains it is v1.24.0, none of 1.23.x does), reading [crio.runtime] cdi_spec_dirs, default
# the CDI package's /etc/cdi and /var/run/cdi (pkg/config/config.go: CDISpecDirs cdi.DefaultSpecDirs);
# cncf-tags/container-device-interface's README: "In CRI-O CDI support is enabled by default".
CDI_SINCE = (1, 24)


def crio_cdi(root: Root, facts: RuntimeFacts) -> CdiFacts:
    dirs = CDI_SPEC_DIRS
    for _, doc in crio_files(root, facts.config_path):
        spec_dirs = dig(doc, "crio", "runtime").get("cdi_spec_dirs")
        if isinstance(spec_dirs, list) and all(isinstance(d, str) for d in spec_dirs):
            dirs = tuple(spec_dirs)             # later files win per option
    binv = version_tuple(facts.version)
    if binv is None:
        return CdiFacts(None, None, "CRI-O's version is unknown (CDI needs CRI-O 1.24 or later; no switch)", dirs)
    if binv < CDI_SINCE:
        return CdiFacts(False, False, f"CRI-O {binv[0]}.{binv[1]} has no CDI support; it came with CRI-O 1.24", dirs)
    return CdiFacts(True, True, "CRI-O injects CDI devices without a switch (since 1.24)", dirs)


class Crio(Runtime):
    name = "crio"
    title = "CRI-O"
    binaries = ("/usr/bin/crio", "/usr/local/bin/crio")
    configs = (DEFAULT_CONFIG,)
    sockets = ("/var/run/crio/crio.sock",)
    process_names = ("crio",)
    reloads_on_signal = True        # SIGHUP: CRI-O reloads its configuration
    checks_binary = True            # plan() refuses a missing binary: CRI-O would refuse to start
    handler_failure = ("CRI-O refuses to start while a runtime's binary is missing, and pods with runtimeClassName "
                       "{handler} cannot run")

    def effective_handlers(self, root: Root, config_path: str | None) -> tuple[list[str], str | None]:
        return crio_handlers(root, config_path), None

    def handler_binary(self, root: Root, facts: RuntimeFacts, handler: str) -> str | None:
        # A runtime table in a later file replaces an earlier one whole; without runtime_path CRI-O
        # runs the handler's name from its PATH.
        tables = [t for _, doc in crio_files(root, facts.config_path)
                  if isinstance(t := dig(doc, "crio", "runtime", "runtimes").get(handler), dict)]
        if not tables:
            return None
        path = tables[-1].get("runtime_path")
        return path if isinstance(path, str) and path else handler

    def default_runtime(self, root: Root, facts: RuntimeFacts) -> str | None:
        name = None                 # CRI-O's own default differs by version (runc, crun): unknown when unset
        for _, doc in crio_files(root, facts.config_path):
            value = dig(doc, "crio", "runtime").get("default_runtime")
            if isinstance(value, str) and value:
                name = value        # later files win per option
        return name

    def cdi(self, root: Root, facts: RuntimeFacts) -> CdiFacts:
        return crio_cdi(root, facts)

    def configure(self, root: Root, config_path: str, options: Options, report: ChangeReport,
                  facts: RuntimeFacts | None, record: dict | None) -> list[FileEdit]:
        return plan(root, config_path, options, report, record)


__all__ = ["plan", "config_dir", "dropin_path", "crio_handlers", "crio_files", "crio_cdi", "Crio", "os"]
