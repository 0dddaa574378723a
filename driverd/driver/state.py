"""DriverState: the one reader of which driver this host runs and has — the driver the kernel runs,
the kernel half installed for a release, the user-space tree in use, the records of the last converge
and the parameters the running modules were loaded with. Read-only; a missing or damaged record is
"not there", never an exception (a damaged one may add a warning)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from driverd.driver import layout
from driverd.driver.ident import DriverId
from driverd.driver.ident import loaded as loaded_driver
from driverd.driver.modules import InstalledModules, installed_modules
from driverd.driver.records import read_json
from driverd.root import Root

if TYPE_CHECKING:
    from driverd.driver.userspace import Tree

# Values a module shows for a parameter nobody set: passed back, they would set a literal string.
_UNSET = ("", "(null)")


def running_parameters(kernel, names=None) -> dict[str, dict[str, str]]:
    """Loaded module (of `names`, default all) -> the parameters it shows, as the kernel shows them:
    /sys/module/<m>/parameters, plus nvidia's registry keys, which it declares unreadable there and shows
    in /proc/driver/nvidia/params ("EnableGpuFirmware: 18" for NVreg_EnableGpuFirmware). The one reader:
    the snapshot a rollback reloads with and the drift a daemon reloads for see the same values."""
    out = {name: dict(m.parameters) for name, m in kernel.modules(names).items()}
    if "nvidia" in out:
        for k, v in parse_nvidia_params(kernel.root.read_text("/proc/driver/nvidia/params")).items():
            out["nvidia"].setdefault(k, v)
    return out


def settable(params: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The running parameters to load a module with again: values nobody set ("", "(null)") are left
    out, as passing them back would set a literal string instead of leaving the default."""
    out = {}
    for m, vals in params.items():
        keep = {k: v for k, v in vals.items() if v not in _UNSET}
        if keep:
            out[m] = keep
    return out


def parse_nvidia_params(text: str | None) -> dict[str, str]:
    """/proc/driver/nvidia/params ("Key: value" per line) as NVreg_<Key> -> value."""
    out = {}
    for line in (text or "").splitlines():
        k, sep, v = line.partition(":")
        if sep and k.strip() and " " not in k.strip():
            out[f"NVreg_{k.strip()}"] = v.strip().strip('"')
    return out


class DriverState:
    """What this host runs and has, read when asked (never cached: the host changes under a daemon)."""

    def __init__(self, root: Root, *, state_dir: str = layout.DEFAULT_STATE_DIR, release: str | None = None,
                 places: layout.Places | None = None) -> None:
        self.root, self.state_dir, self.release = root, state_dir, release
        self.places = places or layout.Places(state_dir=state_dir)

    @classmethod
    def from_config(cls, root: Root, cfg, release: str | None) -> "DriverState":
        return cls(root, state_dir=cfg["state.dir"], release=release, places=layout.Places.from_config(cfg))

    @classmethod
    def of(cls, ctx) -> "DriverState":
        """For a step context (root, config, kernel)."""
        return cls.from_config(ctx.root, ctx.config, ctx.kernel.release)

    def loaded(self) -> DriverId | None:
        """The driver the kernel runs now."""
        return loaded_driver(self.root)

    def installed(self, release: str | None = None, warnings: list[str] | None = None) -> InstalledModules | None:
        """The kernel half installed for `release` (default: the running kernel's)."""
        return installed_modules(self.root, release or self.release, warnings)

    # The user-space half is read by driver/userspace.py, imported when asked: `detect` never asks.
    def userspace(self) -> Tree | None:
        """driverd's user-space tree `current` points to (None: driverd installed none)."""
        from driverd.driver.userspace import current_name, read_tree
        name = current_name(self.root, self.places)
        return read_tree(self.root, self.places, name) if name else None

    def userspace_trees(self) -> list[Tree]:
        from driverd.driver.userspace import trees
        return trees(self.root, self.places)

    def userspace_of(self, sha: str) -> Tree | None:
        """The intact user-space tree of the package `sha` (kept or current)."""
        from driverd.driver.userspace import lookup
        return lookup(self.root, self.places, sha)

    def converged_record(self) -> dict | None:
        """The record of the last converge (layout.CONVERGED_RECORD), None when absent or unreadable."""
        doc = read_json(self.root, layout.state_path(self.state_dir, layout.CONVERGED_RECORD))
        return doc or None

    def last_converged(self) -> DriverId | None:
        """The driver driverd last converged this host to: the converge record's; a host last converged
        by an older driverd in cluster mode may only have its node-driver record."""
        rec = self.converged_record()
        if rec is not None:
            if rec.get("left_to"):
                return None         # the host's own driver, converged as it is: not one driverd keeps
            got = DriverId.from_dict(rec.get("driver"))
            if got is not None:
                return got
        return DriverId.from_dict(read_json(self.root, layout.state_path(self.state_dir, layout.NODE_DRIVER_RECORD)))

    def has(self) -> DriverId | None:
        """The driver this host has: the one loaded; with nothing loaded (after a reboot) the one driverd
        last converged it to; failing that, the driverd package installed for the running kernel. None:
        none of these (a host joining a cluster)."""
        got = self.loaded() or self.last_converged()
        if got is None and (inst := self.installed()) is not None:
            got = inst.driver
        return got
