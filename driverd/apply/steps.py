"""Step implementations, registered by action name (the names driverd.plan emits, plus the ones a
reload or rollback needs). Each step is idempotent: check() says whether its effect is in place."""
from __future__ import annotations

import json
import os

from driverd.apply.executor import StepContext, StepImpl, register
from driverd.errors import ModuleError, PackageError, PlanError
from driverd.kmod import daemons as dmn
from driverd.kmod import load as ld
from driverd.kmod import mig, nouveau
from driverd.kmod import unload as ul
from driverd.kmod.holders import NVIDIA_FAMILY


def _identity(ctx) -> dict | None:
    ident = ld.installed_identity(ctx.kernel)
    return None if ident is None else {"version": ident[0], "flavor": ident[1], "sha256": ident[2]}


def _loaded_identity(ctx) -> dict | None:
    from driverd.host.modules import parse_nvidia_version
    ver, flav, _ = parse_nvidia_version(ctx.root.read_text("/proc/driver/nvidia/version"))
    return None if ver is None else {"version": ver, "flavor": flav}


def _nics_switches(ctx) -> tuple[int, int]:
    from driverd.host import pci
    _, sw, nics = pci.classify(ctx.root, pci.scan(ctx.root, []), [])
    return len(nics), len(sw)


@register
class Snapshot(StepImpl):
    """Record the last-known-good state before anything changes: the loaded driver, its modules and
    parameters, the installed package, running daemons, MIG layout, the kernel-log position."""
    action = "snapshot"

    def check(self, ctx, params):
        return "lkg" in ctx.doc

    def do(self, ctx, params):
        mods = ctx.kernel.modules()
        loaded = _loaded_identity(ctx)
        family = [m for m in reversed(NVIDIA_FAMILY) if m in mods]
        lkg = {"loaded": loaded, "modules": family,
               "parameters": {m: p for m, p in ctx.config["modules.parameters"].items() if m in family},
               "installed": _identity(ctx),
               "daemons": [d for d in (dmn.PERSISTENCED, dmn.FABRICMANAGER) if ctx.services.running(d)],
               "mig": mig.record(ctx.kernel) if loaded else None}
        ctx.doc["lkg"] = lkg
        ctx.doc["log_mark"] = ctx.kernel.log_mark()
        return {"lkg": lkg}

    def describe(self, params):
        return "record the last-known-good state"


@register
class BlacklistNouveau(StepImpl):
    action = "blacklist-nouveau"

    def check(self, ctx, params):
        p = ctx.root.path(nouveau.BLACKLIST_PATH)
        return p.is_file() and p.read_text() == nouveau.BLACKLIST_TEXT

    def do(self, ctx, params):
        existed = ctx.root.path(nouveau.BLACKLIST_PATH).exists()
        nouveau.write_blacklist(ctx.root)
        from driverd.host.osrelease import read_os
        os_ = read_os(ctx.root, [])
        ird = nouveau.initramfs_report(ctx.root, os_.id, os_.id_like, ctx.kernel.release)
        if ird.get("regenerate"):
            ctx.warn(f"the initramfs {ird['image']} carries nouveau: regenerate it so the blacklist applies at "
                     f"boot: {' '.join(ird['regenerate'])}")
        return {"written": not existed, "initramfs": ird}

    def undo(self, ctx, params, result):
        return [{"action": "unblacklist-nouveau"}] if result and result.get("written") else []

    def describe(self, params):
        return f"blacklist nouveau ({nouveau.BLACKLIST_PATH})"


@register
class UnblacklistNouveau(StepImpl):
    action = "unblacklist-nouveau"

    def check(self, ctx, params):
        return not ctx.root.path(nouveau.BLACKLIST_PATH).exists()

    def do(self, ctx, params):
        nouveau.remove_blacklist(ctx.root)


@register
class UnloadNouveau(StepImpl):
    action = "unload-nouveau"

    def check(self, ctx, params):
        return not ctx.kernel.is_loaded("nouveau")

    def do(self, ctx, params):
        res = nouveau.unload(ctx.kernel)
        if res.reboot_required:
            raise ModuleError("nouveau cannot be unloaded: reboot_required", cause=res.reason,
                              fix="reboot; the blacklist keeps nouveau out at boot")
        return res.to_json()


