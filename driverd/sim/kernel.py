"""A simulated kernel working on a host tree: the state a real kernel exposes lives in the tree, in
the real formats (/proc/modules, /sys/module/<m>/{initstate,refcnt,holders/,parameters/},
/proc/driver/nvidia/{version,gpus/}, /proc/devices, PCI driver bindings in /sys/bus/pci), so every
reader in driverd runs unchanged against it.

It fails the way the real kernel does, with the same errno text and kernel-log lines:
- module not in modules.dep            -> modprobe: FATAL: Module X not found in directory ...
- vermagic for another kernel          -> Exec format error + "version magic '...' should be '...'"
- unsigned module under enforcement    -> Key was rejected by service + "Loading of unsigned module is rejected"
- signer not in the trusted keyrings   -> Key was rejected by service + "Loading of module with unavailable key is
  (under enforcement)                     rejected" (Linux >= 5.4, kernel/module/signing.c; older kernels said
                                          ENOKEY "Required key not available"); the keyrings are real certificates
                                          (driverd.sim.keys), matched by issuer + serial or SKID like the kernel
- lockdown without sig_enforce         -> Operation not permitted + "Lockdown: modprobe: unsigned module loading is
                                          restricted; see man kernel_lockdown.7"
- declared firmware missing            -> No such device + "Direct firmware load ... failed with error -2"
- unknown parameter                    -> *ignored* with "unknown parameter 'X' ignored" (as the real
                                          kernel does: the reason driverd validates before loading)
- bad parameter value                  -> Invalid argument + "`v' invalid for parameter `p'"
- no GPU it can drive (nouveau bound, flavour unsupported) -> No such device + NVRM lines
- rmmod of a module with holders or open device files -> "Module X is in use[ by: ...]"

The simulation's own bookkeeping (pinned references, sim processes, the log) is in
/run/driverd-sim/state.json; the procfs/sysfs views are re-rendered from it after every change.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from driverd.errors import ModuleError
from driverd.fsutil import atomic_write, atomic_write_json
from driverd.host import gputable, pci
from driverd.host.modules import parse_proc_modules
from driverd.kmod.holders import device_owner
from driverd.kmod.kernel import Kernel, LoadedModule, kernel_error
from driverd.modinfo import read_modinfo
from driverd.nvproc import IMEX_CHANNELS, IMEX_REGION
from driverd.root import Root

STATE = "/run/driverd-sim/state.json"
KMSG = "/run/driverd-sim/kmsg"
MIG_DIR = "/run/driverd-sim/mig"
FABRIC = "/run/driverd-sim/fabric-state"
BASE_DEVICES = [(1, "mem"), (4, "/dev/vc/0"), (4, "tty"), (5, "/dev/tty"), (5, "/dev/console"), (7, "vcs"),
                (10, "misc"), (13, "input"), (29, "fb"), (128, "ptm"), (136, "pts"), (226, "drm")]
MODULE_DEVICES = {"nvidia": [(195, "nvidia"), (235, "nvidia-caps")], "nvidia_uvm": [(510, "nvidia-uvm")]}
NVSWITCH_MAJOR = 509
IMEX_MAJOR = 237            # dynamic in the kernel (alloc_chrdev_region); driverd.sim.scenario's GB200 tray's


class SimKernel(Kernel):
    name = "sim"

    def __init__(self, root: Root, runner=None) -> None:
        super().__init__(root, runner)
        # A dry run leaves even the simulated kernel's /proc and /sys alone.
        self._readonly = runner is not None and runner.dry_run
        self._state = self._load_state()
        self._render()

    # -- state -------------------------------------------------------------------------------------
    def _p(self, hostpath: str) -> Path:
        return self.root.path(hostpath)

    def _load_state(self) -> dict:
        text = self.root.read_text(STATE)
        if text:
            return json.loads(text)
        # First use on a tree written by hosttree: adopt what /proc/modules shows. References that
        # neither holders nor open files explain are "pinned" (e.g. the console holding nouveau).
        rows = parse_proc_modules(self.root.read_text("/proc/modules"))
        opens = self._opens()
        mods = []
        for name, row in reversed(list(rows.items())):   # /proc/modules lists the newest first
            holders = sorted(set(self.root.listdir(f"/sys/module/{name}/holders")) | set(row["used_by"]))
            pinned = max(0, (row["refcount"] or 0) - len(holders) - opens.get(name, 0))
            mods.append({"name": name, "size": row["size"] or 0, "pinned": pinned, "holders": holders,
                         "taints": row["taints"], "params": {}, "path": None,
                         "version": self.root.read_first_line(f"/sys/module/{name}/version")})
        return {"modules": mods, "next_pid": 40000, "procs": {}, "log": 0}

    def _save(self) -> None:
        if self._readonly:
            return
        atomic_write_json(self._p(STATE), self._state)
        self._render()

    def _mod(self, name: str) -> dict | None:
        return next((m for m in self._state["modules"] if m["name"] == name), None)

    def _opens(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pid in self.root.listdir("/proc"):
            if not pid.isdigit():
                continue
            for fd in self.root.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(self._p(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
                owner = device_owner(target)
                if owner:
                    out[owner] = out.get(owner, 0) + 1
        return out

    def refcount(self, name: str) -> int:
        m = self._mod(name)
        if m is None:
            return 0
        return len(m["holders"]) + m["pinned"] + self._opens().get(name, 0)

    def _render(self) -> None:
        """Write the procfs/sysfs views from the state (idempotent; also heals a view left stale)."""
        if self._readonly:
            return
        unload = self.root.read_text("/proc/modules") is None or _has_refcounts(self.root)
        opens = self._opens()
        rows, addr = [], 0xffffffffc0400000
        names = {m["name"] for m in self._state["modules"]}
        for m in reversed(self._state["modules"]):
            ref = len(m["holders"]) + m["pinned"] + opens.get(m["name"], 0)
            used = "".join(f"{h}," for h in m["holders"]) or "-"
            taint = f" ({m['taints']})" if m["taints"] else ""
            rows.append(f"{m['name']} {m['size']} {ref if unload else '-'} {used if unload else '-'} Live "
                        f"0x{addr:016x}{taint}")
            addr += 0x100000
            base = f"/sys/module/{m['name']}"
            _write(self._p(f"{base}/initstate"), "live\n")
            _write(self._p(f"{base}/taint"), f"{m['taints']}\n")
            if unload:
                _write(self._p(f"{base}/refcnt"), f"{ref}\n")
            hdir = self._p(f"{base}/holders")
            hdir.mkdir(parents=True, exist_ok=True)
            for h in os.listdir(hdir):
                if h not in m["holders"]:
                    os.unlink(hdir / h)
            for h in m["holders"]:
                if not (hdir / h).is_symlink():
                    os.symlink(f"../../{h}", hdir / h)
            pdir = self._p(f"{base}/parameters")
            if m["params"]:
                pdir.mkdir(parents=True, exist_ok=True)
                for k, v in m["params"].items():
                    _write(pdir / k, f"{v}\n")
            if m.get("version"):
                _write(self._p(f"{base}/version"), f"{m['version']}\n")
        for d in self.root.listdir("/sys/module"):
            if d not in names and self.root.exists(f"/sys/module/{d}/initstate"):
                shutil.rmtree(self._p(f"/sys/module/{d}"), ignore_errors=True)
        atomic_write(self._p("/proc/modules"), "\n".join(rows) + ("\n" if rows else ""))
        devs = list(BASE_DEVICES)
        for m in self._state["modules"]:
            devs += MODULE_DEVICES.get(m["name"], [])
            if m["name"] == "nvidia" and self._nvswitches():
                devs.append((NVSWITCH_MAJOR, "nvidia-nvswitch"))
            if m["name"] == "nvidia" and m.get("imex"):
                devs.append((IMEX_MAJOR, IMEX_REGION))
        text = "Character devices:\n" + "".join(f"{n:3d} {d}\n" for n, d in sorted(devs)) + \
               "\nBlock devices:\n  8 sd\n259 blkext\n"
        _write(self._p("/proc/devices"), text)

    # -- the kernel log ----------------------------------------------------------------------------
    def _log(self, *lines: str) -> None:
        p = self._p(KMSG)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a") as f:
            for ln in lines:
                f.write(f"[{time.monotonic():12.6f}] {ln}\n")

    def _kmsg(self) -> list[str]:
        return (self.root.read_text(KMSG, 64 << 20) or "").splitlines()

    def log_mark(self) -> int:
        return len(self._kmsg())

    def log_since(self, mark: int) -> list[str]:
        return self._kmsg()[mark:]

    # -- inspection ------------------------------------------------------------------------------
    def modules(self, names=None) -> dict[str, LoadedModule]:
        self._render()
        return super().modules(names)

    def loaded_names(self) -> set[str]:
        self._render()
        return super().loaded_names()

    def _gpus(self) -> list:
        devs = pci.scan(self.root, [])
        gpus, _, _ = pci.classify(self.root, devs, [])
        return gpus

    def _nvswitches(self) -> list:
        _, sw, _ = pci.classify(self.root, pci.scan(self.root, []), [])
        return sw

    def _enforcement(self) -> tuple[bool, bool]:
        """(signatures enforced, locked down): the evidence detect reports (sig_enforce, the command
        line, CONFIG_MODULE_SIG_FORCE; lockdown refuses with its own error)."""
        from driverd.host.kernel import read_kernel
        k = read_kernel(self.root, [])
        lock = any(s.startswith("kernel lockdown=") for s in k.signature_enforcement_sources)
        return (any(not s.startswith("kernel lockdown=") for s in k.signature_enforcement_sources), lock)

    def _signature_problem(self, info) -> str | None:
        """None when the kernel would verify the module, else its words: 'unsigned module' or
        'module with unavailable key' (kernel/module/signing.c module_sig_check)."""
        if not info.signed:
            return "unsigned module"
        from driverd.sim import keys
        if not keys.enabled(self.root):
            return None                 # no simulated keyrings: every signature verifies
        from driverd.package.modsig import read_signature
        sig = read_signature(info.path)
        if sig.error or not sig.signers:
            return "module with unavailable key"
        return None if any(keys.module_keyrings_trust(self.root, s) for s in sig.signers) else \
            "module with unavailable key"

    def _firmware_found(self, fw: str) -> bool:
        dirs = [d for d in [self.firmware_path()] if d] + [f"/lib/firmware/updates/{self.release}",
                                                             "/lib/firmware/updates", f"/lib/firmware/{self.release}",
                                                             "/lib/firmware"]
        return any(self.root.is_file(f"{d.rstrip('/')}/{fw}") for d in dirs)

    # -- load --------------------------------------------------------------------------------------
    def load(self, name: str, params: dict[str, str] | None = None) -> None:
        name = name.replace("-", "_")
        if self._mod(name) is not None:
            return                        # modprobe leaves a loaded module alone
        path = self.module_file(name)
        if path is None:
            raise ModuleError(f"could not load {name}: module not found",
                              cause=f"modprobe: FATAL: Module {name} not found in directory {self.modules_dir()}",
                              fix="install the driver package for the running kernel and run depmod",
                              details={"module": name, "reason": "not found", "kernel_log": []})
        for dep in reversed(self.module_deps(name)):   # modprobe inserts dependencies first
            self.load(dep)
        mark = self.log_mark()
        try:
            info = read_modinfo(self.root.real(path))
        except (OSError, ValueError) as e:
            self._log(f"{name}: module has invalid ELF structures")
            raise kernel_error("load", name, "Exec format error", self.log_since(mark),
                               f"{path} is not a valid module ({e}); reinstall the package") from None
        fail = self._check(name, info, dict(params or {}))
        if fail:
            reason, fix = fail
            raise kernel_error("load", name, reason, self.log_since(mark), fix, path=path)
        taints = "OE" if self._signature_problem(info) else "O"
        accepted = {k: v for k, v in (params or {}).items() if k in info.params}
        self._state["modules"].append({"name": name, "size": _size(self.root.real(path)), "pinned": 0,
                                       "holders": [], "taints": taints, "params": accepted, "path": path,
                                       "version": info.version, "imex": "NVreg_ImexChannelCount" in info.params})
        for dep in info.depends:
            d = self._mod(dep)
            if d is not None and name not in d["holders"]:
                d["holders"] = sorted(d["holders"] + [name])
        if name == "nvidia":
            self._nvidia_up(info)
            if "NVreg_ImexChannelCount" in info.params and accepted.get("NVreg_CreateImexChannel0", "").strip() in (
                    "1", "Y", "y"):
                # channel 0 on request: the node made for this load (udev, nvidia-modprobe) with the region's major
                self.mknod(f"{IMEX_CHANNELS}/channel0", IMEX_MAJOR, 0)
                self._mod("nvidia")["imex_channel0"] = True
        self._save()

    def _check(self, name: str, info, params: dict[str, str]) -> tuple[str, str] | None:
        """The kernel's checks, in its order. Returns (errno text, fix) or None when it loads."""
        if info.vermagic_release != self.release:
            self._log(f"{name}: version magic '{info.vermagic}' should be "
                      f"'{self.release} SMP preempt mod_unload modversions '")
            return "Exec format error", f"{name} was built for kernel {info.vermagic_release}, this is {self.release}: " \
                                        "install the package built for the running kernel"
        reason = self._signature_problem(info)
        if reason:
            sig_enforce, lockdown = self._enforcement()
            if sig_enforce:
                self._log(f"Loading of {reason} is rejected")
                return "Key was rejected by service", "the kernel enforces module signatures: sign the modules " \
                    "with a key in its trusted keyrings (enrol it as a MOK: mokutil --import CERT.der) or use a " \
                    "package signed with a trusted key"
            if lockdown:
                self._log("Lockdown: modprobe: unsigned module loading is restricted; see man kernel_lockdown.7")
                return "Operation not permitted", "the kernel is locked down: sign the modules with a trusted key"
            if not any(ln.endswith("tainting kernel") for ln in self._kmsg()):
                self._log(f"{name}: module verification failed: signature and/or required key missing - tainting kernel")
        for dep in info.depends:
            if self._mod(dep) is None:
                self._log(f"{name}: Unknown symbol in module (needs {dep})")
                return "Unknown symbol in module", f"load {dep} first"
        for k, v in params.items():
            p = info.params.get(k)
            if p is None:
                self._log(f"{name}: unknown parameter '{k}' ignored")
                continue
            err = _param_error(p.type, v)
            if err:
                self._log(f"{name}: `{v}' invalid for parameter `{k}'")
                return err, f"parameter {k} of {name} takes {p.type}; {v!r} is not one"
        missing = [fw for fw in info.firmware if not self._firmware_found(fw)]
        if missing:
            for fw in missing:
                self._log(f"{name}: Direct firmware load for {fw} failed with error -2")
            if name == "nvidia":
                first = next((g.pci_address for g in self._gpus()), "0000:00:00.0")
                self._log("NVRM: RmFetchGspRmImages: No firmware image found",
                          f"NVRM: GPU {first}: RmInitAdapter failed! (0x61:0x56:1594)",
                          "NVRM: None of the NVIDIA devices were initialized.")
            return "No such device", f"firmware {', '.join(missing)} is missing: install the package's firmware " \
                                     f"under /lib/firmware (or point firmware_class.path at it)"
        if name == "nvidia":
            usable, lines = self._probe(info.flavor)
            if not usable:
                self._log(*lines, f"NVRM: The NVIDIA probe routine failed for {len(lines) or 1} device(s).",
                          "NVRM: None of the NVIDIA devices were initialized.")
                return "No such device", "no GPU could be claimed: " + ("; ".join(lines) or "no NVIDIA GPU found")
            if lines:
                self._log(*lines)
        return None

    def _probe(self, flavor: str) -> tuple[list, list[str]]:
        usable, lines = [], []
        for g in self._gpus():
            if g.bound_driver and g.bound_driver != "nvidia":
                lines.append(f"NVRM: GPU {g.pci_address} is already bound to {g.bound_driver}.")
                continue
            if flavor == "open" and g.open_module_support == "unsupported":
                lines.append(f"NVRM: The NVIDIA GPU {g.pci_address} (PCI ID: 10de:{g.device_id[2:]}) installed in "
                             "this system is not supported by open nvidia.ko because it does not include the "
                             "required GPU System Processor (GSP).")
                continue
            if flavor == "proprietary" and g.open_module_support == "required":
                lines.append(f"NVRM: The NVIDIA GPU {g.pci_address} (PCI ID: 10de:{g.device_id[2:]}) requires the "
                             "open kernel modules.")
                continue
            usable.append(g)
        return usable, lines

    def _nvidia_up(self, info) -> None:
        from driverd.sim.hosttree import nvidia_version_line
        usable, _ = self._probe(info.flavor)
        _write(self._p("/proc/driver/nvidia/version"), nvidia_version_line(info.version or "0.0", info.flavor))
        drv = self._p("/sys/bus/pci/drivers/nvidia")
        drv.mkdir(parents=True, exist_ok=True)
        for i, g in enumerate(usable):
            model = gputable.lookup(g.device_id)
            _write(self._p(f"/proc/driver/nvidia/gpus/{g.pci_address}/information"),
                   f"Model: \t\t {model.name if model else 'NVIDIA GPU'}\nIRQ:   \t\t {100 + i}\n"
                   f"GPU UUID: \t GPU-{_uuid(g.pci_address)}\nVideo BIOS: \t 96.00.99.00.01\n"
                   f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\n"
                   f"Bus Location: \t {g.pci_address}\nDevice Minor: \t {i}\nGPU Excluded:\t No\n")
            _bind(self.root, g.pci_address, "nvidia")
        for s in self._nvswitches():
            _bind(self.root, s.pci_address, "nvidia-nvswitch")
        self._log("nvidia: loading out-of-tree module taints kernel.",
                  f"NVRM: loading {nvidia_version_line(info.version or '0.0', info.flavor).splitlines()[0][14:]}")

    # -- unload ------------------------------------------------------------------------------------
    def unload(self, name: str) -> None:
        name = name.replace("-", "_")
        m = self._mod(name)
        mark = self.log_mark()
        if m is None:
            raise kernel_error("unload", name, f"Module {name} is not currently loaded", [], "nothing to do")
        if m["holders"]:
            raise kernel_error("unload", name, f"Module {name} is in use by: {' '.join(m['holders'])}",
                               self.log_since(mark), f"unload {', '.join(m['holders'])} first",
                               holders=list(m["holders"]))
        if self.refcount(name) > 0:
            raise kernel_error("unload", name, f"Module {name} is in use", self.log_since(mark),
                               "stop the processes holding it (driverd unload lists them)",
                               refcount=self.refcount(name))
        self._state["modules"].remove(m)
        for other in self._state["modules"]:
            if name in other["holders"]:
                other["holders"].remove(name)
        if name == "nvidia":
            shutil.rmtree(self._p("/proc/driver/nvidia"), ignore_errors=True)
            for g in self._gpus():
                if g.bound_driver == "nvidia":
                    _unbind(self.root, g.pci_address, "nvidia")
            for s in self._nvswitches():
                _unbind(self.root, s.pci_address, "nvidia-nvswitch")
            self._destroy_mig_instances()
            self._p(FABRIC).unlink(missing_ok=True)
            if m.get("imex_channel0"):          # the node made for the load goes with its region
                self._p(f"{IMEX_CHANNELS}/channel0").unlink(missing_ok=True)
        if name == "nouveau":
            for g in self._gpus():
                if g.bound_driver == "nouveau":
                    _unbind(self.root, g.pci_address, "nouveau")
        self._log(f"{name}: unloaded")
        self._save()

    def reboot(self) -> None:
        """A simulated reboot: the driver and its processes are gone, nouveau is gone too when the
        modprobe.d files now blacklist it (else it comes back as it was), the boot id changes."""
        import uuid
        from driverd.host.nouveau import read_nouveau
        blacklisted = read_nouveau(self.root, []).blacklisted
        for pid in list(self._state["procs"]):
            shutil.rmtree(self._p(f"/proc/{pid}"), ignore_errors=True)
        self._state["procs"] = {}
        for m in list(reversed(self._state["modules"])):
            if m["name"].startswith("nvidia") or (m["name"] == "nouveau" and blacklisted):
                m["holders"], m["pinned"] = [], 0
        for m in list(reversed(self._state["modules"])):
            if m["name"].startswith("nvidia") or (m["name"] == "nouveau" and blacklisted):
                for other in self._state["modules"]:
                    other["holders"] = [h for h in other["holders"] if h != m["name"]]
                self.unload(m["name"])
        _write(self._p("/proc/sys/kernel/random/boot_id"), str(uuid.uuid4()) + "\n")
        self._log("reboot: a new boot")
        self._save()

    def _destroy_mig_instances(self) -> None:
        for f in self.root.listdir(MIG_DIR):
            p = self._p(f"{MIG_DIR}/{f}")
            doc = json.loads(p.read_text())
            if doc.get("gpu_instances"):
                doc["gpu_instances"] = []
                atomic_write_json(p, doc)

    # -- the module tree (driverd.sim.depmod: modules.dep from the modules' own .modinfo) ------------
    def depmod(self, release: str, check: bool = True) -> str:
        from driverd.sim import depmod
        argv = f"depmod -b {self.root.base} {release} (simulated)"
        base = self.root.real(f"/lib/modules/{release}")
        try:
            lines = depmod.dependency_lines(base)
            if not self._readonly:
                self.root.atomic_write(f"/lib/modules/{release}/modules.dep", "".join(ln + "\n" for ln in lines))
                # a binary index a real depmod left would now disagree with modules.dep: real
                # modprobe reads it first, so it goes (modprobe then says "not found" instead)
                self.root.unlink(f"/lib/modules/{release}/modules.dep.bin", missing_ok=True)
        except (OSError, ValueError) as e:
            if check:
                raise ModuleError(f"depmod failed for {release}: {e}", cause=f"{argv} could not index the tree",
                                  fix="see the depmod message") from None
        return argv

    def show_depends(self, release: str, name: str) -> list[str]:
        from driverd.sim import depmod
        mdir = f"/lib/modules/{release}"
        found = depmod.show_depends(self.root.real(mdir), self.root.read_text(f"{mdir}/modules.dep") or "", name)
        if found is None:
            raise ModuleError(f"installed modules do not resolve: modprobe: FATAL: Module {name} not found in "
                              f"directory {self.root.real(mdir)}", cause=f"{mdir}/modules.dep has no {name}",
                              fix="check the package's modules and run depmod")
        return [str(self.root.real(f"{mdir}/{p}")) for p in found]

    # -- devices, firmware, processes --------------------------------------------------------------
    def mknod(self, hostpath: str, major: int, minor: int) -> None:
        # A placeholder file: a test tree must not contain real device nodes of this machine.
        _write(self._p(hostpath), f"c {major}:{minor}\n")

    def set_firmware_path(self, hostdir: str) -> None:
        _write(self._p("/sys/module/firmware_class/parameters/path"), hostdir + "\n")

    def spawn(self, comm: str, devices: list[str] = (), cmdline: str = "", cgroup: str = "0::/system.slice/x",
              maps: list[str] = (), ignores_sigterm: bool = False, environ: dict | None = None) -> int:
        """Create a simulated process in <root>/proc (used for daemons and in tests)."""
        pid = self._state["next_pid"]
        self._state["next_pid"] = pid + 1
        base = self._p(f"/proc/{pid}")
        (base / "fd").mkdir(parents=True, exist_ok=True)
        _write(base / "comm", comm[:15] + "\n")
        _write(base / "cmdline", (cmdline or comm).replace(" ", "\0") + "\0")
        _write(base / "cgroup", cgroup + "\n")
        _write(base / "environ", "".join(f"{k}={v}\0" for k, v in (environ or {}).items()))
        _write(base / "maps", "".join(f"7f0000000000-7f0000100000 r-xp 00000000 08:01 1 {m}\n" for m in maps))
        for i, d in enumerate(devices, 3):
            os.symlink(d, base / "fd" / str(i))
        self._state["procs"][str(pid)] = {"ignores_sigterm": ignores_sigterm}
        self._save()
        return pid

    def signal(self, pid: int, sig: int) -> None:
        if not self.alive(pid):
            return
        meta = self._state["procs"].get(str(pid), {})
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and not meta.get("ignores_sigterm")):
            shutil.rmtree(self._p(f"/proc/{pid}"), ignore_errors=True)
            self._state["procs"].pop(str(pid), None)
            self._save()

    def alive(self, pid: int) -> bool:
        return self.root.is_dir(f"/proc/{pid}")


