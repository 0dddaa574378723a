"""Every command that changes a host, as one transaction: load, unload, reload, rollback, apply,
install, rollback-install, runtime configure/revert.

A command is a `Request` (its name, what identifies it, how to build its steps). `transact` runs it:
    --dry-run -> preview only (check() of each step; no lock, no journal)
    take the host lock (exit 3 naming the holder, or wait)
    a pending (interrupted) run is finished first - or rolled back, for `rollback` - and said so
    build the steps from the host as it is now; a run whose steps are all in place writes nothing
    execute with the journal; a plan that needs a reboot does what is safe before it and says so
The CLI only parses arguments and renders what this returns.
"""
from __future__ import annotations

from dataclasses import field
from typing import Callable

from driverd.apply import hostview
from driverd.apply.executor import Executor
from driverd.apply.journal import UNFINISHED, Journal, phases
from driverd.apply.lock import HostLock
from driverd.apply.step import StepContext
from driverd.apply import steps as st
from driverd.datatypes import dataclass
from driverd.plan import steplists as sl
from driverd.errors import EXIT_REBOOT, ConfigError, DriverdError, ModuleError, PackageError, PlanError, UsageError


def make_context(root, runner, config, kernel_choice: str | None = None, log=None) -> StepContext:
    from driverd.kmod import daemons as dmn
    from driverd.kmod.kernel import select_kernel
    kernel = select_kernel(root, runner, kernel_choice or config["modules.kernel"])
    # the daemons come from driverd's trees when it installed them (the driver's version): the fabric
    # manager, NVLSM and IMEX from their companion trees, persistenced from the user-space's
    from driverd.apply.fmconfig import config_path
    from driverd.driver.companions import CompanionPlaces
    fm, nvlsm, imex = (CompanionPlaces.from_config(config, c) for c in ("fabricmanager", "nvlsm", "imex"))
    services = dmn.select_services(
        kernel, config["daemons.mode"],
        bin_dirs=(fm.bin_dir, f"{nvlsm.current}/sbin", imex.bin_dir,
                  f"{config['userspace.root'].rstrip('/')}/current/bin"),
        # the fabric manager's, written with its tree (apply/fmconfig.py); IMEX's: the operator's (where NVIDIA's
        # IMEX guide has the node list set), else its tree's own; NVLSM's: its tree's
        configs={dmn.FABRICMANAGER: (config_path(fm),), dmn.IMEX: (dmn.COMMANDS[dmn.IMEX][2],
                                                                   f"{imex.current}/etc/nvidia-imex/config.cfg"),
                 dmn.NVLSM: (f"{nvlsm.current}/share/nvidia/nvlsm/nvlsm.conf",)})
    from driverd.log import log as default_log
    return StepContext(root, runner, kernel, config, services, log=log or default_log)


def journal(ctx: StepContext) -> Journal:
    return Journal(ctx.root, ctx.config["state.dir"], ctx.config["state.journal_keep"], ctx.log)


def executor(ctx: StepContext) -> Executor:
    return Executor(ctx, journal(ctx), st.REGISTRY, st.converge)


@dataclass
class Request:
    """One command that changes the host, as `transact` runs it: its name, identity and how to build its steps."""
    command: str
    build: Callable[[StepContext], list[dict]]
    identity: dict = field(default_factory=dict)     # what makes two requests the same command
    changes_kernel: bool = True                       # needs a kernel that may change this root
    reboot: list[str] = field(default_factory=list)   # filled by build when the plan needs a reboot


# -- each command as a Request: its step list (driverd.plan.steplists) from what the host says now --

