"""The workload check's child process: loads the driver's own libraries by path, asks NVML, then makes
real CUDA driver-API calls (cuInit, a context and a memory round trip on every GPU) and prints what it
saw as JSON lines on stdout, one per stage, so a parent that has to kill a hung call knows where it hung.

Run only as `python -m driverd.host.cudaprobe SPEC` by driverd.host.workload: a GPU context and the
libraries keep memory and threads for the life of a process, and a hung call must be killable.
NVML goes through pynvml (NVIDIA's bindings); the library file is loaded first by its exact path, so
pynvml's `dlopen("libnvidia-ml.so.1")` finds that one (glibc matches a loaded object by its soname).
The CUDA driver API has no binding among driverd's dependencies: a few ctypes calls, no toolkit.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading

# CUDA driver API result codes (cuda.h, CUresult) we name when cuGetErrorName itself is unusable.
_CU_NAMES = {0: "CUDA_SUCCESS", 3: "CUDA_ERROR_NOT_INITIALIZED", 100: "CUDA_ERROR_NO_DEVICE",
             101: "CUDA_ERROR_INVALID_DEVICE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 999: "CUDA_ERROR_UNKNOWN",
             802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
             804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
             46: "CUDA_ERROR_DEVICES_UNAVAILABLE", 214: "CUDA_ERROR_ECC_UNCORRECTABLE"}


_EMIT = threading.Lock()
CUINIT_DONE = threading.Event()          # cuInit returned (or failed): NVML may open the GPUs now


def emit(doc: dict) -> None:
    line = json.dumps(doc) + "\n"
    with _EMIT:                 # the GPUs' threads report at once: whole lines, never interleaved
        sys.stdout.write(line)
        sys.stdout.flush()


def _s(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def probe_nvml(path: str) -> None:
    emit({"stage": "nvml-load"})
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        import pynvml
    except (OSError, ImportError) as e:
        emit({"nvml": {"ok": False, "error": "load", "message": str(e)}})
        return
    emit({"stage": "nvml-init"})
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        emit({"nvml": {"ok": False, "error": type(e).__name__, "code": e.value, "message": _s(e)}})
        return
    try:
        out: dict = {"ok": True, "driver_version": _s(pynvml.nvmlSystemGetDriverVersion()), "devices": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            dev = {"index": i, "pci_bus_id": _s(pynvml.nvmlDeviceGetPciInfo(h).busId).lower(), "fabric": None,
                   "persistence_mode": None}
            try:        # for the validation's persistence check: no second NVML start for it
                dev["persistence_mode"] = pynvml.nvmlDeviceGetPersistenceMode(h) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                pass
            info = pynvml.c_nvmlGpuFabricInfo_t()
            try:
                pynvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
                if info.state != pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
                    dev["fabric"] = {"state": int(info.state), "status": int(info.status)}
            except (pynvml.NVMLError, AttributeError):
                pass        # no fabric on this GPU / an NVML without the call: nothing to judge
            out["devices"].append(dev)
        emit({"nvml": out})
    except pynvml.NVMLError as e:
        emit({"nvml": {"ok": False, "error": type(e).__name__, "code": e.value, "message": _s(e)}})
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


class _Cuda:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)

    def name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        try:
            if self.lib.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
                return s.value.decode()
        except AttributeError:
            pass
        return _CU_NAMES.get(rc, f"CUresult {rc}")

    def call(self, fn: str, *args) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            raise _CudaError(fn, rc, self.name(rc))


class _CudaError(Exception):
    def __init__(self, fn: str, rc: int, name: str) -> None:
        super().__init__(f"{fn}: {name}")
        self.fn, self.rc, self.cu_name = fn, rc, name


def probe_cuda(path: str, nbytes: int) -> None:
    emit({"stage": "cuda-load"})
    try:
        cu = _Cuda(path)
    except OSError as e:
        CUINIT_DONE.set()
        emit({"cuda": {"ok": False, "error": "load", "message": str(e)}})
        return
    emit({"stage": "cuInit"})
    try:
        try:
            cu.call("cuInit", 0)
        finally:
            CUINIT_DONE.set()
        ver, count = ctypes.c_int(), ctypes.c_int()
        cu.call("cuDriverGetVersion", ctypes.byref(ver))
        cu.call("cuDeviceGetCount", ctypes.byref(count))
    except _CudaError as e:
        emit({"cuda": {"ok": False, "error": e.cu_name, "call": e.fn, "code": e.rc}})
        return
    out: dict = {"ok": True, "driver_api": ver.value, "devices": []}
    # a 251-byte run (prime: it never lines up with a page or a power of two) repeated, built in C: a
    # byte-at-a-time generator over 1 MiB cost the check ~80 ms of Python before the first context
    run = bytes((i * 7 + 3) & 0xFF for i in range(251))
    pattern = (run * (nbytes // len(run) + 1))[:nbytes]
    # Every GPU at once, a thread each: the driver API is thread-safe, a context is current per thread, and
    # ctypes lets go of the GIL inside each call, so N contexts cost about one (each GPU's context creation
    # is most of the check's time). Each thread says when it starts and ends: the parent names the GPUs
    # still in their calls when it has to kill a hung check.
    results: list[dict | None] = [None] * count.value

    def run(ordinal: int) -> None:
        emit({"stage": f"device {ordinal}"})
        results[ordinal] = _device(cu, ordinal, pattern)
        emit({"device_done": ordinal})
    threads = [threading.Thread(target=run, args=(o,), daemon=True, name=f"gpu{o}") for o in range(count.value)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["devices"] = [r for r in results if r is not None]
    out["ok"] = all(d["ok"] for d in out["devices"])
    emit({"cuda": out})


def _device(cu: _Cuda, ordinal: int, pattern: bytes) -> dict:
    d: dict = {"ordinal": ordinal, "ok": False}
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    retained = False
    try:
        cu.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        bus = ctypes.create_string_buffer(64)
        cu.call("cuDeviceGetPCIBusId", bus, 64, dev)
        d["pci_bus_id"] = bus.value.decode().lower()
        name = ctypes.create_string_buffer(256)
        cu.call("cuDeviceGetName", name, 256, dev)
        d["name"] = name.value.decode(errors="replace")
        cu.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        retained = True
        cu.call("cuCtxSetCurrent", ctx)
        cu.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(len(pattern)))
        back = ctypes.create_string_buffer(len(pattern))
        try:
            cu.call("cuMemcpyHtoD_v2", ptr, ctypes.c_char_p(pattern), ctypes.c_size_t(len(pattern)))
            cu.call("cuMemcpyDtoH_v2", back, ptr, ctypes.c_size_t(len(pattern)))
        finally:
            cu.lib.cuMemFree_v2(ptr)
        d["roundtrip_bytes"] = len(pattern)
        if back.raw != pattern:
            d["error"] = "the memory round trip returned other bytes than were written"
        else:
            d["ok"] = True
    except _CudaError as e:
        d.update(error=e.cu_name, call=e.fn, code=e.rc)
    finally:
        if retained and not d["ok"]:
            cu.lib.cuDevicePrimaryCtxRelease_v2(dev)     # a good one is left to the process's end (main)
    return d


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    # NVML beside CUDA (issue 47): NVML's init and queries take about as long as a context, and neither needs
    # the other. Each reports its own result line; "done" follows both.
    def nvml_after_cuinit() -> None:
        # Both opening the GPUs at the same moment makes each slower (measured on an H200: cuInit ~100 ms
        # alone, ~250 ms beside nvmlInit); NVML beside the contexts costs nothing. A cuInit that hangs
        # holds NVML back 2 s at most: its answer is kept for the report.
        CUINIT_DONE.wait(2.0)
        probe_nvml(spec["nvml"])
    nvml = threading.Thread(target=nvml_after_cuinit, daemon=True, name="nvml") if spec.get("nvml") else None
    if nvml is not None:
        nvml.start()
    if spec.get("cuda"):
        probe_cuda(spec["cuda"], int(spec.get("bytes", 1 << 20)))
    else:
        CUINIT_DONE.set()
    if nvml is not None:
        nvml.join()
    emit({"stage": "done"})
    return 0


if __name__ == "__main__":
    rc = main(sys.argv)
    # The contexts are torn down by the process's end, after the parent has its answer (it stops waiting
    # at "done"): tearing them down here first would only make the parent wait for it.
    os._exit(rc)
