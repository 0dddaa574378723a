"""The companions' steps (issue 46): switch a component of the driver (fabric manager, NSCQ, NVLSM, IMEX) to the
driver version's tree in the transaction that switches the modules — with the old driver out of the kernel,
before the new one loads and its daemons start from `current/bin` — and put the replaced one back on a rollback.
NSCQ never fails a run: a package of it the repositories turn out not to have is a warning (driverd.apply.
companions: what CUDA does not need never blocks)."""
from __future__ import annotations

import os

from driverd.apply.step import StepImpl
from driverd.errors import PackageError


def _places(ctx, component: str):
    from driverd.driver.companions import CompanionPlaces
    return CompanionPlaces.from_config(ctx.config, component)


def _config_done(ctx, places, tree) -> bool:
    if places.component != "fabricmanager":
        return True
    from driverd.apply.fmconfig import written_for
    return written_for(ctx.root, places, tree)


def _configured(ctx, places, res: dict) -> dict:
    """The fabric manager's configuration for the tree now current, with the operator's settings carried
    from the one in use (apply/fmconfig.py)."""
    if places.component != "fabricmanager":
        return res
    from driverd.apply import fmconfig
    from driverd.driver.companions import current, lookup
    new = current(ctx.root, places)
    if new is None or not new.intact:
        return res
    old = lookup(ctx.root, places, res["replaced"]) if res.get("replaced") else None
    path, carried = fmconfig.write(ctx.root, places, new, old)
    return {**res, "config": path, "carried": carried}


class InstallCompanion(StepImpl):
    """The driver version's companion: its installed tree (`installed`: found on disk by the planner: nothing
    is fetched), else its package from packages.repositories (driverd.repo.companion), checked while unpacked."""
    action = "install-companion"

    def check(self, ctx, params):
        from driverd.driver.companions import current
        places = _places(ctx, params["component"])
        cur = current(ctx.root, places)
        return cur is not None and cur.intact and cur.version == params["driver"] and \
            not ctx.root.lexists(places.pending) and _config_done(ctx, places, cur)

    def do(self, ctx, params):
        from driverd.install import companion as ci
        places = _places(ctx, params["component"])
        if params.get("installed"):
            return _configured(ctx, places, ci.restore(ctx.root, params["sha256"], ctx.runner, places=places).to_json())
        from driverd.repo.companion import fetch
        try:
            found = fetch(ctx.root, ctx.config, params["component"], params["driver"],
                          params.get("arch") or os.uname().machine, runner=ctx.runner)
        except PackageError as e:
            from driverd.apply.companions import KINDS
            kind = KINDS.get(params["component"])
            if kind is None or kind.daemon:
                raise
            ctx.warn(f"the {params['driver']} {kind.title} is not installed: {e.one_line()} ({kind.refuses}; CUDA "
                     "does not need it)")
            return {"skipped": e.one_line()}
        rep = ci.install(ctx.root, found.package, ctx.runner, places=places, driver=params["driver"],
                         expected_sha256=found.sha256)
        return _configured(ctx, places, {**rep.to_json(), "source": found.source})

    def undo(self, ctx, params, entry):
        res = entry.get("result") or {}
        if entry["status"] != "done" or "replaced" not in res:
            return []
        return [{"action": "restore-companion", "params": {"component": params["component"], "sha256": res["replaced"]},
                 "reason": f"undo install-companion: the {params['component']} it replaced"}]

    def describe(self, params):
        return f"switch the driver's {params.get('component')} to {params.get('driver')}"


class RestoreCompanion(StepImpl):
    """Make the component's `current` the package `sha256` again (None: none), from its installed trees."""
    action = "restore-companion"

    def check(self, ctx, params):
        from driverd.driver.companions import current, is_installed
        places = _places(ctx, params["component"])
        if not is_installed(ctx.root, places, params.get("sha256")):
            return False
        cur = current(ctx.root, places)
        return cur is None or _config_done(ctx, places, cur)

    def do(self, ctx, params):
        from driverd.install import companion as ci
        if params.get("sha256") is not None and not isinstance(params["sha256"], str):
            raise PackageError("restore-companion: sha256 is not a string", fix="report this journal")
        places = _places(ctx, params["component"])
        return _configured(ctx, places, ci.restore(ctx.root, params.get("sha256"), ctx.runner, places=places).to_json())

    def describe(self, params):
        sha = params.get("sha256")
        return f"restore the last-known-good {params.get('component')} ({sha[:12] if sha else 'none installed'})"
