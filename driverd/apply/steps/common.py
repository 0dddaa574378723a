"""What several step modules share: the driver's identity as the journal records it, the running module
parameters a reload passes again, the package a step works on, driverd's paths, a step's undo by its
preimage."""
from __future__ import annotations

from driverd.driver import state as driver_state
from driverd.driver.state import DriverState
from driverd.errors import PackageError


def installed(ctx) -> dict | None:
    """The driverd package installed for the running kernel: version, flavour, sha256."""
    got = DriverState.of(ctx).installed()
    return None if got is None else {**got.driver.as_dict(), "sha256": got.package_sha256}


def loaded(ctx) -> dict | None:
    got = DriverState.of(ctx).loaded()
    return None if got is None else got.as_dict()


def running_parameters(ctx, modules: list[str]) -> dict[str, dict[str, str]]:
    """The parameters the running modules were loaded with, as a reload passes them again (the values
    driver.state.running_parameters reads, which the daemon's drift check reads too)."""
    return driver_state.settable(driver_state.running_parameters(ctx.kernel, modules))


def restore_files_steps(entry: dict, restart: list[str] | None = None, reason: str = "") -> list[dict]:
    before = entry.get("before")
    if not before:
        return []
    return [{"action": "restore-files", "params": {"files": before, "restart": restart or []},
             "reason": reason or f"undo {entry['action']}: put back the files as they were before it"}]


def package_path(ctx, params) -> str:
    """The package a step works on: its own parameter, else what the run's fetch step produced."""
    path = params.get("package") or ctx.doc.get("package") or next(
        (s.get("result", {}).get("package") for s in ctx.doc.get("steps", []) if s["action"] == "fetch-package"
         and s.get("result")), None)
    if not path:
        raise PackageError("no package to install", cause="neither --package nor a fetch step provided one",
                           fix="pass --package FILE or configure packages.repositories")
    return path


def places(ctx):
    from driverd.driver.layout import Places
    return Places.from_config(ctx.config)
