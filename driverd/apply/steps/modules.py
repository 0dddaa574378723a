"""The kernel modules and what runs on them: nouveau out of the way, the GPU daemons, unload, the
parameter and signer checks before an unload, load, MIG."""
from __future__ import annotations

import os
import tempfile

from driverd.apply.hostview import fabric, known_daemons, wanted_daemons
from driverd.apply.step import StepImpl
from driverd.apply.steps.common import loaded, package_path, restore_files_steps
from driverd.apply.validation import driver_modules, expected_driver
from driverd.errors import ModuleError, PackageError
from driverd.host.fabric import NVLSM_AFTER
from driverd.kmod import daemons as dmn
from driverd.kmod import load as ld
from driverd.kmod import mig, nouveau
from driverd.kmod import unload as ul
from driverd.kmod.holders import NVIDIA_FAMILY
from driverd.nvproc import IMEX_CHANNELS


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
        return restore_files_steps(entry)

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


def _daemons(ctx, params) -> list[str]:
    """The daemons a step acts on: its list; "all" — every one of driverd's (driverd.plan.companions: not the DRA
    driver's IMEX); none given — those the host wants now, in their start order."""
    d = params.get("daemons")
    if d == "all" or d is None and params.get("all"):
        return known_daemons(ctx)
    if d is None:
        return wanted_daemons(ctx)
    return list(d)


def _wait_for_modules(ctx, modules: list[str], wait_s: float) -> None:
    """NVLSM opens the switch trays through the InfiniBand MAD interface: wait (up to `wait_s`) until `modules`
    are live — at boot the InfiniBand stack comes up beside driverd —, then fail naming those still missing."""
    import time
    deadline = time.monotonic() + max(wait_s, 0)
    while True:
        missing = [m for m in modules if m not in ctx.kernel.loaded_names()]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise ModuleError(f"{dmn.NVLSM} cannot start: {', '.join(missing)} not loaded"
                              + (f" after {wait_s:.0f} s" if wait_s else ""),
                              cause="NVLSM reaches the NVLink5 switch trays through the ConnectX functions' InfiniBand "
                                    "MAD interface (mlx5_core, ib_core, ib_umad)",
                              fix=f"modprobe {' '.join(missing)} (rdma-core's rdma-load-modules@infiniband.service or "
                                  "MLNX_OFED's openibd loads them at boot), then apply again")
        time.sleep(1.0)


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
                if d == dmn.NVLSM:
                    _wait_for_modules(ctx, list(params.get("after_modules") or NVLSM_AFTER),
                                      float(params.get("wait_s") or 0))
                ctx.services.start(d)
                started.append(d)
                if d != dmn.PERSISTENCED:
                    ctx.services.wait_ready(d)
            elif d == dmn.FABRICMANAGER:
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
        return super().do(ctx, {**params, "daemons": [self.daemon]})

    def describe(self, params):
        return f"start {self.daemon}"


class StartPersistenced(_StartOneDaemon):
    action = "start-persistenced"
    daemon = dmn.PERSISTENCED


class StartNvlsm(_StartOneDaemon):
    """NVLSM, before the fabric manager, once the InfiniBand modules are live (`after_modules`; `wait_s`: how
    long to wait for them, 0 on a host where the plan found them loaded)."""
    action = "start-nvlsm"
    daemon = dmn.NVLSM


class StartFabricManager(_StartOneDaemon):
    action = "start-fabricmanager"
    daemon = dmn.FABRICMANAGER


class StartImex(_StartOneDaemon):
    """nvidia-imex of the driver's version, after the load (the IMEX channel the load made serves its workloads)."""
    action = "start-imex"
    daemon = dmn.IMEX

    def do(self, ctx, params):
        res = super().do(ctx, params)
        c = fabric(ctx).want("imex-channel0")
        if c is not None and not ctx.root.exists(f"{IMEX_CHANNELS}/channel0"):
            ctx.warn(f"IMEX runs, but {c.path} is missing: workloads cannot use IMEX channel 0 ({c.how})")
        return res


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


def _params(ctx, params) -> dict:
    p = params.get("parameters")
    return dict(ctx.config["modules.parameters"]) if p is None else p


class CheckParameters(StepImpl):
    """Module parameters are checked against the module files that will be loaded (names and value
    types, as modinfo -p declares them) while the running driver is still in place: a bad value
    must never be found after the unload."""
    action = "check-parameters"

    def do(self, ctx, params):
        mods = driver_modules(ctx, params)
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
        from driverd.driver.layout import modules_dir
        try:
            pkg = package_path(ctx, params)
        except PackageError:
            pkg = None
        if pkg:
            sigs, source = signers.package_signatures(pkg), f"package {os.path.basename(pkg)}"
        else:
            d = ctx.root.real(modules_dir(ctx.kernel.release))
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
        expect = expected_driver(ctx, params)
        mods = ctx.kernel.loaded_names()
        ident = loaded(ctx)
        from driverd.kmod.devnodes import wanted_nodes
        nodes_ok = all(ctx.root.path(p).exists() for p, _, _ in wanted_nodes(ctx.root, set(mods)))
        return (expect is not None and ident is not None and (ident["version"], ident["flavor"]) == expect
                and all(m in mods for m in driver_modules(ctx, params)) and nodes_ok)

    def do(self, ctx, params):
        expect = expected_driver(ctx, params)
        if expect is None:
            raise ModuleError("no driver package is installed for this kernel",
                              cause=f"/lib/modules/{ctx.kernel.release}/updates/driverd/manifest.json is missing",
                              fix="driverd install PACKAGE (or driverd apply)")
        rep = ld.load(ctx.kernel, driver_modules(ctx, params), _params(ctx, params), expect)
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
