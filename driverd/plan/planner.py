"""plan(facts, desired) -> Plan: a pure function. No I/O, no clock; same inputs, same plan."""
from __future__ import annotations

from dataclasses import replace

from driverd.datatypes import dataclass
from driverd.errors import UsageError
from driverd.host.facts import Facts
from driverd.plan import companions as comp
from driverd.plan import flavor as flavor_mod
from driverd.plan.model import Desired, Plan, Step
from driverd.plan.peermem import decide_peermem

# CUDA needs the driver and its unified-memory module; nothing else is loaded unless something needs it.
CORE_MODULES = ("nvidia", "nvidia_uvm")
# The order a load brings them up in (dependencies first) and the only modules a module set holds.
MODULE_ORDER = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem")
# NVIDIA modules that the driver package does not provide (GPUDirect Storage, vGPU host).
NOT_IN_PACKAGE = ("nvidia_fs", "nvidia_vgpu_vfio")


@dataclass(frozen=True)
class ModuleSet:
    """The NVIDIA modules to load on this host, with why each is in or out of the set."""
    modules: list[str]
    reasons: dict[str, str]                 # module -> why it is (or is not) in the set
    blocked: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def decide_modules(desired: Desired, running: frozenset[str] | set[str], display_gpus: tuple[str, ...],
                   mellanox_nics: int, rdma, flavor: str | None, release: str | None) -> ModuleSet:
    """The one decision of which NVIDIA modules a host runs: the plan loads them and every validation
    (after a transaction, the daemon's, the cluster agent's) checks exactly them. `running`: the NVIDIA
    modules loaded now (or recorded before this transaction); an upgrade keeps the same set.

    nvidia, nvidia_uvm: always. nvidia_modeset: modules.load_modeset, or (unset) when nvidia_drm is in
    the set (it depends on it), when it was running, or when a GPU is a display controller (PCI class
    0x0300: a console or display server drives it). nvidia_drm: modules.load_drm, or (unset) when it
    was running. nvidia_peermem: driverd.plan.peermem's decision."""
    reasons: dict[str, str] = {"nvidia": "the driver", "nvidia_uvm": "CUDA's unified memory (every CUDA program)"}
    warnings: list[str] = []
    drm = None
    if desired.load_drm:
        drm = "modules.load_drm = true"
    elif desired.load_drm is None and "nvidia_drm" in running:
        drm = "nvidia_drm was loaded with the running driver; the new one loads the same set"
    modeset = None
    if desired.load_modeset:
        modeset = "modules.load_modeset = true"
    elif drm:
        modeset = "nvidia_drm depends on it"
        if desired.load_modeset is False:
            warnings.append("modules.load_modeset = false is overridden: nvidia_drm is loaded and needs nvidia_modeset")
    elif desired.load_modeset is None and "nvidia_modeset" in running:
        modeset = "nvidia_modeset was loaded with the running driver; the new one loads the same set"
    elif desired.load_modeset is None and display_gpus:
        modeset = f"GPU {display_gpus[0]} is a display controller (PCI class 0x0300)"
    pm = decide_peermem(desired.load_peermem, mellanox_nics, rdma, flavor, release, "nvidia_peermem" in running)
    chosen = {"nvidia", "nvidia_uvm"}
    for m, why in (("nvidia_modeset", modeset), ("nvidia_drm", drm)):
        if why:
            chosen.add(m)
            reasons[m] = why
        else:
            reasons[m] = "not needed: no display GPU, not loaded before, not configured"
    if pm.load:
        chosen.add("nvidia_peermem")
    reasons["nvidia_peermem"] = pm.reason
    warnings += [f"{m} is loaded and is not part of the driver package: load it again after the upgrade"
                 for m in NOT_IN_PACKAGE if m in running]
    return ModuleSet([m for m in MODULE_ORDER if m in chosen], reasons, (pm.blocked,) if pm.blocked else (),
                     tuple(warnings) + ((pm.warning,) if pm.warning else ()))


