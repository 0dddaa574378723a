"""nouveau state: loaded, bound, blacklisted (modprobe.d in every location kmod reads, and the
kernel command line)."""
from __future__ import annotations

import os

from driverd.host.facts import NouveauFacts
from driverd.host.kernel import cmdline_params
from driverd.host.modules import parse_proc_modules, read_module
from driverd.root import Root

# kmod's search order; a file name in an earlier directory hides the same name in later ones.
MODPROBE_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/local/lib/modprobe.d", "/lib/modprobe.d",
                 "/usr/lib/modprobe.d")


def effective_modprobe_files(root: Root) -> list[str]:
    seen: dict[str, str] = {}
    for d in MODPROBE_DIRS:
        for name in root.listdir(d):
            if name.endswith(".conf") and name not in seen:
                seen[name] = f"{d}/{name}"
    return [seen[n] for n in sorted(seen)]


def parse_modprobe_conf(text: str) -> list[list[str]]:
    """Commands of a modprobe.d file: comments stripped, backslash continuations joined."""
    out: list[list[str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append(line.split())
    return out


def read_nouveau(root: Root, gpu_addresses: list[str]) -> NouveauFacts:
    sources: list[str] = []
    modeset0 = False
    for path in effective_modprobe_files(root):
        for cmd in parse_modprobe_conf(root.read_text(path) or ""):
            if len(cmd) >= 2 and cmd[1] == "nouveau":
                if cmd[0] == "blacklist":
                    sources.append(path)
                elif cmd[0] == "install" and any(c.endswith(("/false", "/true")) for c in cmd[2:3]):
                    sources.append(f"{path} (install {cmd[2]})")
                elif cmd[0] == "options" and "modeset=0" in cmd[2:]:
                    modeset0 = True
    params = cmdline_params((root.read_text("/proc/cmdline") or "").strip())
    for key in ("modprobe.blacklist", "module_blacklist", "rd.driver.blacklist"):
        if "nouveau" in params.get(key, "").split(","):
            sources.append(f"kernel command line {key}=nouveau")
    if params.get("nouveau.modeset") == "0":
        modeset0 = True
    proc = parse_proc_modules(root.read_text("/proc/modules"))
    loaded = "nouveau" in proc or root.exists("/sys/module/nouveau/initstate")
    mod = read_module(root, "nouveau", proc.get("nouveau")) if loaded else None
    bound = tuple(sorted({os.path.basename(d) for d in root.listdir("/sys/bus/pci/drivers/nouveau")
                          if ":" in d} | {a for a in gpu_addresses if
                                          os.path.basename(root.readlink(f"/sys/bus/pci/devices/{a}/driver") or "") == "nouveau"}))
    return NouveauFacts(loaded=loaded, refcount=mod.refcount if mod else None, holders=mod.holders if mod else (),
                        bound_devices=bound, blacklisted=bool(sources), blacklist_sources=tuple(sources),
                        modeset_disabled=modeset0)
