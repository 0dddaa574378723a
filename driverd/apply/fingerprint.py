"""What the host was last converged to, kept in <state.dir>/daemon/converged.json: a fingerprint of
the configuration that decides the host's state, the kernel release and the installed package's
sha256 and the sha256 of driverd's user-space in use (both halves of the driver), with the driver that was loaded and validated, the module parameters it was loaded with and
every driver setting of that converge (config.DRIVER_SETTINGS: what a cluster-mode node keeps until a
rollout changes it).
The container entrypoint compares it on start: same fingerprint, same driver loaded and valid ->
ready at once, nothing reloaded."""
from __future__ import annotations

import hashlib
import json
import time

from driverd.config import SCHEMA
from driverd.driver import layout
from driverd.driver.state import DriverState


# The keys that decide what the host should look like (where packages come from, cache sizes,
# timers and the like do not).
DESIRED_KEYS = ("driver.version", "driver.flavor", "driver.manage", "modules.parameters", "modules.load_drm",
                "modules.load_peermem", "signing.key", "signing.cert", "runtime.runtimes", "runtime.handler", "runtime.binary",
                "runtime.set_as_default", "runtime.cdi", "daemons.persistenced", "daemons.fabricmanager",
                "daemons.mode")
# Keys added after converges were recorded: part of the fingerprint only when set to other than their default,
# so that a host an older driverd converged keeps its fingerprint (the container's fast path) until one is used.
LATER_KEYS = ("daemons.imex",)
# The user-space half: where it comes from and where it goes.
USERSPACE_KEYS = ("userspace.package", "userspace.fetch", "userspace.root", "userspace.bin_dir",
                  "userspace.driver_link", "companions.fetch")


def fingerprint(cfg, kernel_release: str | None, package_sha256: str | None, userspace_sha256: str | None = None,
                *, userspace: bool = True) -> str:
    """`userspace` False: the kernel half only, as driverd before issue 45 fingerprinted a converge."""
    doc = {"config": {k: cfg[k] for k in DESIRED_KEYS}, "kernel": kernel_release, "package": package_sha256}
    doc["config"].update({k: cfg[k] for k in LATER_KEYS if cfg[k] != SCHEMA[k].default})
    us_config = {k: cfg[k] for k in USERSPACE_KEYS if cfg[k] != SCHEMA[k].default}
    if userspace and (us_config or userspace_sha256):
        # Only then: a host without driverd's user-space keeps the fingerprint an older driverd recorded.
        doc["userspace"] = {"config": us_config, "sha256": userspace_sha256}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _halves(sctx, cfg) -> tuple[DriverState, str | None, str | None]:
    state = DriverState.from_config(sctx.root, cfg, sctx.kernel.release)
    inst, us = state.installed(), state.userspace()
    return state, inst.package_sha256 if inst else None, us.sha if us and us.intact else None


def of_host(sctx, cfg) -> str:
    """The fingerprint of the host as it is now: both halves of the driver installed, the configuration."""
    _, package, userspace = _halves(sctx, cfg)
    return fingerprint(cfg, sctx.kernel.release, package, userspace)


def matches(rec: dict, sctx, cfg) -> bool:
    """Whether the record of the last converge is about the host and configuration as they are now."""
    if "userspace_sha256" in rec:
        return rec.get("fingerprint") == of_host(sctx, cfg)
    # An older driverd's record fingerprints the kernel half only: it stands when that half matches and
    # driverd's user-space, if any, is whole and in use (a changed user-space setting is then the next
    # reconcile's to find, as that driverd left it).
    state, package, userspace = _halves(sctx, cfg)
    if rec.get("fingerprint") != fingerprint(cfg, sctx.kernel.release, package, userspace=False):
        return False
    us = state.userspace()
    if us is None:
        return True
    from driverd.install import userspace as ui
    return bool(us.intact and us.sha and ui.is_installed(sctx.root, us.sha, state.places))


def _path(cfg) -> str:
    return layout.state_path(cfg["state.dir"], layout.CONVERGED_RECORD)


def read(root, cfg) -> dict | None:
    return DriverState(root, state_dir=cfg["state.dir"]).converged_record()


def recorded_parameters(rec: dict | None, loaded: dict | None, kernel_release: str | None) -> dict | None:
    """The module parameters the running driver was loaded with, when the record is about it."""
    if not rec or not loaded or rec.get("driver") != loaded or rec.get("kernel") != kernel_release:
        return None
    params = rec.get("parameters")
    return params if isinstance(params, dict) else None


def recorded_settings(rec: dict | None) -> dict | None:
    """The driver settings of the last converge (None: not recorded, e.g. by an older driverd)."""
    settings = (rec or {}).get("settings")
    return settings if isinstance(settings, dict) else None


def write(sctx, cfg, loaded: dict | None, left_to: str | None = None, validation: dict | None = None) -> bool:
    """Record a converge of the host as it is now; written only when something in it changed (an idle
    daemon writes nothing). `left_to`: the driver is another package manager's (the plan's
    driver_managed_by): the record says so, so that a restarted container goes ready at once on it too
    (issue 47) while nothing takes that driver for driverd's (DriverState.last_converged skips it)."""
    root = sctx.root
    _, package, userspace = _halves(sctx, cfg)
    rec = {"fingerprint": fingerprint(cfg, sctx.kernel.release, package, userspace), "driver": loaded,
           "package_sha256": package, "userspace_sha256": userspace, "kernel": sctx.kernel.release,
           "parameters": cfg["modules.parameters"], "settings": cfg.driver_settings()}
    if left_to:
        # and what its validation expects (the modules as the host runs them, no daemon of driverd's)
        rec["left_to"], rec["validation"] = left_to, validation or {}
    old = read(root, cfg)
    if old is not None and {k: old.get(k) for k in rec} == rec:
        return False
    root.atomic_write_json(_path(cfg), {**rec, "at": time.time()}, 0o644)
    return True