def running_modules(facts: Facts) -> frozenset[str]:
    return frozenset(m.name for m in facts.driver.modules) if facts.driver.loaded else frozenset()


def display_gpus(gpus) -> tuple[str, ...]:
    return tuple(g.pci_address for g in gpus if (g.class_code or "").lower().removeprefix("0x").startswith("0300"))


def module_set(facts: Facts, desired: Desired, flavor: str | None) -> ModuleSet:
    return decide_modules(desired, running_modules(facts), display_gpus(facts.gpus), len(facts.mellanox_nics),
                          facts.rdma, flavor, facts.kernel.release)


def modules_to_load(facts: Facts, desired: Desired, flavor: str | None = None) -> list[str]:
    return module_set(facts, desired, flavor).modules


def runtimes_to_configure(facts: Facts, desired: Desired) -> list[str]:
    if "none" in desired.runtimes:
        return []
    if "auto" in desired.runtimes:
        return [r.name for r in facts.runtimes]
    return list(desired.runtimes)


def _user(u) -> str:
    where = f", pod {u.pod_uid}" if u.pod_uid else (f", container {u.container_id[:12]}" if u.container_id else "")
    return f"pid {u.pid} ({u.comm}{where})"


def userspace_blocks(facts: Facts, loading: str | None) -> list[str]:
    """What the driver's user-space (facts.userspace) says against a workload-ready host: for a plan that
    keeps the loaded driver, the workload check's file-only half (its version is another, it is missing);
    for a plan that loads `loading`, whether containers would get that version's libraries."""
    us = facts.userspace or {}
    if loading is None:
        return [f"not workload-ready: {p}" for p in us.get("problems") or ()]
    if not us.get("libs"):
        return [f"not workload-ready after the load: no NVIDIA user-space (libcuda.so.1, libnvidia-ml.so.1) is "
                f"installed; fix: install the {loading} user-space first"]
    if us.get("version") and us["version"] != loading:
        return [f"not workload-ready after the load: the user-space is {us['version']}, loading {loading} would "
                f"leave containers with an NVML/RM version mismatch; fix: install the {loading} user-space first, or "
                f"keep driver.version = {us['version']}"]
    return []


def userspace_steps(offer, version: str, arch: str | None) -> tuple[list[Step], list[Step]]:
    """(fetch, install) steps that switch driverd's user-space to `version` with the modules: `offer` is
    driverd.repo.userspace.Offer (None: no package of it to switch to)."""
    if offer is None or offer.version != version or offer.in_place:
        return [], []
    now = f"driverd's user-space is {offer.current_version}" if offer.current_version else \
        "driverd has installed no user-space"
    if offer.inactive:
        now = f"driverd's {offer.current_version} user-space is installed but not active (its loader " \
              "configuration, PATH links or driver-root link are missing or changed)"
    if offer.package is None and offer.installed_sha:
        # the tree is on disk and intact: switching to it (or only making it active again, after a reboot)
        # needs no repository — a node must come back without the network
        what = "made active again" if offer.inactive and offer.installed_sha == offer.current_sha else "switched to"
        return [], [Step("install-userspace", f"{now}; {version}'s installed tree ({offer.installed_sha[:12]}) is "
                         f"{what} with the modules, before the validation; nothing is fetched",
                         {"driver": version, "sha256": offer.installed_sha, "installed": True})]
    fetch = [] if offer.package else [Step("fetch-userspace", f"{now}; the {version} user-space comes from "
                                           f"{offer.source}", {"driver": version, "arch": arch})]
    params = {"driver": version}
    if offer.package:
        params.update(package=offer.package, sha256=offer.sha256)
    return fetch, [Step("install-userspace", f"{now}; {version}'s ({offer.source}) is switched with the modules, "
                        "before the validation", params)]


