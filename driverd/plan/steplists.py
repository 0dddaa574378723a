"""The step list of every command that changes a host, in one place: what `driverd load`, `unload`,
`reload`, `rollback`, `install`, `rollback-install`, `prepare-kernel`, `runtime configure|revert` and
`apply` (a Plan made executable) run, in order, and a failed run's convergence back to its snapshot. Pure:
whatever must be read from the host first (the package to roll back to, a package's manifest, whether a
kernel already has its package, whether the kernel still runs the recorded driver) is read by driverd.apply
(lifecycle, the steps' converge) and handed in. driverd.apply.executor runs these lists."""
from __future__ import annotations

from driverd.plan.actions import MODULES, PACKAGE, USERSPACE, touches_host_driver

# What may still be done when the plan needs a reboot first: nothing that touches the running driver.
SAFE_BEFORE_REBOOT = ("blacklist-nouveau", "fetch-package", "verify-package", "install-package", "restore-package",
                      "fetch-userspace", "configure-runtime")

SNAPSHOT = {"action": "snapshot"}

# kmod.daemons.PERSISTENCED, by value: plan sits beside kmod in the layers, not above it.
PERSISTENCED = "nvidia-persistenced"


def load_steps() -> list[dict]:
    return [dict(SNAPSHOT), {"action": "check-parameters"}, {"action": "load-modules"},
            {"action": "start-gpu-daemons"}, {"action": "validate"}]


