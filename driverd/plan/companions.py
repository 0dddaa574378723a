"""Which of the driver's companion daemons driverd runs beside the driver on a host, and who owns IMEX: one
decision — pure, the host's fabric facts (driverd.host.fabric) and the settings in — for the plan, the steps
that start and stop the GPU daemons, the snapshot and the container's fast path, so they never disagree.

- **fabric manager**: `daemons.fabricmanager = true`, or auto with NVSwitches on PCI or NVLink5 switch trays
  managed from this host.
- **NVLSM** (the NVLink subnet manager): wherever the fabric manager runs for NVLink5 switch trays, and started
  before it, as NVIDIA's nvidia-fabricmanager-start.sh does (NVLSM first, then nv-fabricmanager, which talks to
  it). It has no key of its own: `daemons.fabricmanager = false` leaves both to the host.
- **IMEX**: `daemons.imex = true`, or auto on NVLink5 IMEX trays (GB200/GB300 NVL72) — unless NVIDIA's DRA
  driver's ComputeDomains own IMEX on the node (its compute-domain kubelet plugin is there: the fact
  `Fabric.compute_domains`). A ComputeDomain runs an IMEX daemon of its own in its pods and makes its channels;
  a host IMEX service beside it would serve the same GPUs to another domain: never both. Under auto driverd
  leaves IMEX to them; `true` with them present names both owners and is BLOCKED before anything changes.

And the plan's part for them (`daemon_steps`, `install_step`, the IMEX channel's load parameter): the planner
calls these with the offers driverd.apply.companions made of each companion the host wants.
"""
from __future__ import annotations

from driverd.datatypes import dataclass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.plan.model import Step

# driverd.kmod.daemons' names, by value: plan sits beside kmod in the layers, not above it.
PERSISTENCED, FABRICMANAGER, NVLSM, IMEX = "nvidia-persistenced", "nv-fabricmanager", "nvlsm", "nvidia-imex"
# The order they start in (NVLSM configures the switch trays the fabric manager then routes; IMEX needs the
# fabric); they stop in any order, all before the unload.
START_ORDER = (PERSISTENCED, NVLSM, FABRICMANAGER, IMEX)
# daemon -> its companion package (driverd.package.companion.COMPONENTS)
COMPONENT = {FABRICMANAGER: "fabricmanager", NVLSM: "nvlsm", IMEX: "imex"}
# the order the plan switches the companions' trees in, with the old driver out of the kernel
INSTALL_ORDER = ("fabricmanager", "nscq", "nvlsm", "imex")


@dataclass(frozen=True)
class FabricDaemons:
    """Why driverd runs each companion daemon (None: it does not), who owns IMEX, and what cannot be."""
    fabricmanager: str | None = None
    nvlsm: str | None = None
    imex: str | None = None
    imex_owner: str | None = None        # one line for detect and plan; None: nothing here wants IMEX
    blocked: tuple[str, ...] = ()
    dra_imex: bool = False               # the DRA driver's ComputeDomains run IMEX here: its processes are theirs

    def why(self, daemon: str) -> str | None:
        return {FABRICMANAGER: self.fabricmanager, NVLSM: self.nvlsm, IMEX: self.imex}.get(daemon)

    def wanted(self, persistenced: bool) -> list[str]:
        """The GPU daemons driverd keeps running, in START_ORDER."""
        return [d for d in START_ORDER if (persistenced if d == PERSISTENCED else self.why(d) is not None)]

    def known(self) -> list[str]:
        """Every daemon a stop before an unload stops: all driverd runs anywhere (a setting changed since one
        started must not leave it holding the devices), except IMEX where the ComputeDomains own it — those
        IMEX daemons are their pods' processes, for the drain to move, never driverd's to stop."""
        return [d for d in START_ORDER if not (d == IMEX and self.dra_imex)]


