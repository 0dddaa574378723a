"""The driver container's fast path. A driver container is restarted often (a node reboot, an image
roll, an eviction); when the host already is what the configuration asks - the same driver loaded
and valid, the same configuration, kernel and package as the last converge recorded - it must not
unload anything, restart daemons or touch the runtimes: it goes ready at once and leaves the host to
the reconcile loop's next pass. Read-only: no lock, no journal, no file written.

What it checks, and why that is enough: the record of the last converge (its fingerprint: the configuration
that decides the host, the kernel, the kernel package's and the user-space's sha256) matches the host now; no
run is pending and no reboot is required; the kernel runs the driver the record names (a driver left to the
host — the record's left_to — included: its package manager changing it changes what is loaded); the GPU
daemons it wants run; and the validation passes, workload check included, so ready still means CUDA works.
Anything else that could differ is decided by those inputs, which the converge that wrote the record proved."""
from __future__ import annotations

from driverd.apply import fingerprint as fpr
from driverd.apply.validation import validate_driver
from driverd.driver.state import DriverState
from driverd.errors import DriverdError


def fast_path(sctx, cfg) -> tuple[dict | None, str]:
    """(the loaded driver, why) when the container may go ready without a reconcile, else (None, why not)."""
    from driverd.apply.lifecycle import journal, reboot_record
    rec = fpr.read(sctx.root, cfg)
    if rec is None:
        return None, "no converged state is recorded (first start on this host)"
    if not fpr.matches(rec, sctx, cfg):
        return None, "the configuration, kernel or installed driver (package or user-space) changed since the " \
                     "last converge"
    try:
        doc = journal(sctx).load(repair=False)
    except DriverdError as e:
        return None, e.one_line()
    if doc is not None and doc.get("state") in ("running", "rolling-back"):
        return None, f"the {doc['command']} run {doc['run_id']} was interrupted and must be finished first"
    if reboot_record(sctx) is not None:
        return None, "a reboot is recorded as required"
    running = DriverState.of(sctx).loaded()
    loaded = running.as_dict() if running else None
    if loaded is None or loaded != rec.get("driver"):
        return None, f"the loaded driver ({_name(loaded)}) is not the one last converged ({_name(rec.get('driver'))})"
    from driverd.apply.hostview import wanted_daemons
    # a driver left to the host has the host's daemons, or none: driverd starts none for it (as its reconcile)
    wanted = [] if rec.get("left_to") else wanted_daemons(sctx, cfg)
    missing = [d for d in wanted if not sctx.services.running(d)]
    if missing:
        return None, f"{', '.join(missing)} not running: the first reconcile starts it (no reload)"
    try:
        validate_driver(sctx, dict(rec.get("validation") or {}) if rec.get("left_to") else {})
    except DriverdError as e:
        return None, e.one_line()
    left = f", left to {rec['left_to']}" if rec.get("left_to") else ""
    return loaded, f"driver {loaded['version']} ({loaded['flavor']}{left}) is loaded and valid and the configuration " \
                   "is unchanged since the last converge: nothing reloaded or restarted"


def _name(d: dict | None) -> str:
    return f"{d['version']} ({d['flavor']})" if d else "none"
