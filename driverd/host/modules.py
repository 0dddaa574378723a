"""Loaded kernel modules (/proc/modules, /sys/module/<name>/) and the NVIDIA driver's own report
(/proc/driver/nvidia/version), plus driverd-installed packages under /lib/modules/<release>/."""
from __future__ import annotations

import json
import re

from driverd.host.facts import DriverFacts, InstalledPackage, ModuleFacts
from driverd.host.textfmt import kernel_int
from driverd.root import Root

NVIDIA_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem", "nvidia_fs",
                  "nvidia_vgpu_vfio")
INSTALL_DIR = "updates/driverd"   # relative to /lib/modules/<release>/
# NVIDIA driver versions: 3-digit branch today (96.43.23 and 1xx.yy existed; allow 2-4 digits).
_VERSION_RE = re.compile(r"(?<![\w.])(\d{2,4}\.\d{1,3}(?:\.\d{1,3})?)(?![\w.])")
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


def parse_nvidia_version(text: str | None) -> tuple[str | None, str | None, str | None]:
    """(version, flavour, first line) from /proc/driver/nvidia/version.

    nv-procfs.c nv_procfs_read_version() prints "NVRM version: %s\n" with the driver's NVRM id,
    then "GCC version:  %s\n". The id names the architecture and flavour before the version:
      proprietary: 'NVIDIA UNIX x86_64 Kernel Module  535.261.03  <date>'
                   (also aarch64/ppc64le, legacy 470/390, and 'Kernel Module for GRID'/vGPU builds)
      open:        'NVIDIA UNIX Open Kernel Module for x86_64  535.261.03  Release Build  (...)  <date>'
    """
    if not text:
        return None, None, None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("NVRM version")), None)
    if first is None:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return None, None, (lines[0][:200] if lines and lines[0].isprintable() else None)
    ident = first.partition(":")[2]
    if "Kernel Module" not in ident:
        return None, None, first[:200] if first.isprintable() else None
    m = _VERSION_RE.search(ident.split("Kernel Module", 1)[1])
    flavor = "open" if "Open Kernel Module" in ident else "proprietary"
    return (m.group(1) if m else None), flavor, first[:200]


def read_installed(root: Root, release: str | None, warnings: list[str]) -> tuple[InstalledPackage, ...]:
    if not release:
        return ()
    path = f"/lib/modules/{release}/{INSTALL_DIR}/manifest.json"
    text = root.read_text(path)
    if text is None:
        return ()
    try:
        m = json.loads(text)
        rec = json.loads(root.read_text(f"/lib/modules/{release}/{INSTALL_DIR}/install.json") or "{}")
        if not isinstance(rec, dict):
            rec = {}
        fields = (m["kernel"]["release"], m["driver"]["version"], m["flavor"])
        if not all(isinstance(f, str) for f in fields):
            raise TypeError("manifest fields are not strings")
        sha = rec.get("package_sha256")
        return (InstalledPackage(kernel_release=fields[0], driver_version=fields[1], flavor=fields[2],
                                 sha256=sha if isinstance(sha, str) else None, path=path),)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        warnings.append(f"{path}: unreadable driverd manifest ({e.__class__.__name__}); treated as not installed")
        return ()


def read_driver(root: Root, release: str | None, warnings: list[str]) -> DriverFacts:
    proc = loaded_modules(root)
    mods = tuple(read_module(root, n, proc.get(n)) for n in NVIDIA_MODULES if is_loaded(root, n, proc))
    text = root.read_text("/proc/driver/nvidia/version")
    version, flavor, line = parse_nvidia_version(text)
    if text is not None and version is None:
        warnings.append("/proc/driver/nvidia/version is garbled: driver version unknown")
    loaded = any(m.name == "nvidia" for m in mods) or version is not None
    if version is None and loaded:
        version = next((m.version for m in mods if m.name == "nvidia" and m.version), None)
    return DriverFacts(loaded=loaded, version=version, flavor=flavor if loaded else None, version_line=line,
                       modules=mods, installed=read_installed(root, release, warnings))
