"""One reconcile pass: desired state (the configuration) against the host, through the node
transaction path. `driverd apply`'s request under the host lock (waiting for another driverd as long
as it takes), then - with the wanted driver running - a reload when the running module parameters
differ from the configured ones, then the same validation a transaction ends with. The outcome is a
`Result`; nothing here raises, so a host that cannot converge is reported and retried, not a crash."""
from __future__ import annotations

import time
from dataclasses import field
from typing import Callable

from driverd.apply import lifecycle as lc
from driverd.apply import steps as st
from driverd.apply.hostplan import verdict_for_host
from driverd.apply.lock import LockHeld
from driverd.apply.validation import validate_driver
from driverd.apply import fingerprint as fpr
from driverd.datatypes import dataclass
from driverd.errors import ConfigError, DriverdError, PlanError, UsageError

LOCK_WAIT_S = 3600.0      # the daemon waits for another driverd (a boot-time apply, an operator) this long
OK_STATES = ("done", "nothing-to-do")


@dataclass
class Result:
    """The outcome of one reconcile pass: the host's state, why, and what the pass did."""
    state: str                  # converged | blocked | failed | reboot-required | config-error | error
    reason: str                 # one line: what the host is, or why it is not converged
    failure: str | None = None  # metrics label: blocked lock rolled-back rollback-failed reboot-required config
                                #   validation unexpected
    loaded: dict | None = None  # the driver loaded and validated when converged
    gpus: int = 0
    kernel: str | None = None
    runs: list[dict] = field(default_factory=list)     # journal documents of the runs this pass made
    warnings: list[str] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0
    fingerprint: str | None = None
    workload: dict | None = None   # the last workload check of this driver (driverd.host.workload), fresh or kept
    workload_ran: bool = False     # this pass made the check (CUDA calls), rather than keeping the last verdict
    # A pass that did not converge on a host whose running driver still validates (and is workload-ready
    # where the check applies): {"running": {version, flavor}, "wanted": driver.version, "why": reason}.
    # The node works, on another driver than the configuration wants or with something else left undone.
    degraded: dict | None = None
    # cluster mode: what the node keeps and why, what waits for a rollout (daemon/cluster_mode.py's pinned)
    pinned: dict | None = None
    # the kernels newer than the running one (driverd.apply.kernelprep): release -> {"prepared", "reason", ...}
    kernels: dict | None = None
    retry_in_s: float | None = None    # the kernel watch's next due retry: the loop's next pass comes no later
    left_to: str | None = None         # the driver is another package manager's (the plan's driver_managed_by)
    # the configured driver.version is not what runs, and why (a driver left to the host): one line, or None
    not_applied: str | None = None

    @property
    def converged(self) -> bool:
        return self.state == "converged"

    @property
    def changed(self) -> bool:
        return bool(self.runs)


