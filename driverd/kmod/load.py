"""Loading the installed driver: modules in dependency order with validated parameters, firmware
path when the package's firmware is not where the kernel looks, /dev nodes, then validation."""
from __future__ import annotations

import re
from dataclasses import asdict, field

from driverd.datatypes import dataclass
from driverd.errors import ConfigError, ModuleError
from driverd.host import pci
from driverd.driver.ident import loaded as loaded_driver
from driverd.host.modules import INSTALL_DIR
from driverd.kmod import devnodes
from driverd.nvproc import gpu_addresses

STD_FIRMWARE = "/lib/firmware"


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


def validate_parameters(kernel, modules: list[str], params: dict[str, dict[str, str]],
                        infos: dict | None = None) -> dict[str, dict[str, str]]:
    """Every configured parameter must be one the module file declares (modinfo -p): an unknown
    one is an error here, because the kernel would only log 'unknown parameter ignored'; and its
    value must parse as the declared type. `infos` (module name -> ModInfo) judges against module
    files that are not installed yet (a package about to be installed)."""
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
        info = infos[mod] if infos and mod in infos else kernel.modinfo(mod)
        unknown = sorted(set(want) - set(info.params))
        if unknown:
            raise ConfigError(f"unknown parameter {', '.join(unknown)} for module {mod}",
                              cause=f"{info.path} declares only: {', '.join(sorted(info.params)) or 'no parameters'} "
                                    "(the kernel would silently ignore it)",
                              fix=f"fix [modules.parameters.{mod}] in the config", details={"module": mod, "unknown": unknown})
        for k, v in sorted(want.items()):
            split = option_problem(k, str(v))
            if split:
                raise ConfigError(f"module {mod} parameter {k}: {split}", cause=_SPLIT_CAUSE,
                                  fix=f"in [modules.parameters.{mod}] give {k} a value without double quotes, a "
                                      "leading quote or tabs/newlines (blanks alone are passed quoted), and set "
                                      "every other parameter under its own key",
                                  details={"module": mod, "parameter": k})
        bad = [f"{k}={v!r} ({problem})" for k, v in sorted(want.items())
               for problem in [value_problem(info.params[k].type, str(v))] if problem]
        if bad:
            raise ConfigError(f"invalid value for module {mod}: {'; '.join(bad)}",
                              cause=f"{info.path} declares the types (modinfo -p); the kernel would refuse the load "
                                    "with 'Invalid argument'",
                              fix=f"fix [modules.parameters.{mod}] in the config", details={"module": mod, "invalid": bad})
        out[mod] = {k: str(v) for k, v in want.items()}
    return out


# -- how a NAME=VALUE reaches the kernel -------------------------------------------------------------
# modprobe (kmod's options_from_array, tools/modprobe.c and insmod alike; kmod 30 checked with
# `modprobe -n -v` in tests/kmod/test_param_split.py) joins the parameters with blanks into one
# string for init_module(2), wrapping a value in double quotes when it holds a ' ' and does not begin
# with '"' or "'". The kernel then splits that string with parse_args() (kernel/params.c), which calls
# next_arg() (lib/cmdline.c; kernel/params.c before 4.x): parameters end at isspace() outside double
# quotes; a '"' anywhere toggles quoting and cannot be escaped; one leading '"' of the value and the
# token's last '"' are dropped; a bare `--` ends the parameters. isspace() is the kernel's lib/ctype.c:
# ' ', \t, \n, \v, \f, \r and the byte 0xa0 (so a UTF-8 character holding that byte splits too).
# A value the kernel would not see as exactly one parameter with that same value is refused: it would
# set other parameters than the configuration names (`x" NVreg_EnableGpuFirmware=0 "y`).
_KERNEL_SPACE = frozenset(b" \t\n\v\f\r\xa0")
_SPLIT_CAUSE = ("modprobe passes a value with blanks in double quotes unless it begins with a quote, and the "
                "kernel splits module parameters at blanks and tabs outside double quotes, which cannot be "
                "escaped, and drops the quotes (kernel/params.c parse_args, lib/cmdline.c next_arg)")


def modprobe_option(name: str, value: str) -> bytes:
    """`name=value` as modprobe hands it to the kernel (kmod's options_from_array)."""
    v = value.encode("utf-8", "surrogateescape")
    if v[:1] not in (b'"', b"'") and b" " in v:
        v = b'"' + v + b'"'
    return name.encode("utf-8", "surrogateescape") + b"=" + v


