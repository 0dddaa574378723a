"""load, unload, reload, rollback, status, apply, demo: the lifecycle commands (driverd.apply.lifecycle
runs them; this module parses and renders)."""
from __future__ import annotations

from driverd.cli.options import Parser, add_flavor, add_kernel_backend, add_work_dir
from driverd.cli.output import emit
from driverd.errors import EXIT_OK


def _common(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="print what would run; change nothing")
    add_kernel_backend(p)
    add_wait(p)
    add_force(p)


def add_force(p) -> None:
    """A command that changes the driver: on a node whose driver the cluster owns it is refused, unless
    forced with a reason (recorded as an Event on the Node)."""
    p.add_argument("--force", action="store_true", help="run even though this node's driver belongs to a cluster "
                   "(only a DriverRollout changes it: cordon, drain, canary, failure budget); needs --reason")
    p.add_argument("--reason", metavar="TEXT", help="why --force: recorded as an Event on the Node")


def cluster_guard(ctx, args, command: str) -> str | None:
    """Refuse `command` on a cluster-owned node (one line naming the rollout that does it); the forced
    reason back when --force --reason, None when the host is not a cluster's. A dry run changes nothing."""
    if ctx.dry_run:
        return None
    from driverd.daemon.cluster_mode import refuse_outside_rollout
    return refuse_outside_rollout(ctx.config, ctx.root, command, force=bool(getattr(args, "force", False)),
                                  reason=getattr(args, "reason", None))


def forced(ctx, command: str, reason: str | None, out: dict) -> dict:
    """A change forced outside a rollout: said in the outcome, and an Event on the Node."""
    if reason is None:
        return out
    from driverd.daemon.cluster_mode import record_forced
    out.setdefault("warnings", []).append(f"forced outside a DriverRollout on a cluster node: {reason}; the "
                                          "daemon keeps the driver its rollout record names")
    problem = record_forced(ctx.config, ctx.root, command, reason, out.get("state") or "?")
    if problem:
        out["warnings"].append(problem)
    return out


def add_wait(p) -> None:
    p.add_argument("--wait", type=float, metavar="SECONDS", default=None,
                   help="wait up to SECONDS for another driverd transaction on this host to finish (default: "
                        "state.lock_wait_s, 0: exit 3 at once naming the holder)")


