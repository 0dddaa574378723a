"""configure / revert one container runtime's handler: what the executor's `configure-runtime` and
`revert-runtime` steps and `driverd runtime configure|revert` run.

Idempotent: a second run with the same options computes the same files, writes nothing and restarts
nothing. The CDI spec is recorded on its own ("cdi") because several runtimes share it.
"""
from __future__ import annotations

from driverd.errors import RuntimeConfigError, UsageError
from driverd.root import Root
from driverd.runner import Runner
from driverd.runtime import registry, state
from driverd.runtime.base import Runtime
from driverd.runtime.changes import ChangeReport, FileEdit, Options
from driverd.runtime.model import HANDLER_NAME, RESTART_MODES
from driverd.runtime.needs import TOOLKIT, resolve_binary
from driverd.runtime.restart import DidNotStart


def _facts_for(root: Root, runtime: str, handler: str, facts=None):
    runtimes = getattr(facts, "runtimes", None)
    if runtimes is None:
        runtimes = registry.detect_all(root, handler)
    return next((r for r in runtimes if r.name == runtime), None)


def _check(runtime: str, opts: Options) -> None:
    if runtime not in registry.names():
        raise UsageError(f"unknown runtime {runtime!r}", fix=f"use one of {', '.join(registry.names())}")
    if opts.restart not in RESTART_MODES:
        raise UsageError(f"unknown restart mode {opts.restart!r}", fix=f"use one of {', '.join(RESTART_MODES)}")
    if not HANDLER_NAME.match(opts.handler):
        raise UsageError(f"invalid handler name {opts.handler!r}", fix="use a lower-case name like nvidia")
    if not opts.binary.startswith("/"):
        raise UsageError(f"--binary must be an absolute host path, not {opts.binary!r}")


def config_path_for(rt: Runtime, options: Options, rf) -> str:
    """The config file a run edits: --config-path / the option, else the one detect found, else the default."""
    return options.config_path or (rf.config_path if rf is not None else None) or rt.default_config


def _unit_and_socket(root: Root, rt: Runtime, config_path: str, rf) -> tuple[str, str]:
    sock = (rf.socket if rf is not None and rf.socket else None) or rt.default_socket
    return rt.unit(root, config_path), sock


def configure(root: Root, runtime: str, options: Options, runner: Runner | None = None,
              facts=None) -> ChangeReport:
    """Add the handler to `runtime` (and the CDI spec when options.cdi); restart when anything changed."""
    _check(runtime, options)
    runner = runner or Runner(dry_run=options.dry_run)
    dry = options.dry_run or runner.dry_run
    rt = registry.get(runtime)
    rf = _facts_for(root, runtime, options.handler, facts)
    config_path = config_path_for(rt, options, rf)
    report = ChangeReport(runtime, options.handler, "configure", config_path, dry_run=dry)
    if rf is None and options.config_path is None and not root.exists(config_path):
        report.notes.append(f"{runtime} was not detected on this host; configuring {config_path} anyway")
    edits: list[FileEdit] = rt.configure(root, config_path, options, report, rf,
                                             state.recorded(root, runtime, options.state_dir))
    binary = report.binary or options.binary
    _path, found = resolve_binary(root, binary)
    if found != "present" and not rt.checks_binary:
        # Not refused: the toolkit may come after driverd, and the handler works from then on.
        report.notes.append(f"{binary} {'does not exist yet' if found == 'missing' else 'is not executable'}: "
                            f"containers asking for '{options.handler}' fail until {TOOLKIT} is installed or "
                            "runtime.binary (--binary) names an installed NVIDIA runtime (`driverd detect` says what "
                            "each runtime's handler needs)")
    spec_plan = None
    if options.cdi:
        # CDI in two parts: the runtime side is enabled now; the spec needs the GPUs, so without them
        # it is written later by cdi.refresh (the daemon calls it when GPUs or the driver change). The
        # spec is left to NVIDIA's toolkit where its own refresh writes it (cdi.plan says who writes).
        from driverd.runtime import cdi
        spec_plan = cdi.plan(root, options, facts)
    state.apply(root, runtime, options.handler, edits, report, dry, options.state_dir)
    if spec_plan is not None:
        cdi.commit(root, options, report, spec_plan, dry)
    runtime_changed = any(p in report.files_changed for p in (e.path for e in edits))
    if not runtime_changed:
        if not report.files_changed:
            report.skipped = f"{runtime} already has the '{options.handler}' handler as requested: nothing to do"
        return report
    try:
        _restart(root, rt, config_path, rf, options, runner, report, checked=True)
    except DidNotStart as e:
        _undo_after_failed_start(root, rt, config_path, rf, options, runner, report, str(e))
    return report


