"""Container runtime handlers: containerd (1.x/2.x, k3s/RKE2), CRI-O, Docker; the CDI spec; restarts.

    from driverd.runtime import configure, revert, Options
    report = configure(root, "containerd", Options(handler="nvidia", cdi=True), runner)

Nothing heavy is imported here: tomlkit/yaml load only when a runtime is configured.
"""
from __future__ import annotations

from driverd.runtime.model import ChangeReport, Options


def configure(root, runtime_name, options, runner=None, facts=None) -> ChangeReport:
    from driverd.runtime.configure import configure as _configure
    return _configure(root, runtime_name, options, runner, facts)


def revert(root, runtime_name, options=None, runner=None, facts=None) -> ChangeReport:
    from driverd.runtime.configure import revert as _revert
    return _revert(root, runtime_name, options or Options(), runner, facts)


__all__ = ["configure", "revert", "Options", "ChangeReport"]
