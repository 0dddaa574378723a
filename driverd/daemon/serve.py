"""`driverd daemon` and `driverd container-entrypoint`: put the pieces together and run the loop.
The CLI hands in how to load the configuration and how to build a step context (it is the
composition root that picks the kernel and daemon backends); everything else is built here."""
from __future__ import annotations

import os
import sys
from typing import Callable

from driverd.errors import DriverdError


def _log(msg: str, level: str | None = None, **fields) -> None:
    from driverd.log import log
    log(msg, level, **fields)


def loaded_probe(root) -> Callable[[], dict | None]:
    from driverd.driver.ident import loaded

    def probe() -> dict | None:
        got = loaded(root)
        return None if got is None else got.as_dict()
    return probe


def serve(*, mode: str, root, config_path: str | None, load_config: Callable, make_context: Callable,
          listen: str | None = None, log: Callable[[str], None] = _log) -> int:
    """mode: "daemon" (host) or "container-entrypoint" (the driver container, with the fast path)."""
    from driverd.config import SCHEMA
    from driverd.daemon.configwatch import ConfigWatch
    from driverd.daemon.endpoints import Endpoints
    from driverd.daemon.health import Health
    from driverd.daemon.loop import DaemonLoop
    from driverd.daemon.metrics import Metrics
    from driverd.daemon.notify import Notifier
    from driverd.apply.reconcile import Reconciler

    from driverd.host.nvml import query_in_child
    query_in_child()                    # an idle daemon must not carry NVML's memory for hours
    notifier = Notifier(log=log)
    health = Health(loaded_probe(root))
    metrics = Metrics()
    from driverd import observe
    stop_observing = observe.subscribe(metrics.package_event)     # fetches and builds made by reconciles
    watch = ConfigWatch(root, config_path)
    from driverd.apply import statefile

    def record(result=None, next_in_s=None, stopped=False) -> None:
        statefile.write(root, mode=mode, result=result, next_in_s=next_in_s, stopped=stopped,
                        ready=False if stopped else health.readiness()[0])
    from driverd.daemon.kernelwatch import KernelDirs
    reconciler = Reconciler(make_context, log, kernel_watch=True)
    loop = DaemonLoop(name=mode, load_config=load_config, reconciler=reconciler, health=health,
                      metrics=metrics, notifier=notifier, watch=watch, log=log,
                      unload=lambda cfg: unload(make_context(cfg)), record=record,
                      kernels=KernelDirs(root), kernels_changed=reconciler.kernels.wake)
    cfg = None
    try:
        cfg = load_config()
    except DriverdError as e:
        problem = e.one_line()
        health.set_state("config-error", problem)
        metrics.set_state("config-error")
        log(f"driverd {mode}: the configuration cannot be used: {problem}; waiting for it to change (or SIGHUP)")
    cluster = None
    if cfg is not None:
        from driverd.daemon import cluster_mode
        if cluster_mode.wanted(cfg, root):
            try:
                cluster = cluster_mode.ClusterMode(cfg, root, make_context, log).start()
                loop.reconciler = cluster_mode.PinnedReconciler(loop.reconciler, cluster)
                if cluster.coordinator is not None:
                    metrics.watch_fleet(cluster.coordinator.fleet.snapshot)
            except DriverdError as e:
                log(f"driverd {mode}: cluster mode is on but unusable: {e.one_line()}; running host-only")
    endpoints = Endpoints(listen or (cfg["daemon.listen"] if cfg is not None else SCHEMA["daemon.listen"].default),
                          health, metrics)
    host, port = endpoints.start()
    log(f"driverd {mode}: listening on {host}:{port} (/metrics /healthz /readyz); pid {os.getpid()}, root "
        f"{root.base}" + (", notifying systemd" if notifier.enabled else ""), listen=f"{host}:{port}")
    converged = False
    if cfg is not None and mode == "container-entrypoint":
        converged = _fast_path(make_context, cfg, health, metrics, log, mode)
    rc = loop.run(cfg, converged_at_start=converged)
    if cluster is not None:
        cluster.close()
    stop_observing()
    endpoints.close()
    notifier.close()
    if loop.abandoned:             # a reconcile thread is still inside a step: leave without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _fast_path(make_context, cfg, health, metrics, log, mode: str) -> bool:
    from driverd.daemon.entrypoint import fast_path
    try:
        sctx = make_context(cfg)
        loaded, why = fast_path(sctx, cfg)
    except Exception as e:        # the fast path is an optimisation: anything odd means "reconcile"
        loaded, why, sctx = None, f"{e.__class__.__name__}: {e}", None
    if loaded is None:
        log(f"driverd {mode}: no fast path: {why}; reconciling")
        return False
    health.converged_at_start(loaded, why)
    metrics.converged_at_start(loaded, sctx.kernel.release)
    metrics.set_ready(True)
    log(f"driverd {mode}: fast path: {why}")
    return True


def unload(sctx) -> str:
    """daemon.unload_on_exit: a journalled unload (stop the GPU daemons, unload the modules)."""
    from driverd.apply import lifecycle as lc
    out = lc.transact(sctx, lc.lifecycle_request("unload"), wait_s=2.0)
    lc.raise_for(out)
    return f"unload {out['state']}"
