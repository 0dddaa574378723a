"""PodDisruptionBudget status (what the disruption controller keeps) and the pods/eviction subresource.

Healthy pod: no deletionTimestamp, status.phase Running, and the Ready condition True.
expectedPods: for an integer minAvailable, the number of pods the selector matches; for a percentage or
maxUnavailable, the sum of spec.replicas of the pods' controllers (ReplicaSet, StatefulSet, ReplicationController,
Deployment) when those exist in the store, else the number of matching pods. desiredHealthy and
disruptionsAllowed then follow Kubernetes' rules (percentages rounded up)."""
from __future__ import annotations

import math

from tests.apiserver.clock import now
from tests.apiserver.errors import ApiError, bad_request
from tests.apiserver.selectors import LabelSelector
from tests.apiserver.watch import MODIFIED


def is_ready(pod: dict) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def is_healthy(pod: dict) -> bool:
    return (not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") == "Running"
            and is_ready(pod))


def _selector(pdb: dict):
    sel = (pdb.get("spec") or {}).get("selector")
    return LabelSelector.from_dict(sel) if sel is not None else None


def _scaled(value, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        try:
            pct = int(value[:-1])
        except ValueError:
            return 0
        v = pct * total / 100
        return math.ceil(v) if round_up else math.floor(v)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _controller_scale(store, ns: str, pods: list[dict]) -> int | None:
    seen, total = set(), 0
    for p in pods:
        ref = next((o for o in p["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
        if ref is None:
            return None
        if ref.get("uid") in seen:
            continue
        seen.add(ref.get("uid"))
        plural = {"ReplicaSet": "replicasets", "StatefulSet": "statefulsets", "Deployment": "deployments",
                  "ReplicationController": "replicationcontrollers"}.get(ref.get("kind"))
        key = ("apps" if plural != "replicationcontrollers" else "", plural)
        obj = store._data.get(key, {}).get((ns, ref.get("name"))) if plural else None
        if obj is None:
            return None
        total += int((obj.get("spec") or {}).get("replicas", 1))
    return total


def compute_status(store, pdb: dict) -> dict:
    ns = pdb["metadata"].get("namespace", "")
    sel = _selector(pdb)
    pods = [] if sel is None else [p for (pns, _), p in store._data.get(("", "pods"), {}).items()
                                   if pns == ns and sel.matches(p["metadata"].get("labels"))]
    spec = pdb.get("spec") or {}
    healthy = sum(1 for p in pods if is_healthy(p))
    if "maxUnavailable" in spec and spec["maxUnavailable"] is not None:
        expected = _controller_scale(store, ns, pods)
        expected = len(pods) if expected is None else expected
        desired = max(0, expected - _scaled(spec["maxUnavailable"], expected, True))
    elif isinstance(spec.get("minAvailable"), str):
        expected = _controller_scale(store, ns, pods)
        expected = len(pods) if expected is None else expected
        desired = _scaled(spec["minAvailable"], expected, True)
    else:
        expected = len(pods)
        desired = int(spec.get("minAvailable") or 0) if "minAvailable" in spec else 1
    allowed = healthy - desired
    if expected <= 0 or allowed <= 0:
        allowed = 0
    old = pdb.get("status") or {}
    cond_ok = allowed > 0
    cond = {"type": "DisruptionAllowed", "status": "True" if cond_ok else "False",
            "reason": "SufficientPods" if cond_ok else "InsufficientPods", "message": "",
            "observedGeneration": pdb["metadata"].get("generation", 1)}
    prev = next((c for c in old.get("conditions") or [] if c.get("type") == "DisruptionAllowed"), None)
    if prev and prev.get("status") == cond["status"] and prev.get("lastTransitionTime"):
        cond["lastTransitionTime"] = prev["lastTransitionTime"]
    else:
        cond["lastTransitionTime"] = now()
    return {"observedGeneration": pdb["metadata"].get("generation", 1), "disruptionsAllowed": allowed,
            "currentHealthy": healthy, "desiredHealthy": desired, "expectedPods": expected, "conditions": [cond]}


def sync_budgets(store, ns: str, res, obj: dict, type_: str) -> None:
    """Recompute the budgets a pod or PDB change touches; commit their status when it changed."""
    pdb_res = store.registry.resolve("poddisruptionbudgets")
    bucket = store._data.get(pdb_res.key, {})
    if res.plural == "poddisruptionbudgets":
        if type_ == "DELETED":
            return
        targets = [obj]
    else:
        labels = obj["metadata"].get("labels")
        targets = [p for (pns, _), p in bucket.items() if pns == ns
                   and (s := _selector(p)) is not None and s.matches(labels)]
    for pdb in targets:
        cur = bucket.get((ns, pdb["metadata"]["name"]))
        if cur is None:
            continue
        st = compute_status(store, cur)
        if st != cur.get("status"):
            new = dict(cur)
            new["metadata"] = dict(cur["metadata"])
            new["status"] = st
            store._commit(pdb_res, MODIFIED, new, cur)


def evict(store, namespace: str, name: str, body: dict, dry_run: bool = False) -> dict:
    """POST pods/NAME/eviction. Returns the Status to answer with 201; raises ApiError (429 under a budget)."""
    pods = store.registry.resolve("pods")
    if not isinstance(body, dict):
        raise bad_request("the body of the request was not a JSON object")
    if (body.get("metadata") or {}).get("name") not in (None, name):
        raise bad_request("name in URL does not match name in Eviction object")
    opts = body.get("deleteOptions") or {}
    with store.lock:
        pod = store._current(pods, name, namespace)
        pre = opts.get("preconditions") or {}
        grace = opts.get("gracePeriodSeconds")

        def delete():
            if not dry_run:
                store.delete(pods, name, namespace, grace_period_seconds=grace, uid=pre.get("uid"),
                             resource_version=pre.get("resourceVersion"))
            return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed", "Pending") or pod["metadata"].get("deletionTimestamp"):
            return delete()
        pdb_res = store.registry.resolve("poddisruptionbudgets")
        labels = pod["metadata"].get("labels")
        pdbs = [p for (pns, _), p in sorted(store._data.get(pdb_res.key, {}).items()) if pns == namespace
                and (s := _selector(p)) is not None and s.matches(labels)]
        if not pdbs:
            return delete()
        if len(pdbs) > 1:
            raise ApiError(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the "
                           "eviction subresource does not support.")
        pdb = pdbs[0]
        st = compute_status(store, pdb)
        if not is_healthy(pod):
            policy = (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy") or "IfHealthyBudget"
            if policy == "AlwaysAllow" or (st["currentHealthy"] >= st["desiredHealthy"] and st["desiredHealthy"] > 0):
                return delete()
        if st["disruptionsAllowed"] <= 0:
            raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
                           {"causes": [{"reason": "DisruptionBudget", "message":
                                        f"The disruption budget {pdb['metadata']['name']} needs "
                                        f"{st['desiredHealthy']} healthy pods and has {st['currentHealthy']} "
                                        "currently"}]})
        return delete()