class Reconciler:
    def __init__(self, make_context: Callable, log: Callable[[str], None], lock_wait_s: float = LOCK_WAIT_S, *,
                 reload_drift: bool = True, kernel_watch: bool = False) -> None:
        """`kernel_watch`: the daemon's own passes also prepare newer installed kernels and forget removed
        ones (driverd.apply.kernelprep; `log` then takes a level and fields, as driverd.log.log does)."""
        self.make_context = make_context        # cfg -> StepContext (the CLI's composition root picks backends)
        self.log = log
        self.lock_wait_s = lock_wait_s
        # whether a pass reloads the driver when its module parameters differ from the configuration; off for
        # a cluster-mode daemon's own passes (daemon/cluster_mode.py): only a rollout, drained, reloads there
        self.reload_drift = reload_drift
        self._reloaded_for: set[tuple] = set()  # (fingerprint, drift) a reload already tried to fix
        self._said: set[str] = set()            # notes logged once, not on every pass
        # the last passing workload check: (what it judged, monotonic time, its report). The check makes CUDA
        # calls in a child (0.3 s to seconds a GPU), so a pass repeats it only after a change, when the last one
        # failed or is older than validation.workload_interval_s; the daemon's first pass always makes it.
        self._workload: tuple[tuple, float, dict] | None = None
        self.kernels = None
        if kernel_watch:
            from driverd.apply.kernelprep import KernelWatch
            self.kernels = KernelWatch(log)

    def reconcile(self, cfg) -> Result:
        res = Result("error", "", started=time.time())
        sctx = None
        try:
            sctx = self.make_context(cfg)
            self._reconcile(sctx, cfg, res)
        except PlanError as e:
            _fail(res, "blocked", e.one_line(), "blocked")
        except LockHeld as e:
            _fail(res, "blocked", e.one_line(), "lock")
        except (ConfigError, UsageError) as e:
            _fail(res, "config-error", e.one_line(), "config")
        except DriverdError as e:
            _fail(res, "failed", e.one_line(), "failed")
        except Exception as e:                   # a bug: reported and retried, never a crash loop
            _fail(res, "error", f"unexpected error: {e.__class__.__name__}: {e}", "unexpected")
        if res.workload is None and "not workload-ready" in res.reason:
            # the plan's file-only half of the check, or a transaction's validation, said why: that is this
            # pass's workload verdict, and the next pass checks again
            res.workload, self._workload = {"ok": False, "problems": [res.reason]}, None
        if not res.converged and sctx is not None and res.state != "config-error":
            try:
                self._judge_running(sctx, cfg, res)
            except Exception as e:               # never a crash: the node is then simply not degraded-ready
                res.warnings.append(f"cannot validate the running driver: {e.__class__.__name__}: {e}")
        if self.kernels is not None and sctx is not None and res.state != "config-error":
            # after the host's own pass: a kernel installed behind driverd's back gets its driver before a reboot
            self.kernels.run(sctx, cfg, self.lock_wait_s, res)
        res.finished = time.time()
        return res

    def _judge_running(self, sctx, cfg, res: Result) -> None:
        """The wanted state was not reached (not fetched, an upgrade rolled back, blocked, a reboot away):
        does the driver that runs still work? Validated as a transaction ends - this host's modules,
        persistence, the workload check (unless a passing one of this same driver is kept) - it makes the
        node degraded, not down. No driver, or one that fails, leaves it not ready."""
        loaded = st.loaded(sctx)
        if loaded is None or (res.workload is not None and not res.workload.get("ok")):
            return                               # nothing runs, or this pass just found it unfit
        inst = st.installed(sctx)
        fp = fpr.of_host(sctx, cfg)
        try:
            self._validate(sctx, cfg, {"expect": [loaded["version"], loaded["flavor"]]}, loaded, inst, fp, res)
        except DriverdError as e:
            wl = ((e.details or {}).get("validation") or {}).get("workload")
            if wl is not None:
                res.workload, res.workload_ran = wl, True
            res.warnings.append(f"the running driver {loaded['version']} ({loaded['flavor']}) does not validate "
                                f"either: {e.one_line()}")
            return
        res.degraded = {"running": loaded, "wanted": cfg["driver.version"], "why": f"{res.state}: {res.reason}"}

    def _transact(self, sctx, req, res: Result) -> dict | None:
        """Run a request; a run that did not end done/nothing-to-do is recorded in `res` (None back)."""
        out = lc.transact(sctx, req, wait_s=self.lock_wait_s)
        if out.get("run_id"):
            doc = lc.journal(sctx).load(repair=False)
            if doc and doc.get("run_id") == out["run_id"]:
                res.runs.append(doc)
        if out.get("finished_first"):
            f = out["finished_first"]
            res.warnings.append(f"first finished the interrupted {f['command']} run {f['run_id']}: {f['state']}")
        res.warnings += [w for w in out.get("warnings") or [] if w not in res.warnings]
        if out["state"] not in OK_STATES:
            try:
                lc.raise_for(out)
            except DriverdError as e:
                _fail(res, "failed", e.one_line(), out["state"])
            return None
        return out

    def _reconcile(self, sctx, cfg, res: Result) -> None:
        res.kernel = sctx.kernel.release
        out = self._transact(sctx, lc.apply_request(cfg), res)
        if out is None:
            return
        if out.get("reboot_required"):
            _fail(res, "reboot-required", "a reboot is required to finish: " + "; ".join(out["reboot_required"]),
                  "reboot-required")
            return
        res.gpus = _gpu_count(sctx)
        if res.gpus == 0:
            res.state, res.reason = "converged", "no NVIDIA GPU on this host: nothing to provision"
            return
        # The host as it is now, judged by the same function as `driverd status` (its plan is `driverd plan`'s
        # and `apply --dry-run`'s).
        verdict = verdict_for_host(sctx, cfg)
        p = verdict.plan
        if p.verdict != "converged":
            left = p.blocked_by or p.reboot_reasons or tuple(f"{s.action} ({s.reason})" for s in p.changes)
            _fail(res, "blocked" if p.blocked_by else "failed",
                  f"the plan for this host is not empty after the apply ({p.verdict}): " + "; ".join(left),
                  "blocked" if p.blocked_by else "validation")
            return
        left_alone = p.driver_managed_by is not None
        res.left_to = p.driver_managed_by
        if left_alone:
            self._say_once(res, f"the driver is left to {p.driver_managed_by}: {p.flavor_reason}")
        inst = st.installed(sctx)
        fp = fpr.of_host(sctx, cfg)
        drift = list(verdict.drift)
        if drift and (fp, tuple(drift)) in self._reloaded_for:
            res.warnings.append("module parameters still differ after a reload (the kernel shows them differently): "
                                + "; ".join(drift))
        elif drift and not self.reload_drift:
            self._say_once(res, "module parameters differ from what this node converged to (" + "; ".join(drift)
                           + "): in a cluster only a DriverRollout reloads the driver; this node keeps running as it is")
        elif drift:
            users = _blocking_users(sctx)
            if users and cfg["modules.unload_policy"] == "refuse":
                _fail(res, "blocked", "module parameters differ from the configuration (" + "; ".join(drift)
                      + "); the reload that applies them is blocked: the GPU is in use by " + "; ".join(users)
                      + "; fix: stop them, drain the node, or set modules.unload_policy=terminate", "blocked")
                return
            self.log("driverd daemon: module parameters differ from the configuration: " + "; ".join(drift)
                     + "; reloading")
            self._reloaded_for.add((fp, tuple(drift)))
            if self._transact(sctx, lc.lifecycle_request("reload"), res) is None:
                return
        try:
            self._validate(sctx, cfg, p.validation(), st.loaded(sctx), inst, fp, res)
        except DriverdError as e:
            res.workload = ((e.details or {}).get("validation") or {}).get("workload")
            res.workload_ran = res.workload is not None
            _fail(res, "failed", e.one_line(), "validation")
            return
        loaded = st.loaded(sctx)
        want = cfg["driver.version"]
        if loaded is None or (want and loaded["version"] != want and not left_alone):
            _fail(res, "failed", f"the loaded driver is {loaded['version'] if loaded else 'none'}, the configuration "
                  f"wants {want}", "validation")
            return
        res.state, res.loaded, res.fingerprint = "converged", loaded, fp
        wl = res.workload
        res.reason = f"driver {loaded['version']} ({loaded['flavor']}) loaded and validated" + \
            (f", workload-ready (CUDA on {len((wl.get('cuda') or {}).get('devices') or [])} GPU(s))" if wl else "") + \
            (f" ({', '.join(p.modules)}; left to {p.driver_managed_by})" if left_alone else "")
        if left_alone and want and loaded["version"] != want:
            # ready (the driver works), but the configuration's driver is not what runs: said, not hidden
            res.not_applied = (f"driver.version {want} is not applied: driver {loaded['version']} is left to "
                               f"{p.driver_managed_by} (driver.manage = auto; `always` replaces it)")
            res.reason += f"; {res.not_applied}"
        self._refresh_cdi(sctx, cfg, res)
        try:
            # a driver left to the host is recorded as such: a restarted container goes ready at once on it
            # too, and nothing takes it for driverd's (the record's left_to)
            fpr.write(sctx, cfg, loaded, left_to=p.driver_managed_by if left_alone else None,
                      validation=p.validation() if left_alone else None)
        except (OSError, DriverdError) as e:
            res.warnings.append(f"cannot record the converged state: {e}")

    def _refresh_cdi(self, sctx, cfg, res: Result) -> None:
        """runtime.cdi: the spec follows the GPUs and the driver's user-space now validated (after a load,
        an upgrade, a GPU that came back), under the host lock; unchanged, nothing is written."""
        if not cfg["runtime.cdi"]:
            return
        from driverd.apply.lock import HostLock
        from driverd.runtime import cdi
        from driverd.runtime.changes import Options
        try:
            with HostLock(sctx.root, cfg["state.dir"], "cdi-refresh").acquire(self.lock_wait_s):
                rep = cdi.refresh(sctx.root, Options.from_config(cfg))
        except (OSError, DriverdError) as e:
            res.warnings.append(f"the CDI spec could not be refreshed: {e}")
            return
        if rep.files_changed:
            self.log(f"driverd daemon: CDI spec {', '.join(rep.files_changed)} written: " + "; ".join(rep.notes))

    def _validate(self, sctx, cfg, params: dict, loaded: dict | None, inst: dict | None, fp: str, res: Result) -> None:
        """The validate step on the driver that runs, its workload check kept from the last passing one of this
        same driver, package, kernel and configuration (see _workload_kept); the verdict goes into `res`. A
        failing validation raises (and forgets the kept check)."""
        judged = (loaded and (loaded["version"], loaded["flavor"]), inst["sha256"] if inst else None,
                  sctx.kernel.release, fp)
        keep = self._workload_kept(judged, res.changed, cfg)
        if keep is not None:
            params["workload"] = False
        try:
            out = validate_driver(sctx, params)
        except DriverdError:
            self._workload = None
            raise
        if keep is not None:
            res.workload = keep
        elif isinstance(out, dict) and out.get("workload"):
            res.workload, res.workload_ran = out["workload"], True
            self._workload = (judged, time.monotonic(), out["workload"])

    def _workload_kept(self, judged: tuple, changed: bool, cfg) -> dict | None:
        """The last passing workload check when it still holds for this pass, else None (check again)."""
        if self._workload is None or changed:
            return None
        what, at, report = self._workload
        interval = cfg["validation.workload_interval_s"]
        if what != judged or (interval > 0 and time.monotonic() - at >= interval):
            return None
        return report

    def _say_once(self, res: Result, msg: str) -> None:
        if msg not in self._said:
            self._said.add(msg)
            res.warnings.append(msg)


def _fail(res: Result, state: str, reason: str, failure: str) -> None:
    res.state, res.reason, res.failure = state, reason, failure


def _gpu_count(sctx) -> int:
    from driverd.host import pci
    gpus, _, _ = pci.classify(sctx.root, pci.scan(sctx.root, []), [])
    return len(gpus)


def _blocking_users(sctx) -> list[str]:
    """Processes holding /dev/nvidia* other than the GPU daemons (a reload stops those itself)."""
    from driverd.host import processes
    users, daemons = processes.scan(sctx.root)
    ours = {p for d in daemons for p in d.pids}
    return [f"pid {u.pid} ({u.comm})" for u in users if u.pid not in ours]