@register
class FetchPackage(StepImpl):
    action = "fetch-package"

    def check(self, ctx, params):
        return bool(params.get("package")) and os.path.isfile(params["package"])

    def do(self, ctx, params):
        from driverd.apply.packages_api import fetch
        path = fetch(ctx, params)
        ctx.doc["package"] = path
        return {"package": path}

    def describe(self, params):
        return f"fetch package {params.get('driver')} ({params.get('flavor')}) for {params.get('kernel')}"


def _package(ctx, params) -> str:
    path = params.get("package") or ctx.doc.get("package") or next(
        (s.get("result", {}).get("package") for s in ctx.doc.get("steps", []) if s["action"] == "fetch-package"
         and s.get("result")), None)
    if not path:
        raise PackageError("no package to install", cause="neither --package nor a fetch step provided one",
                           fix="pass --package FILE or configure packages.repositories")
    return path


@register
class VerifyPackage(StepImpl):
    action = "verify-package"

    def do(self, ctx, params):
        from driverd.packages.archive import verify_package
        m = verify_package(_package(ctx, params))
        return {"driver": m.driver_version, "flavor": m.flavor, "kernel": m.kernel_release}

    def describe(self, params):
        return f"verify package {os.path.basename(params.get('package') or '(fetched)')}"


@register
class InstallPackage(StepImpl):
    action = "install-package"
    touches_driver = True

    def check(self, ctx, params):
        from driverd.packages.archive import sha256_file
        ident = _identity(ctx)
        path = _package(ctx, params)
        return ident is not None and os.path.isfile(path) and ident["sha256"] == sha256_file(path)

    def do(self, ctx, params):
        from driverd.packages.install import install
        rep = install(ctx.root, _package(ctx, params), ctx.runner, kernel=ctx.kernel.release,
                      state_dir=ctx.config["state.dir"])
        return {"driver": rep.driver_version, "flavor": rep.flavor, "sha256": rep.sha256,
                "resolves": rep.resolves}

    def describe(self, params):
        return f"install package {os.path.basename(params.get('package') or '(fetched)')}"


@register
class RestorePackage(StepImpl):
    """Make the installed package the given one (sha256) again, through the kept previous install."""
    action = "restore-package"
    touches_driver = True

    def check(self, ctx, params):
        ident = _identity(ctx)
        return (ident["sha256"] if ident else None) == params.get("sha256")

    def do(self, ctx, params):
        from driverd.packages.install import previous_dir, rollback_install
        prev = previous_dir(ctx.root, ctx.kernel.release, ctx.config["state.dir"])
        try:
            state = json.loads((prev / "state.json").read_text())
        except (OSError, ValueError):
            state = None
        if state is None or state.get("package_sha256") != params.get("sha256"):
            raise PackageError("the last-known-good package is not kept any more",
                               cause=f"{prev} holds {state and state.get('package_sha256')}, wanted {params.get('sha256')}",
                               fix="install the wanted package with driverd install, then driverd load")
        rep = rollback_install(ctx.root, ctx.kernel.release, ctx.runner, state_dir=ctx.config["state.dir"])
        return {"driver": rep.driver_version, "flavor": rep.flavor}

    def describe(self, params):
        return f"restore the last-known-good package ({(params.get('sha256') or 'none')[:12]})"


@register
class RestorePreviousPackage(StepImpl):
    """driverd rollback with no pending run: switch to the kept previous installation, once."""
    action = "restore-previous-package"
    touches_driver = True

    def check(self, ctx, params):
        ident = _identity(ctx)
        return (ident["sha256"] if ident else None) == params.get("target_sha256")

    def do(self, ctx, params):
        from driverd.packages.install import rollback_install
        rep = rollback_install(ctx.root, ctx.kernel.release, ctx.runner, state_dir=ctx.config["state.dir"])
        return {"driver": rep.driver_version, "flavor": rep.flavor}