def plan(facts: Facts, desired: Desired, signers=None, userspace: bool = False, us_offer=None,
         no_package=None, kept: dict | None = None, companions: dict | None = None) -> Plan:
    """`signers`: the signer preflight's verdict on the package that would be loaded
    (driverd.build.signers.SignerVerdict, computed from its files and the kernel's keyrings), or
    None when nobody looked. Only a verdict that the kernel would refuse blocks the plan.
    `userspace`: judge the driver's user-space (`userspace_blocks`) — where the workload check applies.
    `us_offer`: the user-space package of the wanted version this node can switch to
    (driverd.repo.userspace.Offer): its install goes into the same transaction as the modules.
    `no_package`: why no repository or local build can provide a package (driverd.build.obtain.unavailable),
    None when one may: a plan that needs to fetch one is then blocked instead of failing at fetch-package; a
    callable giving that answer is called only when the plan needs to fetch (it may read local indexes).
    `kept`: (version, flavour) -> sha256 of the packages for the running kernel in driverd's kept store
    (driverd.install.kept.kept_for): the wanted one comes back from there, with nothing fetched.
    `companions`: component -> what this host could use of it after the load (driverd.apply.companions.
    CompanionOffer), for the companions the host wants (driverd.plan.companions decides which): their trees are
    switched before the load, their daemons started after it; a daemon none of whose offers is the version
    blocks the plan, NSCQ only warns."""
    if not facts.gpus:
        return Plan(desired.driver_version, None, "no NVIDIA GPU on this host", facts.kernel.release, (),
                    warnings=facts.warnings)
    owner = facts.driver_owner.foreign if facts.driver_owner is not None else None
    if desired.manage == "never" or (desired.manage == "auto" and owner is not None):
        p = _leave_driver(facts, desired, owner)
        unready = userspace_blocks(facts, None) if userspace and facts.driver.loaded else []
        if unready:
            p = replace(p, blocked_by=p.blocked_by + tuple(
                f"{w} (the driver is left to {p.driver_managed_by}: fix its user-space there, or set "
                "driver.manage = always)" for w in unready))
        return p
    if not desired.driver_version:
        raise UsageError("no driver version requested", cause="neither --driver nor driver.version is set",
                         fix="pass --driver VERSION or set [driver] version in /etc/driverd/config.toml")
    version = desired.driver_version
    decision = flavor_mod.decide(facts.gpus, version, desired.flavor)
    flavor = decision.flavor
    k = facts.kernel
    steps: list[Step] = []
    blocked: list[str] = []
    reboot: list[str] = []

    if k.release is None:
        blocked.append("the kernel release is unknown (/proc/sys/kernel/osrelease unreadable); no package can be chosen")
    if not k.modules_supported:
        blocked.append("this kernel cannot load modules (no /proc/modules, CONFIG_MODULES not set)")

    # nouveau must be out of the way before nvidia can bind the GPUs.
    nv = facts.nouveau
    if not nv.blacklisted or not nv.modeset_disabled:
        steps.append(Step("blacklist-nouveau", "nouveau is not blacklisted; it would claim the GPUs at next boot"
                          if not nv.blacklisted else "nouveau modeset is not disabled",
                          {"path": "/etc/modprobe.d/driverd-blacklist-nouveau.conf"}))
    if nv.loaded:
        in_use = (nv.refcount or 0) > 0 or nv.holders
        if in_use:
            reboot.append(f"nouveau is loaded and in use (refcount {nv.refcount}, holders "
                          f"{', '.join(nv.holders) or 'none'}; e.g. the console) and cannot be unloaded")
        else:
            steps.append(Step("unload-nouveau", f"nouveau is loaded (bound to {', '.join(nv.bound_devices) or 'no device'})"))

    d = facts.driver
    want_loaded = d.loaded and d.version == version and d.flavor == flavor
    installed = any(p.kernel_release == k.release and p.driver_version == version and p.flavor == flavor
                    for p in d.installed)
    ms = module_set(facts, desired, flavor)
    mods = ms.modules
    fab = getattr(facts, "fabric", None)
    fd = comp.decide(fab, len(facts.nvswitches), desired.fabricmanager, desired.imex)
    offers = {c: o for c, o in (companions or {}).items() if o is not None and o.version == version}
    restore_sha = (kept or {}).get((version, flavor)) if not installed and not want_loaded else None
    if not installed and not want_loaded and not restore_sha:
        steps.append(Step("fetch-package", f"no driverd package for {version} ({flavor}) is installed for kernel "
                          f"{k.release}", {"driver": version, "flavor": flavor, "kernel": k.release, "arch": k.arch}))
        why = no_package() if callable(no_package) else no_package      # asked only when a fetch is planned
        if why:
            blocked.append(f"nothing can provide the {version} ({flavor}) package for kernel {k.release}: {why}; "
                           "fix: set packages.repositories to a repository that holds it (driverd build, driverd repo "
                           "index), or packages.source to the driver's source with the kernel's headers installed")
    if signers is not None and signers.blocks and not want_loaded:
        blocked.append("the kernel enforces module signatures (" + "; ".join(k.signature_enforcement_sources)
                       + ") and would refuse the package: " + signers.summary
                       + (f"; fix: {signers.enrol}" if signers.enrol else ""))
    us_fetch, us_install = userspace_steps(us_offer, version, k.arch)
    steps += us_fetch
    if restore_sha:
        steps.append(Step("restore-package", f"driverd kept the {version} ({flavor}) package for {k.release} "
                          f"({restore_sha[:12]}) when it was replaced: installed again from there, nothing is fetched",
                          {"sha256": restore_sha, "kernel_release": k.release}))
    elif not installed and not want_loaded:
        steps.append(Step("install-package", f"install {version} ({flavor}) modules and firmware for {k.release}",
                          {"driver": version, "flavor": flavor, "kernel": k.release}))
    if not want_loaded:
        replacing = d.loaded
        if replacing:
            # the ComputeDomains' IMEX daemons are their pods' (driverd.plan.companions): GPU users, not driverd's
            mine = [dm for dm in facts.daemons if dm.running and not (dm.name == comp.IMEX and fd.dra_imex)]
            running = [dm.name for dm in mine]
            if not k.module_unload_supported:
                reboot.append(f"driver {d.version} ({d.flavor}) is loaded and this kernel cannot unload modules "
                              f"({k.module_unload_evidence}); the new modules load at next boot")
            else:
                if running:
                    steps.append(Step("stop-gpu-daemons", "they hold the driver open", {"daemons": running}))
                # The GPU daemons hold /dev/nvidia* too, but the plan stops them before the unload.
                ours = {p for dm in mine for p in dm.pids}
                users = [u for u in facts.gpu_users if u.pid not in ours]
                if users and desired.unload_policy == "refuse":
                    blocked.append("the GPU is in use by " + "; ".join(_user(u) for u in users)
                                   + ": stop them, drain the node, or set modules.unload_policy=terminate")
                steps.append(Step("unload-modules", f"driver {d.version} ({d.flavor}) is loaded; {version} ({flavor}) "
                                  "is wanted", {"modules": [m.name for m in d.modules]},
                                  preconditions=("no process holds /dev/nvidia*",)))
        if replacing and not k.module_unload_supported:
            us_install = []         # the running driver stays until the reboot: its user-space with it
        if not (replacing and not k.module_unload_supported):
            steps += us_install     # with the old driver out of the kernel, before the new one loads
            us_install = []
            # the new driver's companions, from driverd's companion trees: before its daemons start
            steps += [comp.install_step(o) for c in comp.INSTALL_ORDER if (o := offers.get(c)) is not None
                      and o.install is not None]
            params = {m: dict(p) for m, p in desired.module_parameters.items() if m in mods}
            channel = comp.imex_channel_parameter(fab, fd, desired.module_parameters, version)
            if channel:
                params.setdefault("nvidia", {})["NVreg_CreateImexChannel0"] = "1"
            steps.append(Step("load-modules", f"{version} ({flavor}) is not loaded; nvidia_peermem: "
                              f"{ms.reasons['nvidia_peermem']}{channel}", {"modules": mods, "parameters": params,
                              "why": ms.reasons}, preconditions=("package installed for the running kernel",)))
    steps += us_install             # the wanted driver runs: only its user-space changes
    switching_us = any(s.action == "install-userspace" for s in steps)
    loading = any(s.action == "load-modules" for s in steps)
    if loading:
        blocked.extend(ms.blocked)          # a module the kernel would refuse (driverd.plan.peermem)
    persist = facts.daemon("nvidia-persistenced")
    if desired.persistenced and (loading or not (persist and persist.running)) and not reboot_only(reboot, d, k):
        steps.append(Step("start-persistenced", "keeps the GPUs initialised between jobs (daemons.persistenced)"))
    companion_warnings: list[str] = []
    if not reboot_only(reboot, d, k):
        fsteps, fblocked, companion_warnings = comp.daemon_steps(facts, fd, offers, version, loading)
        steps += fsteps
        blocked += fblocked
    blocked += fd.blocked
    companion_warnings += comp.imex_channel_warnings(fab, fd, desired.module_parameters, loading)
    steps += runtime_steps(facts, desired)
    persistence = desired.persistenced and not reboot_only(reboot, d, k)
    if loading or switching_us:
        steps.append(Step("validate", "prove the driver works: version, flavour, every GPU visible and the modules "
                          "decided for this host loaded", {"driver": version, "flavor": flavor,
                                                           "gpus": [g.pci_address for g in facts.gpus],
                                                           "modules": mods, "persistence": persistence}))
    if owner is not None:       # driver.manage = always
        replacing = (f"driver.manage = always: replacing the driver that {owner.describe()} owns ({owner.evidence}); "
                     "its user-space libraries may no longer match the kernel modules")
        ms = ModuleSet(ms.modules, ms.reasons, ms.blocked, (*ms.warnings, replacing))
    if userspace and not reboot and (loading or d.loaded):
        if switching_us and not us_offer.foreign:
            pass                    # the transaction installs the matching user-space; its validation proves it
        else:
            blocked.extend(userspace_blocks(facts, version if loading else None))
    return Plan(version, flavor, decision.reason, k.release, tuple(steps), bool(reboot), tuple(reboot),
                tuple(blocked), tuple(facts.warnings) + decision.warnings + ms.warnings
                + tuple(runtime_warnings(facts, desired)) + tuple(companion_warnings),
                signers.to_json() if signers is not None and not want_loaded else None,
                modules=tuple(mods), persistence=persistence, runtimes=tuple(runtime_needs(facts, desired)),
                fabric=fabric_summary(fab, fd))


