"""A fabric manager stand-in that behaves like NVIDIA's nv-fabricmanager where driverd can see it: an
executable that reads the kernel's report of the loaded driver (<root>/proc/driver/nvidia/version) and
refuses another version with NVIDIA's own message (the one operators report, e.g. NVIDIA/gpu-operator
issue 544: "fabric manager NVIDIA GPU driver interface version X don't match with driver version Y.
Please update with matching NVIDIA driver package."), logging it to /var/log/fabricmanager.log as the
real daemon does; of the same version it configures the simulated fabric (every GPU Completed) and
exits 0, as the real one does once it has forked. A POSIX shell script, so that it runs as a real
process: the simulated services (sim/services.py) execute it with DRIVERD_SIM_ROOT set to the tree."""
from __future__ import annotations

import os
from pathlib import Path

from driverd.sim.kernel import FABRIC

LOG = "/var/log/fabricmanager.log"

_SCRIPT = """#!/bin/sh
# nv-fabricmanager stand-in (driverd.sim.fabricmanager): fabric manager {version}
FM_VERSION={version}
root="${{DRIVERD_SIM_ROOT:-}}"
if [ "$1" = "--version" ] || [ "$1" = "-v" ]; then
    echo "Fabric Manager version is : $FM_VERSION"
    exit 0
fi
drv=$(head -n 1 "$root/proc/driver/nvidia/version" 2>/dev/null | grep -oE '[0-9]+\\.[0-9]+(\\.[0-9]+)?' | head -n 1)
if [ -z "$drv" ]; then
    echo "fabric manager: request to query NVIDIA GPU driver failed with error: driver is not loaded" >&2
    exit 1
fi
if [ "$drv" != "$FM_VERSION" ]; then
    msg="fabric manager NVIDIA GPU driver interface version $FM_VERSION don't match with driver version $drv. Please update with matching NVIDIA driver package."
    mkdir -p "$root/var/log" && echo "$msg" >> "$root{log}"
    echo "$msg" >&2
    exit 1
fi
mkdir -p "$(dirname "$root{fabric}")" "$root/var/log" && echo completed > "$root{fabric}"
echo "fabric manager $FM_VERSION: fabric configured" >> "$root{log}"
exit 0
"""


def script(version: str) -> str:
    return _SCRIPT.format(version=version, log=LOG, fabric=FABRIC)


def write(path: str | os.PathLike, version: str) -> Path:
    """Put the stand-in of `version` at `path` (executable)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(script(version))
    p.chmod(0o755)
    return p


def version_of(text: str) -> str | None:
    """The version a stand-in was written for (None: not a stand-in)."""
    for line in text.splitlines()[:4]:
        if line.startswith("FM_VERSION="):
            return line.partition("=")[2].strip() or None
    return None