def _daemons(ctx, params) -> list[str]:
    d = params.get("daemons")
    if d == "all" or d is None and params.get("all"):
        return [dmn.PERSISTENCED, dmn.FABRICMANAGER]
    if d is None:
        return dmn.wanted_daemons(ctx.config, _nics_switches(ctx)[1])
    return list(d)


@register
class StopDaemons(StepImpl):
    action = "stop-gpu-daemons"
    touches_driver = True

    def check(self, ctx, params):
        return not any(ctx.services.running(d) for d in _daemons(ctx, {"daemons": "all", **params}))

    def do(self, ctx, params):
        stopped = [d for d in _daemons(ctx, {"daemons": "all", **params}) if ctx.services.running(d)]
        for d in stopped:
            ctx.services.stop(d)
        return {"stopped": stopped}

    def describe(self, params):
        return "stop GPU daemons"


@register
class StartDaemons(StepImpl):
    action = "start-gpu-daemons"
    touches_driver = True

    def check(self, ctx, params):
        return all(ctx.services.running(d) for d in _daemons(ctx, params))

    def do(self, ctx, params):
        started = []
        for d in _daemons(ctx, params):
            if not ctx.services.running(d):
                ctx.services.start(d)
                started.append(d)
            if d == dmn.FABRICMANAGER:
                ctx.services.wait_ready(d)
        return {"started": started}

    def describe(self, params):
        return "start GPU daemons (" + ", ".join(params.get("daemons") or ["as configured"]) + ")"


class _StartOneDaemon(StartDaemons):
    """The plan's per-daemon steps: start-gpu-daemons restricted to `daemon`."""
    daemon = ""

    def check(self, ctx, params):
        return ctx.services.running(self.daemon)

    def do(self, ctx, params):
        return super().do(ctx, {"daemons": [self.daemon]})

    def describe(self, params):
        return f"start {self.daemon}"


@register
class StartPersistenced(_StartOneDaemon):
    action = "start-persistenced"
    daemon = dmn.PERSISTENCED


@register
class StartFabricManager(_StartOneDaemon):
    action = "start-fabricmanager"
    daemon = dmn.FABRICMANAGER


@register
class UnloadModules(StepImpl):
    action = "unload-modules"
    touches_driver = True

    def check(self, ctx, params):
        mods = ctx.kernel.modules()
        return not any(m in mods for m in NVIDIA_FAMILY)

    def do(self, ctx, params):
        policy = params.get("policy") or ctx.config["modules.unload_policy"]
        rep = ul.unload(ctx.kernel, policy, float(ctx.config["modules.terminate_grace_s"]))
        return rep.to_json()

    def describe(self, params):
        return "unload the NVIDIA modules"


def _expect(ctx, params) -> tuple[str, str] | None:
    if params.get("expect"):
        return tuple(params["expect"])
    ident = _identity(ctx)
    return (ident["version"], ident["flavor"]) if ident else None


def _modules(ctx, params) -> list[str]:
    return list(params.get("modules") or ld.wanted_modules(ctx.config, _nics_switches(ctx)[0]))


def _params(ctx, params, mods) -> dict:
    p = params.get("parameters")
    if p is None:
        p = {m: v for m, v in ctx.config["modules.parameters"].items()}
    return p


@register
class LoadModules(StepImpl):
    action = "load-modules"
    touches_driver = True

    def check(self, ctx, params):
        expect = _expect(ctx, params)
        loaded = ctx.kernel.modules()
        ident = _loaded_identity(ctx)
        from driverd.kmod.devnodes import wanted_nodes
        nodes_ok = all(ctx.root.path(p).exists() for p, _, _ in wanted_nodes(ctx.root, set(loaded)))
        return (expect is not None and ident is not None and (ident["version"], ident["flavor"]) == expect
                and all(m in loaded for m in _modules(ctx, params)) and nodes_ok)

    def do(self, ctx, params):
        expect = _expect(ctx, params)
        if expect is None:
            raise ModuleError("no driver package is installed for this kernel",
                              cause=f"/lib/modules/{ctx.kernel.release}/updates/driverd/manifest.json is missing",
                              fix="driverd install PACKAGE (or driverd apply)")
        mods = _modules(ctx, params)
        rep = ld.load(ctx.kernel, mods, _params(ctx, params, mods), expect)
        return rep.to_json()

    def describe(self, params):
        e = params.get("expect")
        return "load the NVIDIA modules" + (f" ({e[0]} {e[1]})" if e else "")


