"""configure / revert one container runtime's handler: what the executor's `configure-runtime` and
`revert-runtime` steps and `driverd runtime configure|revert` run.

Idempotent: a second run with the same options computes the same files, writes nothing and restarts
nothing. The CDI spec is recorded on its own ("cdi") because several runtimes share it.
"""
from __future__ import annotations

from driverd.errors import RuntimeConfigError, UsageError
from driverd.root import Root
from driverd.runner import Runner
from driverd.runtime import state
from driverd.runtime.model import RESTART_MODES, RUNTIMES, ChangeReport, FileEdit, Options

DEFAULT_SOCKETS = {"containerd": "/run/containerd/containerd.sock", "crio": "/var/run/crio/crio.sock",
                   "docker": "/var/run/docker.sock"}
DEFAULT_CONFIGS = {"containerd": "/etc/containerd/config.toml", "crio": "/etc/crio/crio.conf",
                   "docker": "/etc/docker/daemon.json"}


def _facts_for(root: Root, runtime: str, handler: str, facts=None):
    runtimes = getattr(facts, "runtimes", None)
    if runtimes is None:
        from driverd.host.runtimes import read_runtimes
        runtimes = read_runtimes(root, handler)
    return next((r for r in runtimes if r.name == runtime), None)


def _check(runtime: str, opts: Options) -> None:
    if runtime not in RUNTIMES:
        raise UsageError(f"unknown runtime {runtime!r}", fix=f"use one of {', '.join(RUNTIMES)}")
    if opts.restart not in RESTART_MODES:
        raise UsageError(f"unknown restart mode {opts.restart!r}", fix=f"use one of {', '.join(RESTART_MODES)}")
    from driverd.config import SCHEMA
    pat = SCHEMA["runtime.handler"].pattern
    if pat is not None and not pat.match(opts.handler):
        raise UsageError(f"invalid handler name {opts.handler!r}", fix="use a lower-case name like nvidia")
    if not opts.binary.startswith("/"):
        raise UsageError(f"--binary must be an absolute host path, not {opts.binary!r}")


def _unit_and_socket(root: Root, runtime: str, config_path: str, rf) -> tuple[str, str]:
    sock = (rf.socket if rf is not None and rf.socket else None) or DEFAULT_SOCKETS[runtime]
    if runtime == "containerd":
        from driverd.runtime.containerd import restart_unit
        return restart_unit(root, config_path), sock
    return {"crio": "crio", "docker": "docker"}[runtime], sock


def configure(root: Root, runtime: str, options: Options, runner: Runner | None = None,
              facts=None) -> ChangeReport:
    """Add the handler to `runtime` (and the CDI spec when options.cdi); restart when anything changed."""
    _check(runtime, options)
    runner = runner or Runner(dry_run=options.dry_run)
    dry = options.dry_run or runner.dry_run
    rf = _facts_for(root, runtime, options.handler, facts)
    config_path = options.config_path or (rf.config_path if rf is not None else None) or DEFAULT_CONFIGS[runtime]
    report = ChangeReport(runtime, options.handler, "configure", config_path, dry_run=dry)
    if rf is None and options.config_path is None and not root.exists(config_path):
        report.notes.append(f"{runtime} was not detected on this host; configuring {config_path} anyway")
    rec = state.recorded(root, runtime)
    edits: list[FileEdit]
    if runtime == "containerd":
        from driverd.runtime import containerd
        edits = containerd.plan(root, config_path, options, report, rf.version if rf else None, rec)
    elif runtime == "crio":
        from driverd.runtime import crio
        edits = crio.plan(root, options.config_path or (rf.config_path if rf else None), options, report, rec)
    else:
        from driverd.runtime import docker
        edits = docker.plan(root, config_path, options, report, rec)
    binary = report.binary or options.binary
    if not root.exists(binary) and runtime != "crio":
        report.notes.append(f"{binary} does not exist yet: containers asking for '{options.handler}' "
                            "fail until nvidia-container-toolkit is installed")
    spec = None
    if options.cdi:
        # CDI in two parts: the runtime side is enabled now; the spec needs the GPUs, so without them
        # it is written later by cdi.refresh (the daemon calls it when GPUs or the driver change).
        from driverd.runtime import cdi
        spec = cdi.build_if_visible(root, facts)
    state.apply(root, runtime, options.handler, edits, report, dry)
    if spec is not None:
        write_cdi_spec(root, options, report, facts, dry, spec)
    elif options.cdi:
        report.notes.append(cdi.PENDING.format(path=options.cdi_spec_path))
    runtime_changed = any(p in report.files_changed for p in (e.path for e in edits))
    if not runtime_changed:
        if not report.files_changed:
            report.skipped = f"{runtime} already has the '{options.handler}' handler as requested: nothing to do"
        return report
    _restart(root, runtime, config_path, rf, options, runner, report)
    return report


def write_cdi_spec(root: Root, options: Options, report: ChangeReport, facts=None, dry: bool = False,
                   spec: dict | None = None) -> None:
    """Write (or rewrite) the CDI spec for the GPUs now visible; recorded as "cdi" for revert."""
    from driverd.runtime import cdi
    cdi.write_spec(root, options, report, facts, dry, spec)


def _restart(root, runtime, config_path, rf, options, runner, report) -> None:
    from driverd.runtime.restart import restart
    if report.dry_run and not runner.dry_run:
        runner = Runner(dry_run=True)       # a dry run never restarts anything
    unit, sock = _unit_and_socket(root, runtime, config_path, rf)
    report.restarted, report.restart_detail, report.socket_ready_s = restart(
        root, runtime, unit, sock, options.restart, runner, options.wait_timeout_s)


def revert(root: Root, runtime: str, options: Options, runner: Runner | None = None, facts=None) -> ChangeReport:
    """Undo what driverd recorded for `runtime` ("cdi" for the CDI spec); restart when anything changed."""
    if runtime != "cdi":
        _check(runtime, options)
    runner = runner or Runner(dry_run=options.dry_run)
    dry = options.dry_run or runner.dry_run
    report = ChangeReport(runtime, options.handler, "revert", dry_run=dry)
    state.revert(root, runtime, report, dry)
    if runtime == "cdi" or not report.files_changed:
        return report
    rf = _facts_for(root, runtime, options.handler, facts)
    config_path = options.config_path or (rf.config_path if rf else None) or DEFAULT_CONFIGS[runtime]
    report.config_path = config_path
    _restart(root, runtime, config_path, rf, options, runner, report)
    return report


def recorded_runtimes(root: Root) -> list[str]:
    return list(state.load(root)["runtimes"])


__all__ = ["configure", "revert", "write_cdi_spec", "recorded_runtimes", "RuntimeConfigError"]
