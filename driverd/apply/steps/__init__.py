"""Step implementations, by action name (the names driverd.plan emits, plus the ones the lifecycle
commands and rollbacks need), grouped by what they change: snapshot, package, userspace, modules,
validate, runtime, reboot. Each step is idempotent: check() says whether its effect is in place.

What the executor is given is built here: `REGISTRY`, the explicit table of the modules' classes
(nothing registers itself on import), and `converge`, a failed run's way back to its snapshot. Only
driverd.apply imports this package; the layers above it validate through driverd.apply.validation
(tests/test_architecture.py)."""
from __future__ import annotations

from driverd.apply.hostview import boot_id
from driverd.apply.step import MODULES, Registry, StepContext
from driverd.apply.steps.common import installed, loaded, running_parameters
from driverd.apply.steps.modules import (BlacklistNouveau, CheckParameters, CheckSigners, LoadModules, RestoreMig,
                                         StartDaemons, StartFabricManager, StartImex, StartNvlsm, StartPersistenced,
                                         StopDaemons, UnloadModules, UnloadNouveau)
from driverd.apply.steps.package import (FetchPackage, ForgetKernel, InstallPackage, RestorePackage,
                                         RestorePreviousPackage, VerifyPackage)
from driverd.apply.steps.reboot import ClearReboot, RequireReboot, reboot_record
from driverd.apply.steps.runtime import ConfigureRuntime, RestoreFiles, RevertRuntime
from driverd.apply.steps.snapshot import Snapshot
from driverd.apply.steps.companion import InstallCompanion, RestoreCompanion
from driverd.apply.steps.userspace import FetchUserspace, InstallUserspace, RestoreUserspace
from driverd.apply.steps.validate import Validate
from driverd.plan import steplists as sl

# what driverd.apply's lifecycle, reconcile and preflight read through this package
__all__ = ["REGISTRY", "boot_id", "converge", "installed", "loaded", "reboot_record"]


def converge(lkg: dict | None, touched: set, ctx: StepContext) -> list[dict]:
    """Back to the last-known-good state, for exactly what the run touched (the list:
    driverd.plan.steplists.converge_steps). Only whether the kernel still runs the recorded driver is
    read here, and only when the run touched the modules of a loaded driver."""
    now = (lkg or {}).get("loaded")
    same = bool(MODULES in touched and now and _driver_is_lkg(ctx, lkg))
    return sl.converge_steps(lkg, touched, driver_is_lkg=same)


def _driver_is_lkg(ctx, lkg: dict) -> bool:
    """The kernel runs the recorded driver: same version and flavour, every recorded module loaded,
    with the parameters it was running with."""
    try:
        mods = ctx.kernel.loaded_names()
        return (loaded(ctx) == lkg.get("loaded") and all(m in mods for m in lkg.get("modules") or ())
                and running_parameters(ctx, list(lkg.get("modules") or ())) == (lkg.get("parameters") or {}))
    except Exception:          # cannot tell: take the full way back
        return False


REGISTRY: Registry = {impl.action: impl for impl in (
    Snapshot(), BlacklistNouveau(), UnloadNouveau(), FetchPackage(), VerifyPackage(), InstallPackage(),
    FetchUserspace(), InstallUserspace(), RestoreUserspace(), InstallCompanion(), RestoreCompanion(),
    RestorePackage(), RestorePreviousPackage(), StopDaemons(), StartDaemons(), StartPersistenced(),
    StartNvlsm(), StartFabricManager(), StartImex(), UnloadModules(), CheckSigners(), CheckParameters(), LoadModules(), RestoreMig(), Validate(),
    ConfigureRuntime(), RevertRuntime(), RestoreFiles(), RequireReboot(), ClearReboot(), ForgetKernel())}