@register
class RestoreMig(StepImpl):
    action = "restore-mig"

    def do(self, ctx, params):
        recorded = (ctx.doc.get("lkg") or {}).get("mig")
        res = mig.restore(ctx.kernel, recorded)
        for m in res.must_reapply:
            ctx.warn(f"MIG must be re-applied: {m}")
        return res.to_json()

    def describe(self, params):
        return "restore the MIG layout recorded before the reload"


@register
class Validate(StepImpl):
    action = "validate"

    def do(self, ctx, params):
        expect = _expect(ctx, params) or (None, None)
        v = ld.validate(ctx.kernel, expect[0], expect[1], ctx.services, ctx.config["daemons.persistenced"]
                        and params.get("persistence", True), _modules(ctx, params))
        if not v.ok:
            from driverd.kmod.kernel import NVRM_RE
            words = [ln for ln in ctx.kernel.log_since(ctx.doc.get("log_mark", 0)) if NVRM_RE.search(ln)][-6:]
            raise ModuleError("validation failed: " + "; ".join(v.problems),
                              cause="kernel log: " + (" | ".join(words) if words else "(no NVRM lines)"),
                              fix="see the problems above; driverd rolls back to the last-known-good driver",
                              details={"validation": v.to_json(), "kernel_log": words})
        return v.to_json()

    def describe(self, params):
        e = params.get("expect")
        return "validate the driver" + (f" ({e[0]} {e[1]})" if e else "")


@register
class ConfigureRuntime(StepImpl):
    """Add the handler to one container runtime (driverd.runtime); idempotent by construction: a
    second run writes and restarts nothing."""
    action = "configure-runtime"

    def do(self, ctx, params):
        from driverd.runtime import Options, configure
        opts = Options.from_config(ctx.config, handler=params.get("handler"), dry_run=ctx.runner.dry_run)
        return configure(ctx.root, params["runtime"], opts, ctx.runner).to_json()

    def undo(self, ctx, params, result):
        if not result or not result.get("files_changed"):
            return []
        return [{"action": "revert-runtime", "params": {"runtime": params["runtime"], "handler": params.get("handler")}}]

    def describe(self, params):
        return f"configure {params.get('runtime')} handler {params.get('handler')}"


@register
class RevertRuntime(StepImpl):
    action = "revert-runtime"

    def do(self, ctx, params):
        from driverd.runtime import Options, revert
        opts = Options.from_config(ctx.config, handler=params.get("handler"), dry_run=ctx.runner.dry_run)
        return revert(ctx.root, params["runtime"], opts, ctx.runner).to_json()

    def describe(self, params):
        return f"revert driverd's {params.get('runtime')} handler"


def restore_lkg_steps(lkg: dict | None, ctx: StepContext) -> list[dict]:
    """Converge to the last-known-good driver: stop daemons, unload whatever is loaded, put the
    LKG package back, load it with its parameters, re-create MIG, restart its daemons, validate."""
    steps = [{"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
             {"action": "unload-modules", "params": {}}]
    if not lkg:
        return steps
    inst = lkg.get("installed")
    if inst:
        steps.append({"action": "restore-package", "params": {"sha256": inst["sha256"]}})
    loaded = lkg.get("loaded")
    if loaded:
        expect = [loaded["version"], loaded["flavor"]]
        steps += [{"action": "load-modules", "params": {"modules": lkg["modules"], "parameters": lkg["parameters"],
                                                        "expect": expect}},
                  {"action": "restore-mig", "params": {}},
                  {"action": "start-gpu-daemons", "params": {"daemons": lkg["daemons"]}},
                  {"action": "validate", "params": {"expect": expect, "modules": lkg["modules"],
                                                    "persistence": dmn.PERSISTENCED in lkg["daemons"]}}]
    return steps
