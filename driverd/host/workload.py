"""Workload-ready: the driver's user-space and kernel half agree and a CUDA call works on every GPU.

"Loaded" is not "ready": a kernel-only upgrade leaves the old libcuda and libnvidia-ml in front of the
new modules (NVML: "RM has detected an NVML/RM version mismatch", cuInit: 803), and a GPU can be visible
to the driver while CUDA cannot open it (no fabric on an NVSwitch system, a wedged GPU). So the check
loads the very libraries containers will get (`driverd.driver.files.find`, the CDI spec's finder) in a
short-lived child (`driverd.host.cudaprobe`) and judges what it saw:

1. the user-space exists, and its version (the libraries' real file names) is the loaded module's;
2. NVML starts, `nvmlSystemGetDriverVersion` equals the loaded module's version, NVML sees every GPU
   PCI shows (by bus id);
3. the CUDA driver API initialises, and on each GPU a context and a memory round trip succeed;
4. where NVML reports a GPU fabric (NVSwitch systems), its registration is complete and healthy.

A problem is one line in operators' words with the fix; the CUDA error by name, never its number. The
child is killed after `timeout_s` (a hung cuInit is a hung GPU or driver, and says where it hung).
`quick()` is the file-only half (1.) that detect and plan use: no library is loaded.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import asdict, field

from driverd.datatypes import dataclass
from driverd.driver.files import UserSpace, find
from driverd.root import Root

# nvmlReturn_t values of NVML errors we put into words (nvml.h)
_NVML_WORDS = {"NVMLError_LibRmVersionMismatch": "NVML/RM version mismatch",
               "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded (NVML)",
               "NVMLError_NoPermission": "no permission to open the GPU device nodes (NVML)",
               "NVMLError_LibraryNotFound": "NVML library not found"}
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
ROUNDTRIP_BYTES = 1 << 20


@dataclass
class WorkloadCheck:
    """The outcome of one workload check: CUDA on every GPU, or what failed and how to fix it."""
    ok: bool
    problems: list[str] = field(default_factory=list)
    fix: str | None = None
    kernel_version: str | None = None
    userspace: dict = field(default_factory=dict)
    nvml: dict | None = None
    cuda: dict | None = None
    gpus_expected: list[str] = field(default_factory=list)
    seconds: float = 0.0
    hung_at: str | None = None
    crash: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    def reason(self) -> str:
        return "; ".join(self.problems) + (f"; fix: {self.fix}" if self.fix else "")


def _bus(b: str) -> str:
    """PCI bus ids as NVML/CUDA print them (00000000:3B:00.0) and as sysfs does (0000:3b:00.0), one form."""
    b = b.strip().lower()
    dom, _, rest = b.partition(":")
    return f"{int(dom, 16):04x}:{rest}" if rest and all(c in "0123456789abcdef" for c in dom) else b


def mismatch_line(userspace: str, kernel: str, extra: str = "") -> str:
    return f"user-space {userspace} does not match the loaded kernel driver {kernel}" + (f": {extra}" if extra else "")


def mismatch_fix(userspace: str | None, kernel: str) -> str:
    return (f"install the {kernel} user-space (libcuda, libnvidia-ml, nvidia-smi) where containers get it, "
            f"or load the {userspace} kernel modules" if userspace else
            f"install the {kernel} user-space (libcuda, libnvidia-ml, nvidia-smi)")


def quick(root: Root, kernel_version: str | None, driver_root: str | None = None) -> tuple[UserSpace, list[str]]:
    """The file-only half: where the user-space is and whether its version is the loaded driver's."""
    us = find(root, driver_root)
    problems = []
    if kernel_version and not us.found:
        problems.append(f"no NVIDIA user-space (libcuda.so.1, libnvidia-ml.so.1) found for the loaded driver "
                        f"{kernel_version} (looked in {', '.join(us.searched[:4])}, ...): containers cannot use the GPUs")
    elif kernel_version and len(set(us.versions.values())) > 1:
        problems.append("the user-space is a mixture of versions: "
                        + ", ".join(f"{k} {v}" for k, v in sorted(us.versions.items())))
    elif kernel_version and us.version and us.version != kernel_version:
        problems.append(mismatch_line(us.version, kernel_version))
    return us, problems


