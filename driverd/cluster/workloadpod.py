"""The optional validation workload of a rollout (spec.validation.workloadPod): a pod the node's daemon
runs on its own node once its GPUs are schedulable again, and that must succeed before the node is
`done`.

Why a pod, when the node transaction already validated the driver (a CUDA context on every GPU, with the
libraries containers get)? That check runs in the driver's own process. The pod goes the way a user's GPU
job goes: kube-apiserver's admission (the RuntimeClass `nvidia` and its node selector), the kubelet's
admission and the device plugin's Allocate for `nvidia.com/gpu`, containerd running the `nvidia` handler
driverd configured, the NVIDIA runtime's injection of the driver into the container — and the operator's
own CUDA image on top. Optional, because it needs an image the cluster can pull and costs a pod start per
node.

Pure functions over API objects (the agent, cluster/agent/finish.py, creates, watches and deletes the pod):
its name and labels, its manifest, and what its status says. What a node's identity may create is held by
deploy/base/admission-node-scope.yaml (only such a pod: its own node, runtime class nvidia, nothing of the
host, no service account token, no secret); the manifest below keeps every one of those rules.
"""
from __future__ import annotations

import hashlib
import re

from driverd.cluster import model as m

LABEL = m.PREFIX + "validation"          # the rollout the pod validates for (the admission policy requires it)
L_NODE = m.PREFIX + "node"               # the node it validates
RUNTIME_CLASS = "nvidia"                 # deploy/base/runtimeclass.yaml: the handler driverd configures
GPU = "nvidia.com/gpu"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
CONTAINER = "workload"
LOG_LINES, LOG_CHARS = 5, 400            # the log tail a failure quotes (the node's message holds 1000 chars)
_LABEL_VALUE = re.compile(r"\A(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")


def label_value(text: str) -> str:
    """`text` as a label value: itself when it is one (at most 63 characters of the allowed set), else a
    readable prefix and a digest of the whole (rollout and node names may be 253 characters long)."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", text)[:52].strip("-_.")
    return f"{head}-{digest}" if head else digest


def pod_name(node: str, rollout_key: str, attempt: int, since: str) -> str:
    """One pod per validating stay of the node: a daemon restarted meanwhile finds its pod again by this
    name (the state's `since` changes with every new stay, a retry's included)."""
    digest = hashlib.sha256(f"{node}\0{rollout_key}\0{attempt}\0{since}".encode()).hexdigest()[:10]
    head = re.sub(r"[^a-z0-9.-]", "-", node.lower())[:30].strip("-.")
    return f"driverd-validation-{head}-{digest}" if head else f"driverd-validation-{digest}"


def manifest(name: str, namespace: str, node: str, rollout: str, wp: m.WorkloadPod, *, gpu: bool) -> dict:
    """The pod: bound to `node` (spec.nodeName: it must run there, and the node is still cordoned: the
    toleration says the cordon is expected), the runtime class nvidia, one nvidia.com/gpu when the node
    publishes that resource (a DRA-only node publishes none: no limit, the runtime class alone), run once
    (restartPolicy Never). No service account token, no service links, no host namespace, no volume, no
    added capability: what the admission policy allows a node's identity to create. On a failure the
    kubelet puts the tail of the container's log in its termination message (FallbackToLogsOnError), so
    the failure can quote it without the node's identity reading pod logs."""
    container: dict = {"name": CONTAINER, "image": wp.image, "terminationMessagePolicy": "FallbackToLogsOnError",
                       "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    if wp.command:
        container["command"] = list(wp.command)
    if gpu:
        container["resources"] = {"limits": {GPU: "1"}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {LABEL: label_value(rollout), L_NODE: label_value(node),
                                    "app.kubernetes.io/name": "driverd",
                                    "app.kubernetes.io/component": "validation"}},
            "spec": {"nodeName": node, "runtimeClassName": RUNTIME_CLASS, "restartPolicy": "Never",
                     "automountServiceAccountToken": False, "enableServiceLinks": False,
                     "terminationGracePeriodSeconds": 5,
                     "tolerations": [{"key": UNSCHEDULABLE, "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [container]}}


def publishes_gpus(node: dict) -> bool:
    """Whether the node's allocatable has nvidia.com/gpu (the device plugin's); not on a DRA-only node."""
    value = (((node.get("status") or {}).get("allocatable")) or {}).get(GPU)
    try:
        return int(str(value)) > 0
    except ValueError:
        return False


def _terminated(pod: dict) -> dict:
    for cs in ((pod.get("status") or {}).get("containerStatuses")) or []:
        if cs.get("name") == CONTAINER:
            return ((cs.get("state") or {}).get("terminated")) or {}
    return {}


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()][-LOG_LINES:]
    out = " | ".join(ln.strip() for ln in lines)
    return ("…" + out[-(LOG_CHARS - 1):]) if len(out) > LOG_CHARS else out


def finished(pod: dict) -> bool | None:
    """True: Succeeded; False: Failed; None: not finished yet."""
    phase = (pod.get("status") or {}).get("phase")
    return True if phase == "Succeeded" else False if phase == "Failed" else None


def failure(pod: dict) -> str:
    """A Failed pod in words: its exit code (and the container's reason), or the reason the kubelet gave the
    pod (NodeAffinity, OutOfnvidia.com/gpu, UnexpectedAdmissionError ...), and the last lines of its log."""
    st = pod.get("status") or {}
    t = _terminated(pod)
    if "exitCode" in t:
        words = f"its container exited with code {t['exitCode']}" + (f" ({t['reason']})" if t.get("reason") else "")
    else:
        words = "the pod failed" + (f": {st['reason']}" if st.get("reason") else "") + \
            (f": {' '.join(str(st['message']).split())[:200]}" if st.get("message") else "")
    log = _tail(t.get("message") or "")
    return words + (f"; last lines of its log: {log}" if log else "")


def pending(pod: dict) -> str:
    """Where a pod that has not finished stands, in words (for a timeout): its phase and its container's
    waiting reason (ErrImagePull, ContainerCreating ...) or that it runs."""
    st = pod.get("status") or {}
    words = f"phase {st.get('phase') or 'Pending'}" + (f" ({st['reason']})" if st.get("reason") else "")
    for cs in st.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "waiting" in state:
            w = state["waiting"] or {}
            words += f", container waiting: {w.get('reason') or '?'}" + \
                (f": {' '.join(str(w['message']).split())[:200]}" if w.get("message") else "")
        elif "running" in state:
            words += ", container running"
    for c in st.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
            words += f", {' '.join(str(c['message']).split())[:200]}"
    return words