def _has_refcounts(root: Root) -> bool:
    from driverd.host.kernel import module_unload_evidence
    return module_unload_evidence(root.read_text("/proc/modules"), {})[0]


# kernel/params.c param_set_*: kstrto*(value, 0) (decimal, 0x hex, 0 octal; '+' allowed, '-' only for
# the signed types; no spaces): garbage is EINVAL, a number outside the type ERANGE. Checked against
# Debian's 6.1 in tests/vm (4294967296 for a uint: "Numerical result out of range").
_RANGES = {"byte": (0, 0xff), "short": (-(1 << 15), (1 << 15) - 1), "ushort": (0, 0xffff),
           "int": (-(1 << 31), (1 << 31) - 1), "uint": (0, 0xffffffff), "hexint": (0, 0xffffffff),
           "long": (-(1 << 63), (1 << 63) - 1), "ulong": (0, (1 << 64) - 1), "ullong": (0, (1 << 64) - 1)}
_EINVAL, _ERANGE = "Invalid argument", "Numerical result out of range"


def _param_error(ptype: str | None, value: str) -> str | None:
    """The errno text the kernel answers for `value` of a parameter of type `ptype`, or None."""
    if ptype is None or ptype in ("charp", "string"):
        return None
    if ptype.startswith("array of "):
        return next((e for e in (_param_error(ptype[9:], v) for v in value.split(",")) if e), None)
    v = value[:-1] if value.endswith("\n") else value
    if ptype in ("bool", "invbool"):
        # kstrtobool: y/Y/t/T/1 and n/N/f/F/0 by the first character, on/off by the first two
        ok = v[:1] in tuple("yYtT1nNfF0") or (v[:1] in ("o", "O") and v[1:2] in tuple("nNfF"))
        return None if ok else _EINVAL
    if ptype in _RANGES:
        lo, hi = _RANGES[ptype]
        sign = v[:1] if v[:1] in ("+", "-") else ""
        digits = v[len(sign):]
        if sign == "-" and lo == 0:
            return _EINVAL
        try:
            n = int(digits, 16) if digits[:2] in ("0x", "0X") else int(digits, 8) if digits[:1] == "0" else \
                int(digits, 10) if digits[:1].isdigit() else None
        except ValueError:
            n = None
        if n is None or not digits.isalnum():
            return _EINVAL
        n = -n if sign == "-" else n
        return None if lo <= n <= hi else _ERANGE
    return None


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _uuid(addr: str) -> str:
    import hashlib
    h = hashlib.sha256(addr.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _write(p: Path, text: str) -> None:
    # Every render writes the whole of /sys/module again; a file whose content stays is left alone, so a
    # reader never meets it truncated mid-rewrite (a module's parameters read as '' while another module
    # loaded: a flaky test under load). Real sysfs never shows a half-written value.
    try:
        if p.read_text() == text:
            return
    except OSError:
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _bind(root: Root, addr: str, driver: str) -> None:
    dev = root.path(f"/sys/bus/pci/devices/{addr}")
    real_dev = root.real(f"/sys/bus/pci/devices/{addr}")
    drv = root.path(f"/sys/bus/pci/drivers/{driver}")
    drv.mkdir(parents=True, exist_ok=True)
    link = real_dev / "driver"
    if link.is_symlink():
        link.unlink()
    os.symlink(f"../../../bus/pci/drivers/{driver}", link)
    if not (drv / addr).is_symlink():
        os.symlink(f"../../../../devices/pci0000:00/{addr}", drv / addr)
    del dev


def _unbind(root: Root, addr: str, driver: str) -> None:
    link = root.real(f"/sys/bus/pci/devices/{addr}") / "driver"
    if link.is_symlink():
        link.unlink()
    (root.path(f"/sys/bus/pci/drivers/{driver}") / addr).unlink(missing_ok=True)