def kernel_split(options: bytes) -> list[tuple[bytes, bytes | None]]:
    """(param, value) pairs as parse_args()/next_arg() split a module's option string."""
    out: list[tuple[bytes, bytes | None]] = []
    s, n, i = options, len(options), 0
    while i < n and s[i] in _KERNEL_SPACE:
        i += 1
    while i < n:
        quoted = s[i] == 0x22
        if quoted:
            i += 1
        start, in_quote, equals = i, quoted, -1
        while i < n and (in_quote or s[i] not in _KERNEL_SPACE):
            if equals < 0 and s[i] == 0x3D and i > start:      # `equals == 0` means none in next_arg
                equals = i
            if s[i] == 0x22:
                in_quote = not in_quote
            i += 1
        tok = s[start:i]
        if equals < 0:
            param, val = (tok[:-1] if quoted and tok.endswith(b'"') else tok), None
        else:
            param, val = s[start:equals], s[equals + 1:i]
            if val.startswith(b'"'):
                val = val[1:]
                if tok.endswith(b'"'):
                    val = val[:-1]
            elif quoted and tok.endswith(b'"'):
                val = val[:-1]
        if val is None and param == b"--":
            break
        out.append((param, val))
        while i < n and s[i] in _KERNEL_SPACE:
            i += 1
    return out