def register(sub, common) -> None:
    import argparse
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("load", parents=[common], formatter_class=fmt, help="load the installed driver and validate it",
                       description="Load the installed driverd package's modules in dependency order (nvidia, "
                       "nvidia-uvm, nvidia-modeset; nvidia-drm and nvidia-peermem when configured), with parameters "
                       "from [modules.parameters] checked against what the modules declare; create /dev/nvidia*; "
                       "start persistenced / fabric manager; validate version, flavour and every GPU.\n\n"
                       "examples:\n  driverd load\n  driverd --root /host load --json")
    _common(p)
    p.set_defaults(handler=cmd_run, kind="load")

    p = sub.add_parser("unload", parents=[common], formatter_class=fmt, help="stop GPU daemons and unload the driver",
                       description="Stop the GPU daemons, list every holder of the NVIDIA modules (modules, processes "
                       "with /dev/nvidia* open or CUDA/NVML mapped, with their pod), refuse while any exists unless "
                       "--terminate (or modules.unload_policy=terminate), then unload in holder order.\n\n"
                       "examples:\n  driverd unload\n  driverd unload --terminate")
    _common(p)
    p.add_argument("--terminate", action="store_true", help="SIGTERM (then SIGKILL after the grace period) GPU processes")
    p.set_defaults(handler=cmd_run, kind="unload")

    p = sub.add_parser("reload", parents=[common], formatter_class=fmt, help="reload or upgrade the driver as a transaction",
                       description="Unload and load the driver again (new parameters), or with --package upgrade to "
                       "another package: verify it, stop daemons, record MIG, unload, install, load, restore MIG, "
                       "start daemons, validate. Any failure returns to the last-known-good driver and reports the "
                       "kernel's own words. A run interrupted at any point is resumed by the next driverd command.\n\n"
                       "examples:\n  driverd reload\n  driverd reload --package /var/cache/driverd/driverd-550.127.05-open-....tar.zst")
    _common(p)
    p.add_argument("--package", metavar="FILE", help="package to upgrade to (a .tar.zst from driverd build/fetch)")
    p.add_argument("--userspace", metavar="FILE", help="that version's user-space package (driverd build-userspace), "
                   "switched in the same transaction; default: userspace.package's package of that version")
    p.set_defaults(handler=cmd_run, kind="reload")

    p = sub.add_parser("rollback", parents=[common], formatter_class=fmt, help="return to the previous driver",
                       description="Roll back an interrupted run (from the journal), or with none pending switch to "
                       "the previously installed package and load it.\n\nThe daemon (and `driverd apply`) "
                       "reconcile to driver.version: when that still names the version rolled back from, its next "
                       "pass upgrades again. --pin writes the version rolled back to into the configuration file "
                       "(driver.version), so it stays.\n\nexamples:\n  driverd rollback\n  driverd rollback --pin")
    _common(p)
    p.add_argument("--pin", action="store_true", help="after the rollback, set driver.version in the configuration "
                   "file to the driver rolled back to, so the daemon keeps it")
    p.set_defaults(handler=cmd_run, kind="rollback")

    p = sub.add_parser("apply", parents=[common], formatter_class=fmt, help="plan and execute: bring the host to the desired driver",
                       description="Read the host, plan (as `driverd plan`), and execute the plan step by step with "
                       "the journal, under the host lock. An interrupted earlier run is finished (or rolled back) "
                       "first, and said so. A host already as requested is left alone and nothing is written.\n\n"
                       "When the plan needs a reboot (nouveau in use, or a kernel that cannot unload modules), apply "
                       "does what is safe before it (blacklist nouveau, fetch, verify and install the package for "
                       "the next boot, configure runtimes), records the reason in <state.dir>/reboot-required.json, "
                       "writes /var/run/reboot-required (the sentinel kured and Ubuntu watch) and exits 4. After "
                       "the reboot, apply finishes and clears both.\n\n"
                       "exit codes: 0 done or nothing to do, 2 bad configuration, 3 blocked, failed and rolled back, "
                       "or the host lock is held, 4 reboot required to finish\n\n"
                       "example:\n  driverd apply --driver 535.261.03")
    _common(p)
    p.add_argument("--driver", metavar="VERSION", help="driver version (default: driver.version)")
    add_flavor(p, help="kernel-module flavour (default: driver.flavor)")
    p.set_defaults(handler=cmd_run, kind="apply")

    p = sub.add_parser("status", parents=[common], formatter_class=fmt, help="loaded/installed driver and the last run's journal",
                       description="Show what the host should run (driver, flavour and settings from the "
                       "configuration) next to what it runs - the loaded driver, the installed package, module "
                       "holders, GPU daemons - and every difference; what is happening now (the driverd process "
                       "holding the host lock and the step its run is at, an interrupted run, a pending reboot); "
                       "the daemon's last reconcile when `driverd daemon` or the driver container runs; and how "
                       "the last run ended. Takes no lock and changes nothing.\n\nexample:\n  driverd status --json")
    add_kernel_backend(p)
    p.set_defaults(handler=cmd_status, read_only=True)

    # the demo's own: it makes its sandbox host and configuration, so --root and --config are not offered (given
    # before the command name, they are refused with the reason, below)
    import argparse
    demo_common = Parser(add_help=False, argument_default=argparse.SUPPRESS)
    g = demo_common.add_argument_group("common options")
    g.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    g.add_argument("--log-format", choices=("text", "json"), help="logs on stderr: text (default) or one JSON "
                   "object per line (default: log.format)")
    g.add_argument("--root", metavar="DIR", help=argparse.SUPPRESS)   # accepted only to be refused with the reason
    g.add_argument("--config", metavar="FILE", help=argparse.SUPPRESS)
    p = sub.add_parser("demo", parents=[demo_common], formatter_class=fmt, help="a full provisioning run on a simulated 8-GPU host",
                       description="Build a sandbox host (8x H100, 4 NVSwitch, a Mellanox NIC, nouveau loaded, "
                       "containerd) with the simulated kernel and a small package repository, then run detect, plan, "
                       "fetch, verify, install, load, validate, status, and an upgrade with a forced failure that "
                       "rolls back. No GPU needed. With --kubeconfig, a rolling upgrade across four simulated GPU "
                       "nodes follows, on the Kubernetes API server that kubeconfig names.\n\nexample:\n"
                       "  driverd demo --work-dir /tmp/driverd-demo")
    add_work_dir(p, "where the sandbox goes (default: a new temp directory; --workdir is the same)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="a THROWAWAY test cluster's admin kubeconfig for the rollout stage: it creates simulated "
                   "Node objects, GPU pods and a DriverRollout there (without it the stage is skipped); the nodes "
                   "carry the label driverd.io/demo=<run>, the rollout selects only them, and all of it is removed "
                   "at the end")
    p.add_argument("--keep", action="store_true", help="leave the demo's nodes, pods and rollout on the API server")
    # The demo makes its own sandbox host and configuration: a --root or --config would be ignored.
    p.set_defaults(handler=cmd_demo, refused_common={
        "--root": ("the demo builds its own simulated host in its sandbox and never reads or changes another",
                   "drop --root; --workdir DIR says where the sandbox goes"),
        "--config": ("the demo writes its own configuration into its sandbox",
                     "drop --config; --workdir DIR says where the sandbox goes")})


