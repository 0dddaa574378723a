"""Step implementations, by action name (the names driverd.plan emits, plus the ones the lifecycle
commands and rollbacks need). Each step is idempotent: check() says whether its effect is in place.
`REGISTRY` is the explicit list the executor is given; nothing registers itself on import."""
from __future__ import annotations

import json
import os
import tempfile
import time

from driverd.apply.executor import unb64
from driverd.apply.step import MODULES, PACKAGE, USERSPACE, Registry, StepContext, StepImpl
from driverd.driver import state as driver_state
from driverd.driver.state import DriverState
from driverd.errors import ModuleError, PackageError
from driverd.kmod import daemons as dmn
from driverd.kmod import load as ld
from driverd.kmod import mig, nouveau
from driverd.kmod import unload as ul
from driverd.kmod.holders import NVIDIA_FAMILY

REBOOT_RECORD = "reboot-required.json"          # under state.dir
REBOOT_SENTINEL = "/var/run/reboot-required"     # what kured and Ubuntu's update-notifier watch
REBOOT_PKGS = "/var/run/reboot-required.pkgs"


def installed(ctx) -> dict | None:
    """The driverd package installed for the running kernel: version, flavour, sha256."""
    got = DriverState.of(ctx).installed()
    return None if got is None else {**got.driver.as_dict(), "sha256": got.package_sha256}


def loaded(ctx) -> dict | None:
    got = DriverState.of(ctx).loaded()
    return None if got is None else got.as_dict()


def pci_view(ctx) -> tuple:
    """(GPUs, NVSwitches, NICs) on the PCI bus, read once per transaction (StepContext.memo): the steps'
    decisions of one transaction see the same devices (a reload read them five times). The validation
    reads the bus again: it proves the driver on the host as it is."""
    got = ctx.memo.get("pci")
    if got is None:
        from driverd.host import pci
        got = ctx.memo["pci"] = pci.classify(ctx.root, pci.scan(ctx.root, []), [])
    return got


def _nics_switches(ctx) -> tuple[int, int]:
    _, sw, nics = pci_view(ctx)
    return len(nics), len(sw)


def running_parameters(ctx, modules: list[str]) -> dict[str, dict[str, str]]:
    """The parameters the running modules were loaded with, as a reload passes them again (the values
    driver.state.running_parameters reads, which the daemon's drift check reads too)."""
    return driver_state.settable(driver_state.running_parameters(ctx.kernel, modules))


def _restore_files_steps(entry: dict, restart: list[str] | None = None, reason: str = "") -> list[dict]:
    before = entry.get("before")
    if not before:
        return []
    return [{"action": "restore-files", "params": {"files": before, "restart": restart or []},
             "reason": reason or f"undo {entry['action']}: put back the files as they were before it"}]


def previous_records(ctx) -> dict:
    """What `driverd rollback` would go back to now (the kernel package's and the user-space's previous
    records): a failed run's rollback puts them back, so its failed package never becomes "previous"."""
    from driverd.driver.userspace import previous_record
    from driverd.install import modules as pi
    return {"package": pi.previous_record(ctx.root, ctx.kernel.release, ctx.config["state.dir"]),
            "userspace": previous_record(ctx.root, places(ctx))}


class Snapshot(StepImpl):
    """Record the last-known-good state before anything changes: the loaded driver, its modules and
    the parameters they are running with, the installed package, running daemons, MIG layout, the
    kernel-log position."""
    action = "snapshot"

    def check(self, ctx, params):
        return "lkg" in ctx.doc

    def do(self, ctx, params):
        mods = ctx.kernel.loaded_names()
        now = loaded(ctx)
        family = [m for m in reversed(NVIDIA_FAMILY) if m in mods]
        lkg = {"loaded": now, "modules": family, "parameters": running_parameters(ctx, family),
               "installed": installed(ctx),
               "daemons": [d for d in (dmn.PERSISTENCED, dmn.FABRICMANAGER) if ctx.services.running(d)],
               "mig": mig.record(ctx.kernel) if now else None,
               "userspace": userspace_now(ctx), "previous": previous_records(ctx)}
        ctx.doc["lkg"] = lkg
        ctx.doc["log_mark"] = ctx.kernel.log_mark()
        return {"lkg": lkg}

    def describe(self, params):
        return "record the last-known-good state"


