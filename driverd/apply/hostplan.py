"""The one place a host's plan is made: facts read under the root, the desired state from the
configuration, the signer preflight's verdict, whether any repository or local build can provide a
package, `driverd.plan.plan`. `driverd plan`, `apply` (and its
--dry-run), every pass of the daemon and the cluster agent's preflight call this, so they cannot
disagree about a host: the same facts and configuration give the same plan, and the same plan gives
the same verdict (converged, steps to take, blocked, reboot first)."""
from __future__ import annotations

from dataclasses import dataclass

from driverd.host.facts import Facts
from driverd.plan.model import Desired, Plan


@dataclass(frozen=True)
class HostPlan:
    facts: Facts
    plan: Plan

    @property
    def verdict(self) -> str:
        return self.plan.verdict


def plan_for_host(root, cfg, *, facts: Facts | None = None, nvml: bool = False) -> HostPlan:
    from driverd.host import collect
    from driverd.packages.signers import for_plan
    from driverd.plan import plan
    if facts is None:
        facts = collect(root, nvml=nvml, handler=cfg["runtime.handler"], binary=cfg["runtime.binary"],
                        driver_root=cfg["validation.driver_root"])
    from driverd.packages.fetch import unavailable
    from driverd.packages.userspace_source import offer
    return HostPlan(facts, plan(facts, Desired.from_config(cfg), for_plan(root, facts, cfg),
                                userspace=workload_applies(root, cfg),
                                us_offer=offer(root, cfg, cfg["driver.version"], facts.kernel.arch),
                                no_package=unavailable(root, cfg, facts.kernel.release)))


def workload_applies(root, cfg, kernel: str | None = None) -> bool:
    """validation.workload: on, or auto with the real kernel (`kernel`, default the configured one) on the
    live host (/, or /host in the driver container): then the plan judges the driver's user-space, and the
    validation makes CUDA calls. A sample tree or the simulated kernel has no GPU to call."""
    mode = cfg["validation.workload"]
    return mode == "on" or (mode == "auto" and (kernel or cfg["modules.kernel"]) == "real" and root.is_live())
