"""Stand-ins for the companion daemons beside the fabric manager (driverd/sim/fabricmanager.py is its own): IMEX
and NVLSM, as POSIX shell scripts that run as real processes (the simulated services, sim/services.py, execute
them with DRIVERD_SIM_ROOT set to the tree) and behave like NVIDIA's where driverd can see them:

- each reads the kernel's report of the loaded driver (<root>/proc/driver/nvidia/version) and exits non-zero,
  with a version-mismatch message on stderr and in its log, when that is another driver than its own — IMEX is
  versioned by the driver; NVLSM has a version of its own (2025.03.9) and goes with the driver whose
  redistrib_<version>.json lists it, which the stand-in carries as its driver;
- with no driver loaded each fails as the real one does (it cannot open /dev/nvidiactl);
- NVLSM also needs the InfiniBand MAD interface (ib_umad loaded: <root>/sys/module/ib_umad), through which it
  reaches the NVLink5 switch trays, and fails without it;
- on success each logs that it is up and exits 0, as the real ones do once they have forked; `--version` says
  "IMEX version is: V" / "NVLSM version is: 2025.03.9 (driver V)".
The messages are the stand-ins' own wording of those failures."""
from __future__ import annotations

import os
from pathlib import Path

LOGS = {"imex": "/var/log/nvidia-imex.log", "nvlsm": "/var/log/nvlsm.log"}
NVLSM_VERSION = "2025.03.9"

_HEAD = """#!/bin/sh
# {name} stand-in (driverd.sim.companiond) of driver {driver}
DRIVER={driver}
root="${{DRIVERD_SIM_ROOT:-}}"
log="$root{log}"
if [ "$1" = "--version" ] || [ "$1" = "-v" ]; then
    echo "{version_line}"
    exit 0
fi
say() {{ mkdir -p "$(dirname "$log")" && echo "$1" >> "$log"; echo "$1" >&2; }}
drv=$(head -n 1 "$root/proc/driver/nvidia/version" 2>/dev/null | grep -oE '[0-9]+\\.[0-9]+(\\.[0-9]+)?' | head -n 1)
if [ -z "$drv" ]; then
    say "{name}: failed to open /dev/nvidiactl: the NVIDIA driver is not loaded"
    exit 1
fi
if [ "$drv" != "$DRIVER" ]; then
    say "{mismatch}"
    exit 1
fi
"""

_IMEX = _HEAD + """mkdir -p "$(dirname "$log")" && echo "IMEX {driver}: ready (driver $drv)" >> "$log"
exit 0
"""

_NVLSM = _HEAD + """if [ ! -e "$root/sys/module/ib_umad" ]; then
    say "nvlsm: cannot open /dev/infiniband/umad*: ib_umad is not loaded"
    exit 1
fi
mkdir -p "$(dirname "$log")" && echo "NVLSM {nvlsm} (driver {driver}): NVLink5 switch trays configured" >> "$log"
exit 0
"""


def script(component: str, driver: str) -> str:
    """The stand-in of `component` (imex | nvlsm) that goes with driver `driver`."""
    if component == "imex":
        return _IMEX.format(name="nvidia-imex", driver=driver, log=LOGS["imex"],
                            version_line=f"IMEX version is: {driver}",
                            mismatch=f"nvidia-imex: IMEX version {driver} does not match the NVIDIA driver version "
                                     "$drv: install the nvidia-imex package of the driver's version")
    if component == "nvlsm":
        return _NVLSM.format(name="nvlsm", driver=driver, log=LOGS["nvlsm"], nvlsm=NVLSM_VERSION,
                             version_line=f"NVLSM version is: {NVLSM_VERSION} (driver {driver})",
                             mismatch=f"nvlsm: NVLSM {NVLSM_VERSION} goes with NVIDIA driver {driver}, the loaded "
                                      "driver is $drv: install the NVLSM of the driver's release")
    raise ValueError(f"no stand-in for {component!r}")


def write(path: str | os.PathLike, component: str, driver: str) -> Path:
    """Put the stand-in of `component` for driver `driver` at `path` (executable)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(script(component, driver))
    p.chmod(0o755)
    return p
