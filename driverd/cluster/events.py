"""Events, the one way driverd records what happened to a Node or a DriverRollout (core/v1, in the
`default` namespace as cluster-scoped objects' events are). An event is a courtesy: failing to write
one is logged and never fails the transition it describes."""
from __future__ import annotations

from collections.abc import Callable

from driverd.cluster.kube import Kube, KubeError, now_rfc3339

NAMESPACE = "default"


def record(kube: Kube, involved: dict, reason: str, message: str, *, warning: bool, instance: str,
           log: Callable[[str], None], now: float | None = None) -> None:
    """involved: {apiVersion, kind, name, uid} of the object the event is about."""
    ts = now_rfc3339(now)
    ev = {"apiVersion": "v1", "kind": "Event",
          "metadata": {"generateName": f"{involved['name']}.driverd.", "namespace": NAMESPACE},
          "involvedObject": involved, "reason": reason, "message": message[:1000],
          "type": "Warning" if warning else "Normal", "source": {"component": "driverd", "host": instance},
          "firstTimestamp": ts, "lastTimestamp": ts, "count": 1, "reportingComponent": "driverd",
          "reportingInstance": instance}
    try:
        kube.create(f"/api/v1/namespaces/{NAMESPACE}/events", ev)
    except KubeError as e:
        log(f"driverd cluster: cannot record an event: {e.one_line()}")
