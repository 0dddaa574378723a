"""The one place a host's plan is made: facts read under the root, the desired state from the
configuration, the signer preflight's verdict, whether any repository or local build can provide a
package, `driverd.plan.plan`. `driverd plan`, `apply` (and its
--dry-run), every pass of the daemon and the cluster agent's preflight call this, so they cannot
disagree about a host: the same facts and configuration give the same plan, and the same plan gives
the same verdict (converged, steps to take, blocked, reboot first)."""
from __future__ import annotations

from driverd.datatypes import dataclass
from driverd.host.facts import Facts
from driverd.plan.model import Desired, Plan


@dataclass(frozen=True)
class HostPlan:
    """A host's facts as read under the root, and the plan made from them and the configuration."""
    facts: Facts
    plan: Plan

    @property
    def verdict(self) -> str:
        return self.plan.verdict


def plan_for_host(root, cfg, *, facts: Facts | None = None, nvml: bool = False) -> HostPlan:
    from driverd.host import collect
    from driverd.build.signers import for_plan
    from driverd.plan import plan
    if facts is None:
        facts = collect(root, nvml=nvml, handler=cfg["runtime.handler"], binary=cfg["runtime.binary"],
                        driver_root=cfg["validation.driver_root"])
    from driverd.build.obtain import unavailable
    from driverd.driver.kept import kept_for
    from driverd.repo.userspace import offer
    return HostPlan(facts, plan(facts, Desired.from_config(cfg), for_plan(root, facts, cfg),
                                companions=_companion_offers(root, cfg, facts),
                                userspace=workload_applies(root, cfg),
                                us_offer=offer(root, cfg, cfg["driver.version"], facts.kernel.arch),
                                no_package=lambda: unavailable(root, cfg, facts.kernel.release, _want(facts, cfg)),
                                kept=kept_for(root, cfg["state.dir"], facts.kernel.release)))


def _companion_offers(root, cfg, facts: Facts) -> dict:
    """What this host could use of each companion it wants (driverd.plan.companions decides which; NSCQ where the
    fabric wants it): only those, since running a daemon's --version is not free."""
    from driverd.apply.companions import offers
    from driverd.plan.companions import COMPONENT, decide
    fab = getattr(facts, "fabric", None)
    fd = decide(fab, len(facts.nvswitches), cfg["daemons.fabricmanager"], cfg["daemons.imex"])
    wanted = [c for d, c in COMPONENT.items() if fd.why(d) is not None]
    if fab is not None and fab.want("nscq") is not None:
        wanted.append("nscq")
    return offers(root, cfg, wanted, cfg["driver.version"], facts.kernel.arch)


def _want(facts: Facts, cfg):
    """The package the plan would fetch for the running kernel (None: it cannot be named yet)."""
    from driverd.repo.fetch import Want
    from driverd.plan.flavor import decide
    k, version = facts.kernel, cfg["driver.version"]
    if not facts.gpus or not version or not k.release:
        return None
    flavor = decide(facts.gpus, version, cfg["driver.flavor"]).flavor
    return Want(version, flavor, k.release, k.arch or "x86_64") if flavor else None


@dataclass(frozen=True)
class HostVerdict:
    """The host against its configuration, as `driverd status` and every daemon pass judge it: the
    plan, and the module parameters the running driver has otherwise (the plan compares versions and
    flavours; a reload applies changed parameters)."""
    plan: Plan
    drift: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        """The plan's verdict (blocked | reboot-required | steps | converged), or "drift" for a converged
        plan whose driver runs with other parameters than configured."""
        v = self.plan.verdict
        return "drift" if v == "converged" and self.drift else v

    @property
    def in_sync(self) -> bool:
        return self.verdict == "converged"

    def reasons(self) -> list[str]:
        """What keeps the host from being in sync that a list of steps does not say."""
        p = self.plan
        return [f"blocked: {b}" for b in p.blocked_by] + [f"reboot required: {r}" for r in p.reboot_reasons] \
            + list(self.drift)

    def steps(self) -> list[str]:
        return [f"{s.action}: {s.reason}" for s in self.plan.changes]


def verdict_for_host(sctx, cfg, *, facts: Facts | None = None) -> HostVerdict:
    """plan_for_host, and the parameter drift of the driver it leaves running (none for a driver left
    to another package manager: driverd never reloads it)."""
    from driverd.apply import fingerprint as fpr
    from driverd.apply.drift import parameter_drift
    from driverd.driver.state import DriverState, running_parameters
    p = plan_for_host(sctx.root, cfg, facts=facts).plan
    drift: list[str] = []
    if p.driver_managed_by is None:
        state = DriverState.from_config(sctx.root, cfg, sctx.kernel.release)
        loaded = state.loaded()
        recorded = fpr.recorded_parameters(state.converged_record(), loaded.as_dict() if loaded else None,
                                           sctx.kernel.release)
        wanted = cfg["modules.parameters"]
        drift = parameter_drift(running_parameters(sctx.kernel, set(wanted) | set(recorded or {})), wanted, recorded)
    return HostVerdict(p, tuple(drift))


def workload_applies(root, cfg, kernel: str | None = None) -> bool:
    """validation.workload: on, or auto with the real kernel (`kernel`, default the configured one) on the
    live host (/, or /host in the driver container): then the plan judges the driver's user-space, and the
    validation makes CUDA calls. A sample tree or the simulated kernel has no GPU to call."""
    mode = cfg["validation.workload"]
    return mode == "on" or (mode == "auto" and (kernel or cfg["modules.kernel"]) == "real" and root.is_live())
