"""NVML (through pynvml) when the library and a loaded driver are there; never crashes.

On a live root the data comes from NVML itself. A captured tree may carry the NVML report of the
machine it was captured on (CAPTURE_PATH), which is then reported with source "capture".

The live report is plain data (`report()`), made either in this process or in a short-lived child
(`start_child()`: forked, or a fresh interpreter where this process has threads) that hands it back;
the facts are built from it here, so a fresh child imports neither the facts' classes nor anything else
of driverd's but this module (issue 47: `detect` asks NVML in a child started before its other reads,
on another core, instead of paying for pynvml's import and NVML's calls on its own path).
"""
from __future__ import annotations

import json
import os

TYPE_CHECKING = False           # not typing's: the child would pay for importing typing (~18 ms on a GPU host)
if TYPE_CHECKING:
    from typing import Callable

    from driverd.host.facts import NvmlFacts
    from driverd.root import Root

CAPTURE_PATH = "/var/lib/driverd/capture/nvml.json"


def _facts(doc: dict, source: str | None) -> NvmlFacts:
    """A report (`report()`'s shape, or a captured one) as facts."""
    from driverd.host.facts import NvmlDevice, NvmlFacts
    if not isinstance(doc, dict) or not isinstance(doc.get("devices", []), list):
        raise TypeError("not an NVML report object")
    available = bool(doc.get("available"))
    return NvmlFacts(available=available, reason=doc.get("reason"), source=source if available or source == "capture"
                     else None, driver_version=doc.get("driver_version"),
                     cuda_driver_version=doc.get("cuda_driver_version"),
                     devices=tuple(NvmlDevice(**d) for d in doc.get("devices", [])))


# A long-running process (the daemon) asks NVML in a short-lived child instead: libnvidia-ml and the
# libcuda it loads keep about 20 MB resident after nvmlShutdown(), for the life of the process.
_in_child = False


def query_in_child(on: bool = True) -> None:
    global _in_child
    _in_child = on


def read_nvml(root: Root, driver_loaded: bool) -> NvmlFacts:
    if _in_child and root.is_live() and driver_loaded:
        return start_child()()
    if not root.is_live():
        text = root.read_text(CAPTURE_PATH)
        if text:
            try:
                return _facts(json.loads(text), "capture")
            except (ValueError, TypeError, AttributeError, RecursionError) as e:
                return _facts({"reason": f"captured NVML report {CAPTURE_PATH} is garbled ({e.__class__.__name__})"},
                              None)
        return _facts({"reason": f"root {root.base} is not the live host; NVML reports only on the live host"}, None)
    if not driver_loaded:
        return _facts({"reason": "the NVIDIA driver is not loaded"}, None)
    return _facts(report(), "live")


class Asked:
    """NVML's report, being made by a child: calling it waits for the facts. `pid` is the child's (None
    where none started): the child holds /dev/nvidia* while it asks, and is no GPU user of the host."""
    __slots__ = ("pid", "_wait")

    def __init__(self, pid: int | None, wait: Callable[[], NvmlFacts]) -> None:
        self.pid, self._wait = pid, wait

    def __call__(self) -> NvmlFacts:
        return self._wait()

    def dismiss(self) -> None:
        """The report is not wanted after all (the command failed before it): the child is killed and
        reaped, so that an NVML call that hangs does not hold the command's exit."""
        if self.pid is not None:
            import signal
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._wait()


def start_child(timeout: float = 60.0) -> Asked:
    """The live report, asked of a child started now; calling the answer waits for it (`timeout` s at
    most) and gives the facts.

    A process with one thread (`detect`, `plan`) forks (host/forked.py): the child already holds the
    modules this process has imported, so pynvml's import (~30 ms of re, enum, subprocess, ctypes on a GPU
    host) and Python's start-up are not on its path, and NVML's answer is there before this process has
    read the host (issue 47). A process with threads (the daemon) must not fork, and runs a fresh
    interpreter instead: without site-packages' start-up files, with pynvml's directory only
    (driverd.runner.python_child)."""
    from driverd.host import forked
    if forked.can_fork():
        return _forked(timeout)
    return _spawned(timeout)


def _failed(err: BaseException | str) -> NvmlFacts:
    why = err if isinstance(err, str) else f"{err.__class__.__name__}: {err}"
    return _facts({"reason": f"the NVML query process failed ({why})"}, None)


def _known(facts: NvmlFacts) -> Asked:
    return Asked(None, lambda: facts)


def _forked(timeout: float) -> Asked:
    from driverd.host import forked
    try:
        child = forked.fork(report)
    except OSError as e:
        return _known(_failed(e))

    def result() -> NvmlFacts:
        try:
            return _facts(child.answer(timeout), "live")
        except forked.ChildFailed as e:
            return _failed(str(e))
        except (TypeError, AttributeError) as e:
            return _failed(e)
    return Asked(child.pid, result)


def _spawned(timeout: float) -> Asked:
    import subprocess

    from driverd.runner import CHILD_CWD, python_child
    try:
        proc = subprocess.Popen(python_child("driverd.host.nvml", site_modules=("pynvml",)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=CHILD_CWD)
    except OSError as e:
        return _known(_failed(e))

    def result() -> NvmlFacts:
        try:
            out, _ = proc.communicate(timeout=timeout)
            return _facts(json.loads(out), "live")
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.communicate()
            err: Exception = e
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            err = e
        return _failed(err)
    return Asked(proc.pid, result)


def _opt(fn, *a):
    import pynvml
    try:
        return fn(*a)
    except pynvml.NVMLError:
        return None


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def report() -> dict:
    """What NVML says on this live host, as plain data; a failure is `available: false` and the reason."""
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "the pynvml Python package is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibRmVersionMismatch:
        return {"available": False, "reason": "NVML could not start: NVML/RM version mismatch (the libnvidia-ml.so.1 "
                                              "found is not the loaded kernel driver's version)"}
    except pynvml.NVMLError as e:
        return {"available": False,
                "reason": f"NVML could not start: {e} (libnvidia-ml.so.1 missing or driver mismatch)"}
    except OSError as e:
        return {"available": False, "reason": f"NVML could not start: {e}"}
    try:
        return query(pynvml)
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"NVML query failed: {e}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def query(pynvml) -> dict:
    devices = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = _opt(pynvml.nvmlDeviceGetMemoryInfo, h)
        pm = _opt(pynvml.nvmlDeviceGetPersistenceMode, h)
        mig = _opt(pynvml.nvmlDeviceGetMigMode, h)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        devices.append(dict(
            index=i, name=_s(pynvml.nvmlDeviceGetName(h)), uuid=_s(pynvml.nvmlDeviceGetUUID(h)),
            pci_bus_id=_s(pci.busId).lower(), memory_total_mib=mem.total // (1 << 20) if mem else None,
            persistence_mode=None if pm is None else pm == pynvml.NVML_FEATURE_ENABLED,
            mig_mode_current=None if mig is None else bool(mig[0]),
            mig_mode_pending=None if mig is None else bool(mig[1])))
    cuda = _opt(pynvml.nvmlSystemGetCudaDriverVersion)
    return {"available": True, "reason": None, "driver_version": _s(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None, "devices": devices}


if __name__ == "__main__":          # the child of start_child: one NVML report on stdout
    print(json.dumps(report()))
