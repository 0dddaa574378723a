"""Loaded kernel modules (/proc/modules, /sys/module/<name>/) and the NVIDIA driver's own report
(/proc/driver/nvidia/version), plus driverd-installed packages under /lib/modules/<release>/."""
from __future__ import annotations

import json
import re

from driverd.host.facts import DriverFacts, InstalledPackage, ModuleFacts
from driverd.root import Root

NVIDIA_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem", "nvidia_fs",
                  "nvidia_vgpu_vfio")
INSTALL_DIR = "updates/driverd"   # relative to /lib/modules/<release>/
_VERSION_RE = re.compile(r"\b(\d{3}\.\d{1,3}(?:\.\d{1,3})?)\b")


def parse_proc_modules(text: str | None) -> dict[str, dict]:
    """Rows of /proc/modules: name size refcount used-by state address [taints].

    Without CONFIG_MODULE_UNLOAD the refcount and used-by columns read '-'. used-by lists
    dependent modules each followed by ',', plus '[permanent]' for modules without an exit hook.
    """
    out: dict[str, dict] = {}
    for line in (text or "").splitlines():
        cols = line.split()
        if len(cols) < 5:
            continue
        name, size, ref, used = cols[0], cols[1], cols[2], cols[3]
        taints = ""
        m = re.search(r"\(([A-Z]+)\)\s*$", line)
        if m:
            taints = m.group(1)
        users = [u for u in used.split(",") if u and u != "-"]
        out[name] = {
            "size": int(size) if size.isdigit() else None,
            "refcount": int(ref) if ref.lstrip("-").isdigit() else None,
            "used_by": tuple(u for u in users if u != "[permanent]"),
            "permanent": "[permanent]" in users,
            "state": cols[4],
            "taints": taints,
        }
    return out


def read_module(root: Root, name: str, row: dict | None) -> ModuleFacts:
    base = f"/sys/module/{name}"
    holders = tuple(root.listdir(f"{base}/holders")) or (row["used_by"] if row else ())
    ref = root.read_first_line(f"{base}/refcnt")
    refcount = int(ref) if ref is not None and ref.isdigit() else (row["refcount"] if row else None)
    return ModuleFacts(
        name=name, size=row["size"] if row else None, refcount=refcount, holders=tuple(sorted(holders)),
        state=row["state"] if row else (root.read_first_line(f"{base}/initstate") or None),
        taints=row["taints"] if row else (root.read_first_line(f"{base}/taint") or ""),
        version=root.read_first_line(f"{base}/version") or None,
        srcversion=root.read_first_line(f"{base}/srcversion") or None,
        permanent=bool(row and row["permanent"]))


def loaded_modules(root: Root) -> dict[str, dict]:
    return parse_proc_modules(root.read_text("/proc/modules"))


def is_loaded(root: Root, name: str, proc: dict[str, dict]) -> bool:
    # Built-in modules also appear in /sys/module, but only loadable ones have initstate.
    return name in proc or root.exists(f"/sys/module/{name}/initstate")


def parse_nvidia_version(text: str | None) -> tuple[str | None, str | None, str | None]:
    """(version, flavour, first line) from /proc/driver/nvidia/version.

    Proprietary: 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  <date>'
    Open:        'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.261.03  Release Build ...'
    """
    if not text:
        return None, None, None
    first = next((ln.strip() for ln in text.splitlines() if ln.startswith("NVRM version")), None)
    if first is None:
        return None, None, text.splitlines()[0].strip() if text.strip() else None
    m = _VERSION_RE.search(first.split("Module", 1)[-1])
    flavor = "open" if "Open Kernel Module" in first else "proprietary"
    return (m.group(1) if m else None), flavor, first


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
        return (InstalledPackage(kernel_release=m["kernel"]["release"], driver_version=m["driver"]["version"],
                                 flavor=m["flavor"], sha256=rec.get("package_sha256"), path=path),)
    except (ValueError, KeyError, TypeError) as e:
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