def decide(fab, nvswitches: int, fabricmanager: str = "auto", imex: str = "auto") -> FabricDaemons:
    """`fab`: driverd.host.facts.Fabric (None: not read); `nvswitches`: NVSwitches on PCI; `fabricmanager`,
    `imex`: daemons.fabricmanager and daemons.imex."""
    trays = fab is not None and fab.want("nvlsm") is not None
    fm = None
    if fabricmanager == "true":
        fm = "daemons.fabricmanager = true"
    elif fabricmanager == "auto" and nvswitches:
        fm = f"{nvswitches} NVSwitch(es) need fabric manager"
    elif fabricmanager == "auto" and fab is not None and fab.want("fabricmanager") is not None:
        fm = "the NVLink5 switch trays managed from this host need fabric manager"
    nvlsm = ("the NVLink5 switch trays managed from this host need NVLSM (the NVLink subnet manager) configured "
             "before the fabric manager routes them") if fm and trays else None
    wants_imex = fab is not None and fab.want("imex") is not None
    cd = fab.compute_domains if fab is not None else None
    run, owner, blocked = None, None, ()
    if imex == "true" and cd:
        owner = f"IMEX is claimed twice: daemons.imex = true and the DRA driver's ComputeDomains ({cd})"
        blocked = (f"daemons.imex = true, but NVIDIA's DRA driver's ComputeDomains own IMEX on this node ({cd}): a "
                   "host IMEX service and a ComputeDomain's IMEX daemons must never both run (both would serve these "
                   "GPUs' memory to their own domain); fix: set daemons.imex = \"auto\" (or \"false\") to leave IMEX to "
                   "the ComputeDomains, or take the compute-domain kubelet plugin off this node (the DRA driver's "
                   "resources.computeDomains.enabled = false) to run IMEX as a host service",)
    elif imex == "true":
        run = "daemons.imex = true"
        owner = "IMEX is driverd's: nvidia-imex of the driver's version (daemons.imex = true)"
    elif imex == "auto" and wants_imex and cd:
        owner = f"IMEX is owned by the DRA driver's ComputeDomains ({cd}): driverd starts none"
    elif imex == "auto" and wants_imex:
        run = "this NVLink5 IMEX tray shares GPU memory across the nodes of its NVLink domain through IMEX"
        owner = ("IMEX is driverd's: nvidia-imex of the driver's version (daemons.imex = auto: an NVLink5 IMEX tray "
                 "and no DRA ComputeDomains on the node)")
    elif wants_imex:
        owner = "IMEX is left to the host (daemons.imex = false): driverd starts none"
    return FabricDaemons(fm, nvlsm, run, owner, blocked, dra_imex=bool(cd) and run is None)


def install_step(o) -> Step:
    """The install-companion step of an offer (driverd.apply.companions.CompanionOffer) with a tree to switch to."""
    from driverd.plan.model import Step     # here: detect asks decide() only, and the plan's model is ~5 ms of imports
    return Step("install-companion", f"the {o.version} {o.kind.title}: {o.ours.evidence}{o.carry}", dict(o.install))


def imex_channel_parameter(fab, fd, parameters: dict, version: str) -> str:
    """Why the load gets NVreg_CreateImexChannel0=1 ("" when it does not): driverd runs IMEX on a tray whose
    workloads want /dev/nvidia-caps-imex-channels/channel0, and the operator did not set the parameter.

    The parameter rather than a step that mknods the node: the channel belongs to the loaded module — its major
    is the dynamic one the driver registers at each load (nvidia-caps-imex-channels in /proc/devices), and with
    the parameter the node is made for that load (udev, nvidia-modprobe) — so it is there after every load,
    driverd's or not (a reboot, a load by hand), and never names the major of an earlier load, as a node
    driverd made would after a reload. It is what NVIDIA's IMEX guide sets, and check-parameters checks it
    against the new modules before anything is unloaded. IMEX channels exist from the 550 branch on
    (nv-caps-imex.c): older modules do not know the parameter. A driver that stays loaded without the channel
    keeps running: the plan warns (imex_channel_warnings)."""
    if fd.imex is None or fab is None or fab.want("imex-channel0") is None:
        return ""
    if "NVreg_CreateImexChannel0" in (parameters.get("nvidia") or {}):
        return ""
    branch = version.split(".", 1)[0]
    if not branch.isdigit() or int(branch) < 550:
        return ""
    return ("; NVreg_CreateImexChannel0=1: the load makes IMEX channel 0 (/dev/nvidia-caps-imex-channels/channel0) "
            "for the workloads")


def imex_channel_warnings(fab, fd, parameters: dict, loading: bool) -> list[str]:
    """The channel driverd's IMEX serves is missing and this plan's load does not make it."""
    c = fab.want("imex-channel0") if fd.imex is not None and fab is not None else None
    if c is None:
        return []
    set_to = (parameters.get("nvidia") or {}).get("NVreg_CreateImexChannel0")
    if set_to is not None and str(set_to).strip() not in ("1", "y", "Y"):
        return [f"modules.parameters nvidia.NVreg_CreateImexChannel0 = {set_to}: the driver makes no {c.path}; "
                f"workloads that use IMEX channel 0 need it made otherwise ({c.how})"]
    if c.present is False and not loading:
        return [f"{c.path} is missing and the driver keeps running without it: workloads cannot use IMEX channel 0; "
                f"the next load makes it (driverd reload), or make it now: {c.how}"]
    return []


# what the start step of each companion daemon is called
_START = {NVLSM: "start-nvlsm", FABRICMANAGER: "start-fabricmanager", IMEX: "start-imex"}
# how long start-nvlsm waits for the InfiniBand modules on a host that runs no driver yet (a boot): NVIDIA's
# driver container waits for them without a bound; a transaction must end, so driverd waits this long, then
# fails the run (rolled back), and the daemon's retry comes back
NVLSM_MODULE_WAIT_S = 300


