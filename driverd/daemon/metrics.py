"""Prometheus metrics of the daemon. The only module that imports prometheus_client; it is loaded by
the daemon commands alone, so host-only commands (detect, plan) never pay for it.

driverd_driver_info{version,flavor,kernel}          1 for the driver the last converge (or degraded pass) validated
driverd_state{state=...}                            1 for the daemon's current state, 0 for the other states
                                                    (health.STATES); prometheus_client's Enum would name the label
                                                    after the metric (driverd_state{driverd_state=...})
driverd_ready                                       1 when /readyz answers 200
driverd_degraded                                    1 when the last reconcile did not converge but the driver that
                                                    runs validated (ready on it; /readyz and STATUS= say what was
                                                    wanted and why it could not be had), else 0
driverd_workload_ready                              1 when the last workload check passed (CUDA context and memory
                                                    round trip on every GPU with the containers' libraries), 0 when
                                                    it failed; absent before the first check
driverd_workload_check_duration_seconds             wall time of the workload checks the daemon made
driverd_reconciles_total{result}                    reconcile passes by result (converged, blocked, failed, ...)
driverd_reconcile_failures_total{reason}            failed passes by reason (blocked, lock, rolled-back,
                                                    rollback-failed, reboot-required, config, validation, unexpected)
driverd_reconcile_duration_seconds                  wall time of a reconcile pass
driverd_transaction_duration_seconds{command,state} journalled runs (apply, reload, ...) by how they ended
driverd_step_duration_seconds{action,status}        each step of those runs
driverd_last_reconcile_timestamp_seconds / driverd_last_converged_timestamp_seconds
driverd_config_reloads_total{result}                configuration re-reads (ok, error)
driverd_kernel_unprepared{kernel}                   1 for an installed kernel newer than the running one that has
                                                    no verified package of the node's driver yet (a reboot into it
                                                    would come back without the driver), 0 once it has
                                                    (driverd.apply.kernelprep; `driverd reboot-ready` says why)
driverd_package_fetch_duration_seconds{source,result}  package fetches: source cache (a hit), repository or
                                                    build (misses), none (failed before a source served it)
driverd_package_cache_hits_total / _misses_total    fetches served from the local cache vs downloaded/built
driverd_package_fetch_failures_total{reason}        not-found, index, download, verify, build, io, unexpected
driverd_package_build_duration_seconds{result}      local builds (fetch's fallback): built, cached, failed
driverd_package_build_failures_total{reason}        headers, source, compile, check, toolchain, sign, ...
plus the process collector (process_resident_memory_bytes, process_cpu_seconds_total, ...).

In cluster mode, the fleet as the coordinator sees it (driverd/cluster/fleet_status.py), at scrape time:
driverd_coordinator                                 1 on the daemon holding the rollout Lease (the one whose
                                                    numbers below count), 0 on the others
driverd_rollout_nodes{rollout,state}                target nodes of each rollout by state: upgrading, done,
                                                    failed, pending, skipped, excluded, not_ready (holder only)
driverd_rollout_target_nodes{rollout}               nodes the rollout's nodeSelector selects (holder only)
driverd_rollout_phase{rollout,phase}                1 for the rollout's phase, 0 for every other (holder only)
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               ProcessCollector, disable_created_metrics, generate_latest)
from prometheus_client.core import GaugeMetricFamily

from driverd.apply.journal import run_seconds, step_seconds
from driverd.daemon.health import STATES

_STEP_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
_BUILD_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 900, 1800, 3600)
_RUN_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800, 3600)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        disable_created_metrics()          # no *_created series: they only double the scrape
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.driver = Gauge("driverd_driver_info", "The driver the last converged (or degraded) reconcile validated",
                            ["version", "flavor", "kernel"], registry=r)
        self.state = Gauge("driverd_state", "What the daemon is doing or found: 1 for the current state",
                           ["state"], registry=r)
        self.ready = Gauge("driverd_ready", "1 when the host is converged and the driver validated (/readyz 200)",
                           registry=r)
        self.degraded = Gauge("driverd_degraded", "1 when the last reconcile did not converge but the running driver "
                              "validated: ready on it, not on the configured one (/readyz says why)", registry=r)
        self.workload_ready = Gauge("driverd_workload_ready", "1 when the last workload check passed (NVML and the "
                                    "loaded module agree, CUDA works on every GPU), 0 when it failed", registry=r)
        self.version_applied = Gauge("driverd_configured_version_applied", "1 when the driver that runs is "
                                     "driver.version, 0 when it is not (a driver left to the host: /readyz says why)",
                                     registry=r)
        self.workload_seconds = Histogram("driverd_workload_check_duration_seconds", "Wall time of the workload "
                                          "checks (CUDA calls in a child process)", buckets=_STEP_BUCKETS, registry=r)
        self.reconciles = Counter("driverd_reconciles", "Reconcile passes by result", ["result"], registry=r)
        self.failures = Counter("driverd_reconcile_failures", "Reconcile passes that did not converge, by reason",
                                ["reason"], registry=r)
        self.duration = Histogram("driverd_reconcile_duration_seconds", "Wall time of a reconcile pass",
                                  buckets=_RUN_BUCKETS, registry=r)
        self.runs = Histogram("driverd_transaction_duration_seconds", "Journalled runs made by the daemon",
                              ["command", "state"], buckets=_RUN_BUCKETS, registry=r)
        self.steps = Histogram("driverd_step_duration_seconds", "Steps of the journalled runs",
                               ["action", "status"], buckets=_STEP_BUCKETS, registry=r)
        self.last_reconcile = Gauge("driverd_last_reconcile_timestamp_seconds", "When the last reconcile ended",
                                    registry=r)
        self.last_converged = Gauge("driverd_last_converged_timestamp_seconds",
                                    "When a reconcile last ended converged", registry=r)
        self.kernel_unprepared = Gauge("driverd_kernel_unprepared", "1 for an installed kernel newer than the "
                                       "running one without a verified package of the node's driver, 0 once it "
                                       "has one", ["kernel"], registry=r)
        self.config_reloads = Counter("driverd_config_reloads", "Configuration re-reads", ["result"], registry=r)
        self.fetch_seconds = Histogram("driverd_package_fetch_duration_seconds", "Package fetches by where the "
                                       "package came from (cache, repository, build) and result",
                                       ["source", "result"], buckets=_FETCH_BUCKETS, registry=r)
        self.cache_hits = Counter("driverd_package_cache_hits", "Fetches served from the local package cache",
                                  registry=r)
        self.cache_misses = Counter("driverd_package_cache_misses", "Fetches the local package cache could not "
                                    "serve (downloaded, copied from a file:// repository, built, or failed)",
                                    registry=r)
        self.fetch_failures = Counter("driverd_package_fetch_failures", "Failed package fetches by reason",
                                      ["reason"], registry=r)
        self.build_seconds = Histogram("driverd_package_build_duration_seconds", "Local package builds by result",
                                       ["result"], buckets=_BUILD_BUCKETS, registry=r)
        self.build_failures = Counter("driverd_package_build_failures", "Failed local package builds by reason",
                                      ["reason"], registry=r)
        self.set_state("starting")
        self.degraded.set(0)

    def package_event(self, event: str, f: dict) -> None:
        """driverd.observe subscriber: fetches and builds, wherever in the daemon they happen."""
        if event == "package.fetch":
            self.fetch_seconds.labels(f.get("source") or "none", f.get("result") or "ok").observe(f.get("seconds", 0))
            (self.cache_hits if f.get("cache") == "hit" else self.cache_misses).inc()
            if f.get("result") == "error":
                self.fetch_failures.labels(f.get("reason") or "unexpected").inc()
        elif event == "package.build":
            self.build_seconds.labels(f.get("result") or "built").observe(f.get("seconds", 0))
            if f.get("result") == "failed":
                self.build_failures.labels(f.get("reason") or "unexpected").inc()

    def set_state(self, state: str) -> None:
        state = state if state in STATES else "error"
        for s in STATES:            # every state a series, as an enum: `driverd_state{state="blocked"} == 1`
            self.state.labels(s).set(1 if s == state else 0)

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def converged_at_start(self, loaded: dict, kernel: str | None) -> None:
        self.driver.clear()
        self.driver.labels(loaded["version"], loaded["flavor"], kernel or "").set(1)
        self.set_state("converged")

    def observe(self, result) -> None:
        self.reconciles.labels(result.state).inc()
        if result.failure:
            self.failures.labels(result.failure).inc()
        self.duration.observe(max(0.0, result.finished - result.started))
        self.last_reconcile.set(result.finished)
        for doc in result.runs:
            took = run_seconds(doc)
            if took is not None:
                self.runs.labels(doc["command"], doc["state"]).observe(took)
            for s in list(doc.get("steps") or []) + list(doc.get("rollback") or []):
                took = step_seconds(s)
                if took is not None:
                    self.steps.labels(s["action"], s["status"]).observe(took)
        kernels = getattr(result, "kernels", None)
        if kernels is not None:
            self.kernel_unprepared.clear()
            for rel, k in kernels.items():
                self.kernel_unprepared.labels(rel).set(0 if k.get("prepared") else 1)
        wl = getattr(result, "workload", None)
        if wl is not None:
            self.workload_ready.set(1 if wl.get("ok") else 0)
            if getattr(result, "workload_ran", False):
                self.workload_seconds.observe(wl.get("seconds") or 0.0)
        if result.converged:
            self.version_applied.set(0 if getattr(result, "not_applied", None) else 1)
            self.last_converged.set(result.finished)
            self.driver.clear()
            if result.loaded:
                self.driver.labels(result.loaded["version"], result.loaded["flavor"], result.kernel or "").set(1)
        elif getattr(result, "degraded", None):
            run = result.degraded["running"]
            self.driver.clear()
            self.driver.labels(run["version"], run["flavor"], result.kernel or "").set(1)
        self.degraded.set(0 if result.converged or getattr(result, "degraded", None) is None else 1)
        self.set_state(result.state)

    def watch_fleet(self, snapshot) -> None:
        """Cluster mode: the coordinator's fleet numbers (`snapshot()`: fleet_status.Snapshot), read at
        every scrape, so they are never older than the coordinator's last pass."""
        self.registry.register(_FleetCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CoordinatorMetrics:
    """What `driverd cluster coordinator --listen` serves: its process and the fleet's rollouts (the same
    driverd_coordinator / driverd_rollout_* series a node daemon holding the Lease served before)."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, snapshot) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_FleetCollector(snapshot))

    def set_ready(self, ready: bool) -> None:       # the endpoints' router reports readiness here
        pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector:
    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot

    def describe(self):
        return self._families()

    def collect(self):
        snap = self.snapshot()
        coordinator, nodes, total, phase = self._families()
        coordinator.add_metric([], 1 if snap.coordinator else 0)
        if snap.coordinator:
            from driverd.cluster.fleet_status import PHASES, STATES
            for c in snap.rollouts:
                for state in STATES.values():
                    nodes.add_metric([c.rollout, state], c.nodes.get(state, 0))
                total.add_metric([c.rollout], c.total)
                for p in PHASES + (() if c.phase in PHASES else (c.phase,)):
                    phase.add_metric([c.rollout, p], 1 if p == c.phase else 0)
        return [coordinator, nodes, total, phase]

    @staticmethod
    def _families():
        return [GaugeMetricFamily("driverd_coordinator", "1 on the daemon holding the rollout Lease: its "
                                  "driverd_rollout_* numbers are the fleet's"),
                GaugeMetricFamily("driverd_rollout_nodes", "Target nodes of a DriverRollout by state, as the "
                                  "coordinator's last admission pass counted them", labels=["rollout", "state"]),
                GaugeMetricFamily("driverd_rollout_target_nodes", "Nodes a DriverRollout's nodeSelector selects",
                                  labels=["rollout"]),
                GaugeMetricFamily("driverd_rollout_phase", "1 for a DriverRollout's current phase, 0 for the others",
                                  labels=["rollout", "phase"])]
