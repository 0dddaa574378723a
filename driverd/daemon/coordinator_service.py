"""`driverd cluster coordinator` as a run mode: the coordinator of its own identity (cluster/coordinate.py)
with its access checked first, its fleet metrics and health on --listen, until SIGTERM (which gives the
Lease up for the next replica). deploy/base/coordinator.yaml runs it."""
from __future__ import annotations

from collections.abc import Callable


def serve(cfg, root, *, target, identity: str | None, namespace: str | None, listen: str | None,
          log: Callable[[str], None]) -> int:
    """0 after SIGTERM; 1 when the API or the Lease cannot be read (said in one line with its fix); 2 when
    --listen cannot be bound."""
    from driverd.cluster import coordinate
    from driverd.cluster.kube import Kube
    from driverd.daemon.cluster_mode import api_target, lease_namespace, until_terminated
    from driverd.errors import DriverdError
    tgt = api_target(cfg, root, target)
    name = identity or coordinate.identity()
    ns = lease_namespace(cfg, namespace)
    try:
        coordinate.check_access(Kube(tgt, retry_for_s=10, fail_fast=True), ns)
    except DriverdError as e:
        log(f"driverd cluster coordinator: {e.one_line()}")
        return 1
    kube = Kube(tgt)
    log(f"driverd: coordinator {name}, API {kube.host}, Lease {ns}/driverd-rollout")
    proc = coordinate.CoordinatorProcess(kube, name, ns, log)
    c = proc.coordinator
    assert c is not None
    if listen:
        from driverd.daemon.endpoints import Endpoints
        from driverd.daemon.health import CoordinatorHealth
        from driverd.daemon.metrics import CoordinatorMetrics
        try:
            host, port = Endpoints(listen, CoordinatorHealth(c), CoordinatorMetrics(c.fleet.snapshot)).start()
        except DriverdError as e:
            log(f"driverd cluster coordinator: {e.one_line()}")
            return 2
        log(f"driverd: coordinator serves /metrics, /healthz and /readyz on {host}:{port}")
    return until_terminated(proc.start, proc.close)
