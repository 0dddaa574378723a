"""Runs INSIDE the VM guest (a real Linux kernel booted by virtme-ng), as root, never on the host.

    python tests/vm/guest.py SPEC.json

SPEC names the scenarios to run in order, the packages (paths the guest reads through the host's
read-only file system), the shared writable directory for results, and the python that runs driverd.
Each scenario writes OUT/<name>.json: what driverd printed (exit code, JSON), what the kernel shows
afterwards (/proc/modules, /sys/module/*/parameters, /proc/driver/nvidia/version) and the kernel log
lines it printed meanwhile. The host test reads and asserts on these files; this script only records.

The guest sees this machine's root read-only; /etc, /var, /opt (the unpacked kernel's /lib/modules),
/tmp are private overlays and /run, /var/cache tmpfs, so driverd runs with the REAL root `/` and
every write lands in guest memory. The one test stub: no GPU exists in the VM, so a tmpfs over
/sys/bus/pci/devices adds one NVIDIA PCI function (vendor/device/class files) next to the real
devices; the stand-in nvidia module reports that address in /proc/driver/nvidia/gpus. Every module
load, unload, parameter and refusal is the real kernel's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback

GPU_ADDR = "0001:00:00.0"          # the stand-in GPU (a PCI domain no real device of the VM uses)
PCI = "/sys/bus/pci/devices"
MODULES = ("nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia")
PYCACHE = "/tmp/driverd-pycache"
REFUSING = '["http://127.0.0.1:9/driverd"]'      # a repository nothing listens for: connections refused
# The driver container's mount of the host root (deploy/base/daemonset.yaml's /host; the guest's / is
# read-only, so the mount point is on /run) and of its ConfigMap.
CONTAINER_HOST = "/run/driverd-container/host"
CONTAINER_CONFIG = "/run/driverd-container/config/config.toml"


def sh(*argv: str, timeout: float = 120, env: dict | None = None) -> dict:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return {"argv": list(argv), "rc": r.returncode, "stdout": r.stdout[-20000:], "stderr": r.stderr[-6000:]}


class Guest:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.out = spec["out"]
        self.py = spec["python"]
        self.repo_dir = spec["repo_root"]
        self.dmesg_mark: float | None = 0.0

    # -- driverd ------------------------------------------------------------------------------------
    def driverd(self, *args: str, faults: dict | None = None, timeout: float = 300, bytecode: bool = False) -> dict:
        """`bytecode`: run as an installed driverd runs, from cached bytecode (pip compiles it at install):
        the cache goes to PYCACHE (the runtime image is read-only), the first such run fills it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIVERD_", "FAULTS_"))}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if bytecode:
            del env["PYTHONDONTWRITEBYTECODE"]
            env["PYTHONPYCACHEPREFIX"] = PYCACHE
        if faults:
            env["PYTHONPATH"] = os.pathsep.join([self.spec["faults_dir"], env.get("PYTHONPATH", "")])
            env.update({k: str(v) for k, v in faults.items()})
        t0 = time.monotonic()
        r = subprocess.run([self.py, "-m", "driverd", *args, "--root", "/"], capture_output=True, text=True,
                           env=env, timeout=timeout, cwd="/")
        res = {"args": list(args), "rc": r.returncode, "stderr": r.stderr[-6000:], "seconds": round(time.monotonic() - t0, 2)}
        try:
            res["json"] = json.loads(r.stdout) if r.stdout.strip() else None
        except ValueError:
            res["stdout"] = r.stdout[-6000:]
        return res

    def config(self, version: str, params: dict | None = None, extra: str = "") -> None:
        lines = ['[driver]', f'version = "{version}"', 'flavor = "open"', 'manage = "always"',
                 '[packages]', f'repositories = ["file://{self.spec["repo"]}"]', 'build_fallback = false',
                 '[modules]', 'kernel = "real"', 'load_drm = true', 'terminate_grace_s = 3',
                 '[daemons]', 'persistenced = false', 'fabricmanager = "false"',
                 '[runtime]', 'runtimes = ["none"]',
                 # the guest's GPU is a PCI function made of sysfs files: no CUDA call can be made, and the
                 # workload check is proven on the GPU machines and with stand-in libraries (tests/host)
                 '[validation]', 'workload = "off"', extra]
        for mod, kv in (params or {}).items():
            lines.append(f"[modules.parameters.{mod}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in kv.items()]
        os.makedirs("/etc/driverd", exist_ok=True)
        with open("/etc/driverd/config.toml", "w") as f:
            f.write("\n".join(lines) + "\n")

    # -- what the kernel shows ---------------------------------------------------------------------
    def dmesg_since_mark(self) -> list[str]:
        new, self.dmesg_mark = dmesg_since(self.dmesg_mark)
        return new

    def kernel_view(self) -> dict:
        mods = {}
        try:
            rows = open("/proc/modules").read().splitlines()
        except OSError:
            rows = []
        for row in rows:
            f = row.split()
            if not f[0].startswith(("nvidia", "nouveau")):
                continue
            name = f[0]
            pdir = f"/sys/module/{name}/parameters"
            params = {}
            for p in sorted(os.listdir(pdir)) if os.path.isdir(pdir) else []:
                try:
                    params[p] = open(os.path.join(pdir, p)).read().strip()
                except OSError as e:
                    params[p] = f"<{e.strerror}>"
            mods[name] = {"row": row, "refcnt": _read(f"/sys/module/{name}/refcnt"),
                          "holders": sorted(os.listdir(f"/sys/module/{name}/holders")) if os.path.isdir(
                              f"/sys/module/{name}/holders") else [],
                          "version": _read(f"/sys/module/{name}/version"), "parameters": params}
        return {"modules": mods, "nvidia_version": _read("/proc/driver/nvidia/version"),
                "devices": _read("/proc/devices"), "dev_nvidia": sorted(d for d in os.listdir("/dev")
                                                                        if d.startswith("nvidia"))}

    def state(self) -> dict:
        j = "/var/lib/driverd/journal.json"
        return {"kernel": self.kernel_view(), "journal": json.loads(open(j).read()) if os.path.exists(j) else None}

    # -- scenarios -----------------------------------------------------------------------------------
    def run(self, names: list[str]) -> None:
        self.dmesg_since_mark()
        for name in names:
            t0 = time.monotonic()
            try:
                res = getattr(self, "s_" + name.replace("-", "_"))()
            except Exception:
                res = {"error": traceback.format_exc()}
            res["seconds"] = round(time.monotonic() - t0, 2)
            res["dmesg"] = self.dmesg_since_mark()
            _write_json(os.path.join(self.out, f"{name}.json"), res)

    def s_setup(self) -> dict:
        """The stand-in GPU in the PCI view (see the module docstring), the kernel's own facts."""
        real = sorted(os.listdir(PCI))
        links = {a: os.readlink(os.path.join(PCI, a)) for a in real}
        subprocess.run(["mount", "-t", "tmpfs", "driverd-test-pci", PCI], check=True)
        for a, target in links.items():
            os.symlink(os.path.normpath(os.path.join("/sys/bus/pci/devices", target)), os.path.join(PCI, a))
        d = os.path.join(PCI, GPU_ADDR)
        os.makedirs(d)
        for k, v in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200"), ("subsystem_vendor", "0x10de"),
                     ("subsystem_device", "0x16c1"), ("numa_node", "-1")):
            with open(os.path.join(d, k), "w") as f:
                f.write(v + "\n")
        return {"uname": os.uname().release, "cmdline": _read("/proc/cmdline"), "pci": sorted(os.listdir(PCI)),
                "keys": _read("/proc/keys"), "sig_enforce": _read("/sys/module/module/parameters/sig_enforce"),
                "detect": self.driverd("detect", "--json")}

    def s_nouveau_then_apply(self) -> dict:
        """nouveau loaded (the real one, nothing bound) -> apply 535 with parameters: nouveau unloaded and
        blacklisted; the real modprobe then refuses to load nouveau for an NVIDIA GPU's alias."""
        load = sh("modprobe", "nouveau")
        before = self.kernel_view()
        self.config(self.spec["versions"]["535"], {"nvidia": {"NVreg_EnableMSI": 0, "NVreg_ResmanDebugLevel": 3,
                                              "NVreg_RegistryDwords": "RMStandin=1"}})
        apply = self.driverd("apply", "--json")
        after = self.state()
        alias = "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00"
        by_alias = sh("modprobe", "-v", alias)
        show = sh("modprobe", "-c")
        return {"modprobe_nouveau": load, "before": before, "apply": apply, "after": after,
                "alias_load": by_alias, "nouveau_after_alias": os.path.isdir("/sys/module/nouveau"),
                "blacklist_in_config": [ln for ln in show["stdout"].splitlines() if "nouveau" in ln][:10],
                "blacklist_file": _read("/etc/modprobe.d/driverd-blacklist-nouveau.conf"),
                "status": self.driverd("status", "--json")}

    def s_failing_reload(self) -> dict:
        """Reload to 550 whose nvidia init fails (NVreg_StandinFailInit=1 from the configuration): the
        kernel refuses the load, driverd rolls back to 535 with the parameters it was RUNNING with."""
        before = self.kernel_view()
        self.config(self.spec["versions"]["550"], {"nvidia": {"NVreg_EnableMSI": 0, "NVreg_ResmanDebugLevel": 3,
                                                              "NVreg_StandinFailInit": 1}})
        r = self.driverd("reload", "--package", self.spec["packages"]["550"], "--json")
        return {"before": before, "reload": r, "after": self.state()}

    def s_reload(self) -> dict:
        """Reload 535 -> 550 with new parameters (validated against the 550 module files first)."""
        self.config(self.spec["versions"]["550"], {"nvidia": {"NVreg_EnableMSI": 1, "NVreg_ResmanDebugLevel": 5}})
        bad = self._bad_parameter()
        r = self.driverd("reload", "--package", self.spec["packages"]["550"], "--json")
        return {"bad_parameter": bad, "reload": r, "after": self.state(), "status": self.driverd("status", "--json")}

    def _bad_parameter(self) -> dict:
        """A value the module's declared type refuses: driverd says so before unloading anything."""
        good = open("/etc/driverd/config.toml").read()
        with open("/etc/driverd/config.toml", "a") as f:
            f.write('NVreg_DeviceFileMode = "70000"\n')     # ushort: out of range
        r = self.driverd("reload", "--package", self.spec["packages"]["550"], "--json")
        with open("/etc/driverd/config.toml", "w") as f:
            f.write(good)
        return {"reload": r, "kernel": self.kernel_view()}

    def s_holder(self) -> dict:
        """A process holding /dev/nvidia0: unload refused naming its PID; with unload_policy=terminate it
        is stopped (SIGTERM) and the unload proceeds; then the driver is loaded again."""
        proc = subprocess.Popen(["sh", "-c", "exec 3</dev/nvidia0; echo ready; exec sleep 600"],
                                stdout=subprocess.PIPE, text=True)
        ready = proc.stdout.readline().strip()
        view = self.kernel_view()
        refused = self.driverd("unload", "--json")
        rmmod = sh("rmmod", "nvidia")
        _set_policy_terminate()
        unload = self.driverd("unload", "--json")
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "still running"
        after_unload = self.kernel_view()
        load = self.driverd("load", "--json")
        return {"holder_pid": proc.pid, "ready": ready, "view_with_holder": view, "refused": refused,
                "rmmod_with_holder": rmmod, "unload_terminate": unload, "holder_exit": rc,
                "after_unload": after_unload, "load": load, "after": self.state()}

    def s_reload_cost(self) -> dict:
        """What `driverd reload` of the driver in use costs (the same version and parameters: stop the GPU
        daemons, unload, load, validate) against the bare `modprobe -r` + `modprobe` of the same modules
        with the same parameters; alternately, spec["reload_runs"] times each after one untimed run of
        each (it fills the bytecode cache and the page cache), wall clock in the guest. Also the
        interpreter's start and driverd's (`--version`), the journal's phases of every reload, and
        what the kernel holds after every run. Leaves the driver loaded as it found it."""
        import tomllib
        runs = int(self.spec.get("reload_runs", 5))
        before = self.kernel_view()
        mods = [m for m in reversed(MODULES) if m in before["modules"]]           # load order
        cfg = tomllib.loads(open("/etc/driverd/config.toml").read())
        params = (cfg.get("modules") or {}).get("parameters") or {}
        load = [["modprobe", m] + [f"{k}={v}" for k, v in sorted((params.get(m) or {}).items())] for m in mods]
        bare = " && ".join(" ".join(a) for a in [["modprobe", "-r", *reversed(mods)]] + load)

        def held() -> dict:
            return {m: {"version": v["version"], "parameters": v["parameters"]}
                    for m, v in self.kernel_view()["modules"].items() if m.startswith("nvidia")}

        def one_driverd() -> dict:
            r = self.driverd("reload", "--json", bytecode=True)
            j = json.loads(_read("/var/lib/driverd/journal.json") or "null") or {}
            return {"seconds": r["seconds"], "rc": r["rc"], "stderr": r["stderr"][-2000:] if r["rc"] else "",
                    "state": (r.get("json") or {}).get("state"), "run_id": j.get("run_id"),
                    "run_seconds": round(j["finished_at"] - j["started_at"], 3) if j.get("finished_at") else None,
                    "steps": [{"action": x["action"], "status": x["status"], "seconds": _step_seconds(x)}
                              for x in j.get("steps") or []], "held": held()}

        def one_bare() -> dict:
            t0 = time.monotonic()
            r = sh("sh", "-c", bare)
            return {"seconds": round(time.monotonic() - t0, 3), "rc": r["rc"], "stderr": r["stderr"][-2000:],
                    "held": held()}

        def timed(argv: list[str]) -> float:
            t0 = time.monotonic()
            subprocess.run(argv, capture_output=True, env={**{k: v for k, v in os.environ.items()
                                                             if k != "PYTHONDONTWRITEBYTECODE"},
                                                          "PYTHONPYCACHEPREFIX": PYCACHE}, timeout=300, cwd="/")
            return round(time.monotonic() - t0, 3)

        out: dict = {"modules": mods, "parameters": params, "bare_command": bare, "held_before": held(),
                     "warmup": {"driverd": one_driverd(), "bare": one_bare()}, "driverd": [], "bare": []}
        for _ in range(runs):
            out["driverd"].append(one_driverd())
            out["bare"].append(one_bare())
        out["python_start"] = [timed([self.py, "-c", "pass"]) for _ in range(3)]
        # the interpreter, driverd's imports and the reload command's parser, nothing run
        out["driverd_start"] = [timed([self.py, "-m", "driverd", "reload", "--help"]) for _ in range(3)]
        st = self.driverd("status", bytecode=True)
        out["status_text"] = st.get("stdout", "")
        out["status"] = self.driverd("status", "--json", bytecode=True).get("json")
        if self.spec.get("reload_profile"):
            # where a reload's time goes: function by function (cProfile's own cost inflates it), and what
            # its imports cost (-X importtime, one more run)
            prof = os.path.join(self.out, "reload.prof")
            env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPYCACHEPREFIX": PYCACHE}
            r = subprocess.run([self.py, "-m", "cProfile", "-o", prof, "-m", "driverd", "reload", "--root", "/"],
                               capture_output=True, text=True, env=env, timeout=600, cwd="/")
            out["profile"] = {"rc": r.returncode, "path": prof, "stderr": r.stderr[-2000:]}
            r = subprocess.run([self.py, "-X", "importtime", "-m", "driverd", "reload", "--root", "/"],
                               capture_output=True, text=True, env=env, timeout=600, cwd="/")
            out["importtime"] = {"rc": r.returncode, "lines": [ln for ln in r.stderr.splitlines()
                                                                if ln.startswith("import time:")]}
        out["kmsg_vs_dmesg"] = self.kmsg_vs_dmesg()
        out["held_after"] = held()
        return out

    def kmsg_vs_dmesg(self) -> dict:
        """The kernel log as driverd reads it from /dev/kmsg (driverd.kmod.kmsg) next to util-linux dmesg's
        output, read one after the other: the lines both hold must be the same text."""
        code = ("import json; from driverd.kmod import kmsg; r = kmsg.records(); "
                "print(json.dumps(None if r is None else [ln for _t, ln in r]))")
        r = subprocess.run([self.py, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
        d = sh("dmesg")
        try:
            ours = json.loads(r.stdout)
        except ValueError:
            ours = None
        return {"kmsg": ours, "kmsg_stderr": r.stderr[-2000:], "dmesg": d["stdout"].splitlines(), "dmesg_rc": d["rc"]}

    def s_kernel_claims(self) -> dict:
        """The kernel's own words for what the simulated kernel claims, by insmod/rmmod of the installed
        stand-in files directly (driverd is not involved): parameter parsing, unknown parameters,
        missing symbols, refcounts and holders, in-use refusals, vermagic."""
        self.driverd("unload", "--json")
        rel = os.uname().release
        d = f"/lib/modules/{rel}/updates/driverd"
        files = {os.path.basename(p).split(".ko")[0].replace("-", "_"): os.path.join(d, p)
                 for p in os.listdir(d) if ".ko" in p} if os.path.isdir(d) else {}
        out: dict = {"files": files, "params": []}

        def attempt(label, argv):
            mark = dmesg_since(None)[1]
            r = sh(*argv)
            log = dmesg_since(mark)[0]
            return {"label": label, "argv": argv, "rc": r["rc"], "stderr": r["stderr"].strip(), "dmesg": log}

        nv = files.get("nvidia")
        for ptype, pname, values in self.spec["param_cases"]:
            for v in values:
                # modprobe, as driverd loads: its words are the errno's (insmod names some its own way)
                a = attempt(f"{pname}={v}", ["modprobe", "nvidia", f"{pname}={v}"])
                a["type"], a["value"] = ptype, v
                a["read_back"] = _read(f"/sys/module/nvidia/parameters/{pname}")
                if a["rc"] == 0:
                    sh("rmmod", "nvidia")
                out["params"].append(a)
        out["unknown_param"] = attempt("unknown", ["modprobe", "nvidia", "NVreg_NoSuchThing=1"])
        sh("rmmod", "nvidia")
        out["missing_symbol"] = attempt("uvm-first", ["insmod", files["nvidia_uvm"]])
        out["load_nvidia"] = attempt("nvidia", ["insmod", nv])
        out["load_uvm"] = attempt("uvm", ["insmod", files["nvidia_uvm"]])
        out["load_modeset"] = attempt("modeset", ["insmod", files["nvidia_modeset"]])
        out["load_drm"] = attempt("drm", ["insmod", files["nvidia_drm"]])
        out["view_loaded"] = self.kernel_view()
        out["rmmod_with_holders"] = attempt("rmmod-nvidia", ["rmmod", "nvidia"])
        out["modprobe_r_with_holders"] = attempt("modprobe-r-nvidia", ["modprobe", "-r", "nvidia"])
        out["rmmod_modeset_with_drm"] = attempt("rmmod-modeset", ["rmmod", "nvidia_modeset"])
        for m in ("nvidia_drm", "nvidia_modeset", "nvidia_uvm"):
            sh("rmmod", m)
        proc = subprocess.Popen(["sh", "-c", "exec 3</dev/nvidia0; echo ready; exec sleep 600"],
                                stdout=subprocess.PIPE, text=True)
        if not os.path.exists("/dev/nvidia0"):
            os.mknod("/dev/nvidia0", 0o666 | 0o020000, os.makedev(195, 0))
            proc.kill()
            proc = subprocess.Popen(["sh", "-c", "exec 3</dev/nvidia0; echo ready; exec sleep 600"],
                                    stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        out["view_open_file"] = self.kernel_view()
        out["rmmod_open_file"] = attempt("rmmod-open", ["rmmod", "nvidia"])
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        out["rmmod_after_close"] = attempt("rmmod-closed", ["rmmod", "nvidia"])
        out["rmmod_not_loaded"] = attempt("rmmod-absent", ["rmmod", "nvidia"])
        other = self.spec.get("other_kernel_module")
        if other:
            out["vermagic"] = attempt("vermagic", ["insmod", other])
            out["vermagic_modinfo"] = sh("modinfo", "-F", "vermagic", other)["stdout"].strip()
        out["modinfo_params"] = sh("modinfo", "-p", nv)["stdout"]
        return out

    def s_signatures(self) -> dict:
        """Booted with module.sig_enforce=1: the kernel's verdict on unsigned, test-key-signed and
        Debian-signed modules next to driverd's signer preflight on the same files."""
        out: dict = {"sig_enforce": _read("/sys/module/module/parameters/sig_enforce"), "cases": []}
        for label, pkg in sorted(self.spec["sig_packages"].items()):
            pf = subprocess.run([self.py, self.spec["preflight"], pkg],
                                capture_output=True, text=True, timeout=120)
            try:
                verdict = json.loads(pf.stdout)
            except ValueError:
                verdict = {"error": pf.stderr[-2000:]}
            mark = dmesg_since(None)[1]
            r = sh("insmod", verdict.get("nvidia_path") or "/nonexistent")
            log = dmesg_since(mark)[0]
            if r["rc"] == 0:
                sh("rmmod", "nvidia")
            out["cases"].append({"label": label, "preflight": verdict, "insmod_rc": r["rc"],
                                 "insmod_stderr": r["stderr"].strip(), "dmesg": log})
        # A module Debian signed (its key is in .builtin_trusted_keys): the preflight over the
        # kernel's own module tree, and the kernel loading it.
        deb = subprocess.run([self.py, self.spec["preflight"], "--module", "dummy"],
                             capture_output=True, text=True, timeout=120)
        try:
            dv = json.loads(deb.stdout)
        except ValueError:
            dv = {"error": deb.stderr[-2000:]}
        r = sh("modprobe", "dummy")
        out["debian_signed"] = {"preflight": dv, "modprobe_rc": r["rc"], "stderr": r["stderr"].strip()}
        sh("rmmod", "dummy")
        # Through driverd itself: apply with the untrusted-signer package refuses before loading.
        self.config(self.spec["versions"]["535"])
        out["apply"] = self.driverd("apply", "--json")
        out["after"] = self.kernel_view()
        return out

    def s_userspace_switch(self) -> dict:
        """Both halves of one driver (issue 31) with NVIDIA's real user-space (Debian's .debs, packed on the host
        by `driverd build-userspace`): apply 535 (stand-in modules + real user-space 535), switch to 550 in one
        transaction, `driverd rollback` to 535. After each, what the guest's own tools see (userspace_view)."""
        us = f'[userspace]\npackage = "{self.spec["userspace_dir"]}"\n'
        old, new = self.spec["versions"]["535"], self.spec["versions"]["550"]
        out: dict = {"meminfo_before": _meminfo()}
        for label, version, argv in (("apply_535", old, ("apply", "--json")), ("apply_550", new, ("apply", "--json")),
                                     ("rollback", new, ("rollback", "--json"))):
            self.config(version, extra=us)
            out[label] = {"run": self.driverd(*argv, timeout=900), "state": self.state(),
                          "userspace": self.userspace_view(), "status": self.driverd("status", "--json"),
                          "meminfo": _meminfo()}
        out["detect"] = self.driverd("detect", "--json")
        return out

    def userspace_view(self) -> dict:
        """The user-space as the guest's own tools see it: the real ldconfig's cache (-p), the sonames readelf
        reads in the tree userspace.root/current names, the PATH and driver-root links, and NVIDIA's nvidia-smi
        run through the PATH link (with the loader's own account of which libnvidia-ml it opened)."""
        root = "/var/lib/driverd/driver"
        tree = os.path.realpath(os.path.join(root, "current"))
        ldp = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=120)   # whole: sh() keeps a tail
        cache = {}
        for ln in ldp.stdout.splitlines():
            name, sep, path = ln.strip().partition(" => ")
            if sep and ("nvidia" in name or "libcuda" in name):
                cache[name.split()[0]] = {"path": path, "real": os.path.realpath(path)}
        lib64 = os.path.join(tree, "lib64")
        sonames, links = {}, {}
        for f in sorted(os.listdir(lib64)) if os.path.isdir(lib64) else []:
            p = os.path.join(lib64, f)
            if os.path.islink(p):
                links[f] = os.readlink(p)
                continue
            r = sh("readelf", "-d", p)
            m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", r["stdout"])
            sonames[f] = m.group(1) if m else f"<readelf rc {r['rc']}: {r['stderr'].strip()[:200]}>"
        smi = "/usr/local/bin/nvidia-smi"
        run = sh(smi, "--version", timeout=300) if os.path.lexists(smi) else None
        traced = sh(smi, "--version", timeout=300, env={"LD_DEBUG": "libs"}) if os.path.lexists(smi) else None
        loaded = [ln.split("calling init: ", 1)[1].strip() for ln in (traced or {}).get("stderr", "").splitlines()
                  if "calling init: " in ln and "libnvidia-ml" in ln]
        link = "/run/nvidia/driver"
        return {"current": _readlink(os.path.join(root, "current")), "tree": tree,
                "trees": sorted(os.listdir(root)) if os.path.isdir(root) else [],
                "tree_bytes": _tree_bytes(root),
                "ldconfig_rc": ldp.returncode, "ld_cache": cache,
                "ld_conf": _read("/etc/ld.so.conf.d/00-driverd-nvidia.conf"),
                "sonames": sonames, "links": links,
                "bin_link": _readlink(smi), "bin_real": os.path.realpath(smi),
                "nvidia_smi": run, "nvidia_smi_libnvidia_ml": loaded,
                "driver_link": _readlink(link), "driver_link_real": os.path.realpath(link),
                "manifest": json.loads(_read(os.path.join(tree, "manifest.json")) or "null")}


    # -- reboots (tests/vm/test_vm_reboot.py) ------------------------------------------------------------
    def persist(self) -> dict:
        """What a disk keeps across the guest's boots, on the runtime image (one image for both boots): the
        state directory (journal, kept packages, driverd's user-space trees under /var/lib/driverd/driver)
        and /boot. /etc (the loader configuration), /usr/local/bin, /run and /var's other files are the
        guest's private overlays and tmpfs: gone after a reboot, as /run is on any host. The next kernel's
        headers, which this machine has for building its stand-ins, are hidden: the node has none."""
        rt = self.spec["rt"]
        out = {}
        for src, dst in ((f"{rt}/persist/var-lib-driverd", "/var/lib/driverd"), (f"{rt}/persist/boot", "/boot")):
            os.makedirs(src, exist_ok=True)
            os.makedirs(dst, exist_ok=True)
            out[dst] = sh("mount", "--bind", src, dst)["rc"]
        for hdr in self.spec.get("hide", []):
            if os.path.isdir(hdr):
                out[hdr] = sh("mount", "-t", "tmpfs", "driverd-test-no-headers", hdr)["rc"]
        return out

    def reboot_config(self, repos: str, extra: str = "", userspace: str = "fetch = true\n") -> None:
        """`userspace`: the [userspace] section's keys (the repository's by default; `package = "FILE"` for
        userspace.package)."""
        self.config(self.spec["versions"]["535"], extra=extra)
        text = open("/etc/driverd/config.toml").read().replace(f'repositories = ["file://{self.spec["repo"]}"]',
                                                               f"repositories = {repos}\ninsecure = true")
        text += (f'[userspace]\n{userspace}[daemon]\ninterval_s = 900\nconfig_check_s = 2\nretry_min_s = 5\n'
                 'retry_max_s = 20\n')
        with open("/etc/driverd/config.toml", "w") as f:
            f.write(text)

    def s_reboot_prepare(self) -> dict:
        """Boot 1 (the running kernel): the driver with its user-space from the repository (userspace.fetch);
        the next kernel installed as its Debian package would (its image in /boot, its modules and their index,
        its dpkg record) with no package for it in the repository; reboot-ready, the daemon's metric; then its
        package appears in the repository and the daemon prepares it; reboot-ready again."""
        nxt = self.spec["next_release"]
        out: dict = {"persist": self.persist()}
        self.reboot_config(f'["file://{self.spec["repo"]}"]')
        out["apply"] = self.driverd("apply", "--json", timeout=1800)
        out["userspace"] = self.userspace_view()
        out["state"] = self.state()
        # the running kernel as Debian installed it, then the next one
        rel = os.uname().release
        for r, image in ((rel, self.spec["running_image"]), (nxt, self.spec["next_image"])):
            sh("cp", image, f"/boot/vmlinuz-{r}")
            sh("cp", os.path.join(os.path.dirname(image), f"config-{r}"), f"/boot/config-{r}")
            with open("/var/lib/dpkg/status", "a") as f:
                f.write(f"\nPackage: linux-image-{r}\nStatus: install ok installed\nPriority: optional\n"
                        f"Section: kernel\nArchitecture: amd64\nVersion: 6.1.0-1\nDescription: Linux {r}\n\n")
        os.makedirs(f"/lib/modules/{nxt}", exist_ok=True)
        out["next_modules"] = sh("mount", "--bind", f"{self.spec['rt']}/modroot/lib/modules/{nxt}", f"/lib/modules/{nxt}")
        out["gate_closed"] = self.driverd("reboot-ready", "--json")
        d = GuestDaemon(self)
        try:
            out["unprepared_metric"] = d.wait_metric("driverd_kernel_unprepared", {"kernel": nxt}, 1.0, 900)
            out["log_before"] = d.text()
            out["status"] = self.driverd("status", "--json")
            mark = len(d.lines)
            # the package appears in the repository, as `driverd build` + `driverd repo index` would put it there
            for f in os.listdir(self.spec["next_pkg_dir"]):
                sh("cp", os.path.join(self.spec["next_pkg_dir"], f), self.spec["repo"])
            out["index"] = self.driverd("repo", "index", self.spec["repo"], "--json")
            out["prepared_metric"] = d.wait_metric("driverd_kernel_unprepared", {"kernel": nxt}, 0.0, 900)
            out["log_after"] = "\n".join(d.lines[mark:])
        finally:
            out["daemon_stop"] = d.stop()
        out["gate_open"] = self.driverd("reboot-ready", "--json")
        out["runs"] = journal_runs()
        out["next_tree"] = sorted(os.listdir(f"/lib/modules/{nxt}/updates/driverd")) if os.path.isdir(
            f"/lib/modules/{nxt}/updates/driverd") else None
        return out

    def s_reboot_next(self) -> dict:
        """Boot 2 (the next kernel), the repository refusing connections (nothing listens on its port): the
        daemon brings the node back from what is on disk — the package prepared for this kernel, the user-space
        tree — remaking the loader configuration and the driver-root link; READY=1. Then the previous kernel is
        removed (its image and dpkg record): the daemon removes what driverd kept for it."""
        out: dict = {"persist": self.persist()}
        self.reboot_config(REFUSING)
        out["before"] = {"ld_conf": _read("/etc/ld.so.conf.d/00-driverd-nvidia.conf"),
                         "driver_link": _readlink("/run/nvidia/driver"), "kernel": self.kernel_view()}
        out["plan"] = self.driverd("plan", "--json")
        runs_before = {x["run_id"] for x in journal_runs()}
        d = GuestDaemon(self)
        try:
            out["ready"] = d.wait_notify("READY=1", 1500)
            out["kernel"] = self.kernel_view()
            out["userspace"] = self.userspace_view()
            out["modinfo_filename"] = sh("modinfo", "-n", "nvidia")
            out["runs"] = [x for x in journal_runs() if x["run_id"] not in runs_before]
            kept = "/var/lib/driverd/packages/kept"
            out["kept_before"] = kept_releases(kept)
            prev = self.spec["running_release"]
            os.unlink(f"/boot/vmlinuz-{prev}")
            out["forget_log"] = d.wait_log(f"removed driverd's packages of kernel\\(s\\) no longer installed: {prev}", 900)
            out["kept_after"] = kept_releases(kept)
            out["log"] = d.text()
        finally:
            out["daemon_stop"] = d.stop()
        return out

    def s_userspace_from_package(self) -> dict:
        """Boot 2, after reboot_next, the repository still refusing connections: the configuration switches the
        user-space to userspace.package, a local package file of the same 535 version that the repository does
        not list (built from a smaller set of Debian's .debs: another sha256). `driverd apply` installs it from
        that file (no fetch) and makes it the one in use: what boot 3 must bring back."""
        out: dict = {}
        self.reboot_config(REFUSING, userspace=f'package = "{self.spec["us_package"]}"\n')
        runs_before = {x["run_id"] for x in journal_runs()}
        out["apply"] = self.driverd("apply", "--json", timeout=1800)
        out["runs"] = [x for x in journal_runs() if x["run_id"] not in runs_before]
        out["current"] = _readlink("/var/lib/driverd/driver/current")
        out["driver_link"] = _readlink("/run/nvidia/driver")
        out["trees"] = sorted(os.listdir("/var/lib/driverd/driver"))
        out["kernel"] = self.kernel_view()
        return out

    def s_reboot_container(self) -> dict:
        """Boot 3 (the next kernel again), the repository refusing connections, the user-space configured as
        userspace.package (installed from it in boot 2): `driverd container-entrypoint` as the driver container
        runs it (deploy/base/daemonset.yaml): the host's root mounted into the container (an rbind of the
        guest's / in a mount namespace of its own, propagation slave: hostPath with HostToContainer), given as
        --root and DRIVERD_ROOT, the configuration from a file of the container's own (DRIVERD_CONFIG, the
        ConfigMap's mount), the host's PIDs (hostPID). It loads the driver from the package prepared in boot 1,
        makes the user-space active again from its installed tree, READY=1 and /readyz 200 — no fetch."""
        out: dict = {"persist": self.persist()}
        self.reboot_config(REFUSING, userspace=f'package = "{self.spec["us_package"]}"\n')
        out["before"] = {"ld_conf": _read("/etc/ld.so.conf.d/00-driverd-nvidia.conf"),
                         "driver_link": _readlink("/run/nvidia/driver"),
                         "current": _readlink("/var/lib/driverd/driver/current"), "kernel": self.kernel_view()}
        runs_before = {x["run_id"] for x in journal_runs()}
        d = GuestDaemon(self, container=True)
        try:
            out["ready"] = d.wait_notify("READY=1", 1500)
            out["readyz"] = d.status("/readyz")
            out["kernel"] = self.kernel_view()
            out["userspace"] = self.userspace_view()
            out["modinfo_filename"] = sh("modinfo", "-n", "nvidia")
            out["runs"] = [x for x in journal_runs() if x["run_id"] not in runs_before]
            out["container"] = d.container
            out["log"] = d.text()
        finally:
            out["daemon_stop"] = d.stop()
        return out


class GuestDaemon:
    """`driverd daemon --root /` in the guest, as systemd runs it: a notify socket, its stderr, its /metrics.
    `container`: `driverd container-entrypoint` as the driver container runs it (deploy/base/daemonset.yaml:
    args container-entrypoint --root /host, DRIVERD_ROOT=/host, DRIVERD_CONFIG the ConfigMap's file, the host
    root a hostPath mount of / with HostToContainer propagation, hostPID): in a mount namespace of its own
    (unshare, propagation slave) the guest's / is rbind-mounted at CONTAINER_HOST, and /etc/driverd/config.toml
    is copied to CONTAINER_CONFIG. The notify socket stands for the kubelet's readiness probe (/readyz is read
    too)."""

    def __init__(self, g: Guest, container: bool = False) -> None:
        import shutil
        import socket
        import threading
        self.dir = "/tmp/driverd-daemon"
        os.makedirs(self.dir, exist_ok=True)
        self.notify = os.path.join(self.dir, "notify")
        if os.path.exists(self.notify):
            os.unlink(self.notify)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.notify)
        self.sock.settimeout(1.0)
        self.lines: list[str] = []
        self.messages: list[str] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIVERD_", "FAULTS_"))}
        env.update(NOTIFY_SOCKET=self.notify, PYTHONDONTWRITEBYTECODE="1")
        argv = [g.py, "-m", "driverd", "daemon", "--root", "/", "--listen", "127.0.0.1:0"]
        self.container = None
        if container:
            for d in (CONTAINER_HOST, os.path.dirname(CONTAINER_CONFIG)):
                os.makedirs(d, exist_ok=True)
                os.chmod(d, 0o755)
            shutil.copyfile("/etc/driverd/config.toml", CONTAINER_CONFIG)
            os.chmod(CONTAINER_CONFIG, 0o644)        # driverd trusts a configuration only root can change
            env.update(DRIVERD_ROOT=CONTAINER_HOST, DRIVERD_CONFIG=CONTAINER_CONFIG)
            argv = ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c",
                    f'mount --rbind / {CONTAINER_HOST} && exec "$@"', "sh",
                    g.py, "-m", "driverd", "container-entrypoint", "--root", CONTAINER_HOST, "--listen", "127.0.0.1:0"]
            self.container = {"argv": argv, "env": {k: env[k] for k in ("DRIVERD_ROOT", "DRIVERD_CONFIG")}}
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd="/")
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._notify, daemon=True).start()
        m = self.wait_log(r"listening on 127\.0\.0\.1:(\d+)", 600)
        self.port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", m).group(1))

    def _read(self) -> None:
        for ln in self.proc.stderr:
            self.lines.append(ln.rstrip("\n"))

    def _notify(self) -> None:
        while self.proc.poll() is None:
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except OSError:
                continue

    def text(self) -> str:
        return "\n".join(self.lines)[-20000:]

    def wait_log(self, pattern: str, timeout: float) -> str:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for ln in list(self.lines):
                if rx.search(ln):
                    return ln
            if self.proc.poll() is not None:
                break
            time.sleep(1)
        raise AssertionError(f"no daemon log line matching {pattern!r} in {timeout}s:\n{self.text()[-4000:]}")

    def wait_notify(self, needle: str, timeout: float) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            hit = next((m for m in self.messages if needle in m), None)
            if hit is not None:
                return {"message": hit, "seconds": round(time.monotonic() - t0, 1), "all": list(self.messages)}
            if self.proc.poll() is not None:
                break
            time.sleep(1)
        raise AssertionError(f"no {needle} in {timeout}s: {self.messages}\n{self.text()[-4000:]}")

    def metric(self, name: str, labels: dict) -> float | None:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as r:
            text = r.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for ln in text.splitlines():
            if ln.startswith(f"{name}{{{want}}} "):
                return float(ln.rsplit(" ", 1)[1])
        return None

    def status(self, path: str) -> dict:
        """An HTTP GET of the daemon's endpoint: its status code and body."""
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=60) as r:
                return {"code": r.status, "body": r.read().decode(errors="replace")[-2000:]}
        except urllib.error.HTTPError as e:
            return {"code": e.code, "body": e.read().decode(errors="replace")[-2000:]}

    def wait_metric(self, name: str, labels: dict, value: float, timeout: float) -> dict:
        t0 = time.monotonic()
        got = None
        while time.monotonic() - t0 < timeout:
            got = self.metric(name, labels)
            if got == value:
                return {"value": got, "seconds": round(time.monotonic() - t0, 1)}
            time.sleep(2)
        raise AssertionError(f"{name}{labels} is {got}, not {value}, after {timeout}s:\n{self.text()[-4000:]}")

    def stop(self) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
        return {"rc": self.proc.returncode}