def _reload_steps(package: str | None, ctx=None, userspace: str | None = None) -> list[dict]:
    """`userspace`: --userspace PACKAGE; else userspace.package's package of the new driver's version
    (driverd.repo.userspace), when it is not in use already."""
    expect, us, companions = None, None, []
    if package:
        from driverd.package.archive import read_manifest
        m = read_manifest(package)
        expect = [m.driver_version, m.flavor]
        if ctx is not None:
            from driverd.apply.companions import companion_steps
            companions = companion_steps(ctx.root, ctx.config, m.driver_version)
        if userspace:
            us = {"package": userspace, "driver": m.driver_version}
        elif ctx is not None:
            from driverd.repo.userspace import offer
            o = offer(ctx.root, ctx.config, m.driver_version, m.arch)
            if o is not None and o.package and not o.in_place:
                us = {"package": o.package, "sha256": o.sha256, "driver": m.driver_version}
    elif userspace:
        raise UsageError("--userspace needs --package", cause="a reload without a new package keeps the driver and "
                         "its user-space", fix="pass the driver package with --package, or use driverd apply")
    return sl.reload_steps(package, expect, us, companions)


def previous_target(ctx, release: str | None = None) -> str | None:
    from driverd.driver.modules import previous_sha
    release = release or ctx.kernel.release
    known, sha = previous_sha(ctx.root, release, ctx.config["state.dir"])
    if not known:
        raise PackageError(f"nothing to roll back to: no previous installation is recorded for {release}",
                           cause="no driverd install has replaced another one on this kernel",
                           fix="install the wanted package with driverd install")
    return sha


def previous_userspace(ctx, target_sha256: str | None) -> dict | None:
    """The restore-userspace parameters of `driverd rollback`: driverd's user-space of the driver version
    rolled back to (the kept package `target_sha256`'s) when the one in use is of another version — the
    one the last user-space switch replaced (userspace_install.previous_sha) when it is that version, else
    another kept tree of it. Rolling back to no driverd package (`target_sha256` None) restores what the
    last switch replaced, "none" included. None: no step (driverd never switched a user-space here, the one
    in use is already that version, or no tree of it is kept: the validation's workload check judges)."""
    from driverd.driver import userspace as dus
    from driverd.driver.layout import Places
    from driverd.driver.kept import lookup
    p = Places.from_config(ctx.config)
    known, prev = dus.previous_sha(ctx.root, p)
    if not known:
        return None
    cur = dus.current(ctx.root, p)
    cur_sha = cur.sha if cur is not None and cur.intact else None
    k = lookup(ctx.root, ctx.config["state.dir"], target_sha256) if target_sha256 else None
    if k is None:
        return None if target_sha256 is not None and prev is None or prev == cur_sha else {"sha256": prev}
    if cur_sha is not None and cur.version == k.version:
        return None
    trees = [t for t in dus.trees(ctx.root, p) if t.intact and t.sha and t.version == k.version]
    pick = next((t for t in trees if t.sha == prev), trees[0] if trees else None)
    return {"sha256": pick.sha} if pick is not None else None


def _rollback_steps(ctx) -> list[dict]:
    from driverd.apply.companions import companion_steps
    from driverd.driver.kept import lookup
    target = previous_target(ctx)
    k = lookup(ctx.root, ctx.config["state.dir"], target) if target else None
    return sl.rollback_steps(target, previous_userspace(ctx, target),
                             companion_steps(ctx.root, ctx.config, k.version) if k is not None else [])


def rollback_install_request(release: str) -> Request:
    """`driverd rollback-install`: the package the last install replaced, back from the kept store;
    loaded modules are left alone (driverd rollback also reloads)."""
    return Request("rollback-install", lambda ctx: sl.rollback_install_steps(previous_target(ctx, release), release),
                   {"kernel": release}, changes_kernel=False)


def install_request(command: str, package: str, release: str | None, enforce: bool | None,
                    sha256: str | None = None) -> Request:
    """`driverd install` / `fetch --install`: one package into a kernel's module tree."""
    return Request(command, lambda ctx: sl.install_steps(package, release, enforce, sha256),
                   {"package": package, "kernel": release}, changes_kernel=False)


