"""load, unload, reload, rollback, status, apply, demo: the kernel-module lifecycle commands."""
from __future__ import annotations

from driverd.cli.output import emit
from driverd.errors import EXIT_OK

KERNEL_HELP = "kernel boundary: real (kmod tools), sim (simulated kernel of a host tree), auto (default: sim only for trees driverd.sim wrote)"


def _common(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="print what would run; change nothing")
    p.add_argument("--kernel", choices=("auto", "real", "sim"), help=KERNEL_HELP)


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
    p.set_defaults(handler=cmd_run, kind="reload")

    p = sub.add_parser("rollback", parents=[common], formatter_class=fmt, help="return to the previous driver",
                       description="Roll back an interrupted run (from the journal), or with none pending switch to "
                       "the previously installed package and load it.\n\nexample:\n  driverd rollback")
    _common(p)
    p.set_defaults(handler=cmd_run, kind="rollback")

    p = sub.add_parser("apply", parents=[common], formatter_class=fmt, help="plan and execute: bring the host to the desired driver",
                       description="Read the host, plan (as `driverd plan`), and execute the plan step by step with "
                       "the journal.\n\nexample:\n  driverd apply --driver 535.261.03")
    _common(p)
    p.add_argument("--driver", metavar="VERSION", help="driver version (default: driver.version)")
    p.add_argument("--flavor", choices=("auto", "open", "proprietary"))
    p.set_defaults(handler=cmd_run, kind="apply")

    p = sub.add_parser("status", parents=[common], formatter_class=fmt, help="loaded/installed driver and the last run's journal",
                       description="Show the loaded driver, the installed package, module holders, GPU daemons and how "
                       "the last run ended (or that one is unfinished).\n\nexample:\n  driverd status --json")
    p.add_argument("--kernel", choices=("auto", "real", "sim"), help=KERNEL_HELP)
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("demo", parents=[common], formatter_class=fmt, help="a full provisioning run on a simulated 8-GPU host",
                       description="Build a sandbox host (8x H100, 4 NVSwitch, a Mellanox NIC, nouveau loaded, "
                       "containerd) with the simulated kernel and a small package repository, then run detect, plan, "
                       "fetch, verify, install, load, validate, status, and an upgrade with a forced failure that "
                       "rolls back. No GPU needed.\n\nexample:\n  driverd demo --workdir /tmp/driverd-demo")
    p.add_argument("--workdir", metavar="DIR", help="where the sandbox goes (default: a new temp directory)")
    p.set_defaults(handler=cmd_demo)


def cmd_run(ctx, args) -> int:
    from driverd.kmod import commands as c
    cfg = ctx.config
    if args.kind == "apply":
        cfg = cfg.with_overrides({"driver.version": args.driver, "driver.flavor": args.flavor})
    sctx = c.make_context(ctx.root, ctx.runner, cfg, args.kernel)
    ex = c.executor(sctx)
    if ctx.dry_run:        # nothing is done and no journal is written: the steps and whether each is needed
        out = ex.preview(args.kind, c.steps_for(args.kind, sctx, ctx.root, cfg, args))
        emit(ctx.json, out, lambda o: f"{o['command']}: dry run, nothing changed")
        return EXIT_OK
    c.require_changeable(sctx)
    if args.kind == "rollback":
        doc = ex.rollback_now("rollback requested") if ex.pending() else ex.run("rollback", c.rollback_steps(sctx))
    elif ex.pending() is not None:
        doc = ex.run(args.kind, [])            # finish the interrupted run first
    else:
        doc = ex.run(args.kind, c.steps_for(args.kind, sctx, ctx.root, cfg, args))
    out = c.outcome(doc, sctx)
    emit(ctx.json, out, render_outcome)
    c.raise_for(out)
    return EXIT_OK


def render_outcome(o: dict) -> str:
    lines = [f"{o['command']}: {o['state']}" + (f" (resumed {o['resumed']}x)" if o["resumed"] else "")]
    lo = o["loaded"]
    lines.append(f"  loaded:    {lo['version']} ({lo['flavor']})" if lo else "  loaded:    no NVIDIA driver")
    ins = o["installed"]
    lines.append(f"  installed: {ins['version']} ({ins['flavor']})" if ins else "  installed: none")
    for w in o["warnings"]:
        lines.append(f"  warning:   {w}")
    lines.append(f"  journal:   {o['journal']}")
    return "\n".join(lines)


def cmd_status(ctx, args) -> int:
    from driverd.kmod import commands as c
    from driverd.kmod.holders import find_holders
    sctx = c.make_context(ctx.root, ctx.runner, ctx.config, args.kernel)
    doc = c.executor(sctx).journal.load()
    from driverd.apply.steps import _loaded_identity
    from driverd.kmod.load import installed_identity
    inst = installed_identity(sctx.kernel)
    h = find_holders(sctx.kernel)
    out = {"loaded": _loaded_identity(sctx), "installed": None if inst is None else
           {"version": inst[0], "flavor": inst[1], "sha256": inst[2]},
           "modules": {n: {"refcount": m.refcount, "holders": list(m.holders)} for n, m in sctx.kernel.modules().items()
                       if n.startswith("nvidia") or n == "nouveau"},
           "holders": h.to_json(), "daemons": {d: sctx.services.running(d) for d in ("nvidia-persistenced", "nv-fabricmanager")},
           "last_run": None if doc is None else {"run_id": doc["run_id"], "command": doc["command"], "state": doc["state"],
                                                 "failure": doc.get("failure"), "warnings": doc.get("warnings", [])},
           "kernel": sctx.kernel.name}
    emit(ctx.json, out, render_status)
    return EXIT_OK


def render_status(s: dict) -> str:
    lo, ins, lr = s["loaded"], s["installed"], s["last_run"]
    lines = [f"loaded     {lo['version']} ({lo['flavor']})" if lo else "loaded     no NVIDIA driver",
             f"installed  {ins['version']} ({ins['flavor']})" if ins else "installed  none"]
    for n, m in s["modules"].items():
        lines.append(f"  {n:<16} refcount {m['refcount']}  holders {','.join(m['holders']) or '-'}")
    lines.append("daemons    " + ", ".join(f"{d} {'running' if r else 'stopped'}" for d, r in s["daemons"].items()))
    for p in s["holders"]["processes"]:
        lines.append(f"gpu user   pid {p['pid']} {p['cmdline'] or p['comm']}" + (f" pod {p['pod'] or p['pod_uid']}" if p["pod"] or p["pod_uid"] else ""))
    if lr:
        lines.append(f"last run   {lr['command']} {lr['state']} ({lr['run_id']})")
        if lr["failure"]:
            lines.append(f"  failure: {lr['failure']['step']}: {lr['failure']['error'].get('error')}")
        if lr["state"] in ("running", "rolling-back"):
            lines.append("  UNFINISHED: the next driverd load/unload/reload/apply resumes it; driverd rollback rolls it back")
    return "\n".join(lines)


def cmd_demo(ctx, args) -> int:
    from driverd.kmod.demo import run_demo
    return run_demo(args.workdir, as_json=ctx.json)