def cmd_run(ctx, args) -> int:
    from driverd.apply import lifecycle as lc
    cfg = ctx.config
    if args.kind == "apply":
        cfg = cfg.with_overrides({"driver.version": args.driver, "driver.flavor": args.flavor})
    reason = cluster_guard(ctx, args, args.kind)
    sctx = ctx.step_context(cfg, args.kernel_backend)
    req = lc.lifecycle_request(args.kind, package=getattr(args, "package", None),
                               terminate=getattr(args, "terminate", False), cfg=cfg,
                               userspace=getattr(args, "userspace", None))
    out = lc.transact(sctx, req, wait_s=args.wait, dry_run=ctx.dry_run)
    if args.kind == "rollback" and not ctx.dry_run and reason is None:
        out = _after_rollback(ctx, cfg, out, pin=args.pin)
    return finish(ctx, forced(ctx, args.kind, reason, out))


def _after_rollback(ctx, cfg, out: dict, *, pin: bool) -> dict:
    """A rollback done while driver.version still names another driver: the daemon's (or apply's) next
    pass would upgrade again. Said, and with --pin the configuration is made to name the driver rolled
    back to."""
    lo, want = out.get("loaded"), cfg["driver.version"]
    if out.get("state") not in ("done", "nothing-to-do") or not lo or not want or lo["version"] == want:
        return out
    if pin:
        from driverd.config import set_value
        path = set_value(ctx.root, cfg, "driver.version", lo["version"])
        out.setdefault("warnings", []).append(f"pinned: driver.version = {lo['version']} in {path} (was {want})")
        out["pinned"] = {"driver.version": lo["version"], "file": path, "was": want}
    else:
        out.setdefault("warnings", []).append(
            f"driver.version still names {want} ({cfg.sources.get('driver.version', 'default')}): the daemon's next "
            f"pass (or driverd apply) upgrades to it again; to stay on {lo['version']}: driverd rollback --pin, or set "
            f"driver.version = \"{lo['version']}\" there")
    return out


def finish(ctx, out: dict, head=None) -> int:
    """Print a transaction's outcome (after `head(out)`, a command's own summary) and turn it into
    the exit code (a failed run raises)."""
    from driverd.apply import lifecycle as lc
    if out.get("dry_run"):
        emit(ctx.json, out, lambda o: f"{o['command']}: dry run, nothing changed")
        return EXIT_OK
    emit(ctx.json, out, lambda o: "\n".join(t for t in ((head(o) if head else ""), render_outcome(o)) if t))
    return lc.raise_for(out)


