"""Plans are data: what driverd will do, in order, and why. Printing a plan explains a run."""
from __future__ import annotations

from dataclasses import asdict, field
from typing import Any

from driverd.datatypes import dataclass
from driverd.runtime.model import HandlerNeeds


@dataclass(frozen=True)
class Step:
    """One step of a plan: an action this host needs, and why."""
    action: str                         # e.g. "blacklist-nouveau", "load-modules"
    reason: str                         # why this host needs it
    params: dict[str, Any] = field(default_factory=dict)
    preconditions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Desired:
    """The desired state of one host, from configuration and command-line overrides."""
    driver_version: str | None
    flavor: str = "auto"
    module_parameters: dict[str, dict[str, str]] = field(default_factory=dict)
    load_drm: bool | None = None        # None: keep nvidia_drm loaded across an upgrade when it was running
    load_modeset: bool | None = None    # None: when nvidia_drm needs it, it was running, or a GPU drives a display
    load_peermem: str = "auto"
    unload_policy: str = "refuse"
    signing_key: str | None = None
    signing_cert: str | None = None
    runtimes: tuple[str, ...] = ("auto",)
    handler: str = "nvidia"
    persistenced: bool = True
    fabricmanager: str = "auto"
    imex: str = "auto"                  # daemons.imex (driverd.plan.companions decides with the fabric)
    manage: str = "auto"                # driver.manage: auto | always | never (driverd.host.ownership)

    @classmethod
    def from_config(cls, cfg) -> "Desired":
        return cls(driver_version=cfg["driver.version"], flavor=cfg["driver.flavor"],
                   module_parameters=cfg["modules.parameters"], load_drm=cfg["modules.load_drm"],
                   load_modeset=cfg["modules.load_modeset"],
                   load_peermem=cfg["modules.load_peermem"], unload_policy=cfg["modules.unload_policy"],
                   signing_key=cfg["signing.key"], signing_cert=cfg["signing.cert"],
                   runtimes=tuple(cfg["runtime.runtimes"]), handler=cfg["runtime.handler"],
                   persistenced=cfg["daemons.persistenced"], fabricmanager=cfg["daemons.fabricmanager"],
                   imex=cfg["daemons.imex"], manage=cfg["driver.manage"])


@dataclass(frozen=True)
class FlavorDecision:
    """The kernel-module flavour chosen for a host's GPUs, and why."""
    flavor: str | None                  # open | proprietary | None (no GPU)
    reason: str
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """What a host needs to reach the desired driver: the steps to take, what blocks them, or a reboot first."""
    driver_version: str | None
    flavor: str | None
    flavor_reason: str
    kernel_release: str | None
    steps: tuple[Step, ...]
    reboot_required: bool = False
    reboot_reasons: tuple[str, ...] = ()
    blocked_by: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    signatures: dict | None = None      # the signer preflight's verdict (driverd.build.signers)
    driver_managed_by: str | None = None  # set when driverd leaves the driver to another package manager
    # What "converged" means for this host, checked by every validation (the transaction's last step,
    # the daemon's pass, the cluster agent): these NVIDIA modules loaded, persistence when driverd runs
    # the GPU daemons. The driver version and flavour are driver_version / flavor above.
    modules: tuple[str, ...] = ()
    persistence: bool = False
    # Per runtime the plan configures: what the handler needs on this host and whether it has it (its
    # binary, CDI). A missing binary is a warning, never a block: the toolkit may come after driverd.
    runtimes: tuple[HandlerNeeds, ...] = ()
    # The host's GPU fabric and what it needs (driverd.host.fabric), None where it has none
    fabric: str | None = None

    @property
    def changes(self) -> tuple[Step, ...]:
        """The steps that change the host (validate only reads it)."""
        return tuple(s for s in self.steps if s.action != "validate")

    def validation(self) -> dict:
        """The validate step's parameters for this plan's idea of a converged host."""
        return {"expect": [self.driver_version, self.flavor], "modules": list(self.modules),
                "persistence": self.persistence}

    @property
    def nothing_to_do(self) -> bool:
        return not self.steps and not self.blocked_by and not self.reboot_required

    @property
    def verdict(self) -> str:
        """The one answer `plan`, `apply --dry-run` and the daemon's pass give for a host:
        blocked | reboot-required | steps (something to change) | converged."""
        if self.blocked_by:
            return "blocked"
        if self.reboot_required:
            return "reboot-required"
        return "steps" if self.changes else "converged"

    def to_json(self) -> dict:
        out = asdict(self)
        out["nothing_to_do"] = self.nothing_to_do
        out["verdict"] = self.verdict
        return out
