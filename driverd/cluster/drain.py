"""What a drain of this node will do, decided once from the pods on it: which pods the Eviction API
takes off, which leave by themselves when driverd removes the `driverd.io/driver-ready` label, and
which stay (and why). The preflight judges the host as it will be after the drain from this, and
the `evicting` state carries it out, so the two cannot disagree.

- GPU pods (driverd.cluster.gpuusers) and pods matching `spec.drain.podSelector` are evicted;
- a pod without a controller is not evicted unless `spec.drain.force` (nothing would recreate it:
  `kubectl drain` refuses it for the same reason);
- a DaemonSet pod is never evicted (its controller would put it back at once); it leaves when its
  DaemonSet selects nodes by `driverd.io/driver-ready` (nodeSelector or required node affinity),
  which driverd removes at the cordon, or when it is a GPU Operator component whose
  `nvidia.com/gpu.deploy.<component>` label driverd pauses (cluster/operator_components.py: those
  pods leave whether or not they are GPU users, as k8s-driver-manager waits for all of them);
  otherwise it stays;
- a static (mirror) pod stays;
- a pod labelled `nvidia.com/gpu-driver-upgrade-drain.skip=true` is never evicted nor deleted, not even
  with spec.drain.force: the label means what it means to gpu-operator's upgrade controller, whose
  drain selects `nvidia.com/gpu-driver-upgrade-drain.skip!=true`. Such a pod that uses the GPU is
  `held`: the preflight names it as a pod that stays when one of its processes holds the GPU, and
  the `evicting` state does not go on to unload the driver while it is on the node — it waits for it
  to finish or be removed by its owner, saying so, for at most spec.drain.timeoutSeconds, then fails
  the node (EvictionBlocked) with the driver untouched. A skip pod that is no GPU user (the
  Operator itself, monitoring) is simply left alone.
"""
from __future__ import annotations

from dataclasses import field

from driverd.cluster import model as m
from driverd.cluster import operator_components as oc
from driverd.cluster.gpuusers import PodUse, classify
from driverd.cluster.kube import Kube, KubeError
from driverd.datatypes import dataclass


@dataclass
class DrainPlan:
    """What a drain of this node will do, decided once from its pods: which are evicted, which leave, which stay."""
    evict: list[PodUse] = field(default_factory=list)          # through the Eviction API
    no_controller: list[PodUse] = field(default_factory=list)  # evicted only with spec.drain.force
    with_label: list[PodUse] = field(default_factory=list)     # DaemonSet pods that leave with the label
    staying: dict[str, str] = field(default_factory=dict)      # pod uid -> "ns/name: why it stays"
    held: list[PodUse] = field(default_factory=list)           # GPU users that opt out of the drain: waited for
    leaves_by: dict[str, str] = field(default_factory=dict)    # uid of a with_label pod -> the label it leaves by
    daemonset_of: dict[str, str] = field(default_factory=dict)  # uid of a with_label pod -> "ns/DaemonSet"
    force: bool = False

    @property
    def leaving(self) -> set[str]:
        """UIDs of the pods that are gone once the drain has run."""
        out = {u.uid for u in self.evict + self.with_label}
        if self.force:
            out |= {u.uid for u in self.no_controller}
        return out


def _selects_ready_label(ds: dict) -> bool:
    spec = ((ds.get("spec") or {}).get("template") or {}).get("spec") or {}
    if (spec.get("nodeSelector") or {}).get(m.L_READY) == "true":
        return True
    req = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
           .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = req.get("nodeSelectorTerms") or []
    # every term must require the label (terms are ORed): then no pod runs on a node without it
    return bool(terms) and all(any(e.get("key") == m.L_READY and (e.get("operator") == "Exists" or (
        e.get("operator") == "In" and e.get("values") == ["true"])) for e in t.get("matchExpressions") or [])
        for t in terms)


def _daemonset(pod: dict) -> dict | None:
    return next((o for o in (pod.get("metadata") or {}).get("ownerReferences") or []
                 if o.get("kind") == "DaemonSet"), None)


def has_controller(pod: dict) -> bool:
    return any(o.get("controller") for o in (pod.get("metadata") or {}).get("ownerReferences") or [])