def journal_runs() -> list[dict]:
    """Every run on disk, archived ones first (journal.d keeps the newest state.journal_keep: a run is new when
    its run_id was not there before, not by counting)."""
    d = "/var/lib/driverd"
    out = []
    jd = os.path.join(d, "journal.d")
    for f in sorted(os.listdir(jd)) if os.path.isdir(jd) else []:
        out.append(json.loads(open(os.path.join(jd, f)).read()))
    if os.path.exists(os.path.join(d, "journal.json")):
        out.append(json.loads(open(os.path.join(d, "journal.json")).read()))
    return [{"command": r.get("command"), "state": r.get("state"), "run_id": r.get("run_id"),
             "steps": [s["action"] for s in r.get("steps") or []],
             "userspace": [s.get("params") for s in r.get("steps") or [] if s["action"] == "install-userspace"]}
            for r in out]


def kept_releases(kept: str) -> list[str]:
    out = []
    for e in sorted(os.listdir(kept)) if os.path.isdir(kept) else []:
        m = _read(os.path.join(kept, e, "modules", "manifest.json"))
        try:
            out.append(json.loads(m)["kernel"]["release"] if m else None)
        except (ValueError, KeyError, TypeError):
            out.append(None)
    return out


def _step_seconds(step: dict) -> float | None:
    """A journal step's duration: driverd's own `seconds`, else (a driverd before it recorded them) its end
    minus its start."""
    if step.get("seconds") is not None:
        return step["seconds"]
    if step.get("started_at") and step.get("finished_at"):
        return round(step["finished_at"] - step["started_at"], 3)
    return None