def render_outcome(o: dict) -> str:
    lines = []
    f = o.get("finished_first")
    if f:
        lines.append(f"first finished the interrupted {f['command']} run {f['run_id']}: {f['state']}")
    took = f" in {o['seconds']:.2f}s" if o.get("seconds") is not None else ""
    head = f"{o['command']}: {o['state']}{took}" + (f" (resumed {o['resumed']}x)" if o["resumed"] else "")
    rb = o.get("rolled_back_run")
    if o["state"] == "rolled-back" and o.get("steps") is not None:
        from driverd.apply.lifecycle import rolled_back_words
        step = (o.get("failure") or {}).get("step")
        head = f"{o['command']}: failed" + (f" at {step}" if step else "") + f"; {rolled_back_words(o)}"
        if rb:
            head = f"rollback: the interrupted {rb['command']} run {rb['run_id']}: {rolled_back_words(o)}"
    elif o["state"] == "done" and o["command"] == "rollback":
        lo, ins = o["loaded"], o["installed"]
        head = ("rollback: done: restored " + (f"{ins['version']} ({ins['flavor']})" if ins else "no package")
                + (f", loaded {lo['version']} ({lo['flavor']}) and validated" if lo else ""))
    if o["state"] == "nothing-to-do":
        head = f"{o['command']}: nothing to do, the host is already as requested (no journal written)"
    lines.append(head)
    lo = o["loaded"]
    lines.append(f"  loaded:    {lo['version']} ({lo['flavor']})" if lo else "  loaded:    no NVIDIA driver")
    ins = o["installed"]
    lines.append(f"  installed: {ins['version']} ({ins['flavor']})" if ins else "  installed: none")
    for r in o.get("reboot_required") or []:
        lines.append(f"  REBOOT REQUIRED: {r}")
    for w in o["warnings"]:
        lines.append(f"  warning:   {w}")
    if o["journal"]:
        lines.append(f"  journal:   {o['journal']} (run {o['run_id']})")
    return "\n".join(lines)


def cmd_status(ctx, args) -> int:
    from driverd.apply import lifecycle as lc
    out = lc.status(ctx.step_context(ctx.config, args.kernel_backend))
    emit(ctx.json, out, render_status)
    return EXIT_OK


def _ago(t, now=None) -> str:
    import time
    if not t:
        return "?"
    d = (now or time.time()) - float(t)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}min ago" if d < 7200 else f"{d / 3600:.1f}h ago"


def render_wanted(w: dict) -> list[str]:
    if not w["driver"]:
        return ["wanted     no driver.version configured" + (f" ({w['config_path']})" if w.get("config_path") else "")]
    fl = w["flavor"] if w["flavor"] != "auto" else (f"auto: {w['flavor_decided']}" if w["flavor_decided"]
                                                    else f"auto ({w.get('flavor_reason') or 'undecided'})")
    src = w["sources"].get("driver.version", "default")
    c = w["config"]
    cl = w.get("cluster")
    params = "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in p.items()) for m, p in c["modules.parameters"].items())
    lines = [f"wanted     {w['driver']} ({fl}) from {src}",
             f"           runtimes {','.join(c['runtime.runtimes'])} handler {c['runtime.handler']}"
             + (f"; parameters {params}" if params else "")]
    if cl:
        lines += [f"  waiting for a rollout: {x}" for x in cl.get("waiting") or []]
    if w.get("in_sync"):
        lines.append("  in sync: the host runs what " + ("the cluster keeps for this node" if cl else
                                                          "the configuration wants")
                     + (f" (the driver is left to {w['left_to']})" if w.get("left_to") else ""))
    if w.get("not_applied"):
        lines.append(f"  NOT APPLIED: {w['not_applied']}")
        return lines
    lines += ["  DIFFERS: " + d for d in w["differs"]]
    if w.get("plan"):
        lines.append(f"  plan:    {', '.join(w['plan'])} (`driverd plan` says why; " +
                     (f"in a cluster only a DriverRollout changes the driver: kubectl driverd rollout start --selector "
                      f"kubernetes.io/hostname={cl['node']} ...)" if cl else
                      "`driverd apply` or the daemon's next pass does it)"))
    return lines


