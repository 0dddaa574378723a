"""NVML (through pynvml) when the library and a loaded driver are there; never crashes.

On a live root the data comes from NVML itself. A captured tree may carry the NVML report of the
machine it was captured on (CAPTURE_PATH), which is then reported with source "capture".
"""
from __future__ import annotations

import json

from driverd.host.facts import NvmlDevice, NvmlFacts
from driverd.root import Root

CAPTURE_PATH = "/var/lib/driverd/capture/nvml.json"


def _from_json(doc: dict) -> NvmlFacts:
    if not isinstance(doc, dict) or not isinstance(doc.get("devices", []), list):
        raise TypeError("not an NVML report object")
    return NvmlFacts(available=bool(doc.get("available")), reason=doc.get("reason"), source="capture",
                     driver_version=doc.get("driver_version"), cuda_driver_version=doc.get("cuda_driver_version"),
                     devices=tuple(NvmlDevice(**d) for d in doc.get("devices", [])))


# A long-running process (the daemon) asks NVML in a short-lived child instead: libnvidia-ml and the
# libcuda it loads keep about 20 MB resident after nvmlShutdown(), for the life of the process.
_in_child = False


def query_in_child(on: bool = True) -> None:
    global _in_child
    _in_child = on


def read_nvml(root: Root, driver_loaded: bool) -> NvmlFacts:
    if _in_child and root.is_live() and driver_loaded:
        return _read_in_child()
    if not root.is_live():
        text = root.read_text(CAPTURE_PATH)
        if text:
            try:
                return _from_json(json.loads(text))
            except (ValueError, TypeError, AttributeError, RecursionError) as e:
                return NvmlFacts(False, f"captured NVML report {CAPTURE_PATH} is garbled ({e.__class__.__name__})")
        return NvmlFacts(False, f"root {root.base} is not the live host; NVML reports only on the live host")
    if not driver_loaded:
        return NvmlFacts(False, "the NVIDIA driver is not loaded")
    try:
        import pynvml
    except ImportError:
        return NvmlFacts(False, "the pynvml Python package is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibRmVersionMismatch:
        return NvmlFacts(False, "NVML could not start: NVML/RM version mismatch (the libnvidia-ml.so.1 found is not "
                                "the loaded kernel driver's version)")
    except pynvml.NVMLError as e:
        return NvmlFacts(False, f"NVML could not start: {e} (libnvidia-ml.so.1 missing or driver mismatch)")
    except OSError as e:
        return NvmlFacts(False, f"NVML could not start: {e}")
    try:
        return query(pynvml)
    except pynvml.NVMLError as e:
        return NvmlFacts(False, f"NVML query failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_in_child() -> NvmlFacts:
    import subprocess

    from driverd.runner import CHILD_CWD, python_child
    try:
        res = subprocess.run(python_child("driverd.host.nvml"), capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, cwd=CHILD_CWD)
        doc = json.loads(res.stdout)
        facts = _from_json(doc)
    except (OSError, subprocess.TimeoutExpired, ValueError, TypeError, AttributeError, RecursionError) as e:
        return NvmlFacts(False, f"the NVML query process failed ({e.__class__.__name__}: {e})")
    return NvmlFacts(facts.available, facts.reason, "live" if facts.available else None, facts.driver_version,
                     facts.cuda_driver_version, facts.devices)


def _opt(fn, *a):
    import pynvml
    try:
        return fn(*a)
    except pynvml.NVMLError:
        return None


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def query(pynvml) -> NvmlFacts:
    devices = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = _opt(pynvml.nvmlDeviceGetMemoryInfo, h)
        pm = _opt(pynvml.nvmlDeviceGetPersistenceMode, h)
        mig = _opt(pynvml.nvmlDeviceGetMigMode, h)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        devices.append(NvmlDevice(
            index=i, name=_s(pynvml.nvmlDeviceGetName(h)), uuid=_s(pynvml.nvmlDeviceGetUUID(h)),
            pci_bus_id=_s(pci.busId).lower(), memory_total_mib=mem.total // (1 << 20) if mem else None,
            persistence_mode=None if pm is None else pm == pynvml.NVML_FEATURE_ENABLED,
            mig_mode_current=None if mig is None else bool(mig[0]),
            mig_mode_pending=None if mig is None else bool(mig[1])))
    cuda = _opt(pynvml.nvmlSystemGetCudaDriverVersion)
    return NvmlFacts(True, None, "live", _s(pynvml.nvmlSystemGetDriverVersion()),
                     f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None, tuple(devices))


if __name__ == "__main__":          # the child of _read_in_child: one NVML report on stdout
    from dataclasses import asdict
    print(json.dumps(asdict(read_nvml(Root("/"), True))))