def fabric_summary(fab, fd=None) -> str | None:
    """The plan's line on the host's fabric: its kind, why, what it needs (waiting or missing said) and who owns
    IMEX."""
    if fab is None or fab.kind == "none":
        return None
    wants = []
    for c in fab.wants:
        w = c.name
        if c.waiting_for:
            w += f" (after {', '.join(c.after_modules)}; not loaded yet: {', '.join(c.waiting_for)})"
        elif c.after_modules:
            w += f" (after {', '.join(c.after_modules)})"
        if c.present is False:
            w += f" ({c.path} is missing: {c.how})" if c.how else f" ({c.path} is missing)"
        wants.append(w)
    owner = f"; {fd.imex_owner}" if fd is not None and fd.imex_owner else ""
    return f"{fab.kind}: {fab.why}" + (f"; wants {', '.join(wants)}" if wants else "") + owner


def runtime_needs(facts: Facts, desired: Desired) -> list:
    """What the handler needs in each runtime the plan configures (detected ones; read with this handler)."""
    by_name = {r.name: r for r in facts.runtimes}
    return [r.needs for name in runtimes_to_configure(facts, desired)
            if (r := by_name.get(name)) is not None and r.needs is not None and r.needs.handler == desired.handler]


def runtime_steps(facts: Facts, desired: Desired) -> list[Step]:
    """configure-runtime for each runtime whose configuration lacks the handler. A handler whose binary
    is missing is still added — nvidia-container-toolkit may come after driverd, and the handler works
    from then on — and its reason says so (runtime_warnings repeats it with the fixes); a runtime that
    refuses such a handler (CRI-O would not start) gets no step until the binary exists."""
    steps = []
    by_name = {r.name: r for r in facts.runtimes}
    for name in runtimes_to_configure(facts, desired):
        r = by_name.get(name)
        if r is not None and r.nvidia_handler and desired.handler in r.handlers:
            continue
        needs = r.needs if r is not None and r.needs is not None and r.needs.handler == desired.handler else None
        if needs is not None and needs.waits_for_binary:
            continue
        reason = f"{name} has no '{desired.handler}' runtime handler" if r else \
            f"{name} was requested but is not detected on this host"
        if needs is not None and needs.status == "binary-missing":
            reason += (f" (it will run {needs.binary}, which is {needs.binary_state.replace('-', ' ')}: added now, it "
                       "works once the binary is installed; see the warning)")
        steps.append(Step("configure-runtime", reason, {"runtime": name, "handler": desired.handler}))
    return steps