def render_activity(a: dict) -> list[str]:
    h, r = a["holder"], a["run"]
    step = (f"step {r['step_number']}/{r['steps']} {r['step']}" if r and r.get("step") else "") if r else ""
    if a["state"] == "running":
        since = f" (taken {_ago(h.get('since'))})" if h.get("since") else ""
        line = f"activity   pid {h.get('pid')} ({h.get('command')}) holds the host lock{since}"
        if r:
            line += f": {r['command']} run {r['run_id']} {r['state']}" + (f", at {step}" if step else "")
        return [line]
    if a["state"] == "interrupted":
        return [f"activity   interrupted: {r['command']} run {r['run_id']} stopped at {step or r['state']}; nobody "
                "holds the host lock"]
    if a["state"] in ("reboot-pending", "rebooted"):
        return ["activity   waiting for a reboot" if a["state"] == "reboot-pending"
                else "activity   rebooted since the reboot was required: the next apply finishes"]
    return ["activity   idle (no driverd transaction holds the host lock)"]


def render_daemon(d: dict | None) -> list[str]:
    if not d:
        return []
    if d.get("unreadable"):
        return [f"daemon     state unreadable: {d['unreadable']}"]
    lr = d.get("last_reconcile") or {}
    who = f"{d.get('mode', 'daemon')} pid {d.get('pid')}"
    if d.get("stopped"):
        head = f"daemon     {who} stopped {_ago(d.get('updated_at'))}"
    else:
        head = f"daemon     {who}, {'ready' if d.get('ready') else 'not ready'}"
    dg = lr.get("degraded") if not d.get("stopped") else None
    if dg:
        run = dg["running"]
        head += f", DEGRADED: running {run['version']} ({run['flavor']}), validated; wanted {dg.get('wanted')}: " \
            f"{dg.get('why')}"
        lr = {}                          # the reason was just said
    if lr:
        head += f"; last reconcile (history) {lr.get('state')} {_ago(lr.get('finished_at'))}: {lr.get('reason')}"
    import time
    nxt = d.get("next_reconcile_at")
    if nxt and not d.get("stopped"):
        head += f"; next in {max(0, nxt - time.time()):.0f}s"
    return [head]


def render_kernels(g: dict | None) -> list[str]:
    """The reboot gate (`driverd reboot-ready`): each installed kernel newer than the running one, prepared or
    not, with the daemon's last attempt and next try."""
    if not g or not g.get("kernels"):
        return []
    out = []
    for k in g.get("kernels") or []:
        if k["ready"]:
            out.append(f"kernel     {k['release']}: prepared (driverd package {(k.get('package') or {}).get('version')} "
                       "installed and verified)")
            continue
        line = f"kernel     {k['release']}: NOT PREPARED ({k['short']}): " + "; ".join(k["lacks"])
        d = k.get("daemon") or {}
        if d.get("reason"):
            line += f"; the daemon's last attempt: {d['reason']}"
            if d.get("next_try_in_s") is not None:
                line += f" (attempt {d.get('attempts')}, tries again)"
        out.append(line + (f"; fix: {k['fix']}" if k.get("fix") else ""))
    if not g.get("ready"):
        out.append(f"  REBOOT NOT SAFE: {g['reason']} (driverd reboot-ready)")
    return out


_MARK = {"skipped": " (in place)", "failed": " FAILED", "running": " running", "pending": None}


