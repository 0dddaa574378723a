"""The daemon's control loop: one thread that sleeps in select() on a self-pipe (signals arrive
through signal.set_wakeup_fd, the worker's "done" through the same socket) until the next timer -
the periodic reconcile (daemon.interval_s, or the retry backoff after a failure), the config-file
check (daemon.config_check_s), the systemd watchdog ($WATCHDOG_USEC/2) - and a worker thread that
runs one reconcile at a time. Idle, it costs a stat() every few seconds and nothing else.

SIGHUP re-reads the configuration and reconciles; so does a change of the config file. SIGTERM (or
SIGINT) stops: STOPPING=1, the running reconcile gets up to `grace_s` to finish, and is otherwise
abandoned - the process exits, the kernel drops the host lock, and the journal, written before and
after every step, lets the next driverd finish the interrupted run (as after a kill -9).
"""
from __future__ import annotations

import selectors
import signal
import socket
import threading
import time
from typing import Callable

from driverd.daemon.backoff import Backoff
from driverd.errors import DriverdError

GRACE_S = 7.0           # SIGTERM -> exit 0 within 10 s, with time left to notify and close


def release_memory() -> None:
    """Give the memory a pass freed back to the kernel. A pass loads NVML and reads the whole host;
    glibc keeps the freed heap, and an idle daemon on every GPU node should not hold it for hours."""
    import gc
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):          # not glibc: nothing to trim
        pass