class BlacklistNouveau(StepImpl):
    action = "blacklist-nouveau"

    def check(self, ctx, params):
        return ctx.root.read_text(nouveau.BLACKLIST_PATH) == nouveau.BLACKLIST_TEXT

    def preimage(self, ctx, params):
        return [nouveau.BLACKLIST_PATH]

    def do(self, ctx, params):
        nouveau.write_blacklist(ctx.root)
        from driverd.host.osrelease import read_os
        os_ = read_os(ctx.root, [])
        ird = nouveau.initramfs_report(ctx.root, os_.id, os_.id_like, ctx.kernel.release)
        if ird.get("regenerate"):
            ctx.warn(f"the initramfs {ird['image']} carries nouveau: regenerate it so the blacklist applies at "
                     f"boot: {' '.join(ird['regenerate'])}")
        return {"initramfs": ird}

    def undo(self, ctx, params, entry):
        return _restore_files_steps(entry)

    def describe(self, params):
        return f"blacklist nouveau ({nouveau.BLACKLIST_PATH})"


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


def package_path(ctx, params) -> str:
    """The package a step works on: its own parameter, else what the run's fetch step produced."""
    path = params.get("package") or ctx.doc.get("package") or next(
        (s.get("result", {}).get("package") for s in ctx.doc.get("steps", []) if s["action"] == "fetch-package"
         and s.get("result")), None)
    if not path:
        raise PackageError("no package to install", cause="neither --package nor a fetch step provided one",
                           fix="pass --package FILE or configure packages.repositories")
    return path


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
        from driverd.install.modules import is_installed
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
        from driverd.install.modules import is_installed
        return is_installed(ctx.root, _release(ctx, params), params.get("sha256"), ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.modules import installed_sha256, put_previous_record, restore
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
        from driverd.install.modules import is_installed
        return is_installed(ctx.root, _release(ctx, params), params.get("target_sha256"), ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.modules import restore
        return restore(ctx.root, _release(ctx, params), params.get("target_sha256"), ctx.runner,
                       state_dir=ctx.config["state.dir"], kernel_tools=ctx.kernel).to_json()

    def describe(self, params):
        sha = params.get("target_sha256")
        return f"put back the previous installation ({sha[:12] if sha else 'none'})"


def places(ctx):
    from driverd.driver.layout import Places
    return Places.from_config(ctx.config)


def userspace_now(ctx) -> dict:
    """driverd's user-space in use (userspace.root/current): its package's sha256 (None: none) and version."""
    cur = DriverState.of(ctx).userspace()
    ok = cur is not None and cur.intact
    return {"sha256": cur.sha if ok else None, "version": cur.version if ok else None}


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


class ForgetKernel(StepImpl):
    """After a reboot into a newer kernel: what driverd kept for a kernel that is no longer installed (its
    tree left under /lib/modules, its previous record, its kept packages) is removed — nothing can load it."""
    action = "forget-kernel"

    def check(self, ctx, params):
        from driverd.install.modules import release_leftovers
        return not release_leftovers(ctx.root, params["kernel_release"], ctx.config["state.dir"])

    def do(self, ctx, params):
        from driverd.install.modules import forget_release
        return {"removed": forget_release(ctx.root, params["kernel_release"], ctx.config["state.dir"])}

    def describe(self, params):
        return f"remove driverd's packages of kernel {params.get('kernel_release')} (no longer installed)"


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


def _daemons(ctx, params) -> list[str]:
    d = params.get("daemons")
    if d == "all" or d is None and params.get("all"):
        return [dmn.PERSISTENCED, dmn.FABRICMANAGER]
    if d is None:
        return dmn.wanted_daemons(ctx.config, _nics_switches(ctx)[1])
    return list(d)


class StopDaemons(StepImpl):
    action = "stop-gpu-daemons"

    def check(self, ctx, params):
        return not any(ctx.services.running(d) for d in _daemons(ctx, {"daemons": "all", **params}))

    def do(self, ctx, params):
        stopped = [d for d in _daemons(ctx, {"daemons": "all", **params}) if ctx.services.running(d)]
        for d in stopped:
            ctx.services.stop(d)
        return {"stopped": stopped}

    def describe(self, params):
        return "stop GPU daemons"


class StartDaemons(StepImpl):
    action = "start-gpu-daemons"

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
        d = params.get("daemons")
        return "start GPU daemons (" + (", ".join(d) if isinstance(d, list) else "as configured") + ")"


class _StartOneDaemon(StartDaemons):
    """The plan's per-daemon steps: start-gpu-daemons restricted to `daemon`."""
    daemon = ""

    def check(self, ctx, params):
        return ctx.services.running(self.daemon)

    def do(self, ctx, params):
        return super().do(ctx, {"daemons": [self.daemon]})

    def describe(self, params):
        return f"start {self.daemon}"


class StartPersistenced(_StartOneDaemon):
    action = "start-persistenced"
    daemon = dmn.PERSISTENCED


class StartFabricManager(_StartOneDaemon):
    action = "start-fabricmanager"
    daemon = dmn.FABRICMANAGER


class UnloadModules(StepImpl):
    action = "unload-modules"

    def check(self, ctx, params):
        mods = ctx.kernel.loaded_names()
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
    ident = installed(ctx)
    return (ident["version"], ident["flavor"]) if ident else None


def _modules(ctx, params) -> list[str]:
    """The plan's module list, or (load, reload, a validation without a plan) the planner's decision
    for this host now: the NVIDIA modules running before this transaction (the snapshot) or now."""
    if params.get("modules"):
        return list(params["modules"])
    from driverd.host import modules as host_modules
    from driverd.host import rdma
    from driverd.plan import Desired
    from driverd.plan.planner import MODULE_ORDER, decide_modules, display_gpus
    was = set(((ctx.doc or {}).get("lkg") or {}).get("modules") or ())
    loaded = host_modules.loaded_modules(ctx.root)
    running = frozenset(m for m in MODULE_ORDER if m in was or m in loaded) if (was or "nvidia" in loaded) else frozenset()
    gpus, _, nics = pci_view(ctx)
    release = ctx.kernel.release
    ident = installed(ctx)
    facts = rdma.read_rdma(ctx.root, release, loaded) if nics else None
    return decide_modules(Desired.from_config(ctx.config), running, display_gpus(gpus), len(nics), facts,
                          ident["flavor"] if ident else None, release).modules


def _params(ctx, params) -> dict:
    p = params.get("parameters")
    return dict(ctx.config["modules.parameters"]) if p is None else p


class CheckParameters(StepImpl):
    """Module parameters are checked against the module files that will be loaded (names and value
    types, as modinfo -p declares them) while the running driver is still in place: a bad value
    must never be found after the unload."""
    action = "check-parameters"

    def do(self, ctx, params):
        mods = _modules(ctx, params)
        infos = None
        if params.get("package"):
            infos = _package_modinfo(package_path(ctx, params))
        order = [m for m in mods]
        checked = ld.validate_parameters(ctx.kernel, order, _params(ctx, params), infos)
        return {"parameters": checked}

    def describe(self, params):
        return "check module parameters against the modules to be loaded"


class CheckSigners(StepImpl):
    """The signer preflight, while the running driver is still in place: every module's signature
    (read from the package's files, or the installed ones) against the kernel's trusted keyrings and
    signing.trusted_certs. A signer the kernel would refuse fails the run here, not after the unload."""
    action = "check-signers"

    def do(self, ctx, params):
        from driverd.host.kernel import read_kernel
        from driverd.host.keyrings import read_keyrings
        from driverd.build import signers
        from driverd.install.modules import modules_dir
        try:
            pkg = package_path(ctx, params)
        except PackageError:
            pkg = None
        if pkg:
            sigs, source = signers.package_signatures(pkg), f"package {os.path.basename(pkg)}"
        else:
            d = modules_dir(ctx.root, ctx.kernel.release)
            sigs, source = signers.tree_signatures(d), f"installed {d}"
        enforced = read_kernel(ctx.root, []).module_signature_enforced
        v = signers.check(ctx.root, read_keyrings(ctx.root), sigs, ctx.config, enforced=enforced, source=source)
        if v.blocks:
            raise PackageError(f"the kernel would refuse these modules: {v.summary}",
                               cause="the kernel enforces module signatures",
                               fix=v.enrol or "sign the modules with a key in the kernel's trusted keyrings")
        return v.to_json()

    def describe(self, params):
        return "check the modules' signers against the kernel's trusted keyrings"


def _package_modinfo(package: str) -> dict:
    """ModInfo of every module in a package, read from its files (nothing is installed)."""
    from driverd.modinfo import read_modinfo
    from driverd.package.archive import unpack
    from driverd.package.manifest import MODULES_DIR
    with tempfile.TemporaryDirectory(prefix="driverd-modinfo-") as tmp:
        unpack(package, os.path.join(tmp, "pkg"))
        d = os.path.join(tmp, "pkg", MODULES_DIR)
        infos = {}
        for n in sorted(os.listdir(d)):
            if ".ko" in n:
                info = read_modinfo(os.path.join(d, n))
                infos[info.name or n.split(".ko")[0]] = info
        return infos


class LoadModules(StepImpl):
    action = "load-modules"

    def check(self, ctx, params):
        expect = _expect(ctx, params)
        mods = ctx.kernel.loaded_names()
        ident = loaded(ctx)
        from driverd.kmod.devnodes import wanted_nodes
        nodes_ok = all(ctx.root.path(p).exists() for p, _, _ in wanted_nodes(ctx.root, set(mods)))
        return (expect is not None and ident is not None and (ident["version"], ident["flavor"]) == expect
                and all(m in mods for m in _modules(ctx, params)) and nodes_ok)

    def do(self, ctx, params):
        expect = _expect(ctx, params)
        if expect is None:
            raise ModuleError("no driver package is installed for this kernel",
                              cause=f"/lib/modules/{ctx.kernel.release}/updates/driverd/manifest.json is missing",
                              fix="driverd install PACKAGE (or driverd apply)")
        rep = ld.load(ctx.kernel, _modules(ctx, params), _params(ctx, params), expect)
        return rep.to_json()

    def describe(self, params):
        e = params.get("expect")
        return "load the NVIDIA modules" + (f" ({e[0]} {e[1]})" if e else "")


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


def workload_options(ctx, params) -> dict | None:
    """The workload check's options for this validation, None when it does not run: validation.workload
    off (or auto on anything but the real kernel's live host: apply.hostplan.workload_applies), the
    daemon's passes between two checks and a rollback's convergence (`"workload": false`)."""
    from driverd.apply.hostplan import workload_applies
    if params.get("workload") is False or not workload_applies(ctx.root, ctx.config, ctx.kernel.name):
        return None
    return {"timeout_s": ctx.config["validation.workload_timeout_s"],
            "driver_root": ctx.config["validation.driver_root"]}


class Validate(StepImpl):
    action = "validate"

    def do(self, ctx, params):
        expect = _expect(ctx, params) or (None, None)
        v = ld.validate(ctx.kernel, expect[0], expect[1], ctx.services, ctx.config["daemons.persistenced"]
                        and params.get("persistence", True), _modules(ctx, params),
                        workload=workload_options(ctx, params))
        if not v.ok:
            from driverd.kmod.kernel import NVRM_RE
            words = [ln for ln in ctx.kernel.log_since(ctx.doc.get("log_mark", 0)) if NVRM_RE.search(ln)][-6:]
            raise ModuleError("validation failed: " + "; ".join(v.problems),
                              cause="the kernel log's NVRM lines follow" if words else "the kernel logged no NVRM line",
                              fix=(v.fix or "see the problems above and the kernel log")
                              + ("; the run rolls back to the last-known-good driver" if ctx.doc else ""),
                              details={"validation": v.to_json(), "kernel_log": words})
        return v.to_json()

    def describe(self, params):
        e = params.get("expect")
        return "validate the driver" + (f" ({e[0]} {e[1]})" if e else "")


def runtime_options(ctx, params, dry_run: bool = False):
    from driverd.runtime.model import Options
    opts = dict(params.get("options") or {})
    return Options.from_config(ctx.config, handler=params.get("handler"), dry_run=dry_run or ctx.runner.dry_run,
                               **{k: v for k, v in opts.items() if k != "handler"})


def _runtime_files(ctx, params, verb: str) -> list[str]:
    """The files a configure/revert would write, from a dry run of it (without any restart), plus
    driverd's runtime record and the runtime's main config: what the undo must put back."""
    import dataclasses
    from driverd.runtime import registry
    from driverd.runtime.handler import configure, revert
    from driverd.runtime.state import STATE_FILE, state_file
    from driverd.runner import Runner
    opts = dataclasses.replace(runtime_options(ctx, params, dry_run=True), restart="none")
    files = {state_file(ctx.config["state.dir"]), STATE_FILE}    # the default's: a record moved from there
    if params["runtime"] in registry.names():
        files.add(opts.config_path or registry.get(params["runtime"]).default_config)
    if opts.cdi or params["runtime"] == "cdi":
        files.add(opts.cdi_spec_path)
    fn = configure if verb == "configure" else revert
    try:
        rep = fn(ctx.root, params["runtime"], opts, Runner(dry_run=True))
        files |= set(rep.files_changed) | set(rep.backups)
    except Exception:
        pass                           # do() fails the same way, before it writes anything
    return sorted(files)


class _RuntimeStep(StepImpl):
    """configure/revert one container runtime (driverd.runtime); idempotent by construction: a
    second run writes and restarts nothing. The files it may write are kept in the journal first,
    so a failure after the write (a restart that fails) still puts them back byte for byte."""
    verb = ""

    def _fn(self):
        from driverd.runtime import handler as c
        return c.configure if self.verb == "configure" else c.revert

    def check(self, ctx, params):
        from driverd.runner import Runner
        try:
            rep = self._fn()(ctx.root, params["runtime"], runtime_options(ctx, params, True), Runner(dry_run=True))
        except Exception:
            return False
        return not rep.files_changed

    def preflight(self, ctx, params):
        """A runtime configuration driverd cannot parse is bad input (exit 2), refused before the run
        starts: nothing is journalled, nothing changed, no driver rollback to report."""
        from driverd.errors import EXIT_USAGE, DriverdError
        from driverd.runner import Runner
        try:
            self._fn()(ctx.root, params["runtime"], runtime_options(ctx, params, True), Runner(dry_run=True))
        except DriverdError as e:
            if e.exit_code == EXIT_USAGE:
                raise
        except Exception:
            pass                        # do() meets it again, inside the run, where it is journalled

    def preimage(self, ctx, params):
        return _runtime_files(ctx, params, self.verb)

    def do(self, ctx, params):
        return self._fn()(ctx.root, params["runtime"], runtime_options(ctx, params), ctx.runner).to_json()

    def undo(self, ctx, params, entry):
        if entry["status"] == "done" and not (entry.get("result") or {}).get("files_changed"):
            return []
        return _restore_files_steps(entry, [] if params["runtime"] == "cdi" else [params["runtime"]])


class ConfigureRuntime(_RuntimeStep):
    action = "configure-runtime"
    verb = "configure"

    def describe(self, params):
        return f"configure {params.get('runtime')} handler {params.get('handler') or '(configured)'}"


class RevertRuntime(_RuntimeStep):
    action = "revert-runtime"
    verb = "revert"

    def describe(self, params):
        return f"revert driverd's {params.get('runtime')} changes"


class RestoreFiles(StepImpl):
    """Put files back exactly as a step's preimage recorded them (absent ones are removed), then
    restart the runtimes whose configuration that changed. A restart that fails is a warning: the
    files are what the runtime will read when it next starts."""
    action = "restore-files"

    def check(self, ctx, params):
        return all(ctx.root.read_bytes(p, 64 << 20) == unb64(b) for p, b in params["files"].items())

    def do(self, ctx, params):
        changed = []
        for p, b in sorted(params["files"].items()):
            data = unb64(b)
            if ctx.root.read_bytes(p, 64 << 20) == data:
                continue
            if data is None:
                ctx.root.unlink(p)
            else:
                ctx.root.atomic_write(p, data)
            changed.append(p)
        restarted = []
        for rt in params.get("restart") or []:
            if not changed:
                break
            try:
                from driverd.runtime import restart_runtime
                restarted.append(restart_runtime(ctx.root, rt, runtime_options(ctx, {"runtime": rt}), ctx.runner))
            except Exception as e:
                ctx.warn(f"{rt} could not be restarted after its configuration was restored: {e}")
        return {"restored": changed, "restarts": restarted}

    def describe(self, params):
        return "put back " + ", ".join(sorted(params["files"]))


def reboot_record_path(ctx) -> str:
    return f"{ctx.config['state.dir']}/{REBOOT_RECORD}"


def reboot_record(ctx) -> dict | None:
    """The recorded "reboot required" (reasons, since, boot id, whether we raised the sentinel)."""
    text = ctx.root.read_text(reboot_record_path(ctx))
    try:
        rec = json.loads(text) if text else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def boot_id(ctx) -> str | None:
    return ctx.root.read_first_line("/proc/sys/kernel/random/boot_id") or None


class RequireReboot(StepImpl):
    """Record that the host must reboot to finish (durably, with the reasons) and raise the
    sentinel reboot coordinators watch (/var/run/reboot-required, as Ubuntu and kured use)."""
    action = "require-reboot"

    def check(self, ctx, params):
        rec = reboot_record(ctx)
        return bool(rec) and rec.get("reasons") == params["reasons"] and ctx.root.exists(REBOOT_SENTINEL)

    def do(self, ctx, params):
        created = not ctx.root.exists(REBOOT_SENTINEL)
        if created:
            ctx.root.atomic_write(REBOOT_SENTINEL, "*** System restart required ***\n", 0o644)
        pkgs = ctx.root.read_text(REBOOT_PKGS) or ""
        if "driverd" not in pkgs.split():
            ctx.root.atomic_write(REBOOT_PKGS, pkgs + ("" if not pkgs or pkgs.endswith("\n") else "\n") + "driverd\n",
                                  0o644)
        rec = {"reasons": params["reasons"], "since": time.time(), "boot_id": boot_id(ctx),
               "sentinel_created": created, "target": params.get("target")}
        ctx.root.atomic_write_json(reboot_record_path(ctx), rec, 0o644)
        return rec

    def describe(self, params):
        return "record that a reboot is required (" + "; ".join(params["reasons"]) + ")"


class ClearReboot(StepImpl):
    """After the reboot: forget the record and take our name off the sentinel."""
    action = "clear-reboot"

    def check(self, ctx, params):
        return not ctx.root.exists(reboot_record_path(ctx))

    def do(self, ctx, params):
        rec = reboot_record(ctx) or {}
        pkgs = [p for p in (ctx.root.read_text(REBOOT_PKGS) or "").split() if p != "driverd"]
        if pkgs:
            ctx.root.atomic_write(REBOOT_PKGS, "\n".join(pkgs) + "\n", 0o644)
        else:
            ctx.root.unlink(REBOOT_PKGS)
            if rec.get("sentinel_created"):
                ctx.root.unlink(REBOOT_SENTINEL)
        ctx.root.unlink(reboot_record_path(ctx))
        return {"cleared": rec.get("reasons")}

    def describe(self, params):
        return "clear the reboot-required record"


def converge(lkg: dict | None, touched: set, ctx: StepContext) -> list[dict]:
    """Back to the last-known-good state, for exactly what the run touched: the installed package
    (from the kept store) and/or the loaded driver (stop daemons, unload whatever is loaded, load the
    LKG modules with the parameters they were running with, re-create MIG, restart its daemons,
    validate)."""
    steps: list[dict] = []
    now = (lkg or {}).get("loaded")
    if MODULES in touched and now and _driver_is_lkg(ctx, lkg):
        # The driver in the kernel is still the last-known-good one, with the same modules and
        # parameters (e.g. the unload was refused: a process holds the GPU). Tearing it down to load it
        # again would fail the same way and report a failed rollback of a working driver: keep it,
        # start what the run stopped, and prove it.
        if PACKAGE in touched:
            steps.append(_restore_package(lkg))
        steps += _restore_userspace(lkg, touched)
        expect = [now["version"], now["flavor"]]
        return steps + [{"action": "restore-mig", "params": {}},
                        {"action": "start-gpu-daemons", "params": {"daemons": lkg["daemons"]}},
                        {"action": "validate", "params": {"expect": expect, "modules": lkg["modules"],
                                                          "persistence": dmn.PERSISTENCED in lkg["daemons"],
                                                          "workload": False}}]
    if MODULES in touched:
        steps += [{"action": "stop-gpu-daemons", "params": {"daemons": "all"}},
                  {"action": "unload-modules", "params": {}}]
    if lkg is None:
        return steps
    if PACKAGE in touched:
        steps.append(_restore_package(lkg))
    steps += _restore_userspace(lkg, touched)
    if MODULES in touched and now:
        expect = [now["version"], now["flavor"]]
        steps += [{"action": "load-modules", "params": {"modules": lkg["modules"], "parameters": lkg["parameters"],
                                                        "expect": expect}},
                  {"action": "restore-mig", "params": {}},
                  {"action": "start-gpu-daemons", "params": {"daemons": lkg["daemons"]}},
                  {"action": "validate", "params": {"expect": expect, "modules": lkg["modules"],
                                                    "persistence": dmn.PERSISTENCED in lkg["daemons"],
                                                    # the rollback restores the driver that ran; whether its
                                                    # user-space still serves CUDA is the next pass's verdict,
                                                    # not a failed rollback
                                                    "workload": False}}]
    return steps


def _restore_package(lkg: dict) -> dict:
    inst = lkg.get("installed")
    params = {"sha256": inst["sha256"] if inst else None}
    if "previous" in lkg:
        params["previous"] = lkg["previous"]["package"]
    return {"action": "restore-package", "params": params}


def _restore_userspace(lkg: dict, touched: set) -> list[dict]:
    """The user-space the snapshot recorded, back with the modules (before they load and their daemons start,
    so persistenced comes from the same version)."""
    if USERSPACE not in touched or "userspace" not in lkg:
        return []
    params = {"sha256": (lkg["userspace"] or {}).get("sha256")}
    if "previous" in lkg:
        params["previous"] = lkg["previous"]["userspace"]
    return [{"action": "restore-userspace", "params": params}]


def _driver_is_lkg(ctx, lkg: dict) -> bool:
    """The kernel runs the recorded driver: same version and flavour, every recorded module loaded,
    with the parameters it was running with."""
    try:
        mods = ctx.kernel.loaded_names()
        return (loaded(ctx) == lkg.get("loaded") and all(m in mods for m in lkg.get("modules") or ())
                and running_parameters(ctx, list(lkg.get("modules") or ())) == (lkg.get("parameters") or {}))
    except Exception:          # cannot tell: take the full way back
        return False


REGISTRY: Registry = {impl.action: impl for impl in (
    Snapshot(), BlacklistNouveau(), UnloadNouveau(), FetchPackage(), VerifyPackage(), InstallPackage(),
    FetchUserspace(), InstallUserspace(), RestoreUserspace(),
    RestorePackage(), RestorePreviousPackage(), StopDaemons(), StartDaemons(), StartPersistenced(),
    StartFabricManager(), UnloadModules(), CheckSigners(), CheckParameters(), LoadModules(), RestoreMig(), Validate(),
    ConfigureRuntime(), RevertRuntime(), RestoreFiles(), RequireReboot(), ClearReboot(), ForgetKernel())}