def plan_drain(kube: Kube, pods: list[dict], host_pod_uids: dict[str, str], *, drain_selector_uids: set[str],
               force: bool, selector: str = "", operator_labels: set[str] = frozenset(),
               daemonsets: dict[tuple, dict | None] | None = None) -> DrainPlan:
    """`pods`: the node's pods; `host_pod_uids`: pod UID -> why (a process of it holds the GPU);
    `drain_selector_uids`: the pods matching spec.drain.podSelector; `operator_labels`: the GPU
    Operator's component labels whose pods leave the node (operator_components.leaving);
    `daemonsets`: the DaemonSets read so far, (namespace, name) -> object or None, filled as they are
    read (one drain's rounds read each once)."""
    gpu = {u.uid: u for u in classify(kube, pods, host_pod_uids)}
    users = dict(gpu)
    for p in pods:
        md = p.get("metadata") or {}
        if md.get("uid") in drain_selector_uids and md.get("uid") not in users \
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            users[md["uid"]] = PodUse(md.get("namespace", ""), md.get("name", ""), md["uid"],
                                      f"matches spec.drain.podSelector {selector!r}", _daemonset(p) is not None,
                                      "kubernetes.io/config.mirror" in (md.get("annotations") or {}),
                                      controller=has_controller(p), terminating=bool(md.get("deletionTimestamp")))
    by_uid = {(p.get("metadata") or {}).get("uid"): p for p in pods}
    out = DrainPlan(force=force)
    ds_cache: dict[tuple, dict | None] = {} if daemonsets is None else daemonsets
    if operator_labels:
        # the Operator's components leave with their paused labels, GPU users or not (k8s-driver-manager
        # waits for every one of them); their pods carry the DaemonSet's nodeSelector
        for p in pods:
            md = p.get("metadata") or {}
            if md.get("uid") in users or _daemonset(p) is None or \
                    (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            label = oc.selects(p.get("spec") or {}, operator_labels)
            if label:
                u = PodUse(md.get("namespace", ""), md.get("name", ""), md["uid"], f"GPU Operator component "
                           f"{oc.short(label)}", True, False, terminating=bool(md.get("deletionTimestamp")))
                out.with_label.append(u)
                out.leaves_by[u.uid] = label
                out.daemonset_of[u.uid] = f"{u.namespace}/{(_daemonset(p) or {}).get('name')}"
    for uid, u in users.items():
        pod = by_uid.get(uid) or {}
        if u.mirror:
            out.staying[uid] = f"{u.ref}: a static (mirror) pod cannot be evicted"
        elif u.daemonset:
            ref = _daemonset(pod) or {}
            key = (u.namespace, ref.get("name"))
            if key not in ds_cache:
                try:
                    ds_cache[key] = kube.find(f"/apis/apps/v1/namespaces/{u.namespace}/daemonsets/{ref.get('name')}")
                except KubeError:
                    ds_cache[key] = None
            ds = ds_cache[key]
            label = oc.selects(pod.get("spec") or {}, operator_labels) or (
                oc.selects(((ds or {}).get("spec") or {}).get("template", {}).get("spec") or {}, operator_labels)
                if operator_labels else None)
            if label:
                out.with_label.append(u)
                out.leaves_by[uid] = label
                out.daemonset_of[uid] = f"{u.namespace}/{ref.get('name')}"
            elif ds is not None and _selects_ready_label(ds):
                out.with_label.append(u)
                out.daemonset_of[uid] = f"{u.namespace}/{ref.get('name')}"
            else:
                out.staying[uid] = (f"{u.ref}: DaemonSet {ref.get('name')} does not select nodes by "
                                    f"{m.L_READY}=true, so its pods stay on the node during the upgrade")
        elif oc.skips_drain(pod):
            if uid in gpu:
                out.held.append(u)
                out.staying[uid] = (f"{u.ref}: opts out of the drain ({oc.SKIP_DRAIN}=true), so it is not evicted, "
                                    f"and {u.why}: the driver is not unloaded while it runs")
            else:
                out.staying[uid] = f"{u.ref}: opts out of the drain ({oc.SKIP_DRAIN}=true), so it is not evicted"
        elif not u.controller:
            out.no_controller.append(u)
            if not force:
                out.staying[uid] = (f"{u.ref}: has no controller (nothing would recreate it), so it is not "
                                    "evicted without spec.drain.force")
        else:
            out.evict.append(u)
    return out