def prepare_kernel_request(cfg, want, allow_build: bool) -> Request:
    """The package for another (newly installed, not yet running) kernel, fetched or built and
    installed into /lib/modules/<release>/updates/driverd before the reboot into it. The running
    kernel and its driver are not touched; an install that fails leaves that kernel's previous
    package (install is atomic and kept)."""
    def build(ctx) -> list[dict]:
        from driverd.driver.state import DriverState
        from driverd.driver.modules import is_installed
        p = DriverState.of(ctx).installed(want.kernel_release)
        have = p is not None and (p.driver.version, p.driver.flavor) == (want.driver, want.flavor) and \
            bool(p.package_sha256) and is_installed(ctx.root, want.kernel_release, p.package_sha256,
                                                    ctx.config["state.dir"])
        return [] if have else sl.prepare_kernel_steps(want, allow_build)
    return Request("prepare-kernel", build, {"kernel": want.kernel_release, "driver": want.driver,
                                             "flavor": want.flavor}, changes_kernel=False)


def forget_kernels_request(releases: list[str]) -> Request:
    """The daemon's cleanup after a reboot into a newer kernel: driverd's packages of kernels no longer
    installed (driverd.install.leftovers.forget_release). The running kernel is not touched."""
    return Request("forget-kernels", lambda ctx: sl.forget_kernel_steps(releases), {"kernels": list(releases)},
                   changes_kernel=False)


def apply_request(cfg) -> Request:
    """`driverd apply`: plan from the host's facts and execute; a plan that needs a reboot does the
    safe part and records the reboot; after the reboot the rest is done and the record cleared."""
    req = Request("apply", lambda ctx: [], {"driver": cfg["driver.version"], "flavor": cfg["driver.flavor"]})

    def build(ctx) -> list[dict]:
        from driverd.apply.hostplan import plan_for_host
        p = plan_for_host(ctx.root, cfg).plan
        if p.blocked_by:
            why, _, fix = p.blocked_by[0].rpartition("; fix: ") if len(p.blocked_by) == 1 else ("", "", "")
            if why:         # one reason that names its own fix: one line, one fix
                raise PlanError("the plan is blocked: " + why, fix=fix)
            raise PlanError("the plan is blocked: " + "; ".join(p.blocked_by), fix="see `driverd plan`")
        rec = reboot_record(ctx)
        if p.reboot_required:
            req.reboot[:] = list(p.reboot_reasons)
        return sl.apply_steps(p, rebooted_since_required=rec is not None and rec.get("boot_id") != st.boot_id(ctx))

    req.build = build
    return req


def lifecycle_request(kind: str, *, package: str | None = None, terminate: bool = False, cfg=None,
                      userspace: str | None = None) -> Request:
    if kind == "apply":
        return apply_request(cfg)
    if kind == "load":
        return Request("load", lambda ctx: sl.load_steps())
    if kind == "unload":
        return Request("unload", lambda ctx: sl.unload_steps("terminate" if terminate else None),
                       {"terminate": terminate})
    if kind == "reload":
        return Request("reload", lambda ctx: _reload_steps(package, ctx, userspace),
                       {"package": package, "userspace": userspace})
    if kind == "rollback":
        return Request("rollback", _rollback_steps)
    raise ValueError(kind)


def runtime_request(verb: str, targets: list[str], options: dict) -> Request:
    return Request(f"runtime {verb}", lambda ctx: sl.runtime_steps(verb, targets, options),
                   {"targets": targets, "options": options},
                   changes_kernel=False)


# -- running a request ----------------------------------------------------------------------------

def require_changeable(ctx) -> None:
    """Refuse before any lock or journal when the real kernel cannot change this root."""
    check = getattr(ctx.kernel, "check_changeable", None)
    if check is not None:
        check()                 # raises the one-line error naming the cause and the fix