def unload_steps(policy: str | None = None) -> list[dict]:
    return [dict(SNAPSHOT), {"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
            {"action": "unload-modules", "params": {"policy": policy} if policy else {}}]


def reload_steps(package: str | None = None, expect: list[str] | None = None,
                 userspace: dict | None = None, companions: list[dict] | tuple = ()) -> list[dict]:
    """Stage (verify) the new package and check the parameters against it while the old driver still
    runs, then swap it in with the driver out of the kernel. Any failure converges back to the
    recorded last-known-good. `expect`: the package's [version, flavor]. `userspace`: the
    install-userspace parameters of that version's user-space (package, sha256, driver), switched
    with the driver out of the kernel, before the load and the validation. `companions`: the
    install-companion parameters of that version's companions (fabric manager, NSCQ, NVLSM, IMEX) driverd
    has trees of, switched the same way."""
    steps: list[dict] = [dict(SNAPSHOT)]
    if package:
        steps.append({"action": "verify-package", "params": {"package": package}})
        steps.append({"action": "check-signers", "params": {"package": package}})
    steps.append({"action": "check-parameters", "params": {"package": package} if package else {}})
    steps += [{"action": "stop-gpu-daemons", "params": {"daemons": "all"}}, {"action": "unload-modules"}]
    if package:
        steps.append({"action": "install-package", "params": {"package": package}})
    if userspace:
        steps.append({"action": "install-userspace", "params": dict(userspace)})
    steps += [{"action": "install-companion", "params": dict(c)} for c in companions]
    load = {"action": "load-modules", "params": {"expect": expect} if expect else {}}
    steps += [load, {"action": "restore-mig"}, {"action": "start-gpu-daemons"},
              {"action": "validate", "params": {"expect": expect} if expect else {}}]
    return steps


def rollback_steps(target_sha256: str, userspace: dict | None = None, companions: list[dict] | tuple = ()
                   ) -> list[dict]:
    """driverd rollback with no pending run: back to the previous installed package, loaded.
    `userspace`: the restore-userspace parameters ({"sha256": sha | None}) of the user-space driverd had
    before (the previous one of the same driver version), switched with the driver out of the kernel, like
    the modules; None: driverd's user-space stays as it is."""
    steps = [dict(SNAPSHOT), {"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
             {"action": "unload-modules"},
             {"action": "restore-previous-package", "params": {"target_sha256": target_sha256}}]
    if userspace is not None:
        steps.append({"action": "restore-userspace", "params": dict(userspace),
                      "reason": "the previous user-space, with the previous modules"})
    steps += [{"action": "install-companion", "params": dict(c),
               "reason": f"the previous driver's {c.get('component')}, with its modules"} for c in companions]
    return steps + [{"action": "check-parameters"}, {"action": "load-modules"}, {"action": "restore-mig"},
                    {"action": "start-gpu-daemons"}, {"action": "validate"}]


def rollback_install_steps(target_sha256: str, release: str) -> list[dict]:
    """The package the last install replaced, back from the kept store; loaded modules are left
    alone (driverd rollback also reloads)."""
    return [dict(SNAPSHOT), {"action": "restore-previous-package",
                             "params": {"target_sha256": target_sha256, "kernel_release": release}}]


def install_steps(package: str, release: str | None, enforce: bool | None, sha256: str | None = None) -> list[dict]:
    params = {"package": package, "kernel_release": release, "enforce": enforce}
    if sha256:
        params["sha256"] = sha256
    return [dict(SNAPSHOT), {"action": "install-package", "params": params}]


def prepare_kernel_steps(want, allow_build: bool) -> list[dict]:
    """The package for another (installed, not yet running) kernel: fetched or built, verified and
    installed into that kernel's module tree; the running kernel is not touched."""
    params = {"driver": want.driver, "flavor": want.flavor, "kernel": want.kernel_release, "arch": want.arch,
              "allow_build": allow_build}
    return [{"action": "fetch-package", "params": params, "reason": f"kernel {want.kernel_release} was installed"},
            {"action": "verify-package", "params": {}},
            {"action": "install-package", "params": {"kernel_release": want.kernel_release}}]


def forget_kernel_steps(releases: list[str]) -> list[dict]:
    """After a reboot into a newer kernel: driverd's packages of the kernels no longer installed, removed."""
    return [{"action": "forget-kernel", "params": {"kernel_release": r},
             "reason": f"kernel {r} is no longer installed and the host runs a newer one"} for r in releases]


def runtime_steps(verb: str, targets: list[str], options: dict) -> list[dict]:
    action = "configure-runtime" if verb == "configure" else "revert-runtime"
    return [{"action": action, "params": {"runtime": t, "handler": options.get("handler"), "options": options}}
            for t in targets]


def plan_steps(plan) -> list[dict]:
    """A driverd.plan Plan as executor steps: a snapshot first whenever the package or the driver is
    touched, the package verified after its fetch, signers and parameters checked before the unload,
    the validation of the plan's idea of converged."""
    steps = [{"action": s.action, "params": dict(s.params), "reason": s.reason} for s in plan.steps]
    for i, s in enumerate(steps):
        if s["action"] == "fetch-package":
            steps.insert(i + 1, {"action": "verify-package", "params": {}, "reason": "sha256 of every file"})
            break
    load = next((s for s in steps if s["action"] == "load-modules"), None)
    if load is not None:
        load["params"] = {"modules": load["params"].get("modules"), "parameters": load["params"].get("parameters"),
                          "expect": [plan.driver_version, plan.flavor]}
        at = next((i for i, s in enumerate(steps) if s["action"] in ("stop-gpu-daemons", "unload-modules",
                                                                      "load-modules")), len(steps))
        steps.insert(at, {"action": "check-parameters", "params": {"modules": load["params"]["modules"],
                                                                   "parameters": load["params"]["parameters"]},
                          "reason": "a bad value must be found before the driver is unloaded"})
        steps.insert(at, {"action": "check-signers", "params": {},
                          "reason": "a signer the kernel would refuse must be found before the driver is unloaded"})
    for s in steps:
        if s["action"] == "validate":
            s["params"] = plan.validation()
    if touches_host_driver(steps):
        steps.insert(0, dict(SNAPSHOT))
    return steps


def apply_steps(plan, *, rebooted_since_required: bool) -> list[dict]:
    """`driverd apply`'s steps for `plan`: when it needs a reboot, only what is safe before it, then
    the reboot requirement recorded; after the reboot the rest, and the record cleared."""
    steps = plan_steps(plan)
    if plan.reboot_required:
        steps = [s for s in steps if s["action"] in SAFE_BEFORE_REBOOT]
        if touches_host_driver(steps):
            steps.insert(0, dict(SNAPSHOT))
        steps.append({"action": "require-reboot", "params": {"reasons": list(plan.reboot_reasons),
                                                             "target": [plan.driver_version, plan.flavor]}})
    elif rebooted_since_required:
        steps.append({"action": "clear-reboot", "reason": "the host rebooted since the reboot was required"})
    return steps


def converge_steps(lkg: dict | None, touched: set, *, driver_is_lkg: bool) -> list[dict]:
    """A failed run's way back to the last-known-good state the snapshot recorded (`lkg`), for exactly
    what the run touched: the installed package (from the kept store), the user-space, and/or the loaded
    driver (stop daemons, unload whatever is loaded, load the LKG modules with the parameters they were
    running with, re-create MIG, restart its daemons, validate). `driver_is_lkg`: the kernel still runs
    the recorded driver, same modules and parameters (driverd.apply reads it; only asked when the run
    touched the modules and a driver was loaded)."""
    steps: list[dict] = []
    now = (lkg or {}).get("loaded")
    if MODULES in touched and now and driver_is_lkg:
        # e.g. the unload was refused (a process holds the GPU): tearing the driver down to load it again
        # would fail the same way and report a failed rollback of a working driver. Keep it, start what the
        # run stopped, and prove it.
        if PACKAGE in touched:
            steps.append(_restore_package(lkg))
        steps += _restore_userspace(lkg, touched)
        expect = [now["version"], now["flavor"]]
        return steps + [{"action": "restore-mig", "params": {}},
                        {"action": "start-gpu-daemons", "params": {"daemons": lkg["daemons"]}},
                        {"action": "validate", "params": {"expect": expect, "modules": lkg["modules"],
                                                          "persistence": PERSISTENCED in lkg["daemons"],
                                                          "workload": False}}]
    if MODULES in touched:
        steps += [{"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
                  {"action": "unload-modules", "params": {}}]
    if lkg is None:
        return steps
    if PACKAGE in touched:
        steps.append(_restore_package(lkg))
    steps += _restore_userspace(lkg, touched)
    if MODULES in touched and now:
        expect = [now["version"], now["flavor"]]
        steps += [{"action": "load-modules", "params": {"modules": lkg["modules"], "parameters": lkg["parameters"],
                                                        "expect": expect}},
                  {"action": "restore-mig", "params": {}},
                  {"action": "start-gpu-daemons", "params": {"daemons": lkg["daemons"]}},
                  {"action": "validate", "params": {"expect": expect, "modules": lkg["modules"],
                                                    "persistence": PERSISTENCED in lkg["daemons"],
                                                    # the rollback restores the driver that ran; whether its
                                                    # user-space still serves CUDA is the next pass's verdict,
                                                    # not a failed rollback
                                                    "workload": False}}]
    return steps


def _restore_package(lkg: dict) -> dict:
    inst = lkg.get("installed")
    params = {"sha256": inst["sha256"] if inst else None}
    if "previous" in lkg:
        params["previous"] = lkg["previous"]["package"]
    return {"action": "restore-package", "params": params}


def _restore_userspace(lkg: dict, touched: set) -> list[dict]:
    """The user-space the snapshot recorded, back with the modules (before they load and their daemons start,
    so persistenced comes from the same version)."""
    if USERSPACE not in touched or "userspace" not in lkg:
        return []
    params = {"sha256": (lkg["userspace"] or {}).get("sha256")}
    if "previous" in lkg:
        params["previous"] = lkg["previous"]["userspace"]
    return [{"action": "restore-userspace", "params": params}]
