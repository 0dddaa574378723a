"""The user-space half's steps: fetch its package, switch to it, put back a kept tree."""
from __future__ import annotations

import os

from driverd.apply.step import StepImpl
from driverd.apply.steps.common import places
from driverd.errors import PackageError


class FetchUserspace(StepImpl):
    """The user-space package of the driver version: userspace.package's, or fetched from the repositories'
    index into the download cache and checked against it (driverd.repo.userspace)."""
    action = "fetch-userspace"

    def check(self, ctx, params):
        return bool(params.get("package")) and os.path.isfile(params["package"])

    def do(self, ctx, params):
        from driverd.repo.userspace import fetch
        res = fetch(ctx.root, ctx.config, params["driver"], params.get("arch") or os.uname().machine, ctx.runner)
        return {"package": res.package, "sha256": res.sha256, "source": res.source}

    def describe(self, params):
        return f"fetch the {params.get('driver')} user-space package"


def _userspace_package(ctx, params) -> tuple[str | None, str | None]:
    """(package, sha256) an install-userspace step installs: its own parameters, else the run's fetch.
    A step of an installed tree (`installed`: the planner found it on disk) has no package: (None, sha256)."""
    if params.get("installed"):
        return None, params.get("sha256")
    if params.get("package"):
        return params["package"], params.get("sha256")
    res = next((s.get("result") for s in ctx.doc.get("steps", []) if s["action"] == "fetch-userspace"
                and s.get("result") and s["result"].get("package")), None)
    return (res["package"], res.get("sha256")) if res else (None, None)


class InstallUserspace(StepImpl):
    """Switch the driver's user-space (driverd.install.userspace) in the transaction that switches
    its modules, before the validation (whose workload check then runs with these libraries). The
    preimage is the snapshot's record of the user-space in use (lkg.userspace); undo puts back what the
    install replaced, and the rollback's convergence puts back the recorded one."""
    action = "install-userspace"

    def preflight(self, ctx, params):
        if params.get("package"):
            from driverd.package.archive import read_manifest
            from driverd.package.userspace import KIND
            m = read_manifest(params["package"], kind=KIND)
            if params.get("driver") and m.driver_version != params["driver"]:
                raise PackageError(f"{params['package']} is the {m.driver_version} user-space, the driver is "
                                   f"{params['driver']}", cause="the modules and the user-space of one driver must be "
                                   "the same version (NVML/RM version mismatch otherwise)",
                                   fix=f"give the {params['driver']} user-space package (driverd build-userspace)")

    def check(self, ctx, params):
        from driverd.package.archive import sha256_file
        from driverd.install.userspace import is_installed
        path, sha = _userspace_package(ctx, params)
        if params.get("installed"):
            return is_installed(ctx.root, sha, places(ctx))
        if not path or not os.path.isfile(path):
            return False
        return is_installed(ctx.root, sha or sha256_file(path), places(ctx))

    def do(self, ctx, params):
        from driverd.install.userspace import install, restore
        path, sha = _userspace_package(ctx, params)
        if params.get("installed"):
            # the tree is on disk (its package need not be): switched to, or made active again, from it
            return restore(ctx.root, sha, ctx.runner, places=places(ctx)).to_json()
        if not path:
            raise PackageError("no user-space package to install", cause="neither the step nor a fetch-userspace "
                               "step gave one", fix="set userspace.package or userspace.fetch")
        rep = install(ctx.root, path, ctx.runner, places=places(ctx), expected_sha256=sha)
        return rep.to_json()

    def undo(self, ctx, params, entry):
        if "userspace" in ((ctx.doc or {}).get("lkg") or {}):
            return []                     # the convergence restores the recorded one, in its place in the order
        res = entry.get("result") or {}
        if entry["status"] != "done" or "replaced" not in res:
            return []
        return [{"action": "restore-userspace", "params": {"sha256": res["replaced"]},
                 "reason": "undo install-userspace: the user-space it replaced"}]

    def describe(self, params):
        return "switch the driver's user-space" + (f" to {params['driver']}" if params.get("driver") else "")


class RestoreUserspace(StepImpl):
    """Make driverd's user-space in use the package `sha256` again (None: none), from the kept trees."""
    action = "restore-userspace"

    def check(self, ctx, params):
        from driverd.install.userspace import is_installed
        return is_installed(ctx.root, params.get("sha256"), places(ctx))

    def do(self, ctx, params):
        from driverd.install.userspace import put_previous_record, restore
        out = restore(ctx.root, params.get("sha256"), ctx.runner, places=places(ctx)).to_json()
        if "previous" in params:
            put_previous_record(ctx.root, params["previous"], places(ctx))
        return out

    def describe(self, params):
        sha = params.get("sha256")
        return f"restore the last-known-good user-space ({sha[:12] if sha else 'none installed'})"
