"""The kernel half's package steps: fetch (or build), verify, install, restore from the kept store, and
forget a kernel that is gone."""
from __future__ import annotations

import os

from driverd.apply.step import StepImpl
from driverd.apply.steps.common import package_path
from driverd.errors import PackageError


class FetchPackage(StepImpl):
    """Download (or build) the package into the cache; nothing outside the cache changes."""
    action = "fetch-package"

    def check(self, ctx, params):
        return bool(params.get("package")) and os.path.isfile(params["package"])

    def do(self, ctx, params):
        from driverd.build.obtain import fetch_configured
        from driverd.repo.fetch import Want
        want = Want(params["driver"], params["flavor"], params["kernel"], params.get("arch") or "x86_64")
        res = fetch_configured(ctx.root, ctx.config, want, params.get("repositories") or None, runner=ctx.runner,
                               allow_build=params.get("allow_build", True))
        ctx.doc["package"] = str(res.package)
        return {"package": str(res.package), "sha256": res.sha256}

    def describe(self, params):
        return f"fetch package {params.get('driver')} ({params.get('flavor')}) for {params.get('kernel')}"


def _expected_sha(ctx, params) -> str | None:
    return params.get("sha256") or next((s.get("result", {}).get("sha256") for s in ctx.doc.get("steps", [])
                                         if s["action"] == "fetch-package" and s.get("result")), None)


class VerifyPackage(StepImpl):
    action = "verify-package"

    def do(self, ctx, params):
        from driverd.package.archive import verify_package
        m = verify_package(package_path(ctx, params), _expected_sha(ctx, params))
        return {"driver": m.driver_version, "flavor": m.flavor, "kernel": m.kernel_release}

    def describe(self, params):
        return f"verify package {os.path.basename(params.get('package') or '(fetched)')}"


def _release(ctx, params) -> str:
    return params.get("kernel_release") or ctx.kernel.release


class InstallPackage(StepImpl):
    action = "install-package"

    def preflight(self, ctx, params):
        if params.get("package"):        # a fetched package is checked when the fetch has run
            from driverd.install.modules import preflight
            preflight(ctx.root, params["package"], ctx.runner, kernel=params.get("kernel_release"),
                      enforce=params.get("enforce"), trusted_certs=ctx.config["signing.trusted_certs"])

    def check(self, ctx, params):
        from driverd.package.archive import sha256_file
        from driverd.driver.modules import is_installed
        try:
            path = package_path(ctx, params)
        except PackageError:            # not fetched yet: a run is needed
            return False
        return os.path.isfile(path) and is_installed(ctx.root, _release(ctx, params), sha256_file(path),
                                                     ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.modules import install
        rep = install(ctx.root, package_path(ctx, params), ctx.runner, kernel=params.get("kernel_release"),
                      enforce=params.get("enforce"), state_dir=ctx.config["state.dir"],
                      expected_sha256=_expected_sha(ctx, params), trusted_certs=ctx.config["signing.trusted_certs"],
                      kernel_tools=ctx.kernel)
        return rep.to_json()

    def describe(self, params):
        return f"install package {os.path.basename(params.get('package') or '(fetched)')}"


class RestorePackage(StepImpl):
    """Make the installed package the given one (sha256; null: none) again, from the kept store."""
    action = "restore-package"

    def check(self, ctx, params):
        from driverd.driver.modules import is_installed
        return is_installed(ctx.root, _release(ctx, params), params.get("sha256"), ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.modules import restore
        from driverd.install.modules import installed_sha256, put_previous_record
        from driverd.install.kept import forget, kept_hostdir
        release, state_dir = _release(ctx, params), ctx.config["state.dir"]
        # a rollback takes away the package its run installed: that package failed on this host, so it is
        # not kept as a way back (the planner restores a kept package of the wanted version instead of
        # fetching it: a retry would install the same failure again, not the repository's fixed build)
        failed = installed_sha256(ctx.root, release) if (getattr(ctx, "doc", None) or {}).get("state") == \
            "rolling-back" else None
        out = restore(ctx.root, release, params.get("sha256"), ctx.runner,
                      state_dir=state_dir, kernel_tools=ctx.kernel).to_json()
        if "previous" in params:
            put_previous_record(ctx.root, release, params["previous"], state_dir)
        if failed and failed != params.get("sha256"):
            try:
                forget(ctx.root, state_dir, failed)
            except OSError as e:       # a clean-up: it never fails the rollback that restored the driver
                ctx.log(f"  could not drop the failed package {failed[:12]} from the kept store: {e.strerror}; "
                        f"a retry may install it again from there (fix: remove {kept_hostdir(state_dir)}/{failed})")
        return out

    def describe(self, params):
        sha = params.get("sha256")
        return f"restore the last-known-good package ({sha[:12] if sha else 'none installed'})"


class RestorePreviousPackage(StepImpl):
    """driverd rollback / rollback-install with no pending run: the installation the last install
    replaced comes back."""
    action = "restore-previous-package"

    def check(self, ctx, params):
        from driverd.driver.modules import is_installed
        return is_installed(ctx.root, _release(ctx, params), params.get("target_sha256"), ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.modules import restore
        return restore(ctx.root, _release(ctx, params), params.get("target_sha256"), ctx.runner,
                       state_dir=ctx.config["state.dir"], kernel_tools=ctx.kernel).to_json()

    def describe(self, params):
        sha = params.get("target_sha256")
        return f"put back the previous installation ({sha[:12] if sha else 'none'})"


class ForgetKernel(StepImpl):
    """After a reboot into a newer kernel: what driverd kept for a kernel that is no longer installed (its
    tree left under /lib/modules, its previous record, its kept packages) is removed — nothing can load it."""
    action = "forget-kernel"

    def check(self, ctx, params):
        from driverd.install.leftovers import release_leftovers
        return not release_leftovers(ctx.root, params["kernel_release"], ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.leftovers import forget_release
        return {"removed": forget_release(ctx.root, params["kernel_release"], ctx.config["state.dir"])}

    def describe(self, params):
        return f"remove driverd's packages of kernel {params.get('kernel_release')} (no longer installed)"