def option_problem(name: str, value: str) -> str | None:
    """Why `name=value` would not reach the kernel as that one parameter with that value, or None."""
    got = kernel_split(modprobe_option(name, value))
    want = (name.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape"))
    if got == [want]:
        return None

    def show(p: bytes, v: bytes | None) -> str:
        t = p if v is None else p + b"=" + v
        return t.decode("utf-8", "backslashreplace")
    why = ("the kernel takes the byte 0xa0 in its UTF-8 for a blank" if b"\xa0" in want[1]
           else "the kernel drops double quotes" if len(got) == 1 else "")
    seen = (f"as {show(*got[0])!r}" if len(got) == 1 else
            f"as {len(got)} parameters ({', '.join(repr(show(p, v)) for p, v in got)}), not one")
    return f"the value {value!r} would reach the kernel {seen}" + (f" ({why})" if why else "")


# Integer parameter types and their ranges, as the kernel's param_set_* (kernel/params.c) parse them
# with kstrto*(value, 0): decimal, 0x hex or 0 octal; a sign only for the signed types.
_INT_RANGES = {"byte": (0, 0xff), "short": (-(1 << 15), (1 << 15) - 1), "ushort": (0, 0xffff),
               "int": (-(1 << 31), (1 << 31) - 1), "uint": (0, 0xffffffff), "hexint": (0, 0xffffffff),
               "long": (-(1 << 63), (1 << 63) - 1), "ulong": (0, (1 << 64) - 1), "ullong": (0, (1 << 64) - 1)}
_BOOL_TYPES = ("bool", "invbool")


def value_problem(ptype: str | None, value: str) -> str | None:
    """Why the kernel would refuse `value` for a parameter of type `ptype` (modinfo's parmtype), or
    None when it accepts it. Undeclared types are accepted: the kernel alone can judge them."""
    if ptype is None:
        return None
    ptype = ptype.strip()
    if ptype.startswith("array of "):
        elems = value.split(",")
        for e in elems:
            p = value_problem(ptype[len("array of "):], e)
            if p:
                return f"element {e!r}: {p}"
        return None
    v = value[:-1] if value.endswith("\n") else value
    if ptype in _INT_RANGES:
        lo, hi = _INT_RANGES[ptype]
        m = re.fullmatch(r"([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", v)
        if not m or (m.group(1) == "-" and lo == 0):
            return f"{ptype} wants a{'n unsigned' if lo == 0 else 'n'} integer"
        digits = m.group(2)     # kstrto*(s, 0): 0x hex, a leading 0 octal (Python's int(s, 0) refuses "010")
        n = int(digits, 16 if digits[:2] in ("0x", "0X") else 8 if digits[:1] == "0" else 10)
        n = -n if m.group(1) == "-" else n
        if not lo <= n <= hi:
            return f"{n} is out of range for {ptype} ({lo}..{hi})"
        return None
    if ptype in _BOOL_TYPES:
        # kstrtobool: y/Y/t/T/1 and n/N/f/F/0 by the first character, on/off by the first two (Debian's
        # 6.1 takes "false" and "no"; tests/vm).
        if v[:1] in tuple("yYtT1nNfF0") or v[:2].lower() in ("on", "of"):
            return None
        return f"{ptype} wants y, n, true, false, 1, 0, on or off"
    if ptype in ("charp", "string"):
        return "longer than 1024 bytes" if len(v.encode()) > 1024 else None
    return None


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
    for cand in ("/var/lib/driverd/firmware", f"/lib/modules/{kernel.release}/{INSTALL_DIR}/firmware"):
        if all(kernel.root.is_file(f"{cand}/{fw}") for fw in missing):
            # A host path: the kernel's firmware loader resolves it in the host's own mount namespace,
            # also when driverd runs in the driver container with the host at /host.
            kernel.set_firmware_path(cand)
            return cand
    return None


@dataclass
class LoadReport:
    """What one load of the driver's modules did, and what it found already loaded."""
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
    loaded = kernel.modules(order)
    if "nvidia" in loaded:
        running = loaded_driver(kernel.root)
        ver, flav = (running.version, running.flavor) if running else (None, None)
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
    """Whether the loaded driver works as expected, with the problems found where it does not."""
    version: str | None
    flavor: str | None
    gpus_expected: list[str]
    gpus_visible: list[str]
    problems: list[str] = field(default_factory=list)
    workload: dict | None = None        # driverd.host.workload's check, when it ran
    fix: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


# what NVML says of persistence when daemons.persistenced is on, whichever NVML report says it
PERSISTENCE_OFF = "persistence mode is off on some GPUs although daemons.persistenced is on"


def validate(kernel, version: str | None, flavor: str | None, services=None, persistence: bool = False,
             modules: list[str] = (), workload: dict | None = None) -> Validation:
    """The driver works: /proc/driver/nvidia/version shows the expected version and flavour, every
    GPU from PCI is visible to the driver (and to NVML on a live host), persistence as configured; with
    `workload` ({"timeout_s", "driver_root"}) also workload-ready: the user-space containers get matches
    the loaded module and a CUDA call works on every GPU (driverd.host.workload)."""
    root = kernel.root
    running = loaded_driver(root)
    ver, flav = (running.version, running.flavor) if running else (None, None)
    gpus, _, _ = pci.classify(root, pci.scan(root, []), [])
    expected = sorted(g.pci_address for g in gpus)
    visible = sorted(a for a in gpu_addresses(root) if re.match(r"^[0-9a-f]{4,}:", a))
    v = Validation(ver, flav, expected, visible)
    if ver is None:
        v.problems.append("/proc/driver/nvidia/version is missing: the nvidia module is not loaded")
    elif version and (ver, flav) != (version, flavor):
        v.problems.append(f"the kernel reports {ver} ({flav}), expected {version} ({flavor})")
    missing = sorted(set(expected) - set(visible))
    if ver is not None and missing:
        v.problems.append(f"GPU(s) not visible to the driver: {', '.join(missing)}")
    loaded = kernel.loaded_names()
    for m in modules:
        if m not in loaded:
            v.problems.append(f"module {m} is not loaded")
    live = ver is not None and kernel.name == "real" and root.is_live()
    checked = workload is not None and ver is not None and not v.problems
    if live and not checked:
        from driverd.host.nvml import read_nvml
        n = read_nvml(root, True)
        if n.available and len(n.devices) != len(expected):
            v.problems.append(f"NVML sees {len(n.devices)} GPU(s), PCI shows {len(expected)}")
        if n.available and persistence and not all(d.persistence_mode for d in n.devices):
            v.problems.append(PERSISTENCE_OFF)
    elif not live and ver is not None and persistence and services is not None \
            and not services.running("nvidia-persistenced"):
        v.problems.append("nvidia-persistenced is not running although daemons.persistenced is on")
    if checked:
        # The workload check starts NVML itself, after cuInit (beside it, cuInit takes longer): its report
        # answers what a query of our own would (every GPU seen, by bus id; persistence), and a second
        # NVML start was ~65 ms of every validation, the container's fast path included (issue 47).
        from driverd.host import workload as wl
        w = wl.check(root, ver, expected, driver_root=(workload or {}).get("driver_root"),
                     timeout_s=float((workload or {}).get("timeout_s") or 60))
        v.workload = w.to_json()
        if not w.ok:
            v.problems += ["not workload-ready: " + p for p in w.problems]
            v.fix = w.fix
        devices = (w.nvml or {}).get("devices") or []
        if live and persistence and (w.nvml or {}).get("ok") and not all(d.get("persistence_mode") for d in devices):
            v.problems.append(PERSISTENCE_OFF)
    return v
