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
import tomllib

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import tomldoc
from driverd.runtime.model import ChangeReport, FileEdit, Options

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
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        where = f" (line {m.group(1)}, column {m.group(2)})" if m else ""
        raise RuntimeConfigError(f"{path} is not valid TOML{where}", cause=str(e),
                                 fix=f"fix {path}; CRI-O would refuse it too; driverd wrote nothing") from None


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dropin_path(cdir: str, handler: str) -> str:
    return f"{cdir.rstrip('/')}/99-driverd-{handler}.conf"


def plan(root: Root, config_path: str | None, opts: Options, report: ChangeReport) -> list[FileEdit]:
    cdir = config_dir(root)
    ours = dropin_path(cdir, opts.handler)
    merged: dict = {}
    for f in [config_path or DEFAULT_CONFIG] + [p for p in root.glob(cdir) if p != ours and root.is_file(p)]:
        d = _load(root, f)
        rts = tomldoc.get(d, ["crio", "runtime", "runtimes", opts.handler])
        if isinstance(rts, dict):
            if rts.get("runtime_path") == opts.binary:
                report.notes.append(f"'{opts.handler}' already exists in {f} (not added by driverd); left as it is")
                return []
            raise RuntimeConfigError(
                f"runtime handler '{opts.handler}' already exists in {f} and is not driverd's "
                f"(runtime_path {rts.get('runtime_path')!r})", cause="driverd never overwrites a handler it did not add",
                fix=f"choose another name with --handler, or remove it from {f}", exit_code=3)
        merged = _merge(merged, d)
    if not root.exists(opts.binary):
        raise RuntimeConfigError(f"{opts.binary} does not exist on the host",
                                 cause="CRI-O refuses to start when a runtime's runtime_path is missing",
                                 fix="install nvidia-container-toolkit first, or pass --binary PATH; nothing was written")
    rt = tomldoc.get(merged, ["crio", "runtime"], {}) or {}
    runtimes = rt.get("runtimes", {}) if isinstance(rt.get("runtimes"), dict) else {}
    base_name = rt.get("default_runtime") or ("runc" if "runc" in runtimes else "crun" if "crun" in runtimes else "runc")
    base = runtimes.get(base_name, {}) if isinstance(runtimes.get(base_name), dict) else {}
    table = {"runtime_path": opts.binary, "runtime_type": "oci"}
    table.update({k: base[k] for k in INHERITED if k in base})
    report.notes.append(f"handler '{opts.handler}' inherits {', '.join(k for k in INHERITED if k in base) or 'nothing'}"
                        f" from {base_name}; drop-in {ours} (CRI-O reads {cdir})")
    import tomlkit
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"Written by driverd: the '{opts.handler}' runtime handler. "
                            "`driverd runtime revert` removes this file."))
    if opts.set_as_default:
        tomldoc.set_key(doc, ["crio", "runtime", "default_runtime"], opts.handler)
    tomldoc.set_key(doc, ["crio", "runtime", "runtimes", opts.handler], table)
    if opts.cdi:
        report.notes.append("CRI-O reads CDI specs from /etc/cdi and /var/run/cdi without a switch")
    return [FileEdit(ours, doc.as_string().encode(), root.read_bytes(ours), "owned")]


def unit(root: Root) -> str:
    return "crio"


def socket_default() -> str:
    return "/var/run/crio/crio.sock"


__all__ = ["plan", "config_dir", "dropin_path", "os"]