def _undo_after_failed_start(root, rt, config_path, rf, options, runner, report, why: str) -> None:
    """The runtime did not start again with the handler in its configuration: put back what driverd
    recorded for it (the configuration it had before driverd), start it again, and fail naming both.
    Left as it was, the node would run no containers at all."""
    from driverd.runtime.restart import start_again
    undo = ChangeReport(rt.name, options.handler, "revert", config_path)
    rt.revert(root, undo, False, options.state_dir)
    unit, sock = _unit_and_socket(root, rt, config_path, rf)
    try:
        again = start_again(root, rt.name, unit, sock, runner, options.wait_timeout_s)[1]
    except DidNotStart as e2:
        again = f"it did not start with the previous configuration either: {e2}"
    raise RuntimeConfigError(
        f"{rt.name} did not start with the '{options.handler}' handler in {config_path}: driverd put its previous "
        f"configuration back ({', '.join(undo.files_changed) or 'nothing to restore'}) and restarted it ({again})",
        cause=why, fix=f"see journalctl -u {rt.unit(root, config_path)} for what {rt.name} refused in the new configuration; "
                       "correct runtime.* in driverd's configuration (or --binary/--config-path) and run again")


def write_cdi_spec(root: Root, options: Options, report: ChangeReport, facts=None, dry: bool = False,
                   spec: dict | None = None) -> None:
    """Write (or rewrite) the CDI spec for the GPUs now visible; recorded as "cdi" for revert."""
    from driverd.runtime import cdi
    cdi.write_spec(root, options, report, facts, dry, spec)


def restart(root: Root, rt: Runtime, config_path: str, rf, options: Options,
            runner: Runner, checked: bool = False) -> tuple[bool, str, float | None]:
    """Restart `rt` the way its configuration at config_path asks (unit, socket): restart.restart;
    `checked`: raise DidNotStart when it failed to start again."""
    from driverd.runtime import restart as rs
    unit, sock = _unit_and_socket(root, rt, config_path, rf)
    how = rs.restart_or_raise if checked else rs.restart
    return how(root, rt.name, unit, sock, options.restart, runner, options.wait_timeout_s)


def _restart(root, rt, config_path, rf, options, runner, report, checked: bool = False) -> None:
    if report.dry_run and not runner.dry_run:
        runner = Runner(dry_run=True)       # a dry run never restarts anything
    report.restarted, report.restart_detail, report.socket_ready_s = restart(
        root, rt, config_path, rf, options, runner, checked)


def revert(root: Root, runtime: str, options: Options, runner: Runner | None = None, facts=None) -> ChangeReport:
    """Undo what driverd recorded for `runtime` ("cdi" for the CDI spec); restart when anything changed."""
    if runtime != "cdi":
        _check(runtime, options)
    runner = runner or Runner(dry_run=options.dry_run)
    dry = options.dry_run or runner.dry_run
    report = ChangeReport(runtime, options.handler, "revert", dry_run=dry)
    if runtime == "cdi":            # the CDI spec is recorded on its own, not a runtime of the registry
        from driverd.runtime import cdi
        cdi.revert(root, options, report, dry)
        return report
    rt = registry.get(runtime)
    rt.revert(root, report, dry, options.state_dir)
    if not report.files_changed:
        return report
    rf = _facts_for(root, runtime, options.handler, facts)
    config_path = config_path_for(rt, options, rf)
    report.config_path = config_path
    _restart(root, rt, config_path, rf, options, runner, report)
    return report


def recorded_runtimes(root: Root, state_dir: str = state.DEFAULT_STATE_DIR) -> list[str]:
    return list(state.load(root, state_dir)["runtimes"])


__all__ = ["configure", "revert", "write_cdi_spec", "recorded_runtimes", "RuntimeConfigError"]
