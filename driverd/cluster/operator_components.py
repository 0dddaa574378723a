"""Living beside NVIDIA's GPU Operator: its GPU components (device plugin, GPU feature discovery, DCGM
exporter, ...) keep running on a node while driverd changes the driver, and each of them is a GPU
user the drain must take off the node first. The Operator's own answer, k8s-driver-manager, does it
through node labels, and driverd does the same with the same labels and values, so either tool
leaves a node the other understands.

What NVIDIA does (NVIDIA/k8s-driver-manager cmd/driver-manager/main.go at 0c04c81 and
internal/kubernetes/client.go at 0914515; gpu-operator's DaemonSets select
`nvidia.com/gpu.deploy.<component>: "true"`):
- before the driver goes it reads each `nvidia.com/gpu.deploy.<component>` label of the node and
  sets `true` to `paused-for-driver-upgrade` (`maybeSetPaused`): the component's DaemonSet no longer
  selects the node and its controller deletes the pod; `false` and absent labels are left alone;
- it waits for the pods to go (`WaitForPodTermination`: pods of the component's `app` label on the
  node, polled every 5 s, up to 5 min each; for `gpu.deploy.client`, any DaemonSet pod whose
  nodeSelector names that key);
- the DRA kubelet plugin (`gpu.deploy.dra-driver`) goes last, after the pods holding GPU claims,
  which need it to release them (`evictKubeletPlugin`);
- afterwards, and on every failure (`cleanupOnFailure`), it sets `paused-for-driver-upgrade` back to
  `true` (`maybeSetTrue`), so only what was paused comes back.

driverd differs in one way on purpose: what it paused is recorded on the Node (annotation
`driverd.io/paused-operator-components`, a JSON list of label keys) in the same patch that pauses
them, so a daemon killed mid-upgrade restores exactly those labels when the node's upgrade ends —
done, failed or given back — and no other value is ever written: a label an operator set to `false`
(or changed in the meantime) is left as it is. Only label values of `true` are paused.

Pods that opt out of the drain: gpu-operator's upgrade controller drains with the pod selector
`nvidia.com/gpu-driver-upgrade-drain.skip!=true` (NVIDIA/gpu-operator controllers/upgrade_controller.go at
06faaf0, `UpgradeSkipDrainLabelSelector`), so a pod labelled `nvidia.com/gpu-driver-upgrade-drain.skip=true`
is never evicted by it. driverd gives the label the same meaning (drain.py); see there for what
happens when such a pod uses the GPU.
"""
from __future__ import annotations

import json

from driverd.cluster import model as m
from driverd.datatypes import dataclass

DEPLOY_PREFIX = "nvidia.com/gpu.deploy."
TRUE = "true"
PAUSED = "paused-for-driver-upgrade"
A_PAUSED = m.PREFIX + "paused-operator-components"
SKIP_DRAIN = "nvidia.com/gpu-driver-upgrade-drain.skip"
EARLY, LATE = "early", "late"


@dataclass(frozen=True)
class Component:
    """One GPU Operator component, paused through its `nvidia.com/gpu.deploy.<component>` node label."""
    name: str                 # the <component> of nvidia.com/gpu.deploy.<component>
    stage: str = EARLY        # LATE: paused only once the node's GPU pods are gone

    @property
    def label(self) -> str:
        return DEPLOY_PREFIX + self.name


# The components k8s-driver-manager pauses, in its order. The Operator's driver itself
# (gpu.deploy.driver) is not one: on a node driverd manages it must not run at all.
COMPONENTS: tuple[Component, ...] = tuple(Component(n) for n in (
    "operator-validator", "container-toolkit", "device-plugin", "gpu-feature-discovery", "dcgm-exporter", "dcgm",
    "mig-manager", "nvsm", "sandbox-validator", "sandbox-device-plugin", "vgpu-device-manager", "client",
    "dra-validator", "dcgm-dra", "dcgm-exporter-dra")) + (Component("dra-driver", LATE),)
BY_LABEL = {c.label: c for c in COMPONENTS}


def short(key: str) -> str:
    return key.removeprefix(DEPLOY_PREFIX)


def recorded(annotations: dict | None) -> list[str]:
    """The labels driverd paused on this node and has not restored yet (the annotation's list)."""
    text = (annotations or {}).get(A_PAUSED)
    if not text:
        return []
    try:
        keys = json.loads(text)
    except ValueError:
        keys = None
    if not isinstance(keys, list):
        # unreadable (written by hand?): every component label still paused is taken as ours, so
        # nothing stays paused for ever; a label with another value is left alone as always
        return sorted(BY_LABEL)
    return sorted({k for k in keys if isinstance(k, str) and k in BY_LABEL})


def to_pause(labels: dict, stage: str) -> list[str]:
    """The component labels of `stage` that are `true` on the node now."""
    return sorted(c.label for c in COMPONENTS if c.stage == stage and labels.get(c.label) == TRUE)


def pause(labels: dict, annotations: dict | None, stage: str) -> tuple[dict, dict]:
    """(labels, annotations) of the merge patch that pauses the `true` components of `stage` and records
    them with what was paused before; two empty dicts when there is nothing to pause."""
    keys = to_pause(labels, stage)
    if not keys:
        return {}, {}
    done = sorted(set(recorded(annotations)) | set(keys))
    return {k: PAUSED for k in keys}, {A_PAUSED: json.dumps(done)}


def restore(labels: dict, annotations: dict | None) -> tuple[dict, dict, list[str]]:
    """(labels, annotations, restored keys) of the merge patch that ends the pause: every recorded
    label still `paused-for-driver-upgrade` goes back to `true`; one changed since (an operator's
    `false`, a removed label) stays as it is. The record goes either way."""
    if A_PAUSED not in (annotations or {}):
        return {}, {}, []
    keys = [k for k in recorded(annotations) if labels.get(k) == PAUSED]
    return {k: TRUE for k in keys}, {A_PAUSED: None}, keys


def leaving(labels: dict, annotations: dict | None) -> set[str]:
    """Component labels whose DaemonSets' pods leave the node during an upgrade: `true` ones (driverd
    pauses them) and the ones it paused already."""
    out = {c.label for c in COMPONENTS if labels.get(c.label) == TRUE}
    return out | {k for k in recorded(annotations) if labels.get(k) == PAUSED}


def selects(spec: dict, keys: set[str]) -> str | None:
    """The label of `keys` a pod spec (a pod's or a DaemonSet's template) requires to be `true`: in its
    nodeSelector, or in every term of its required node affinity (terms are ORed). None otherwise."""
    sel = spec.get("nodeSelector") or {}
    for k in sorted(keys):
        if sel.get(k) == TRUE:
            return k
    req = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
           .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = req.get("nodeSelectorTerms") or []
    for k in sorted(keys):
        if terms and all(any(e.get("key") == k and e.get("operator") == "In" and TRUE in (e.get("values") or [])
                             and PAUSED not in (e.get("values") or []) for e in t.get("matchExpressions") or [])
                         for t in terms):
            return k
    return None


def skips_drain(pod: dict) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(SKIP_DRAIN) == TRUE


def names(keys) -> str:
    return ", ".join(short(k) for k in keys)
