"""The validation of the driver on the host: the driver it expects, the modules (the plan's, or the
planner's decision for the host now), the workload check's options and the verdict. One function for the
validate step, the daemon's reconcile pass and the container's fast path, so that the layers above a
transaction prove a driver the way a transaction does without reaching into its steps."""
from __future__ import annotations

from driverd.apply.hostview import pci_view
from driverd.driver.state import DriverState
from driverd.errors import ModuleError
from driverd.kmod import load as ld


def expected_driver(ctx, params) -> tuple[str, str] | None:
    """The step's `expect` ([version, flavor]), else the driver of the package installed for the running kernel."""
    if params.get("expect"):
        return tuple(params["expect"])
    got = DriverState.of(ctx).installed()
    return (got.driver.version, got.driver.flavor) if got else None


def driver_modules(ctx, params) -> list[str]:
    """The plan's module list, or (load, reload, a validation without a plan) the planner's decision
    for this host now: the NVIDIA modules running before this transaction (the snapshot) or now."""
    if params.get("modules"):
        return list(params["modules"])
    from driverd.host import modules as host_modules
    from driverd.host import rdma
    from driverd.plan import Desired
    from driverd.plan.planner import MODULE_ORDER, decide_modules, display_gpus
    was = set(((ctx.doc or {}).get("lkg") or {}).get("modules") or ())
    loaded = host_modules.loaded_modules(ctx.root)
    running = frozenset(m for m in MODULE_ORDER if m in was or m in loaded) if (was or "nvidia" in loaded) else frozenset()
    gpus, _, nics = pci_view(ctx)
    release = ctx.kernel.release
    got = DriverState.of(ctx).installed()
    facts = rdma.read_rdma(ctx.root, release, loaded) if nics else None
    return decide_modules(Desired.from_config(ctx.config), running, display_gpus(gpus), len(nics), facts,
                          got.driver.flavor if got else None, release).modules


def workload_options(ctx, params) -> dict | None:
    """The workload check's options for this validation, None when it does not run: validation.workload
    off (or auto on anything but the real kernel's live host: apply.hostplan.workload_applies), the
    daemon's passes between two checks and a rollback's convergence (`"workload": false`)."""
    from driverd.apply.hostplan import workload_applies
    if params.get("workload") is False or not workload_applies(ctx.root, ctx.config, ctx.kernel.name):
        return None
    return {"timeout_s": ctx.config["validation.workload_timeout_s"],
            "driver_root": ctx.config["validation.driver_root"]}


def validate_driver(ctx, params: dict) -> dict:
    """Prove the driver on the host as it is (driverd.kmod.load.validate) and return its report; a failure
    raises ModuleError carrying the kernel's NVRM lines since the run's snapshot, the evidence an operator
    needs when the rollback has already replaced the driver that failed."""
    expect = expected_driver(ctx, params) or (None, None)
    v = ld.validate(ctx.kernel, expect[0], expect[1], ctx.services, ctx.config["daemons.persistenced"]
                    and params.get("persistence", True), driver_modules(ctx, params),
                    workload=workload_options(ctx, params))
    if not v.ok:
        from driverd.kmod.kernel import NVRM_RE
        words = [ln for ln in ctx.kernel.log_since(ctx.doc.get("log_mark", 0)) if NVRM_RE.search(ln)][-6:]
        raise ModuleError("validation failed: " + "; ".join(v.problems),
                          cause="the kernel log's NVRM lines follow" if words else "the kernel logged no NVRM line",
                          fix=(v.fix or "see the problems above and the kernel log")
                          + ("; the run rolls back to the last-known-good driver" if ctx.doc else ""),
                          details={"validation": v.to_json(), "kernel_log": words})
    return v.to_json()
