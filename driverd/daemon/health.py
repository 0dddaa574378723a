"""What the daemon knows about the host between reconciles, for /readyz, /metrics and STATUS=.

Ready means: the last reconcile converged - or did not, but the driver that runs validated
(degraded: the node works, not on what the configuration wants, and the daemon keeps trying) - and
the driver it validated is still the one the kernel reports (a cheap read of
/proc/driver/nvidia/version on every probe, so an unload by hand or an upgrade in progress shows at
once). A host with no validated driver is never ready."""
from __future__ import annotations

import threading
import time
from typing import Callable

from driverd.redact import redact

STATES = ("starting", "reconciling", "converged", "blocked", "failed", "reboot-required", "config-error", "error",
          "stopping")


class Health:
    def __init__(self, probe: Callable[[], dict | None]) -> None:
        self.probe = probe                       # () -> {"version", "flavor"} loaded now, or None
        self._lock = threading.Lock()
        self.state = "starting"
        self.reason = "the first reconcile has not finished"
        self.converged = False
        self.loaded: dict | None = None
        self.degraded: dict | None = None        # reconcile.Result.degraded of the last pass
        self.since = time.time()
        self.last = None                         # the last reconcile.Result
        self.config_problem: str | None = None
        self.fast_path: str | None = None
        self.not_applied: str | None = None      # the configured driver.version is not what runs (left to the host)

    def begin(self, why: str) -> None:
        with self._lock:
            self.state, self.reason = "reconciling", why

    def update(self, result) -> None:
        with self._lock:
            self.last = result
            self.state, self.reason = result.state, result.reason
            self.converged = result.converged
            self.degraded = None if result.converged else getattr(result, "degraded", None)
            self.loaded = result.loaded if result.converged else (self.degraded or {}).get("running")
            self.not_applied = getattr(result, "not_applied", None) if result.converged else None
            self.since = result.finished or time.time()

    def converged_at_start(self, loaded: dict, reason: str) -> None:
        """The container's fast path: the host already is what the configuration asks."""
        with self._lock:
            self.state, self.reason, self.converged, self.loaded = "converged", reason, True, loaded
            self.degraded = None
            self.fast_path = reason
            self.since = time.time()

    def set_state(self, state: str, reason: str) -> None:
        """A state reached without a reconcile (a configuration that cannot be loaded at start)."""
        with self._lock:
            self.state, self.reason, self.converged, self.loaded = state, reason, False, None
            self.degraded = None

    def set_config_problem(self, problem: str | None) -> None:
        with self._lock:
            self.config_problem = problem

    def stopping(self) -> None:
        with self._lock:
            self.state, self.reason, self.converged = "stopping", "the daemon is stopping", False
            self.degraded = None

    def readiness(self) -> tuple[bool, str]:
        """(ready, one line saying why or why not)."""
        ready, why = self._readiness()
        return ready, redact(" ".join(why.split()))[:1000]

    def _readiness(self) -> tuple[bool, str]:
        with self._lock:
            state, reason, converged, loaded, degraded = (self.state, self.reason, self.converged, self.loaded,
                                                          self.degraded)
            not_applied = self.not_applied
        if not converged and degraded is None:
            return False, f"{state}: {reason}"
        if loaded is None:
            return False, reason
        try:
            now = self.probe()
        except Exception as e:                   # a probe must answer, never raise
            return False, f"cannot read the loaded driver: {e}"
        if now is None:
            return False, f"the NVIDIA driver is not loaded (the last reconcile validated {loaded['version']})"
        if (now["version"], now["flavor"]) != (loaded["version"], loaded["flavor"]):
            return False, (f"the kernel reports {now['version']} ({now['flavor']}); the last reconcile validated "
                           f"{loaded['version']} ({loaded['flavor']})")
        if degraded is not None:
            return True, _degraded_line(degraded)
        return True, f"driver {loaded['version']} ({loaded['flavor']}) loaded and validated; last reconcile converged" \
            + (f"; {not_applied}" if not_applied else "")

    def status_line(self) -> str:
        with self._lock:
            line = _degraded_line(self.degraded) if self.degraded and self.state != "reconciling" else \
                f"{self.state}: {self.reason}"
            if self.config_problem:
                line += f" (config not reloaded: {self.config_problem})"
        return redact(" ".join(line.split()))[:400]


def _degraded_line(d: dict) -> str:
    """degraded: what runs and is validated, what the configuration wants, why the last pass did not get it."""
    run = d["running"]
    head = f"degraded: driver {run['version']} ({run['flavor']}) loaded and validated"
    if d.get("wanted") and d["wanted"] != run["version"]:
        return f"{head}, not the wanted {d['wanted']} (retrying): {d['why']}"
    return f"{head}; the last reconcile did not converge (retrying): {d['why']}"


class CoordinatorHealth:
    """/readyz of the coordinator: ready once it has read the Lease (holding it or standing by)."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator

    def readiness(self) -> tuple[bool, str]:
        c = self.coordinator
        if c.lease.holding():
            return True, f"{c.identity} coordinates rollouts (holds the Lease)"
        if not c.lease_watch.synced.is_set():
            return False, "the Lease is not read yet"
        holder = ((c.lease.last or {}).get("spec") or {}).get("holderIdentity")
        return True, f"standing by ({holder or 'nobody'} holds the Lease)"