def dmesg_since(mark: float | None) -> tuple[list[str], float]:
    """The kernel log's lines stamped after `mark` (seconds since boot), and the new mark. By stamp, not
    by count: the ring buffer is full after a verbose boot and drops old lines."""
    out, t, last = [], 0.0, 0.0
    for ln in sh("dmesg")["stdout"].splitlines():
        if ln.startswith("[") and "]" in ln:
            try:
                t = float(ln[1:ln.index("]")])
            except ValueError:
                pass
        last = t
        if mark is not None and t > mark:
            out.append(ln)
    return out, last


def _set_policy_terminate() -> None:
    text = open("/etc/driverd/config.toml").read()
    text = text.replace("[modules]\n", '[modules]\nunload_policy = "terminate"\n', 1)
    with open("/etc/driverd/config.toml", "w") as f:
        f.write(text)


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _tree_bytes(path: str) -> int:
    n = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            n += st.st_size if not os.path.islink(os.path.join(d, f)) else 0
    return n


def _meminfo() -> dict:
    out = {}
    for ln in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = ln.partition(":")
        if k in ("MemTotal", "MemAvailable", "Shmem"):
            out[k] = v.strip()
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    g = Guest(spec)
    t0 = time.monotonic()
    g.run(spec["scenarios"])
    os.sync()               # the runtime image is the next boot's disk (tests/vm/test_vm_reboot.py)
    _write_json(os.path.join(spec["out"], "done.json"), {"seconds": round(time.monotonic() - t0, 2),
                                                         "uptime": _read("/proc/uptime")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
