"""Container runtime handlers: containerd (1.x/2.x, k3s/RKE2), CRI-O, Docker; the CDI spec; restarts.

    from driverd.runtime import configure, revert, Options
    report = configure(root, "containerd", Options(handler="nvidia", cdi=True), runner)

The runtimes are the explicit table in `registry.py`, each one module with a `base.Runtime` subclass.
Nothing heavy is imported here: tomlkit/yaml load only when a runtime is configured.
"""
from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.runtime.changes import ChangeReport, Options


def __getattr__(name: str):
    # Options and ChangeReport are configure's (driverd.runtime.changes): made when first asked for, not
    # by every import of this package (detect's, issue 47)
    if name in ("Options", "ChangeReport"):
        from driverd.runtime import changes
        return getattr(changes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def configure(root, runtime_name, options, runner=None, facts=None) -> ChangeReport:
    from driverd.runtime.handler import configure as _configure
    return _configure(root, runtime_name, options, runner, facts)


def revert(root, runtime_name, options=None, runner=None, facts=None) -> ChangeReport:
    from driverd.runtime.changes import Options
    from driverd.runtime.handler import revert as _revert
    return _revert(root, runtime_name, options or Options(), runner, facts)


def select_targets(root, wanted: list[str], handler: str) -> list[str]:
    """The runtimes a configure applies to: those named, every detected one for "auto", none for "none"."""
    if "none" in wanted:
        return []
    if "auto" in wanted:
        from driverd.runtime.registry import detect_all
        return [r.name for r in detect_all(root, handler)]
    return list(wanted)


def restart_runtime(root, runtime_name: str, options: Options, runner) -> str:
    """Restart a runtime the way configure does after a change (used after files were put back)."""
    from driverd.runtime import registry
    from driverd.runtime.handler import _facts_for, config_path_for, restart
    rt = registry.get(runtime_name)
    rf = _facts_for(root, runtime_name, options.handler)
    _restarted, detail, _ready = restart(root, rt, config_path_for(rt, options, rf), rf, options, runner)
    return detail


__all__ = ["configure", "revert", "select_targets", "restart_runtime", "Options", "ChangeReport"]
