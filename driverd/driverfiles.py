"""Where the NVIDIA driver's user-space is on a host: the libraries (libcuda, libnvidia-ml, ...), their
version, the directory a container's loader must search. One finder for the workload validation (which
loads exactly these libraries in a child) and the CDI spec (which gives exactly these to containers).

The user-space is looked for, in order, in: an explicit driver root (configuration), the GPU Operator's
driver root `/run/nvidia/driver`, `/usr/local/nvidia` (the layout of GKE/COS-style hosts and of the
machines driverd is validated on: lib64/, bin/, firmware/), then the host's own library directories
(multiarch, lib64, Debian's `nvidia/current`). The first place that holds libcuda.so.1 or
libnvidia-ml.so.1 is the driver's user-space: a container gets the libraries of one place, never a
mixture. Paths are host paths, resolved under the Root.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from driverd.root import Root

# The libraries every compute/utility container needs to talk to the driver: their presence decides
# where the user-space is; their real file names carry the driver version (libcuda.so.580.159.04).
KEY_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1")
DRIVER_ROOTS = ("/run/nvidia/driver", "/usr/local/nvidia")
# Relative to a driver root (or to / for the host's own directories).
LIB_SUBDIRS = ("lib64", "usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu/nvidia/current",
               "lib/x86_64-linux-gnu", "usr/lib", "lib")
_VERSIONED = re.compile(r"^lib[\w+-]+\.so\.(\d+\.\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class UserSpace:
    """The driver user-space found on a host (all paths are host paths)."""
    driver_root: str | None                    # the root it was found under ("/" for the host's own dirs)
    lib_dir: str | None                        # the directory holding the key libraries
    libs: dict[str, str] = field(default_factory=dict)   # soname -> real file (host path)
    version: str | None = None                 # from the real file names of the key libraries
    versions: dict[str, str] = field(default_factory=dict)  # soname -> its own version (a mixed set shows)
    searched: tuple[str, ...] = ()

    @property
    def found(self) -> bool:
        return bool(self.libs)

    def to_json(self) -> dict:
        return {"driver_root": self.driver_root, "lib_dir": self.lib_dir, "libs": dict(self.libs),
                "version": self.version, "versions": dict(self.versions), "searched": list(self.searched)}


def _candidates(driver_root: str | None) -> list[tuple[str, str]]:
    roots = [driver_root] if driver_root else []
    roots += [r for r in DRIVER_ROOTS if r not in roots]
    out = [(r, os.path.normpath(f"{r}/{sub}")) for r in roots for sub in LIB_SUBDIRS]
    out += [("/", "/" + sub) for sub in LIB_SUBDIRS]
    seen: set[str] = set()
    return [(r, d) for r, d in out if not (d in seen or seen.add(d))]


def library_version(root: Root, path: str) -> str | None:
    """The version in a library's real file name (libcuda.so.1 -> libcuda.so.580.159.04 -> 580.159.04)."""
    try:
        real = root.resolve(path)
    except (OSError, ValueError):
        return None
    m = _VERSIONED.match(os.path.basename(real))
    return m.group(1) if m and m.group(1).count(".") >= 1 and not m.group(1).isdigit() else None


def find(root: Root, driver_root: str | None = None) -> UserSpace:
    """The driver's user-space on the host under `root`; `found` is False when no place holds it."""
    searched = []
    for base, d in _candidates(driver_root):
        searched.append(d)
        present = [s for s in KEY_LIBS if root.is_file(f"{d}/{s}")]
        if not present:
            continue
        libs = {s: root.resolve(f"{d}/{s}") for s in present}
        versions = {s: v for s in present if (v := library_version(root, f"{d}/{s}"))}
        distinct = set(versions.values())
        version = distinct.pop() if len(distinct) == 1 else None
        return UserSpace(base, d, libs, version, versions, tuple(searched))
    return UserSpace(None, None, {}, None, {}, tuple(searched))