def runtime_warnings(facts: Facts, desired: Desired) -> list[str]:
    """One warning per runtime whose handler cannot run its binary: the verdict with the fixes."""
    return [n.verdict for n in runtime_needs(facts, desired) if n.status == "binary-missing"]


def _leave_driver(facts: Facts, desired: Desired, owner) -> Plan:
    """driver.manage = never, or auto with a driver that another package manager owns: driverd does
    not fetch, install, unload or load it; it still configures the container runtimes."""
    d = facts.driver
    if desired.manage == "never":
        why = "driver.manage = never: driverd leaves the driver as it is and only configures the runtimes"
        by = "the host (driver.manage = never)"
    elif owner.manager == "host":
        why = (f"{owner.evidence}: driverd did not install it and cannot reinstall or reload what it cannot find, so "
               "driver.manage = auto leaves it as it runs (no package, module configuration or GPU daemon is "
               "changed) and only configures the runtimes (driver.manage = always replaces it)")
        by = owner.describe()
    else:
        why = (f"the installed driver belongs to {owner.describe()} ({owner.evidence}); driver.manage = auto leaves "
               "it to that package manager and only configures the runtimes (driver.manage = always replaces it)")
        by = owner.describe()
    warnings = list(facts.warnings)
    if desired.driver_version and d.loaded and d.version and d.version != desired.driver_version:
        warnings.append(f"driver.version {desired.driver_version} is not applied: {by} keeps {d.version} running")
    warnings += runtime_warnings(facts, desired)
    # Converged means the driver that runs keeps running: its version and modules as they are, and no
    # GPU daemon the host did not start itself.
    return Plan(d.version if d.loaded else desired.driver_version, d.flavor, why, facts.kernel.release,
                tuple(runtime_steps(facts, desired)), warnings=tuple(warnings), driver_managed_by=by,
                modules=tuple(m for m in MODULE_ORDER if m in running_modules(facts)),
                runtimes=tuple(runtime_needs(facts, desired)))


def reboot_only(reboot: list[str], driver, kernel) -> bool:
    """True when the new driver can only take effect after a reboot (daemons stay as they are)."""
    return bool(reboot) and driver.loaded and not kernel.module_unload_supported
