"""Which pods on a node use its GPUs, and why we think so. A pod is a GPU user when any of:

1. a container (or init container) requests or limits `nvidia.com/gpu*` or `nvidia.com/mig-*`;
2. it runs with a GPU RuntimeClass: `runtimeClassName` names a RuntimeClass whose handler (or
   name) is an NVIDIA one — the pods that get GPUs through `NVIDIA_VISIBLE_DEVICES=all` without
   requesting `nvidia.com/gpu`, which other drain tools miss;
3. it holds a DRA resource claim allocated by, or requesting a device class of, NVIDIA's driver
   (`gpu.nvidia.com`);
4. from the host: one of its processes has `/dev/nvidia*` open (the pod found from the process's
   cgroup, which names the pod UID).

DaemonSet pods are not evicted (the controller would recreate them on the cordoned node at once):
GPU DaemonSets (device plugin, DCGM exporter, …) are expected to select nodes labelled
`driverd.io/driver-ready=true`; driverd removes that label when it cordons and sets it again after
validation, so their controller takes them off and brings them back. The GPU Operator's DaemonSets
select their own `nvidia.com/gpu.deploy.<component>` labels instead, which driverd pauses the way
NVIDIA's k8s-driver-manager does (operator_components.py). One that still holds the GPU when the
driver is unloaded is named by the unload's in-use check.
"""
from __future__ import annotations


from driverd.cluster.kube import Kube, KubeError
from driverd.datatypes import dataclass

GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-")
NVIDIA_DRA_DRIVER = "gpu.nvidia.com"
DRA_VERSIONS = ("v1", "v1beta2", "v1beta1")


@dataclass(frozen=True)
class PodUse:
    """A pod on the node that uses its GPUs, or must leave before the driver changes, and why."""
    namespace: str
    name: str
    uid: str
    why: str
    daemonset: bool
    mirror: bool
    controller: bool = True          # an ownerReference with controller=true: something recreates it
    terminating: bool = False        # deletionTimestamp set: evicting it again changes nothing

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def _resources(pod: dict) -> set[str]:
    out = set()
    spec = pod.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            out |= {k for k in (res.get(part) or {}) if k.startswith(GPU_RESOURCES)}
    return out


def gpu_runtime_classes(kube: Kube) -> set[str]:
    try:
        items = kube.list("/apis/node.k8s.io/v1/runtimeclasses").get("items") or []
    except KubeError as e:
        if e.status in (403, 404):
            return {"nvidia"}
        raise
    return {rc["metadata"]["name"] for rc in items
            if str(rc.get("handler", "")).startswith("nvidia") or rc["metadata"]["name"].startswith("nvidia")}


def _claim_is_gpu(kube: Kube, ns: str, name: str) -> bool:
    for v in DRA_VERSIONS:
        try:
            claim = kube.get(f"/apis/resource.k8s.io/{v}/namespaces/{ns}/resourceclaims/{name}")
        except KubeError as e:
            if e.status == 404:
                continue
            return False
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        if any(r.get("driver") == NVIDIA_DRA_DRIVER for r in results):
            return True
        reqs = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
        return any("nvidia" in str(r.get("deviceClassName") or (r.get("exactly") or {}).get("deviceClassName") or "")
                   for r in reqs)
    return False


def _claim_names(pod: dict) -> list[str]:
    st = (pod.get("status") or {}).get("resourceClaimStatuses") or []
    names = [s.get("resourceClaimName") for s in st if s.get("resourceClaimName")]
    names += [c.get("resourceClaimName") for c in (pod.get("spec") or {}).get("resourceClaims") or []
              if c.get("resourceClaimName")]
    return list(dict.fromkeys(names))


def classify(kube: Kube, pods: list[dict], host_pod_uids: dict[str, str] | None = None,
             runtime_classes: set[str] | None = None) -> list[PodUse]:
    """The GPU users among `pods` (those not finished), each with the reason it counts."""
    rcs = runtime_classes if runtime_classes is not None else None
    out = []
    for pod in pods:
        md, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        why = None
        res = _resources(pod)
        if res:
            why = "requests " + ", ".join(sorted(res))
        elif spec.get("runtimeClassName"):
            if rcs is None:
                rcs = gpu_runtime_classes(kube)
            if spec["runtimeClassName"] in rcs:
                why = f"runs with the GPU RuntimeClass {spec['runtimeClassName']}"
        if why is None:
            gpu_claims = [c for c in _claim_names(pod) if _claim_is_gpu(kube, md.get("namespace", ""), c)]
            if gpu_claims:
                why = "holds the GPU resource claim " + ", ".join(gpu_claims)
        if why is None and host_pod_uids and md.get("uid") in host_pod_uids:
            why = host_pod_uids[md["uid"]]
        if why is None:
            continue
        owners = md.get("ownerReferences") or []
        out.append(PodUse(md.get("namespace", ""), md.get("name", ""), md.get("uid", ""), why,
                          any(o.get("kind") == "DaemonSet" for o in owners),
                          "kubernetes.io/config.mirror" in (md.get("annotations") or {}),
                          controller=any(o.get("controller") for o in owners),
                          terminating=bool(md.get("deletionTimestamp"))))
    return out


def host_users(root) -> dict[str, str]:
    """pod UID -> "process PID (comm) has /dev/nvidia… open", from the host's /proc."""
    from driverd.host.processes import gpu_users
    out: dict[str, str] = {}
    for u in gpu_users(root):
        if u.pod_uid:
            uid = u.pod_uid.replace("_", "-")
            out.setdefault(uid, f"its process {u.pid} ({u.comm}) has {', '.join(u.devices[:2])} open")
    return out
