"""daemon, container-entrypoint: the run modes that stay up (driverd.daemon runs them; this module
parses arguments and hands over the composition root's step contexts)."""
from __future__ import annotations


def register(sub, common) -> None:
    import argparse
    fmt = argparse.RawDescriptionHelpFormatter
    listen_help = ("ADDR:PORT for /metrics, /healthz and /readyz (default: daemon.listen, 127.0.0.1:9477; port 0 "
                   "picks a free port, printed on stderr)")
    p = sub.add_parser("daemon", parents=[common], formatter_class=fmt,
                       help="keep the host converged: reconcile loop, sd_notify, metrics and health over HTTP",
                       description="Compare the configuration with the host and apply the plan (as `driverd apply`, "
                       "journalled, under the host lock, waiting for another driverd), then again every "
                       "daemon.interval_s, when the config file changes and on SIGHUP. A failed or blocked plan is "
                       "reported (STATUS=, /readyz 503, metrics) and retried with a capped backoff. Under systemd "
                       "(Type=notify) it sends READY=1 once the host is converged, STATUS= lines, WATCHDOG=1 and "
                       "STOPPING=1. SIGTERM: exit 0 within 10 s (a run in progress is finished or left to the "
                       "journal, which makes it resumable).\n\n"
                       "examples:\n  driverd daemon\n  driverd daemon --listen 0.0.0.0:9477\n"
                       "  systemctl enable --now driverd-daemon   (systemd/driverd-daemon.service)")
    p.add_argument("--listen", metavar="ADDR:PORT", help=listen_help)
    p.set_defaults(handler=cmd_serve, mode="daemon")

    p = sub.add_parser("container-entrypoint", parents=[common], formatter_class=fmt,
                       help="the driver container's process: fast path to ready, then the daemon's loop",
                       description="The driver container's main process (host root at $DRIVERD_ROOT, default "
                       "/host). When the driver last converged on this host is loaded and valid and the "
                       "configuration, kernel and package are unchanged, it goes ready at once without reloading "
                       "the driver or restarting daemons or runtimes; otherwise it reconciles first. Then it runs "
                       "the same loop as `driverd daemon`. daemon.unload_on_exit unloads the driver on SIGTERM.\n\n"
                       "example:\n  driverd container-entrypoint --listen 0.0.0.0:9477")
    p.add_argument("--listen", metavar="ADDR:PORT", help=listen_help)
    p.set_defaults(handler=cmd_serve, mode="container-entrypoint", default_root="/host")

    p = sub.add_parser("reboot-gate", parents=[common], formatter_class=fmt,
                       help="hold a shutdown inhibitor lock while `driverd reboot-ready` says a reboot is not safe",
                       description="For hosts without kured: judge the reboot gate (`driverd reboot-ready`: every "
                       "installed kernel newer than the running one has the node's driver package installed and "
                       "verified) every --interval seconds and when /boot or /lib/modules change, and hold a "
                       "logind shutdown inhibitor lock (systemd-inhibit --what=shutdown --mode=block --who=driverd) "
                       "while it is closed; `systemd-inhibit --list` shows why. The lock goes with this process: "
                       "it never outlives it. A block lock stops reboots that check inhibitors (a session's, "
                       "`systemctl reboot` from a terminal, --check-inhibitors=yes); docs/reboots.md has the rest. "
                       "SIGTERM: the lock is released and it exits 0.\n\n"
                       "examples:\n  driverd reboot-gate\n"
                       "  systemctl enable --now driverd-reboot-gate   (systemd/driverd-reboot-gate.service)")
    p.add_argument("--interval", type=float, default=60.0, metavar="SECONDS",
                   help="seconds between two judgements of the gate (default 60; a kernel installed or removed is "
                   "seen within 5 s)")
    p.set_defaults(handler=cmd_reboot_gate)


def cmd_reboot_gate(ctx, args) -> int:
    from driverd import config as config_mod
    from driverd import log
    from driverd.daemon.inhibit import run
    log.configure(mode="reboot-gate", timestamps=not log.stderr_is_journal())
    return run(ctx.root, lambda: config_mod.load(ctx.root, ctx.config_path), interval_s=args.interval, log=log.log)


def cmd_serve(ctx, args) -> int:
    from driverd import config as config_mod
    from driverd import log
    from driverd.daemon.serve import serve

    def load_config():
        cfg = config_mod.load(ctx.root, ctx.config_path)
        log.configure(cfg["log.format"])          # a re-read config may switch it (--log-format pins it)
        return cfg
    # a long-running process's lines carry their time, unless the journal stamps them already
    log.configure(mode=args.mode, timestamps=not log.stderr_is_journal())
    return serve(mode=args.mode, root=ctx.root, config_path=ctx.config_path, load_config=load_config,
                 make_context=lambda cfg: ctx.step_context(cfg), listen=args.listen)
