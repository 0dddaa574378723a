"""Container runtime handlers: containerd (1.x/2.x, k3s/RKE2), CRI-O, Docker; the CDI spec; restarts.

    from driverd.runtime import configure, revert, Options
    report = configure(root, "containerd", Options(handler="nvidia", cdi=True), runner)

Nothing heavy is imported here: tomlkit/yaml load only when a runtime is configured.
"""
from __future__ import annotations

from driverd.runtime.model import ChangeReport, Options


def configure(root, runtime_name, options, runner=None, facts=None) -> ChangeReport:
    from driverd.runtime.handler import configure as _configure
    return _configure(root, runtime_name, options, runner, facts)


def revert(root, runtime_name, options=None, runner=None, facts=None) -> ChangeReport:
    from driverd.runtime.handler import revert as _revert
    return _revert(root, runtime_name, options or Options(), runner, facts)


def select_targets(root, wanted: list[str], handler: str) -> list[str]:
    """The runtimes a configure applies to: those named, every detected one for "auto", none for "none"."""
    if "none" in wanted:
        return []
    if "auto" in wanted:
        from driverd.host.runtimes import read_runtimes
        return [r.name for r in read_runtimes(root, handler)]
    return list(wanted)


def restart_runtime(root, runtime_name: str, options: Options, runner) -> str:
    """Restart a runtime the way configure does after a change (used after files were put back)."""
    from driverd.runtime.handler import DEFAULT_CONFIGS, _facts_for, _unit_and_socket
    from driverd.runtime.restart import restart
    rf = _facts_for(root, runtime_name, options.handler)
    config_path = options.config_path or (rf.config_path if rf else None) or DEFAULT_CONFIGS[runtime_name]
    unit, sock = _unit_and_socket(root, runtime_name, config_path, rf)
    _restarted, detail, _ready = restart(root, runtime_name, unit, sock, options.restart, runner,
                                         options.wait_timeout_s)
    return detail


__all__ = ["configure", "revert", "select_targets", "restart_runtime", "Options", "ChangeReport"]
