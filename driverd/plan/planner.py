"""plan(facts, desired) -> Plan: a pure function. No I/O, no clock; same inputs, same plan."""
from __future__ import annotations

from driverd.errors import UsageError
from driverd.host.facts import Facts
from driverd.plan import flavor as flavor_mod
from driverd.plan.model import Desired, Plan, Step

CORE_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset")


def modules_to_load(facts: Facts, desired: Desired) -> list[str]:
    mods = list(CORE_MODULES)
    if desired.load_drm:
        mods.append("nvidia_drm")
    if desired.load_peermem == "true" or (desired.load_peermem == "auto" and facts.mellanox_nics):
        mods.append("nvidia_peermem")
    return mods


def runtimes_to_configure(facts: Facts, desired: Desired) -> list[str]:
    if "none" in desired.runtimes:
        return []
    if "auto" in desired.runtimes:
        return [r.name for r in facts.runtimes]
    return list(desired.runtimes)


def _user(u) -> str:
    where = f", pod {u.pod_uid}" if u.pod_uid else (f", container {u.container_id[:12]}" if u.container_id else "")
    return f"pid {u.pid} ({u.comm}{where})"


def plan(facts: Facts, desired: Desired) -> Plan:
    if not facts.gpus:
        return Plan(desired.driver_version, None, "no NVIDIA GPU on this host", facts.kernel.release, (),
                    warnings=facts.warnings)
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
    mods = modules_to_load(facts, desired)
    if not installed and not want_loaded:
        steps.append(Step("fetch-package", f"no driverd package for {version} ({flavor}) is installed for kernel "
                          f"{k.release}", {"driver": version, "flavor": flavor, "kernel": k.release, "arch": k.arch}))
    if k.module_signature_enforced and not want_loaded and not (desired.signing_key and desired.signing_cert):
        blocked.append("the kernel enforces module signatures (" + "; ".join(k.signature_enforcement_sources)
                       + ") and no signing key is configured: set [signing] key and cert (enrolled in the MOK/"
                         "platform keyring) or use a package signed with a trusted key")
    if not installed and not want_loaded:
        steps.append(Step("install-package", f"install {version} ({flavor}) modules and firmware for {k.release}",
                          {"driver": version, "flavor": flavor, "kernel": k.release}))
    if not want_loaded:
        replacing = d.loaded
        if replacing:
            running = [dm.name for dm in facts.daemons if dm.running]
            if not k.module_unload_supported:
                reboot.append(f"driver {d.version} ({d.flavor}) is loaded and this kernel cannot unload modules "
                              f"({k.module_unload_evidence}); the new modules load at next boot")
            else:
                if running:
                    steps.append(Step("stop-gpu-daemons", "they hold the driver open", {"daemons": running}))
                # The GPU daemons hold /dev/nvidia* too, but the plan stops them before the unload.
                ours = {p for dm in facts.daemons if dm.running for p in dm.pids}
                users = [u for u in facts.gpu_users if u.pid not in ours]
                if users and desired.unload_policy == "refuse":
                    blocked.append("the GPU is in use by " + "; ".join(_user(u) for u in users)
                                   + ": stop them, drain the node, or set modules.unload_policy=terminate")
                steps.append(Step("unload-modules", f"driver {d.version} ({d.flavor}) is loaded; {version} ({flavor}) "
                                  "is wanted", {"modules": [m.name for m in d.modules]},
                                  preconditions=("no process holds /dev/nvidia*",)))
        if not (replacing and not k.module_unload_supported):
            params = {m: p for m, p in desired.module_parameters.items() if m in mods}
            steps.append(Step("load-modules", f"{version} ({flavor}) is not loaded", {"modules": mods,
                              "parameters": params}, preconditions=("package installed for the running kernel",)))
    loading = any(s.action == "load-modules" for s in steps)
    persist = facts.daemon("nvidia-persistenced")
    if desired.persistenced and (loading or not (persist and persist.running)) and not reboot_only(reboot, d, k):
        steps.append(Step("start-persistenced", "keeps the GPUs initialised between jobs (daemons.persistenced)"))
    fm = facts.daemon("nv-fabricmanager")
    want_fm = desired.fabricmanager == "true" or (desired.fabricmanager == "auto" and facts.nvswitches)
    if want_fm and (loading or not (fm and fm.running)) and not reboot_only(reboot, d, k):
        steps.append(Step("start-fabricmanager", f"{len(facts.nvswitches)} NVSwitch(es) need fabric manager "
                          "before CUDA can use NVLink"))
    by_name = {r.name: r for r in facts.runtimes}
    for name in runtimes_to_configure(facts, desired):
        r = by_name.get(name)
        if r is not None and r.nvidia_handler and desired.handler in r.handlers:
            continue
        steps.append(Step("configure-runtime", f"{name} has no '{desired.handler}' runtime handler"
                          if r else f"{name} was requested but is not detected on this host",
                          {"runtime": name, "handler": desired.handler}))
    if loading:
        steps.append(Step("validate", "prove the driver works: version, flavour and every GPU visible",
                          {"driver": version, "flavor": flavor, "gpus": [g.pci_address for g in facts.gpus]}))
    return Plan(version, flavor, decision.reason, k.release, tuple(steps), bool(reboot), tuple(reboot),
                tuple(blocked), tuple(facts.warnings) + decision.warnings)


def reboot_only(reboot: list[str], driver, kernel) -> bool:
    """True when the new driver can only take effect after a reboot (daemons stay as they are)."""
    return bool(reboot) and driver.loaded and not kernel.module_unload_supported
