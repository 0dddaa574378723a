"""runtime configure / revert: link container runtimes to the NVIDIA runtime handler."""
from __future__ import annotations

import argparse

from driverd.cli.lifecycle_cmds import add_wait
from driverd.cli.options import builds
from driverd.cli.output import emit
from driverd.errors import EXIT_OK

CONFIGURE_EXAMPLES = """\
examples:
  driverd runtime configure                         every detected runtime, handler 'nvidia'
  driverd runtime configure --runtime containerd --set-as-default --cdi --dry-run
  driverd runtime configure --runtime containerd \\
      --config-path /var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl
  driverd runtime configure --runtime docker        take over nvidia-ctk's 'nvidia' handler
  driverd runtime configure --adopt-foreign         take over an 'nvidia' handler that runs something else
  driverd runtime revert                            undo everything driverd changed

An 'nvidia' handler another tool wrote (nvidia-ctk, the GPU Operator's toolkit, by hand) is taken over
when it runs an NVIDIA container runtime: backed up once, its binary made absolute, and given back
as it was by `driverd runtime revert`. --set-as-default, --cdi and --binary apply to it as well.
"""


def _titles(last_join: str, detail: bool = False) -> str:
    """The registered runtimes as people spell them: "containerd, CRI-O<last_join>Docker"."""
    from driverd.runtime.registry import runtimes
    words = [r.title + (f" ({r.detail})" if detail and r.detail else "") for r in runtimes()]
    return last_join.join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else "".join(words)


def register(sub, common) -> None:
    if not builds(sub, "runtime"):
        return
    from driverd.runtime.registry import names
    rt = sub.add_parser("runtime", help=f"configure container runtimes ({_titles(', ')}) and CDI",
                        description="Add or remove the NVIDIA runtime handler in container runtime configuration.")
    rsub = rt.add_subparsers(dest="runtime_command", metavar="COMMAND")

    p = rsub.add_parser("configure", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=CONFIGURE_EXAMPLES, help="add the NVIDIA runtime handler (idempotent)",
                        description=f"Add the runtime handler to {_titles(' and/or ', detail=True)}, keeping every existing setting, comment and import, or take over the one "
                        "NVIDIA's tooling wrote; optionally make it the default and enable CDI (the CDI spec is "
                        "written once the GPUs are visible). Originals are backed up once; a second run changes "
                        "nothing; the runtime is restarted only when its configuration changed.")
    p.add_argument("--runtime", choices=("auto", *names()), default=None,
                   help="which runtime (default: runtime.runtimes; auto = every runtime detect finds)")
    p.add_argument("--handler", dest="handler_name", metavar="NAME", help="handler name (default: runtime.handler, 'nvidia')")
    p.add_argument("--binary", metavar="PATH", help="the handler's runtime binary (default: runtime.binary)")
    p.add_argument("--set-as-default", action="store_true", default=None, help="make the handler the default runtime")
    p.add_argument("--cdi", action="store_true", default=None,
                   help="enable CDI in the runtime and write the CDI spec (/var/run/cdi/nvidia.yaml) — the spec "
                   "as soon as the GPUs are visible")
    p.add_argument("--adopt-foreign", action="store_true", default=None,
                   help="take over a handler of the same name that runs something other than an NVIDIA container "
                   "runtime (default: runtime.adopt_foreign; without it such a handler is refused)")
    p.add_argument("--restart", choices=("systemd", "signal", "none"), help="how to restart after a change "
                   "(default: runtime.restart)")
    p.add_argument("--config-path", metavar="FILE", help="a custom runtime config file (host path)")
    p.add_argument("--allow-mismatch", dest="force_cdi", action="store_true", default=None,
                   help="write the CDI spec even when the driver's user-space is not the loaded driver's version "
                   "(refused otherwise: containers given it fail with an NVML/RM version mismatch)")
    p.add_argument("--dry-run", action="store_true", help="print the diff; write and restart nothing")
    add_wait(p)
    p.set_defaults(handler=cmd_configure)

    p = rsub.add_parser("revert", parents=[common], help="undo driverd's runtime changes",
                        description="Restore what driverd changed: byte-identical originals when nobody edited the "
                        "files since, otherwise only driverd's own entries are removed (never other handlers). "
                        "Restarts a runtime whose configuration changed.\n\n"
                        "example:  driverd runtime revert --runtime containerd --dry-run",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runtime", choices=("auto", *names(), "cdi"), default="auto",
                   help="which runtime (default auto: every runtime driverd changed, and the CDI spec)")
    p.add_argument("--restart", choices=("systemd", "signal", "none"), help="how to restart after a change")
    p.add_argument("--config-path", metavar="FILE", help="the runtime's config file, for the restart")
    p.add_argument("--dry-run", action="store_true", help="print the diff; write and restart nothing")
    add_wait(p)
    p.set_defaults(handler=cmd_revert)


