"""nouveau state: loaded, bound, blacklisted (modprobe.d in every location kmod reads, and the
kernel command line)."""
from __future__ import annotations

import os

from driverd.host.facts import NouveauFacts
from driverd.host.kernel import cmdline_args
from driverd.host.modules import is_loaded, parse_proc_modules, read_module
from driverd.root import Root

# kmod's search order; a file name in an earlier directory hides the same name in later ones.
MODPROBE_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/local/lib/modprobe.d", "/lib/modprobe.d",
                 "/usr/lib/modprobe.d")


def effective_modprobe_files(root: Root) -> list[str]:
    """modprobe.d(5): every *.conf in the directories above, in name order; a name in an earlier
    directory hides it in later ones. kmod skips directories (and hidden files) while listing, so a
    directory called x.conf hides nothing."""
    seen: dict[str, str] = {}
    for d in MODPROBE_DIRS:
        for name in root.listdir(d):
            if name.endswith(".conf") and not name.startswith(".") and name not in seen \
                    and not root.is_dir(f"{d}/{name}"):
                seen[name] = f"{d}/{name}"
    return [seen[n] for n in sorted(seen)]


def modname(name: str) -> str:
    """kmod compares module names with '-' and '_' equal (it stores them with '_')."""
    return name.replace("-", "_")


def parse_modprobe_conf(text: str) -> list[list[str]]:
    """Commands of a modprobe.d file, the way libkmod's config parser reads them: a line ending in
    a backslash continues on the next; a line whose first character is '#' is a comment. A '#'
    later in a line is *not* a comment (`options m a=1 # x` passes "# x" on), and extra words after
    a command's arguments are ignored. Module names are normalised ('-' -> '_')."""
    out: list[list[str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        line, pending = pending + line, ""
        if not line or line[0] == "#":
            continue
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) >= 2 and words[0] in ("blacklist", "options", "install", "remove", "softdep", "weakdep"):
            words[1] = modname(words[1])
        out.append(words)
    return out


_NO_OP_INSTALL = ("true", "false", "/bin/true", "/bin/false", "/usr/bin/true", "/usr/bin/false", ":")


def install_disables(command: list[str]) -> bool:
    """`install nouveau /bin/true` (or false, or `exit 0`) replaces loading with a no-op."""
    if not command:
        return False
    first = command[0]
    return first in _NO_OP_INSTALL or os.path.basename(first) in ("true", "false") or first == "exit"


def read_nouveau(root: Root, gpu_addresses: list[str]) -> NouveauFacts:
    sources: list[str] = []
    modeset0 = False
    for path in effective_modprobe_files(root):
        for cmd in parse_modprobe_conf(root.read_text(path) or ""):
            if len(cmd) >= 2 and cmd[1] == "nouveau":
                if cmd[0] == "blacklist":
                    if path not in sources:
                        sources.append(path)
                elif cmd[0] == "install" and install_disables(cmd[2:]):
                    sources.append(f"{path} (install {' '.join(cmd[2:])})")
                elif cmd[0] == "options":
                    # options accumulate in file order; the last modeset= given is the one used
                    for opt in cmd[2:]:
                        if opt.startswith("modeset="):
                            modeset0 = opt == "modeset=0"
    # kmod reads modprobe.blacklist= (every occurrence, comma lists) from /proc/cmdline; the kernel
    # itself enforces module_blacklist=; dracut's rd.driver.blacklist= becomes modprobe.d in the initrd.
    for key, value in cmdline_args((root.read_text("/proc/cmdline") or "").strip()):
        if key in ("modprobe.blacklist", "module_blacklist", "rd.driver.blacklist") and value and \
                "nouveau" in (modname(v) for v in value.split(",")):
            src = f"kernel command line {key}=nouveau"
            if src not in sources:
                sources.append(src)
        elif key == "nouveau.modeset" and value is not None:
            modeset0 = value.strip() == "0"
    proc = parse_proc_modules(root.read_text("/proc/modules"))
    loaded = is_loaded(root, "nouveau", proc)
    mod = read_module(root, "nouveau", proc.get("nouveau")) if loaded else None
    bound = tuple(sorted({os.path.basename(d) for d in root.listdir("/sys/bus/pci/drivers/nouveau")
                          if ":" in d} | {a for a in gpu_addresses if
                                          os.path.basename(root.readlink(f"/sys/bus/pci/devices/{a}/driver") or "") == "nouveau"}))
    return NouveauFacts(loaded=loaded, refcount=mod.refcount if mod else None, holders=mod.holders if mod else (),
                        bound_devices=bound, blacklisted=bool(sources), blacklist_sources=tuple(sources),
                        modeset_disabled=modeset0)