def check(root: Root, kernel_version: str | None, gpus_expected: list[str], *, driver_root: str | None = None,
          timeout_s: float = 60.0, python: str | None = None) -> WorkloadCheck:
    """The whole check (see the module's text). Never raises: every failure is a problem."""
    t0 = time.monotonic()
    us, problems = quick(root, kernel_version, driver_root)
    res = WorkloadCheck(False, kernel_version=kernel_version, userspace=us.to_json(),
                        gpus_expected=sorted(_bus(g) for g in gpus_expected))
    if not us.found:
        res.problems = problems
        res.fix = f"install the {kernel_version or 'driver'}'s user-space (libcuda, libnvidia-ml, nvidia-smi)"
        res.seconds = round(time.monotonic() - t0, 3)
        return res
    spec = {"bytes": ROUNDTRIP_BYTES}
    for key, soname in (("nvml", "libnvidia-ml.so.1"), ("cuda", "libcuda.so.1")):
        if soname in us.libs:
            spec[key] = str(root.path(us.libs[soname]))
    events, hung_at = _run_child(root, us, spec, timeout_s, python)
    res.nvml = next((e["nvml"] for e in events if "nvml" in e), None)
    res.cuda = next((e["cuda"] for e in events if "cuda" in e), None)
    res.hung_at = hung_at
    res.crash = next((e["crash"] for e in events if "crash" in e), None)
    _judge(res, us, problems, timeout_s)
    res.ok = not res.problems
    res.seconds = round(time.monotonic() - t0, 3)
    return res


def _run_child(root: Root, us: UserSpace, spec: dict, timeout_s: float, python: str | None) -> tuple[list[dict], str | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")}
    # the libraries the key ones load later (ptxjitcompiler, nvvm...) come from the same directory, as in a container
    # (links resolved inside the Root: a driver root such as /run/nvidia/driver -> userspace.root/current, or
    # an absolute link in a sample tree, must not make the loader search the machine's own directories)
    env["LD_LIBRARY_PATH"] = str(root.safe_real(us.lib_dir or "/") or root.path(us.lib_dir or "/"))
    # One work queue per context instead of CUDA's 8 (issue 47: on an H200 a context with 8 took ~100 ms
    # longer): the check proves the driver makes a context, allocates and copies both ways on each GPU;
    # how many queues a workload later asks for is its own setting, and the child's environment is the
    # check's alone.
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    # isolated, in /: nothing from the caller's working directory or environment is imported as root
    from driverd.runner import CHILD_CWD, python_child      # not at import: detect never spawns the check
    argv = python_child("driverd.host.cudaprobe", json.dumps(spec), python=python, site_modules=("pynvml",))
    try:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             env=env, text=True, start_new_session=True, cwd=CHILD_CWD)
    except OSError as e:
        return [{"nvml": {"ok": False, "error": "spawn", "message": str(e)}}], None
    # The answer is complete at the child's "done" line: its GPU contexts are torn down by its exit, which
    # nobody needs to wait for (issue 47: about a sixth of the check); a reaper collects it, and kills one
    # whose teardown hangs.
    out: list[str] = []
    err: list[str] = []
    done = threading.Event()

    def read_out() -> None:
        for line in p.stdout:
            out.append(line)
            if '"stage": "done"' in line:
                done.set()
        done.set()                                  # EOF: the child ended, with or without "done"
    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)]
    for t in readers:
        t.start()
    if not done.wait(timeout_s):
        p.kill()
        p.wait()
        for t in readers:
            t.join(5)
        events = _parse("".join(out))
        return events, _hung_at(events)
    events = _parse("".join(out))
    if not any(e.get("stage") == "done" for e in events):
        p.wait()
        readers[1].join(5)
        tail = "".join(err).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        stages = [e["stage"] for e in events if "stage" in e]
        events.append({"crash": f"the check process died at {stages[-1] if stages else 'start'}: {tail[0][:200]}"})
    threading.Thread(target=_reap, args=(p,), daemon=True, name="cudaprobe-reaper").start()
    return events, None


