"""The companions' steps (issue 46): switch a component of the driver (the fabric manager) to the driver
version's tree in the transaction that switches the modules — with the old driver out of the kernel, before
the new one loads and its daemons start from `current/bin` — and put the replaced one back on a rollback."""
from __future__ import annotations

import os

from driverd.apply.step import StepImpl
from driverd.errors import PackageError


def _places(ctx, component: str):
    from driverd.driver.companions import CompanionPlaces
    return CompanionPlaces.from_config(ctx.config, component)


class InstallCompanion(StepImpl):
    """The driver version's companion: its installed tree (`installed`: found on disk by the planner: nothing
    is fetched), else its package from packages.repositories (driverd.repo.companion), checked while unpacked."""
    action = "install-companion"

    def check(self, ctx, params):
        from driverd.driver.companions import current
        cur = current(ctx.root, _places(ctx, params["component"]))
        return cur is not None and cur.intact and cur.version == params["driver"] and \
            not ctx.root.lexists(_places(ctx, params["component"]).pending)

    def do(self, ctx, params):
        from driverd.install import companion as ci
        places = _places(ctx, params["component"])
        if params.get("installed"):
            return ci.restore(ctx.root, params["sha256"], ctx.runner, places=places).to_json()
        from driverd.repo.companion import fetch
        found = fetch(ctx.root, ctx.config, params["component"], params["driver"],
                      params.get("arch") or os.uname().machine, runner=ctx.runner)
        rep = ci.install(ctx.root, found.package, ctx.runner, places=places, driver=params["driver"],
                         expected_sha256=found.sha256)
        return {**rep.to_json(), "source": found.source}

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
        from driverd.driver.companions import is_installed
        return is_installed(ctx.root, _places(ctx, params["component"]), params.get("sha256"))

    def do(self, ctx, params):
        from driverd.install import companion as ci
        if params.get("sha256") is not None and not isinstance(params["sha256"], str):
            raise PackageError("restore-companion: sha256 is not a string", fix="report this journal")
        return ci.restore(ctx.root, params.get("sha256"), ctx.runner,
                          places=_places(ctx, params["component"])).to_json()

    def describe(self, params):
        sha = params.get("sha256")
        return f"restore the last-known-good {params.get('component')} ({sha[:12] if sha else 'none installed'})"