def transact(ctx: StepContext, req: Request, *, wait_s: float | None = None, dry_run: bool = False) -> dict:
    ctx.memo.clear()              # what the last transaction read of the host is not this one's
    ex = executor(ctx)
    if dry_run:       # nothing is done and no journal or lock is written: the steps and whether each is needed
        return ex.preview(req.command, req.build(ctx))
    if req.changes_kernel:
        try:
            require_changeable(ctx)
        except ConfigError:
            # A root the real kernel cannot change (a captured tree) that needs no change is simply
            # converged: nothing is locked or written to find that out.
            steps = req.build(ctx)
            if steps and not ex.in_place(steps):
                raise
            return nothing_to_do(req, ctx, ex)
    lock = HostLock(ctx.root, ctx.config["state.dir"], req.command)
    lock.acquire(wait_s if wait_s is not None else float(ctx.config["state.lock_wait_s"]))
    try:
        return _transact_locked(ctx, ex, req)
    finally:
        lock.release()


def _transact_locked(ctx, ex: Executor, req: Request) -> dict:
    pending = ex.pending()
    finished = None
    if pending is not None:
        if req.command == "rollback":
            out = outcome(ex.rollback_now(pending, "rollback requested"), ctx, ex)
            out["rolled_back_run"] = {"run_id": pending["run_id"], "command": pending["command"]}
            return out
        doc = ex.resume(pending)
        finished = summary(doc)
        same = doc["command"] == req.command and (doc.get("meta") or {}).get("request") == req.identity
        if same or doc["state"] not in ("done", "rolled-back"):
            return outcome(doc, ctx, ex)
    steps = req.build(ctx)
    if not steps or ex.in_place(steps):
        out = nothing_to_do(req, ctx, ex)
    else:
        out = outcome(ex.run(req.command, steps, {"request": req.identity}), ctx, ex)
    if finished:
        out["finished_first"] = finished
    if req.reboot and out["state"] in ("done", "nothing-to-do"):
        out["reboot_required"] = list(req.reboot)
    return out


def summary(doc: dict) -> dict:
    return {"run_id": doc["run_id"], "command": doc["command"], "state": doc["state"]}


def nothing_to_do(req: Request, ctx, ex: Executor) -> dict:
    return {"run_id": None, "command": req.command, "state": "nothing-to-do", "resumed": 0,
            "loaded": st.loaded(ctx), "installed": _installed_short(ctx), "failure": None, "rollback_failure": None,
            "warnings": list(ex.journal.warnings), "journal": None, "kernel": ctx.kernel.name,
            "daemons": ctx.services.mode, "seconds": None, "steps": [], "rollback": [], "results": []}


def _installed_short(ctx) -> dict | None:
    inst = st.installed(ctx)
    return None if inst is None else {"version": inst["version"], "flavor": inst["flavor"]}


def outcome(doc: dict, ctx, ex: Executor) -> dict:
    return {"run_id": doc["run_id"], "command": doc["command"], "state": doc["state"],
            "resumed": doc.get("resumed", 0), "loaded": st.loaded(ctx), "installed": _installed_short(ctx),
            "failure": doc.get("failure"), "rollback_failure": doc.get("rollback_failure"),
            "warnings": doc.get("warnings", []), "journal": ex.journal.hostpath,
            "kernel": ctx.kernel.name, "daemons": ctx.services.mode,
            **phases(doc),
            "results": [{"action": s["action"], "result": s.get("result")} for s in doc["steps"]
                        if s.get("result") is not None]}


