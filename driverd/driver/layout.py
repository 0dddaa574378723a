"""Every path driverd owns for a driver, host paths relative to the root: the kernel half's install
directory and records, the user-space half's trees and records, the records of the last converge.
Readers (state.py) and writers (packages' installers, the daemon's records) take their paths here."""
from __future__ import annotations

import os

from driverd.datatypes import NamedTuple
from driverd.package import MANIFEST_NAME
from driverd.root import Root

DEFAULT_STATE_DIR = "/var/lib/driverd"

# -- the kernel half, per kernel release ---------------------------------------------------------------
MODULES_DIR = "updates/driverd"                 # relative to /lib/modules/<release>/
MODULES_MANIFEST = MANIFEST_NAME
MODULES_RECORD = "install.json"                 # {"package_sha256", ...}


FIRMWARE_BASE = "/lib/firmware/nvidia"          # <version>/gsp_*.bin (the open flavour's)
PACKAGES_DIR = "packages"                       # under state.dir: pending-<release>.json
PREVIOUS_DIR = "packages/previous"              # under state.dir: <release>.json
KEPT_DIR = "packages/kept"                      # under state.dir: <sha256>/ (driver/kept.py)


def modules_dir(release: str) -> str:
    return f"/lib/modules/{release}/{MODULES_DIR}"


def modules_marker(state_dir: str, release: str) -> str:
    """The pending marker of an unfinished switch of the kernel half for `release`."""
    return f"{state_dir.rstrip('/')}/{PACKAGES_DIR}/pending-{release}.json"


def modules_previous(state_dir: str, release: str) -> str:
    """What the last install/restore for `release` replaced."""
    return f"{state_dir.rstrip('/')}/{PREVIOUS_DIR}/{release}.json"


# -- records of the last converge (under state.dir) ----------------------------------------------------
CONVERGED_RECORD = "daemon/converged.json"      # the daemon's: fingerprint, driver, parameters, settings
NODE_DRIVER_RECORD = "node-driver.json"         # older driverd's cluster-mode record of the driver; read only


def state_path(state_dir: str, name: str) -> str:
    return f"{state_dir.rstrip('/')}/{name}"


# -- the user-space half -------------------------------------------------------------------------------
USERSPACE_ROOT = "/var/lib/driverd/driver"
USERSPACE_BIN_DIR = "/usr/local/bin"
# The GPU Operator's driver root (nvidia-ctk --driver-root): driverd links it to its `current` tree.
USERSPACE_DRIVER_LINK = "/run/nvidia/driver"
USERSPACE_MAX_KEPT = 3
CURRENT = "current"
USERSPACE_STATE = "userspace"                   # under state.dir: pending.json, previous.json, links.json
USERSPACE_RECORD = "install.json"               # in each tree: {"package_sha256", ...}


class Places(NamedTuple):
    """Where a node's user-space goes (host paths, from the configuration)."""
    root: str = USERSPACE_ROOT                  # userspace.root
    bin_dir: str | None = USERSPACE_BIN_DIR     # userspace.bin_dir (None; "none" in the configuration: no PATH links)
    state_dir: str = DEFAULT_STATE_DIR          # state.dir
    max_kept: int = USERSPACE_MAX_KEPT          # userspace.max_kept
    driver_link: str | None = USERSPACE_DRIVER_LINK   # userspace.driver_link (None; "none": no link)

    @classmethod
    def from_config(cls, cfg) -> "Places":
        bin_dir = cfg["userspace.bin_dir"]
        link = cfg["userspace.driver_link"]
        return cls(cfg["userspace.root"], None if bin_dir in (None, "", "none") else bin_dir, cfg["state.dir"],
                   int(cfg["userspace.max_kept"]), None if link in (None, "", "none") else link)

    @property
    def current(self) -> str:
        return f"{self.root.rstrip('/')}/{CURRENT}"

    def tree(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    @property
    def pending(self) -> str:
        return f"{self.state_dir.rstrip('/')}/{USERSPACE_STATE}/pending.json"

    @property
    def previous(self) -> str:
        return f"{self.state_dir.rstrip('/')}/{USERSPACE_STATE}/previous.json"

    @property
    def links_record(self) -> str:
        return f"{self.state_dir.rstrip('/')}/{USERSPACE_STATE}/links.json"

    @property
    def ld_line(self) -> str:
        return f"{self.current}/lib64"

    def ldconf_text(self) -> str:
        return ("# driverd: the NVIDIA driver's user-space it installed (the tree <userspace.root>/current points to).\n"
                "# Written and removed by driverd; do not edit.\n" + self.ld_line + "\n")

    def bin_target(self, name: str) -> str:
        return f"{self.current}/bin/{name}"

    def link_target(self, root: Root) -> str:
        """What the driver-root link points to: `current`, relative to the link's (resolved) directory, so
        that it resolves to the same tree on the host and under a root (the driver container's /host)."""
        assert self.driver_link
        base = root.resolve(os.path.dirname(self.driver_link.rstrip("/")) or "/")
        return os.path.relpath(root.resolve(self.root).rstrip("/") + f"/{CURRENT}", base)


# The loader configuration driverd writes for the user-space it installed: its one line names
# <userspace.root>/current/lib64.
LDCONF = "/etc/ld.so.conf.d/00-driverd-nvidia.conf"
