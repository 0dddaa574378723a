"""Loading the installed driver: modules in dependency order with validated parameters, firmware
path when the package's firmware is not where the kernel looks, /dev nodes, then validation."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from driverd.errors import ConfigError, ModuleError
from driverd.host import pci
from driverd.host.modules import INSTALL_DIR, parse_nvidia_version
from driverd.kmod import devnodes

CORE = ("nvidia", "nvidia_uvm", "nvidia_modeset")
STD_FIRMWARE = "/lib/firmware"


def installed_manifest(kernel) -> dict | None:
    text = kernel.root.read_text(f"/lib/modules/{kernel.release}/{INSTALL_DIR}/manifest.json")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def installed_identity(kernel) -> tuple[str, str, str | None] | None:
    """(version, flavour, package sha256) of the installed driverd package, or None."""
    m = installed_manifest(kernel)
    if not m:
        return None
    rec = kernel.root.read_text(f"/lib/modules/{kernel.release}/{INSTALL_DIR}/install.json")
    try:
        sha = json.loads(rec).get("package_sha256") if rec else None
    except ValueError:
        sha = None
    return m["driver"]["version"], m["flavor"], sha


def wanted_modules(cfg, mellanox_nics: int) -> list[str]:
    mods = list(CORE)
    if cfg["modules.load_drm"]:
        mods.append("nvidia_drm")
    pm = cfg["modules.load_peermem"]
    if pm == "true" or (pm == "auto" and mellanox_nics):
        mods.append("nvidia_peermem")
    return mods


def dependency_order(kernel, modules: list[str]) -> list[str]:
    """The modules plus their dependencies (from depmod's modules.dep), dependencies first."""
    out: list[str] = []

    def visit(m: str, stack: tuple[str, ...]) -> None:
        if m in out:
            return
        if m in stack:
            raise ModuleError(f"dependency cycle through {m}", fix="reinstall the package (depmod)")
        if kernel.module_file(m) is None:
            raise ModuleError(f"module {m} is not installed for kernel {kernel.release}",
                              cause=f"modules.dep under /lib/modules/{kernel.release} has no {m}",
                              fix="install the driver package for the running kernel (driverd install)")
        for d in reversed(kernel.module_deps(m)):
            visit(d, stack + (m,))
        out.append(m)

    for m in modules:
        visit(m, ())
    return out


def validate_parameters(kernel, modules: list[str], params: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Every configured parameter must be one the module file declares (modinfo -p): an unknown
    one is an error here, because the kernel would only log 'unknown parameter ignored'."""
    for mod in params:
        if mod not in modules:
            raise ConfigError(f"parameters configured for {mod}, which driverd does not load",
                              cause=f"[modules.parameters.{mod}] names a module outside {', '.join(modules)}",
                              fix=f"remove [modules.parameters.{mod}] or enable the module (modules.load_drm / load_peermem)")
    out = {}
    for mod in modules:
        want = params.get(mod, {})
        if not want:
            continue
        info = kernel.modinfo(mod)
        unknown = sorted(set(want) - set(info.params))
        if unknown:
            raise ConfigError(f"unknown parameter {', '.join(unknown)} for module {mod}",
                              cause=f"{info.path} declares only: {', '.join(sorted(info.params)) or 'no parameters'} "
                                    "(the kernel would silently ignore it)",
                              fix=f"fix [modules.parameters.{mod}] in the config", details={"module": mod, "unknown": unknown})
        out[mod] = dict(want)
    return out


def ensure_firmware(kernel, version: str) -> str | None:
    """Point firmware_class.path at the package's firmware when the kernel would not find it in its
    standard directories. Returns the path set, or None when nothing was needed."""
    try:
        info = kernel.modinfo("nvidia")
    except ModuleError:
        return None
    if not info.firmware:
        return None
    std = [f"{STD_FIRMWARE}/updates/{kernel.release}", f"{STD_FIRMWARE}/updates", f"{STD_FIRMWARE}/{kernel.release}",
           STD_FIRMWARE]
    current = kernel.firmware_path()
    missing = [fw for fw in info.firmware if not any(kernel.root.is_file(f"{d}/{fw}") for d in std + [current] if d)]
    if not missing:
        return None
    # The package layout puts GSP images in /lib/firmware/nvidia/<version>/; anything else installed
    # beside the modules is the fallback (e.g. a package whose firmware went to the state dir).
    for cand in (f"/var/lib/driverd/firmware", f"/lib/modules/{kernel.release}/{INSTALL_DIR}/firmware"):
        if all(kernel.root.is_file(f"{cand}/{fw}") for fw in missing):
            kernel.set_firmware_path(str(kernel.root.path(cand)) if kernel.name == "real" else cand)
            return cand
    return None


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    parameters: dict[str, dict[str, str]] = field(default_factory=dict)
    devnodes: list[str] = field(default_factory=list)
    firmware_path: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def load(kernel, modules: list[str], params: dict[str, dict[str, str]], expect: tuple[str, str] | None = None) -> LoadReport:
    rep = LoadReport()
    order = dependency_order(kernel, modules)
    rep.parameters = validate_parameters(kernel, order, params)
    loaded = kernel.modules()
    if "nvidia" in loaded:
        ver, flav, _ = parse_nvidia_version(kernel.root.read_text("/proc/driver/nvidia/version"))
        if expect and (ver, flav) != tuple(expect):
            raise ModuleError(f"driver {ver} ({flav}) is loaded, {expect[0]} ({expect[1]}) is wanted",
                              cause="another driver version is in the kernel", fix="driverd reload")
        for mod, want in rep.parameters.items():
            have = loaded.get(mod)
            if have and any(have.parameters.get(k) not in (v, v.upper(), v.lower()) for k, v in want.items()):
                raise ModuleError(f"{mod} is loaded with other parameters than configured",
                                  cause=f"wanted {want}, loaded {dict((k, have.parameters.get(k)) for k in want)}",
                                  fix="driverd reload applies new parameters")
    version = expect[0] if expect else None
    if version:
        rep.firmware_path = ensure_firmware(kernel, version)
    for m in order:
        if m in loaded:
            rep.already.append(m)
            continue
        kernel.load(m, rep.parameters.get(m, {}))
        rep.loaded.append(m)
    rep.devnodes = devnodes.create_missing(kernel)
    return rep


@dataclass
class Validation:
    version: str | None
    flavor: str | None
    gpus_expected: list[str]
    gpus_visible: list[str]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def validate(kernel, version: str | None, flavor: str | None, services=None, persistence: bool = False,
             modules: list[str] = ()) -> Validation:
    """The driver works: /proc/driver/nvidia/version shows the expected version and flavour, every
    GPU from PCI is visible to the driver (and to NVML on a live host), persistence as configured."""
    root = kernel.root
    ver, flav, _ = parse_nvidia_version(root.read_text("/proc/driver/nvidia/version"))
    gpus, _, _ = pci.classify(root, pci.scan(root, []), [])
    expected = sorted(g.pci_address for g in gpus)
    visible = sorted(a for a in root.listdir("/proc/driver/nvidia/gpus") if re.match(r"^[0-9a-f]{4,}:", a))
    v = Validation(ver, flav, expected, visible)
    if ver is None:
        v.problems.append("/proc/driver/nvidia/version is missing: the nvidia module is not loaded")
    elif version and (ver, flav) != (version, flavor):
        v.problems.append(f"the kernel reports {ver} ({flav}), expected {version} ({flavor})")
    missing = sorted(set(expected) - set(visible))
    if ver is not None and missing:
        v.problems.append(f"GPU(s) not visible to the driver: {', '.join(missing)}")
    loaded = set(kernel.modules())
    for m in modules:
        if m not in loaded:
            v.problems.append(f"module {m} is not loaded")
    if ver is not None and kernel.name == "real" and root.is_live():
        from driverd.host.nvml import read_nvml
        n = read_nvml(root, True)
        if n.available and len(n.devices) != len(expected):
            v.problems.append(f"NVML sees {len(n.devices)} GPU(s), PCI shows {len(expected)}")
        if n.available and persistence and not all(d.persistence_mode for d in n.devices):
            v.problems.append("persistence mode is off on some GPUs although daemons.persistenced is on")
    elif ver is not None and persistence and services is not None and not services.running("nvidia-persistenced"):
        v.problems.append("nvidia-persistenced is not running although daemons.persistenced is on")
    return v