def raise_for(out: dict) -> int:
    """The exit code of a run: 0 done (or nothing to do), EXIT_REBOOT when the host must reboot to
    finish; a run that did not finish `done` raises (exit 3) with what failed and where it ended."""
    if out["state"] in ("done", "nothing-to-do"):
        return EXIT_REBOOT if out.get("reboot_required") else 0
    if out["state"] == "rolled-back" and out.get("rolled_back_run"):
        return 0                # `driverd rollback` of an interrupted run: rolled back is what was asked
    f = out.get("failure") or {}
    err = f.get("error") or {}
    where = f" at {f['step']}" if f.get("step") else ""
    if out["state"] == "rolled-back":
        msg = f"{out['command']} failed{where}: {err.get('error')}; {rolled_back_words(out)}"
    else:
        rf = (out.get("rollback_failure") or {}).get("error") or {}
        msg = f"{out['command']} failed{where}: {err.get('error')}; ROLLBACK FAILED: {rf.get('error')}"
    kernel_log = (err.get("details") or {}).get("kernel_log")
    raise ModuleError(msg, cause=err.get("cause"), fix=err.get("fix") if out["state"] == "rolled-back" else
                      "the host has no validated driver: see the journal and the kernel log; driverd rollback retries",
                      details={**out, "kernel_log": kernel_log} if kernel_log else out)


def _changed(steps: list[dict]) -> list[str]:
    """The steps of a journal list that did change the host (done, and not only recording or checking)."""
    from driverd.plan.actions import ACTIONS
    return [s["action"] for s in steps if s["status"] == "done" and not ACTIONS[s["action"]].read_only]


def nothing_changed(out: dict) -> bool:
    """A run that failed before any step changed the host (and whose rollback found nothing to put
    back): it must not claim a rollback, let alone a validated one."""
    return not _changed(out["steps"]) and not _changed(out.get("rollback") or [])


def rolled_back_words(out: dict) -> str:
    """What the rollback of a failed run did, as much as it did: nothing changed; back to the driver
    a validation proved; or the run's own changes undone (no validation ran: the driver was not touched)."""
    if nothing_changed(out):
        return "nothing was changed"
    back = out.get("loaded")
    if back and any(s["action"] == "validate" and s["status"] == "done" for s in out.get("rollback") or []):
        return f"rolled back to {back['version']} ({back['flavor']}), validated"
    done = _changed(out["steps"])
    return "rolled back to the state before the run" + (f" ({', '.join(done)} undone)" if done else "")


# -- status (a reader: no lock) ---------------------------------------------------------------------

reboot_record = st.reboot_record


def status(ctx) -> dict:
    from driverd.errors import JournalError
    from driverd.kmod.holders import find_holders
    j = journal(ctx)
    try:
        doc, problem = j.load(repair=False), None
    except JournalError as e:
        doc, problem = None, e.one_line()
    inst = st.installed(ctx)
    h = find_holders(ctx.kernel)
    lock = HostLock(ctx.root, ctx.config["state.dir"], "status")
    holder = lock.held_by()
    rec = reboot_record(ctx)
    want = wanted(ctx, inst)
    if doc is not None and doc["state"] in UNFINISHED and want.get("driver"):
        # the host is mid-run: whatever it runs now, the next command first finishes (or rolls back) that run
        left = [s["action"] for s in doc.get("steps", []) if s.get("status") not in ("done", "skipped")]
        want["in_sync"], want["verdict"] = False, "unfinished"
        want["differs"] = [f"the {doc['command']} run {doc['run_id']} was interrupted ({doc['state']}): the next "
                           f"driverd command finishes it first" + (f" ({', '.join(left[:6])}"
                                                                    + (" ..." if len(left) > 6 else "") + " left)"
                                                                    if left else "")] + list(want.get("differs") or [])
    return {"loaded": st.loaded(ctx), "installed": inst,
            "modules": {n: {"refcount": m.refcount, "holders": list(m.holders), "parameters": m.parameters}
                        for n, m in ctx.kernel.modules(sorted(n for n in ctx.kernel.loaded_names()
                                                              if n.startswith("nvidia") or n == "nouveau")).items()},
            "holders": h.to_json(),
            "daemons": daemons_now(ctx),
            "userspace": userspace_in_use(ctx),
            "last_run": None if doc is None else {
                "run_id": doc["run_id"], "command": doc["command"], "state": doc["state"],
                "unfinished": doc["state"] in UNFINISHED, "failure": doc.get("failure"),
                "warnings": doc.get("warnings", []), **phases(doc)},
            "journal_problem": problem, "history": j.history()[-5:],
            "lock_holder": holder,
            "reboot_required": rec, "kernel": ctx.kernel.name,
            "wanted": want,
            "activity": activity(holder, doc, rec, ctx),
            "daemon": daemon_state(ctx),
            "kernels": reboot_gate(ctx)}