def daemon_steps(facts, fd, offers: dict, version: str,
                 loading: bool) -> tuple[list[Step], list[str], list[str]]:
    """(steps, blocks, warnings) for the companions: the daemons driverd runs (`fd`: decide()'s) started in
    their order after the load — each from the offer of its version (blocked when that is known to be another
    version, or there is none), NVLSM only once the InfiniBand modules are up —, the companion of a daemon that
    is not running switched first when the driver stays loaded, and NSCQ's warning."""
    from driverd.plan.model import Step
    steps: list[Step] = []
    blocked: list[str] = []
    warnings: list[str] = []
    fab = getattr(facts, "fabric", None)
    for daemon in (NVLSM, FABRICMANAGER, IMEX):
        why = fd.why(daemon)
        dm = facts.daemon(daemon)
        if why is None or not (loading or not (dm and dm.running)):
            continue
        o = offers.get(COMPONENT[daemon])
        if not loading and o is not None and o.install is not None:
            steps.append(install_step(o))    # the driver stays: only the companion is switched first
        which = ""
        if o is not None:
            src = o.source
            which = f"; {src.describe()} is started" if src is not None and o.ok else ""
            if o.known_wrong or o.missing:
                blocked.append(o.why_not())         # none at all, or one that will refuse the driver
            elif loading and not o.ok:
                warnings.append(f"cannot tell that the {o.kind.title} started after the load is {version}'s: "
                                + o.why_not().partition(": ")[2])
        if daemon == FABRICMANAGER:
            why += " before CUDA can use NVLink"
        params: dict = {}
        c = fab.want("nvlsm") if daemon == NVLSM and fab is not None else None
        if c is not None:
            why += f"; after {', '.join(c.after_modules)}"
            params = {"after_modules": list(c.after_modules)}
            if c.waiting_for:
                waiting = ", ".join(c.waiting_for)
                if facts.driver.loaded:
                    # A driver runs: it is left running rather than replaced by one whose fabric cannot come up
                    # (these modules do not appear by themselves on a running host: they load at boot).
                    blocked.append(f"NVLSM cannot start: {waiting} {'is' if len(c.waiting_for) == 1 else 'are'} not "
                                   "loaded (NVLSM reaches the NVLink5 switch trays through the ConnectX functions' "
                                   f"InfiniBand MAD interface: {', '.join(c.after_modules)}), so the fabric could not "
                                   "complete; the driver that runs is left as it is; fix: modprobe "
                                   f"{' '.join(c.waiting_for)} (rdma-core's rdma-load-modules@infiniband.service or "
                                   "MLNX_OFED's openibd loads them at boot), then apply again")
                else:
                    # No driver runs (a boot, a first load): nothing to protect, and at boot the InfiniBand stack
                    # comes up beside driverd: the step waits for it, as NVIDIA's driver container does.
                    why += f" (not loaded yet: {waiting}; it waits up to {NVLSM_MODULE_WAIT_S} s for them)"
                    params["wait_s"] = NVLSM_MODULE_WAIT_S
        steps.append(Step(_START[daemon], why + which, params))
    if fd.dra_imex:
        # an IMEX service of the host's (not a ComputeDomain pod's) beside the DRA driver's: one of them must go,
        # and driverd cannot tell the operator's intent (nor stop it: its signals would reach the pods' too)
        host = sorted({u.pid for u in facts.gpu_users if u.comm == IMEX and not u.pod_uid and not u.container_id})
        if host:
            warnings.append(f"an IMEX service of the host runs (pid {', '.join(map(str, host))}) beside the DRA "
                            "driver's ComputeDomains, which run IMEX themselves: they must never both run; stop it "
                            "(systemctl disable --now nvidia-imex.service, or driverd-nvidia-imex.service)")
    o = offers.get("nscq")
    if fab is not None and fab.want("nscq") is not None and (loading or (o is not None and o.known_wrong)):
        if o is None or not o.ok:
            text = o.why_not() if o is not None else (
                f"no NSCQ of driver {version} is available: driverd has no libnvidia-nscq of it (no companion tree of "
                "it, or companions.fetch off) and the host has none; provide it: build the companion package (driverd "
                f"build-companion libnvidia_nscq-linux-<arch>-{version}-archive.tar.xz) into packages.repositories "
                f"with companions.fetch = true, or install the distribution's libnvidia-nscq of {version} on the host")
            warnings.append(f"{text} (a warning, not a block: nvidia-smi and DCGM cannot read the NVSwitches without "
                            "it; CUDA does not need it)")
    elif fab is not None and fab.want("nscq") is not None and o is not None and o.install is not None \
            and o.install.get("installed"):
        steps.append(install_step(o))          # the driver stays: its NSCQ tree made current again
    return steps, blocked, warnings
