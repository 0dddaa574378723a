"""Loaded kernel modules (/proc/modules, /sys/module/<name>/) and the NVIDIA driver's own report
(/proc/driver/nvidia/version), plus driverd-installed packages under /lib/modules/<release>/."""
from __future__ import annotations

import re

from driverd.driver import layout
from driverd.driver.ident import VERSION_FILE, parse_version_file
from driverd.driver.modules import installed_modules
from driverd.host.facts import DriverFacts, InstalledPackage, ModuleFacts
from driverd.host.textfmt import kernel_int
from driverd.root import Root

NVIDIA_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem", "nvidia_fs",
                  "nvidia_vgpu_vfio")
INSTALL_DIR = layout.MODULES_DIR   # relative to /lib/modules/<release>/
# kernel/module/procfs.c m_show(): the state column is one of these three words.
PROC_STATES = ("Live", "Loading", "Unloading")
# kernel/module/main.c show_initstate(): /sys/module/<m>/initstate, mapped to the /proc words.
INITSTATE = {"live": "Live", "coming": "Loading", "going": "Unloading"}
# Module names are at most MODULE_NAME_LEN-1 (55) characters of [A-Za-z0-9_-].
_MODNAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# module_flags(): '(' + one upper-case letter per module taint + '-' while unloading or '+' while
# loading + ')'. printed only when the module has taints (m_show: `if (mod->taints)`).
_TAINTS = re.compile(r"\(([A-Z]*)([+-]?)\)")


def parse_proc_modules(text: str | None) -> dict[str, dict]:
    """Rows of /proc/modules, in kernel/module/procfs.c m_show() format:

        name size refcount used-by state address [(taints)]

    `%s %u`, then with CONFIG_MODULE_UNLOAD ` %i ` refcount and used-by as `dep,` per dependent
    module plus `[permanent],` (or `-` when empty); without it ` - -`. State is Live, Loading or
    Unloading; the address is `0x%px` (zeros when kptr_restrict hides it); taints as above.
    Rows that do not follow this format are skipped, never fatal.
    """
    out: dict[str, dict] = {}
    for line in (text or "").splitlines():
        cols = line.split()
        if len(cols) < 5 or not _MODNAME.fullmatch(cols[0]):
            continue
        name, size, ref, used, state = cols[:5]
        taints = ""
        m = _TAINTS.fullmatch(cols[-1]) if len(cols) >= 7 else None
        if m:
            taints = m.group(1)
        users = [u for u in used.split(",") if u and u != "-"]
        out[name] = {
            "size": kernel_int(size, signed=False),
            "refcount": kernel_int(ref),
            "used_by": tuple(u for u in users if u != "[permanent]"),
            "permanent": "[permanent]" in users,
            "state": state if state in PROC_STATES else None,
            "taints": taints,
        }
    return out


def read_module(root: Root, name: str, row: dict | None) -> ModuleFacts:
    base = f"/sys/module/{name}"
    holders = tuple(h for h in root.listdir(f"{base}/holders") if _MODNAME.fullmatch(h)) \
        or (row["used_by"] if row else ())
    # /sys/module/<m>/refcnt is "%i\n" (module_refcount(), may be negative while unloading)
    refcount = kernel_int(root.read_first_line(f"{base}/refcnt"))
    if refcount is None and row:
        refcount = row["refcount"]
    state = row["state"] if row else None
    if state is None:
        state = INITSTATE.get(root.read_first_line(f"{base}/initstate") or "")
    if row:
        taints = row["taints"]
    else:   # show_taint(): the flags without parentheses, e.g. "OE"
        t = root.read_first_line(f"{base}/taint") or ""
        taints = t if re.fullmatch(r"[A-Z]*", t) else ""
    return ModuleFacts(
        name=name, size=row["size"] if row else None, refcount=refcount, holders=tuple(sorted(holders)),
        state=state, taints=taints,
        version=_attr(root.read_first_line(f"{base}/version")),
        srcversion=_attr(root.read_first_line(f"{base}/srcversion")),
        permanent=bool(row and row["permanent"]))


def _attr(text: str | None) -> str | None:
    """A modinfo string attribute ("%s\n"); junk with control characters is not a version."""
    if not text or len(text) > 128 or not text.isprintable():
        return None
    return text


def loaded_modules(root: Root) -> dict[str, dict]:
    return parse_proc_modules(root.read_text("/proc/modules"))


def is_loaded(root: Root, name: str, proc: dict[str, dict]) -> bool:
    # Built-in modules also appear in /sys/module, but only loadable ones have initstate, which
    # reads live/coming/going; a directory or junk in its place is no evidence.
    return name in proc or root.read_first_line(f"/sys/module/{name}/initstate") in INITSTATE


def read_installed(root: Root, release: str | None, warnings: list[str]) -> tuple[InstalledPackage, ...]:
    got = installed_modules(root, release, warnings)
    if got is None:
        return ()
    return (InstalledPackage(kernel_release=got.kernel_release, driver_version=got.driver.version,
                             flavor=got.driver.flavor, sha256=got.package_sha256, path=got.path),)


def read_driver(root: Root, release: str | None, warnings: list[str]) -> DriverFacts:
    proc = loaded_modules(root)
    mods = tuple(read_module(root, n, proc.get(n)) for n in NVIDIA_MODULES if is_loaded(root, n, proc))
    text = root.read_text(VERSION_FILE)
    version, flavor, line = parse_version_file(text)
    if text is not None and version is None:
        warnings.append("/proc/driver/nvidia/version is garbled: driver version unknown")
    loaded = any(m.name == "nvidia" for m in mods) or version is not None
    if version is None and loaded:
        version = next((m.version for m in mods if m.name == "nvidia" and m.version), None)
    return DriverFacts(loaded=loaded, version=version, flavor=flavor if loaded else None, version_line=line,
                       modules=mods, installed=read_installed(root, release, warnings))