def _reap(p: subprocess.Popen, grace_s: float = 30.0) -> None:
    try:
        p.wait(grace_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _hung_at(events: list[dict]) -> str:
    """Where a killed check was: the GPUs whose calls had started and not ended (the devices run at once),
    else its last stage."""
    stages = [e["stage"] for e in events if "stage" in e]
    done = {e["device_done"] for e in events if "device_done" in e}
    pending = [s for s in stages if s.startswith("device ") and s[7:].isdigit() and int(s[7:]) not in done]
    if pending:
        return pending[0] if len(pending) == 1 else f"devices {', '.join(s[7:] for s in pending)}"
    # NVML and CUDA run at once: the stage of the one without its result
    nvml = [s for s in stages if s.startswith("nvml")]
    cuda = [s for s in stages if not s.startswith("nvml")]
    if any("nvml" in e for e in events) and cuda:
        return cuda[-1]
    if any("cuda" in e for e in events) and nvml:
        return nvml[-1]
    return stages[-1] if stages else "start"


def _parse(out: str) -> list[dict]:
    events = []
    for line in (out or "").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            events.append(doc)
    return events


def _judge(res: WorkloadCheck, us: UserSpace, problems: list[str], timeout_s: float) -> None:
    kv = res.kernel_version
    nvml, cuda = res.nvml, res.cuda
    fixes: list[str] = []
    if problems and us.version and kv and us.version != kv:
        extra = "NVML/RM version mismatch" if nvml and nvml.get("error") == "NVMLError_LibRmVersionMismatch" else ""
        problems = [mismatch_line(us.version, kv, extra)] + problems[1:]
        fixes.append(mismatch_fix(us.version, kv))
    res.problems = list(problems)
    mismatch_said = bool(fixes)
    if res.hung_at:
        res.problems.append(f"the CUDA check did not finish within {timeout_s:g}s (stuck at {res.hung_at}): "
                            "a hung GPU or driver")
        fixes.append("look at the kernel log (NVRM, Xid) and nvidia-smi; a GPU reset or a reboot may be needed")
    if nvml is None and not res.hung_at:
        res.problems.append("NVML gave no answer" + (f" ({res.crash})" if res.crash else ""))
    elif nvml and not nvml.get("ok"):
        words = _NVML_WORDS.get(nvml.get("error", ""), nvml.get("message") or nvml.get("error"))
        if not (mismatch_said and nvml.get("error") == "NVMLError_LibRmVersionMismatch"):
            res.problems.append(f"NVML cannot start: {words}")
    elif nvml:
        nv = nvml.get("driver_version")
        if kv and nv and nv != kv and not mismatch_said:
            res.problems.append(mismatch_line(nv, kv, "NVML reports another driver version"))
            fixes.append(mismatch_fix(nv, kv))
        seen = {_bus(d["pci_bus_id"]) for d in nvml.get("devices", [])}
        missing = [g for g in res.gpus_expected if g not in seen]
        if missing:
            res.problems.append(f"NVML sees {len(seen)} GPU(s), PCI shows {len(res.gpus_expected)}: "
                                f"not seen {', '.join(missing)}")
        for d in nvml.get("devices", []):
            f = d.get("fabric")
            if f and (f.get("state") != 3 or f.get("status", 0) != 0):
                state = FABRIC_STATES.get(f.get("state"), str(f.get("state")))
                res.problems.append(f"GPU {_bus(d['pci_bus_id'])}: NVLink fabric registration {state}"
                                    + (f" (status {f.get('status')})" if f.get("status") else "")
                                    + ": CUDA cannot use the GPU until it completes")
                if "fabric" not in " ".join(fixes):
                    fixes.append("start nvidia-fabricmanager of the driver's version (and IMEX where used)")
    if cuda is None and not res.hung_at and nvml is not None:
        res.problems.append("the CUDA check gave no answer" + (f" ({res.crash})" if res.crash else ""))
    elif cuda and not cuda.get("ok") and "devices" not in cuda:
        err = cuda.get("error")
        if err == "load":
            res.problems.append(f"libcuda.so.1 cannot be loaded: {cuda.get('message')}")
        elif not (mismatch_said and err == "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"):
            res.problems.append(f"CUDA cannot initialise: {cuda.get('call', 'cuInit')} returned {err}")
        else:
            res.problems[0] += f" (cuInit: {err})"
    elif cuda:
        for d in cuda.get("devices", []):
            if not d.get("ok"):
                where = _bus(d["pci_bus_id"]) if d.get("pci_bus_id") else f"CUDA device {d['ordinal']}"
                what = d.get("error", "failed")
                res.problems.append(f"GPU {where}: {d.get('call') + ' returned ' if d.get('call') else ''}{what}")
        cu_seen = {_bus(d["pci_bus_id"]) for d in cuda.get("devices", []) if d.get("pci_bus_id")}
        cu_missing = [g for g in res.gpus_expected if g not in cu_seen]
        if cu_missing and cuda.get("devices") is not None:
            res.problems.append(f"CUDA sees {len(cuda.get('devices', []))} GPU(s), PCI shows "
                                f"{len(res.gpus_expected)}: not seen {', '.join(cu_missing)}")
    if res.problems and not fixes:
        fixes.append("see the problems above, the kernel log (NVRM, Xid) and nvidia-smi")
    res.fix = "; ".join(dict.fromkeys(fixes)) or None