def daemons_now(ctx) -> dict[str, bool]:
    """Each GPU daemon of driverd's this host wants or runs (persistenced and the fabric manager always, as
    before the companions), and whether it runs."""
    wanted = set(hostview.wanted_daemons(ctx)) | {"nvidia-persistenced", "nv-fabricmanager"}
    out = {}
    for d in hostview.known_daemons(ctx):
        running = ctx.services.running(d)
        if running or d in wanted:
            out[d] = running
    return out


def reboot_gate(ctx) -> dict | None:
    """`driverd reboot-ready`'s answer (driverd.install.rebootgate): the installed kernels newer than the running
    one and whether each has the node's driver, with the daemon's last preparation of each."""
    from driverd.install.rebootgate import judge
    try:
        return judge(ctx.root, ctx.config).to_json()
    except DriverdError as e:
        return {"ready": False, "reason": e.one_line(), "kernels": []}


def userspace_in_use(ctx) -> dict | None:
    """driverd's user-space `current` points to (None: driverd installed none)."""
    from driverd.driver.state import DriverState
    from driverd.install import userspace as ui
    state = DriverState.of(ctx)
    cur = state.userspace()
    if cur is None:
        return None
    return {"version": cur.version, "sha256": cur.sha, "intact": cur.intact, "tree": state.places.tree(cur.name),
            "active": ui.is_installed(ctx.root, cur.sha, state.places) if cur.intact else False}


_WANTED_KEYS = ("driver.version", "driver.flavor", "modules.parameters", "modules.load_drm", "modules.load_peermem",
                "runtime.runtimes", "runtime.handler", "runtime.cdi", "daemons.persistenced", "daemons.fabricmanager",
                "daemons.imex", "daemons.mode")


