"""The module lifecycle commands as step lists for the executor (load, unload, reload, rollback,
apply a plan), and the context they run in. The CLI only parses arguments and prints results."""
from __future__ import annotations

import sys

from driverd.errors import ModuleError, PackageError
from driverd.kmod import daemons as dmn


def make_context(root, runner, config, kernel_choice: str | None = None, log=None):
    import driverd.apply.steps  # noqa: F401  (registers the step implementations)
    from driverd.apply.executor import StepContext
    from driverd.kmod.kernel import select_kernel
    kernel = select_kernel(root, runner, kernel_choice or config["modules.kernel"])
    services = dmn.select_services(kernel, config["daemons.mode"])
    return StepContext(root, runner, kernel, config, services,
                       log=log or (lambda m: print(m, file=sys.stderr, flush=True)))


def require_changeable(ctx) -> None:
    """Refuse before any journal is written when the real kernel cannot change this root."""
    if ctx.kernel.name == "real":
        ctx.kernel.check_changeable()      # raises the one-line error naming the cause and the fix


def steps_for(kind: str, ctx, root, cfg, args) -> list[dict]:
    """The step list of a lifecycle command (apply plans first and refuses a blocked plan)."""
    if kind == "rollback":
        return rollback_steps(ctx)
    if kind == "load":
        return load_steps()
    if kind == "unload":
        return unload_steps("terminate" if getattr(args, "terminate", False) else None)
    if kind == "reload":
        return reload_steps(args.package)
    from driverd.errors import PlanError
    from driverd.host import collect
    from driverd.plan import Desired, plan
    p = plan(collect(root, nvml=False, handler=cfg["runtime.handler"]), Desired.from_config(cfg))
    if p.blocked_by:
        raise PlanError("the plan is blocked: " + "; ".join(p.blocked_by), fix="see `driverd plan`")
    return plan_steps(p)


def executor(ctx):
    from driverd.apply.executor import Executor
    from driverd.apply.journal import Journal
    return Executor(ctx, Journal(ctx.root, ctx.config["state.dir"]))


def load_steps() -> list[dict]:
    return [{"action": "snapshot"}, {"action": "load-modules"}, {"action": "start-gpu-daemons"},
            {"action": "validate"}]


def unload_steps(policy: str | None = None) -> list[dict]:
    return [{"action": "snapshot"}, {"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
            {"action": "unload-modules", "params": {"policy": policy} if policy else {}}]


def reload_steps(package: str | None = None) -> list[dict]:
    """Stage (verify) the new package while the old driver still runs, then swap it in with the
    driver out of the kernel. Any failure converges back to the recorded last-known-good."""
    steps: list[dict] = [{"action": "snapshot"}]
    expect = None
    if package:
        from driverd.packages.archive import read_manifest
        m = read_manifest(package)
        expect = [m.driver_version, m.flavor]
        steps.append({"action": "verify-package", "params": {"package": package}})
    steps += [{"action": "stop-gpu-daemons", "params": {"daemons": "all"}}, {"action": "unload-modules"}]
    if package:
        steps.append({"action": "install-package", "params": {"package": package}})
    load = {"action": "load-modules", "params": {"expect": expect} if expect else {}}
    steps += [load, {"action": "restore-mig"}, {"action": "start-gpu-daemons"},
              {"action": "validate", "params": {"expect": expect} if expect else {}}]
    return steps


def rollback_steps(ctx) -> list[dict]:
    """driverd rollback with no pending run: back to the previous installed package."""
    import json
    from driverd.packages.install import previous_dir
    prev = previous_dir(ctx.root, ctx.kernel.release, ctx.config["state.dir"])
    try:
        state = json.loads((prev / "state.json").read_text())
    except (OSError, ValueError):
        raise PackageError(f"nothing to roll back to: no previous installation is kept for {ctx.kernel.release}",
                           cause=f"{prev}/state.json is missing", fix="install the wanted package with driverd install") from None
    return [{"action": "snapshot"}, {"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
            {"action": "unload-modules"},
            {"action": "restore-previous-package", "params": {"target_sha256": state.get("package_sha256")}},
            {"action": "load-modules"}, {"action": "restore-mig"}, {"action": "start-gpu-daemons"},
            {"action": "validate"}]


def plan_steps(plan) -> list[dict]:
    """A driverd.plan Plan as executor steps; a snapshot first whenever the driver is touched."""
    from driverd.apply.executor import DRIVER_ACTIONS
    steps = [{"action": s.action, "params": dict(s.params), "reason": s.reason} for s in plan.steps]
    for i, s in enumerate(steps):
        if s["action"] == "fetch-package":
            steps.insert(i + 1, {"action": "verify-package", "params": {}, "reason": "sha256 of every file"})
            break
    if any(s["action"] in DRIVER_ACTIONS for s in steps):
        steps.insert(0, {"action": "snapshot"})
    for s in steps:
        if s["action"] == "load-modules":
            s["params"] = {"modules": s["params"].get("modules"), "parameters": s["params"].get("parameters"),
                           "expect": [plan.driver_version, plan.flavor]}
        if s["action"] == "validate":
            s["params"] = {"expect": [plan.driver_version, plan.flavor]}
    return steps


def outcome(doc: dict, ctx) -> dict:
    from driverd.kmod.load import installed_identity
    from driverd.apply.steps import _loaded_identity
    inst = installed_identity(ctx.kernel)
    return {"run_id": doc["run_id"], "command": doc["command"], "state": doc["state"],
            "resumed": doc.get("resumed", 0), "loaded": _loaded_identity(ctx),
            "installed": None if inst is None else {"version": inst[0], "flavor": inst[1]},
            "failure": doc.get("failure"), "rollback_failure": doc.get("rollback_failure"),
            "warnings": doc.get("warnings", []), "journal": f"{ctx.config['state.dir']}/journal.json",
            "kernel": ctx.kernel.name, "daemons": ctx.services.mode,
            "steps": [{"action": s["action"], "status": s["status"]} for s in doc["steps"]],
            "rollback": [{"action": s["action"], "status": s["status"]} for s in doc.get("rollback", [])]}


def raise_for(out: dict) -> None:
    """A run that did not finish `done` is an error for the command line (exit 3)."""
    if out["state"] == "done":
        return
    f = out.get("failure") or {}
    err = f.get("error") or {}
    where = f" at {f['step']}" if f.get("step") else ""
    back = out.get("loaded")
    if out["state"] == "rolled-back":
        msg = (f"{out['command']} failed{where}: {err.get('error')}; rolled back to "
               + (f"{back['version']} ({back['flavor']}), validated" if back else "no driver (there was none before)"))
    else:
        rf = (out.get("rollback_failure") or {}).get("error") or {}
        msg = f"{out['command']} failed{where}: {err.get('error')}; ROLLBACK FAILED: {rf.get('error')}"
    raise ModuleError(msg, cause=err.get("cause"), fix=err.get("fix") if out["state"] == "rolled-back" else
                      "the host has no validated driver: see the journal and the kernel log; driverd rollback retries",
                      details=out)
