"""containerd's configuration as tables: where each config version keeps the CRI plugin, what a
runtime table makes containerd run, and the handler table driverd derives from the runtime pods run
by default. Shared by the planner (containerd.py) and what detect reads (containerd/detect.py)."""
from __future__ import annotations

import copy
import re

from driverd.errors import RuntimeConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CRI_PLUGIN = {1: ["plugins", "cri"], 2: ["plugins", "io.containerd.grpc.v1.cri"],
              3: ["plugins", "io.containerd.cri.v1.runtime"]}
RUNC_V2 = "io.containerd.runc.v2"
LINUX_V1 = "io.containerd.runtime.v1.linux"      # containerd 1.x's v1 shim: options are RuncOptions
RUNC_TYPES = (RUNC_V2, "io.containerd.runc.v1", LINUX_V1)
DEFAULT_RUNC = {"runtime_type": RUNC_V2}
CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]


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


def deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


# -- the handler we add ----------------------------------------------------------------------------
def runtime_type(table: dict) -> str:
    """The runtime_type containerd's CRI plugin sees ('' when the key is missing or empty)."""
    t = table.get("runtime_type") if isinstance(table, dict) else None
    return t if isinstance(t, str) else ""


def runc_family(table: dict) -> bool:
    """A runc-shim table (an empty runtime_type is a runc table someone wrote without the type)."""
    return runtime_type(table) in RUNC_TYPES + ("",)


def _options(table: dict) -> dict:
    o = table.get("options") if isinstance(table, dict) else None
    return o if isinstance(o, dict) else {}


def binaries(table: dict) -> list[str | None]:
    """The binaries a runtime table names, the one containerd executes first: the v1 shim
    (io.containerd.runtime.v1.linux) reads RuncOptions.Runtime (runtime_engine without options);
    the runc v1/v2 shims read BinaryName."""
    o = _options(table)
    if runtime_type(table) == LINUX_V1:
        first = o.get("Runtime") if o else table.get("runtime_engine")
        return [first, o.get("BinaryName")]
    return [o.get("BinaryName"), o.get("Runtime")]


def runs(table: dict) -> str:
    """What containerd actually runs for a runtime table, in words (for one-line messages)."""
    t = runtime_type(table)
    if not runc_family(table):
        return f"the {t} shim"
    first = binaries(table)[0]
    what = repr(first) if first else "plain runc (no binary set)"
    return f"{what} with an empty runtime_type (containerd then ignores BinaryName)" if not t else what


def legacy_default(ctd: dict, binv: tuple[int, int] | None) -> dict | None:
    """The deprecated [.containerd.default_runtime] table when containerd honours it: 1.x makes it
    runtime "default" and the default, overriding default_runtime_name, as soon as its runtime_type is
    set; 2.x ignores it (measured: "Ignoring unknown key ... default_runtime")."""
    t = ctd.get("default_runtime")
    if not isinstance(t, dict) or not runtime_type(t) or (binv and binv[0] >= 2):
        return None
    return t


def derive(runtimes: dict, default_name: str, handler: str, binary: str, legacy: dict | None = None,
           plugin_systemd: bool = False) -> tuple[dict, str, list[str]]:
    """The handler's table: a copy of the runc-type runtime it derives from (the runtime pods run by
    default, else runc, else containerd's built-in runc), so SystemdCgroup and friends are inherited;
    the binary set where that shim reads it. Returns (table, derived from, notes)."""
    cands = [(legacy, "the deprecated default_runtime table (containerd's effective default)")]
    if default_name != handler:
        cands.append((runtimes.get(default_name), default_name))
    if handler != "runc":
        cands.append((runtimes.get("runc"), "runc"))
    base, name = next(((t, n) for t, n in cands if isinstance(t, dict) and runc_family(t)),
                      (None, "containerd's built-in runc"))
    new = copy.deepcopy(base) if base else dict(DEFAULT_RUNC)
    notes: list[str] = []
    if not runtime_type(new):
        # containerd reads an empty type's options as generic runtime options: BinaryName would be lost.
        new["runtime_type"] = RUNC_V2
        for k in ("runtime_engine", "runtime_root"):     # 1.x accepts these only for the v1 shim
            if new.get(k):
                del new[k]
        if base is not None:
            notes.append(f"{name} has an empty runtime_type (containerd then ignores BinaryName); "
                         f"the handler uses {RUNC_V2}")
    opts = dict(_options(new))
    opts["BinaryName"] = binary
    if new["runtime_type"] == LINUX_V1:
        opts["Runtime"] = binary          # the v1 shim runs RuncOptions.Runtime, not BinaryName
        if plugin_systemd and "SystemdCgroup" not in opts:
            opts["SystemdCgroup"] = True  # what the plugin-wide systemd_cgroup gave the option-less table
        if new.get("runtime_engine"):
            del new["runtime_engine"]     # read only when a v1 table has no options; ours has
        notes.append(f"{name} uses the v1 shim ({LINUX_V1}): the handler sets options.Runtime, which that shim runs")
    new["options"] = opts
    return new, name, notes


def adoption_fixes(existing: dict, hkey: list[str], binary: str, derived: dict) -> list[tuple[list[str], Any]]:
    """The keys to set so another tool's handler runs `binary` with the shim it names; everything
    else it had (annotations, privileged_without_host_devices, other options) stays."""
    if not runc_family(existing):
        return [(hkey, derived)]          # another shim taken over with --adopt-foreign: driverd's table
    fixes: list[tuple[list[str], Any]] = []
    t = runtime_type(existing)
    if not t:
        fixes.append((hkey + ["runtime_type"], RUNC_V2))
    if t == LINUX_V1:
        fixes.append((hkey + ["options", "Runtime"], binary))
        if "BinaryName" in _options(existing):
            fixes.append((hkey + ["options", "BinaryName"], binary))
    else:
        fixes.append((hkey + ["options", "BinaryName"], binary))
    return fixes