class DaemonLoop:
    def __init__(self, *, name: str, load_config: Callable, reconciler, health, metrics, notifier, watch,
                 log: Callable[..., None], unload: Callable | None = None, grace_s: float = GRACE_S,
                 record: Callable[..., None] | None = None, kernels=None,
                 kernels_changed: Callable[[], None] | None = None) -> None:
        """`kernels`: daemon.kernelwatch.KernelDirs (None: not watched); `kernels_changed`: told when they
        changed, before the pass that follows (the kernel watch's retries are then due)."""
        self.name, self.load_config, self.reconciler = name, load_config, reconciler
        self.record = record or (lambda *a, **kw: None)     # the last reconcile, for `driverd status`
        self.health, self.metrics, self.notifier, self.watch, self.log = health, metrics, notifier, watch, log
        self.unload = unload
        self.kernels, self.kernels_changed = kernels, kernels_changed
        self.grace_s = grace_s
        self.cfg = None
        self.backoff = Backoff(10, 900)
        self.abandoned = False
        self._stop: str | None = None
        self._hup = False
        self._again = False
        self._ready_sent = False
        self._worker: threading.Thread | None = None
        self._results: list = []
        self._lock = threading.Lock()
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._rsock, selectors.EVENT_READ)
        self._install_signals()

    # -- signals ---------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop(self, signum, frame) -> None:
        self._stop = signal.Signals(signum).name

    def _on_hup(self, signum, frame) -> None:
        self._hup = True

    def _wake(self) -> None:
        try:
            self._wsock.send(b"w")
        except OSError:            # the buffer is full: the loop is awake anyway
            pass

    # -- timers from the configuration -----------------------------------------------------------
    def _use(self, cfg) -> None:
        self.cfg = cfg
        self.interval = float(cfg["daemon.interval_s"]) or None            # 0: no periodic re-check
        self.check_s = float(cfg["daemon.config_check_s"]) or None         # 0: SIGHUP only
        self.backoff.min_s = max(1.0, float(cfg["daemon.retry_min_s"]))
        self.backoff.max_s = max(self.backoff.min_s, float(cfg["daemon.retry_max_s"]))

    # -- the loop --------------------------------------------------------------------------------
    def run(self, cfg, *, converged_at_start: bool = False) -> int:
        now = time.monotonic()
        self.due: float | None = None
        self.interval = self.check_s = None
        if cfg is not None:
            self._use(cfg)
            if not converged_at_start:
                self.due = now                  # reconcile at once
            elif self.interval:
                self.due = now + self.interval  # the fast path: the next periodic re-check
        else:
            self.check_s = 5.0          # no configuration yet: watch for one
        if converged_at_start:
            self._ready()
            self.record(None, None if self.due is None else max(0.0, self.due - now))
        next_check = now + (self.check_s or 0)
        dog = self.notifier.watchdog_s
        next_dog = now
        while self._stop is None:
            now = time.monotonic()
            self._collect(now)
            if self._hup:
                self._hup = False
                self._reread("SIGHUP", now)
                self.watch.mark()
            if self.check_s and now >= next_check:
                next_check = now + self.check_s
                if self.watch.changed():
                    self._reread("the configuration file changed", now)
                elif self.kernels is not None and self.kernels.changed() and self.cfg is not None:
                    self._kernels(now)
            if dog and now >= next_dog:
                self.notifier.watchdog()
                next_dog = now + dog
            if self.due is not None and now >= self.due and self._worker is None and self.cfg is not None:
                self._start_worker()
            if self._stop is not None:
                break
            wakes = [t for t in ((self.due if self._worker is None else None), next_check if self.check_s else None,
                                 next_dog if dog else None) if t is not None]
            timeout = max(0.0, min(wakes) - time.monotonic()) if wakes else None
            if self._sel.select(timeout):
                try:
                    while self._rsock.recv(4096):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
        return self._shutdown()

    def _start_worker(self) -> None:
        self.due = None
        cfg = self.cfg
        self.health.begin("reconciling the host with the configuration")
        self.metrics.set_state("reconciling")
        self.notifier.status(self.health.status_line())

        def work():
            try:
                res = self.reconciler.reconcile(cfg)
            except BaseException as e:          # reconcile() catches everything; belt and braces
                from driverd.apply.reconcile import Result
                res = Result("error", f"unexpected error: {e.__class__.__name__}: {e}", "unexpected",
                             started=time.time(), finished=time.time())
            with self._lock:
                self._results.append(res)
            self._wake()
        self._worker = threading.Thread(target=work, name="driverd-reconcile", daemon=True)
        self._worker.start()

    def _collect(self, now: float) -> None:
        with self._lock:
            results, self._results = self._results, []
        for res in results:
            self._worker = None
            self.health.update(res)
            self.metrics.observe(res)
            ready, _ = self.health.readiness()
            self.metrics.set_ready(ready)
            took = f"{res.finished - res.started:.1f}s" + (f", {len(res.runs)} journalled run(s)" if res.runs else
                                                           ", nothing changed")
            for w in res.warnings:
                self.log(f"driverd {self.name}: warning: {w}")
            fields = {"state": res.state, "reason": res.reason, "seconds": round(res.finished - res.started, 3),
                      "runs": [d.get("run_id") for d in res.runs]}
            retry = getattr(res, "retry_in_s", None)     # a kernel the watch will try to prepare again
            if res.converged:
                self.backoff.reset()
                self.due = now + self.interval if self.interval else None
                if retry is not None:
                    self.due = now + retry if self.due is None else min(self.due, now + retry)
                self.log(f"driverd {self.name}: converged: {res.reason} ({took})", "info", **fields)
                if not self._ready_sent:
                    self._ready()
                else:
                    self.notifier.status(self.health.status_line())
            else:
                delay = self.backoff.next()
                if res.failure == "rolled-back":
                    # The host runs its last-known-good driver again, and every attempt interrupts the
                    # GPUs' work for an upgrade that failed the same way: retry at the longest delay.
                    delay = self.backoff.max_s
                self.due = now + (delay if retry is None else min(delay, max(retry, self.backoff.min_s)))
                self.log(f"driverd {self.name}: not converged: {res.state}: {res.reason} ({took}); "
                         f"retrying in {delay:.0f}s", "warning", failure=res.failure, retry_in_s=round(delay), **fields)
                if res.degraded is not None and ready:
                    run = res.degraded["running"]
                    self.log(f"driverd {self.name}: degraded: driver {run['version']} ({run['flavor']}) runs and is "
                             f"validated; the node is ready on it while the daemon retries", "warning",
                             degraded=res.degraded)
                    if not self._ready_sent:
                        # systemd orders containerd and kubelet after this unit: a node whose driver works
                        # must not wait for TimeoutStartSec because the wanted one cannot be had
                        self._ready()
                self.notifier.status(f"{self.health.status_line()}; retry in {delay:.0f}s")
            if self._again:
                self._again = False
                self.due = now
            self.record(res, None if self.due is None else max(0.0, self.due - now))
        if results:
            release_memory()

    def _ready(self) -> None:
        self._ready_sent = True
        self.notifier.ready(self.health.status_line())
        self.log(f"driverd {self.name}: ready")

    def _kernels(self, now: float) -> None:
        self.log(f"driverd {self.name}: the installed kernels changed (/boot, /lib/modules); reconciling")
        if self.kernels_changed is not None:
            self.kernels_changed()
        if self._worker is not None:
            self._again = True
        else:
            self.due = now

    def _reread(self, why: str, now: float) -> None:
        try:
            cfg = self.load_config()
        except DriverdError as e:
            self.metrics.config_reloads.labels("error").inc()
            problem = e.one_line()
            self.health.set_config_problem(problem)
            if self.cfg is None:
                self.health.set_state("config-error", problem)
                self.metrics.set_state("config-error")
            self.log(f"driverd {self.name}: {why}, but the configuration cannot be used: {problem}"
                     + ("; keeping the previous one" if self.cfg is not None else ""))
            self.notifier.status(self.health.status_line())
            return
        self.metrics.config_reloads.labels("ok").inc()
        self.health.set_config_problem(None)
        self._use(cfg)
        self.backoff.reset()
        if self.kernels_changed is not None:
            self.kernels_changed()          # another driver, another build setting: the kernels' retries are due
        self.log(f"driverd {self.name}: {why}: configuration re-read; reconciling")
        if self._worker is not None:
            self._again = True
        else:
            self.due = now

    def _shutdown(self) -> int:
        self.log(f"driverd {self.name}: {self._stop}: stopping")
        self.health.stopping()
        self.metrics.set_state("stopping")
        self.metrics.set_ready(False)
        self.notifier.stopping()
        w = self._worker
        if w is not None and w.is_alive():
            self.log(f"driverd {self.name}: waiting up to {self.grace_s:.0f}s for the current reconcile to finish")
            w.join(self.grace_s)
            if w.is_alive():
                self.abandoned = True
                self.log(f"driverd {self.name}: abandoning the current reconcile: the journal records every step, "
                         "and the next driverd command (or daemon start) finishes the interrupted run first")
        if self.unload is not None and self.cfg is not None and self.cfg["daemon.unload_on_exit"]:
            if self.abandoned:
                self.log(f"driverd {self.name}: daemon.unload_on_exit: not unloading, a run was abandoned")
            else:
                try:
                    self.log(f"driverd {self.name}: daemon.unload_on_exit: {self.unload(self.cfg)}")
                except DriverdError as e:
                    self.log(f"driverd {self.name}: daemon.unload_on_exit: the unload failed: {e.one_line()}")
        self.record(None, None, stopped=True)
        signal.set_wakeup_fd(-1)
        return 0