def render_phases(run: dict) -> list[str]:
    """A run's steps with their durations on one line (and its rollback's on another): where the time went.
    Steps not reached are left out; an unfinished step says so."""
    out = []
    for label, rows in (("steps", run.get("steps")), ("rollback", run.get("rollback"))):
        words = [f"{r['action']}" + (f" {r['seconds']:.2f}s" if r.get("seconds") is not None else "")
                 + (_MARK.get(r["status"]) or "") for r in rows or [] if r["status"] != "pending"]
        if words:
            out.append(f"  {label + ':':<9} " + ", ".join(words))
    return out


def render_now(w: dict | None) -> list[str]:
    """The verdict on the host as it is now (the plan's, as `driverd plan` gives it), first: what follows the
    daemon's line is history (issue 48: a status that showed only the last reconcile's "converged" after the
    host had changed)."""
    if not w or not w.get("driver") or w.get("in_sync") is None:
        return []
    if w["in_sync"]:
        return ["now        in sync (judged now, as `driverd plan` does)"]
    n = len(w.get("differs") or [])
    what = {"blocked": "BLOCKED", "unfinished": "AN INTERRUPTED RUN IS UNFINISHED"}.get(w.get("verdict") or "",
                                                                                    "NOT IN SYNC")
    return [f"now        {what} (judged now, as `driverd plan` does; {n} line{'s' if n != 1 else ''} below)"]


def render_status(s: dict) -> str:
    lo, ins, lr = s["loaded"], s["installed"], s["last_run"]
    lines = render_now(s.get("wanted"))
    lines += render_wanted(s["wanted"]) if s.get("wanted") else []
    lines += [f"loaded     {lo['version']} ({lo['flavor']})" if lo else "loaded     no NVIDIA driver",
              f"installed  {ins['version']} ({ins['flavor']})" if ins else "installed  none"]
    us = s.get("userspace")
    if us:
        lines.append(f"userspace  {us['version']} in {us['tree']}" + ("" if us["intact"] else " (NOT INTACT)")
                     + ("" if us["active"] or not us["intact"] else " (installed, not active: the next apply makes it so)"))
    for n, m in s["modules"].items():      # a refcount the kernel does not show (built in, no unload) is left out
        lines.append(f"  {n:<16} " + (f"refcount {m['refcount']}  " if m["refcount"] is not None else "")
                     + f"holders {','.join(m['holders']) or '-'}")
    lines.append("daemons    " + ", ".join(f"{d} {'running' if r else 'stopped'}" for d, r in s["daemons"].items()))
    for p in s["holders"]["processes"]:
        lines.append(f"gpu user   pid {p['pid']} {p['cmdline'] or p['comm']}" + (f" pod {p['pod'] or p['pod_uid']}" if p["pod"] or p["pod_uid"] else ""))
    rb = s["reboot_required"]
    if rb:
        lines.append("REBOOT REQUIRED: " + "; ".join(rb.get("reasons") or []))
    h = s["lock_holder"]
    if s.get("activity"):
        lines += render_activity(s["activity"])
    elif h:
        lines.append(f"in progress  pid {h.get('pid')} ({h.get('command')}) holds the host lock")
    lines += render_daemon(s.get("daemon"))
    lines += render_kernels(s.get("kernels"))
    if s["journal_problem"]:
        lines.append(f"journal    {s['journal_problem']}")
    if lr:
        took = f" in {lr['seconds']:.2f}s" if lr.get("seconds") is not None and not lr["unfinished"] else ""
        lines.append(f"last run   {lr['command']} {lr['state']}{took} ({lr['run_id']})")
        lines += render_phases(lr)
        if lr["failure"]:
            lines.append(f"  failure: {lr['failure']['step']}: {lr['failure']['error'].get('error')}")
        if lr["unfinished"] and not h:
            lines.append("  UNFINISHED: the next driverd command that changes the host finishes it first; "
                         "driverd rollback rolls it back")
    return "\n".join(lines)


def cmd_demo(ctx, args) -> int:
    from driverd.cli.demo import run_demo
    return run_demo(args.work_dir, as_json=ctx.json, kubeconfig=args.kubeconfig, keep=args.keep)
