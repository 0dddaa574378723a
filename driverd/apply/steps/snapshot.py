"""The snapshot every run that touches the driver starts with: the last-known-good state a failed run's
rollback converges back to (driverd.plan.steplists.converge_steps)."""
from __future__ import annotations

from driverd.apply.step import StepImpl
from driverd.apply.steps.common import installed, loaded, places, running_parameters
from driverd.driver.state import DriverState
from driverd.apply.hostview import known_daemons
from driverd.kmod import mig
from driverd.kmod.holders import NVIDIA_FAMILY


def userspace_now(ctx) -> dict:
    """driverd's user-space in use (userspace.root/current): its package's sha256 (None: none) and version."""
    cur = DriverState.of(ctx).userspace()
    ok = cur is not None and cur.intact
    return {"sha256": cur.sha if ok else None, "version": cur.version if ok else None}


def previous_records(ctx) -> dict:
    """What `driverd rollback` would go back to now (the kernel package's and the user-space's previous
    records): a failed run's rollback puts them back, so its failed package never becomes "previous"."""
    from driverd.driver.modules import previous_record as previous_modules
    from driverd.driver.userspace import previous_record
    return {"package": previous_modules(ctx.root, ctx.kernel.release, ctx.config["state.dir"]),
            "userspace": previous_record(ctx.root, places(ctx))}


class Snapshot(StepImpl):
    """Record the last-known-good state before anything changes: the loaded driver, its modules and
    the parameters they are running with, the installed package, running daemons, MIG layout, the
    kernel-log position."""
    action = "snapshot"

    def check(self, ctx, params):
        return "lkg" in ctx.doc

    def do(self, ctx, params):
        mods = ctx.kernel.loaded_names()
        now = loaded(ctx)
        family = [m for m in reversed(NVIDIA_FAMILY) if m in mods]
        lkg = {"loaded": now, "modules": family, "parameters": running_parameters(ctx, family),
               "installed": installed(ctx),
               "daemons": [d for d in known_daemons(ctx) if ctx.services.running(d)],
               "mig": mig.record(ctx.kernel) if now else None,
               "userspace": userspace_now(ctx), "previous": previous_records(ctx)}
        ctx.doc["lkg"] = lkg
        ctx.doc["log_mark"] = ctx.kernel.log_mark()
        return {"lkg": lkg}

    def describe(self, params):
        return "record the last-known-good state"