def _options(ctx, args):
    from driverd.runtime.changes import Options
    return Options.from_config(ctx.config, handler=getattr(args, "handler_name", None) or None,
                               binary=getattr(args, "binary", None), set_as_default=getattr(args, "set_as_default", None),
                               cdi=getattr(args, "cdi", None), restart=args.restart, dry_run=args.dry_run,
                               config_path=args.config_path, adopt_foreign=getattr(args, "adopt_foreign", None),
                               force_cdi=getattr(args, "force_cdi", None))


def _step_options(args) -> dict:
    """The flags given, as the configure/revert step's options (the rest comes from the config)."""
    keys = ("binary", "set_as_default", "cdi", "restart", "config_path", "adopt_foreign", "force_cdi")
    out = {k: getattr(args, k, None) for k in keys}
    out["handler"] = getattr(args, "handler_name", None)
    return {k: v for k, v in out.items() if v is not None}


def _run(ctx, args, verb: str, targets: list[str]) -> int:
    """configure/revert: a dry run prints the diffs (nothing written); otherwise one journalled
    transaction under the host lock, each runtime a step whose files are put back on failure."""
    from driverd.apply import lifecycle as lc
    from driverd.cli.lifecycle_cmds import finish
    from driverd.runtime.handler import configure, revert
    if args.dry_run:
        fn = configure if verb == "configure" else revert
        opts = _options(ctx, args)
        reports = [fn(ctx.root, name, opts, ctx.runner).to_json() for name in targets]
        emit(ctx.json, {"reports": reports, "runtimes": targets}, render)
        return EXIT_OK
    if not targets:
        emit(ctx.json, {"reports": [], "runtimes": []}, render)
        return EXIT_OK
    req = lc.runtime_request(verb, targets, _step_options(args))
    out = lc.transact(ctx.step_context(), req, wait_s=args.wait)
    out["runtimes"] = targets
    out["reports"] = [r["result"] for r in out["results"] if r["action"].endswith("-runtime")]
    return finish(ctx, out, lambda o: render(o) if o["reports"] else "")


def cmd_configure(ctx, args) -> int:
    from driverd.runtime import select_targets
    opts = _options(ctx, args)
    wanted = [args.runtime] if args.runtime else list(ctx.config["runtime.runtimes"])
    return _run(ctx, args, "configure", select_targets(ctx.root, wanted, opts.handler))


def cmd_revert(ctx, args) -> int:
    from driverd.runtime.handler import recorded_runtimes
    targets = recorded_runtimes(ctx.root, ctx.config["state.dir"]) if args.runtime == "auto" else [args.runtime]
    return _run(ctx, args, "revert", targets)


def render(d: dict) -> str:
    if not d["reports"]:
        return "nothing to do: no runtime selected (none detected, or runtime.runtimes = none)"
    lines = []
    for r in d["reports"]:
        head = f"{r['runtime']}: "
        if r["skipped"]:
            head += r["skipped"]
        else:
            verb = "would change" if r["dry_run"] else ("reverted" if r["action"] == "revert" else "changed")
            head += f"{verb} {', '.join(r['files_changed']) or 'nothing'}"
        lines.append(head)
        lines.extend(f"  backup   {b}" for b in r["backups"])
        lines.extend(f"  adopted  '{a['handler']}' in {a['file']}: ran {a['before']}, now {a['binary']} ({a['how']}); "
                     "revert gives it back" for a in r.get("adopted") or [])
        lines.extend(f"  note     {n}" for n in r["notes"])
        if r["restart_detail"]:
            lines.append(f"  restart  {r['restart_detail']}")
        if r["dry_run"]:
            lines.extend("  " + ln for diff in r["diffs"].values() for ln in diff.splitlines())
    return "\n".join(lines)