def wanted(ctx, inst: dict | None = None) -> dict:
    """What the configuration says this host should run, next to what it runs. Whether the host is in
    sync is `hostplan.verdict_for_host`'s answer - the plan `driverd plan` shows and every daemon pass
    acts on, with the parameter drift a pass reloads for - so the three never disagree; `differs`
    says why not in lines (what is loaded or installed instead, else each step the plan would take,
    a block, a reboot, a parameter), `plan` lists the plan's steps."""
    cfg, cluster = ctx.config, cluster_keeps(ctx)
    if cluster is not None:
        # the daemon keeps what the cluster decided for this node: that is what the host should run
        try:
            cfg = cfg.pinned_to(cluster["settings"], f"the cluster (node {cluster['node']}: {cluster['source']})")
        except DriverdError:
            cluster = None
    version, requested = cfg["driver.version"], cfg["driver.flavor"]
    flavor, why = (requested if requested != "auto" else None), None
    if version and requested == "auto":
        try:
            from driverd.host import pci
            from driverd.plan.flavor import decide
            gpus, _, _ = pci.classify(ctx.root, pci.scan(ctx.root, []), [])
            d = decide(tuple(gpus), version, "auto")
            flavor, why = d.flavor, d.reason
        except Exception as e:             # a reader: an undecidable flavour is reported, not raised
            why = f"cannot decide: {getattr(e, 'message', None) or e}"
    out = {"driver": version, "flavor": requested, "flavor_decided": flavor, "flavor_reason": why,
           "config": {k: cfg[k] for k in _WANTED_KEYS},
           "sources": {k: cfg.sources.get(k, "default") for k in _WANTED_KEYS if k in cfg.sources},
           "config_path": cfg.path, "differs": [], "in_sync": None, "verdict": None, "plan": [], "left_to": None,
           "not_applied": None,
           "cluster": None if cluster is None else {k: cluster.get(k) for k in ("node", "source", "waiting")}}
    if not version:
        return out
    from driverd.apply.hostplan import verdict_for_host
    try:
        v = verdict_for_host(ctx, cfg)
    except DriverdError as e:              # e.g. no flavour serves every GPU: the plan is blocked
        out.update(verdict="blocked", in_sync=False, differs=[f"blocked: {e.one_line()}"])
        return out
    out.update(verdict=v.verdict, in_sync=v.in_sync, plan=[s.action for s in v.plan.changes],
               left_to=v.plan.driver_managed_by)
    lo = st.loaded(ctx)
    if v.plan.driver_managed_by and lo is not None and lo["version"] != version:
        out["not_applied"] = (f"driver.version {version} is not applied: driver {lo['version']} is left to "
                              f"{v.plan.driver_managed_by} (driver.manage = auto; `always` replaces it)")
    if v.in_sync:
        return out
    summary: list[str] = []
    if v.plan.driver_managed_by is None:
        if lo is None:
            summary.append(f"driver {version} is wanted, none is loaded")
        elif lo["version"] != version:
            summary.append(f"driver {version} is wanted, {lo['version']} is loaded")
        elif flavor and lo.get("flavor") and lo["flavor"] != flavor:
            summary.append(f"flavour {flavor} is wanted, {lo['flavor']} is loaded")
        if inst is not None and inst.get("version") != version:
            summary.append(f"installed package is {inst.get('version')} ({inst.get('flavor')}), not {version}")
    out["differs"] = summary + v.reasons() + ([] if summary else v.steps())
    return out


def cluster_keeps(ctx) -> dict | None:
    """What the host's cluster-mode daemon keeps for this node (its last pass: the driver and settings,
    why, what waits for a rollout), while it runs; None in host mode."""
    st = daemon_state(ctx) or {}
    cl = st.get("cluster")
    if st.get("stopped") or not isinstance(cl, dict) or not isinstance(cl.get("settings"), dict):
        return None
    return cl


def activity(holder: dict | None, doc: dict | None, reboot: dict | None, ctx) -> dict:
    """What is happening on the host now: the host-lock holder and the step its run is at (from the
    journal), or an unfinished run nobody is finishing, and a pending reboot."""
    out: dict = {"state": "idle", "holder": holder, "run": None, "reboot_pending": bool(reboot)}
    if doc is not None and doc["state"] in UNFINISHED:
        phase = "rollback" if doc["state"] == "rolling-back" else "steps"
        steps = doc.get(phase) or []
        at = next((i for i, s in enumerate(steps) if s["status"] == "running"), None)
        if at is None:
            at = next((i for i, s in enumerate(steps) if s["status"] == "pending"), None)
        out["run"] = {"run_id": doc["run_id"], "command": doc["command"], "state": doc["state"],
                      "step": steps[at]["action"] if at is not None else None,
                      "step_number": (at + 1) if at is not None else None, "steps": len(steps),
                      "started_at": doc.get("started_at"), "updated_at": doc.get("updated_at")}
    if holder:
        out["state"] = "running"
    elif out["run"]:
        out["state"] = "interrupted"      # journalled as running, nobody holds the lock: a killed run
    elif reboot:
        out["state"] = "reboot-pending"
        if reboot.get("boot_id") and reboot.get("boot_id") != st.boot_id(ctx):
            out["state"] = "rebooted"     # the next apply finishes and clears the record
    return out


def daemon_state(ctx) -> dict | None:
    """`driverd daemon` / container-entrypoint's last reconcile (its runtime state file), if any."""
    from driverd.apply import statefile
    return statefile.read(ctx.root)
