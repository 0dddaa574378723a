"""Whether a node's GPUs can be scheduled again after its upgrade: the count the scheduler sees before
the drain and again before `done`.

A driver that loads and validates on the host is not yet a node that serves GPU work: the device plugin
(the extended resources `nvidia.com/*` in the Node's allocatable) or the DRA kubelet plugin (the devices
of its ResourceSlices, driver gpu.nvidia.com) must come back with it. A plugin that kept NVML handles of
the old driver reports its devices unhealthy (the kubelet's allocatable drops to 0) until someone
restarts it; NVIDIA's own validator checks the allocatable count for that reason. Pure functions over
API objects, and one read of the ResourceSlices; the agent (cluster/agent/__init__.py) records the counts at the
cordon (driverd.io/gpus-before) and compares them in `validating`.
"""
from __future__ import annotations

import json

from driverd.cluster.gpuusers import DRA_VERSIONS, NVIDIA_DRA_DRIVER
from driverd.cluster.kube import Kube, KubeError

DRA_KEY = f"resourceslices/{NVIDIA_DRA_DRIVER}"     # the DRA devices, beside the extended resources' names
PREFIX = "nvidia.com/"


def counts(node: dict, slices: list[dict]) -> dict[str, int]:
    """What the scheduler can place on `node`: each extended resource nvidia.com/* in its allocatable
    (nvidia.com/gpu, MIG profiles, shared GPUs) with a count above 0, and the devices its ResourceSlices of
    gpu.nvidia.com publish (each pool at its newest generation)."""
    out: dict[str, int] = {}
    for name, value in (((node.get("status") or {}).get("allocatable")) or {}).items():
        if not name.startswith(PREFIX):
            continue
        try:
            n = int(str(value))
        except ValueError:          # an extended resource is a whole number; anything else is not a GPU count
            continue
        if n > 0:
            out[name] = n
    newest: dict[str, tuple[int, int]] = {}         # pool -> (generation, devices)
    name = ((node.get("metadata") or {}).get("name")) or ""
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != NVIDIA_DRA_DRIVER or spec.get("nodeName") != name:
            continue
        pool = spec.get("pool") or {}
        gen, devices = int(pool.get("generation") or 0), len(spec.get("devices") or [])
        have = newest.get(pool.get("name") or "")
        if have is None or gen > have[0]:
            newest[pool.get("name") or ""] = (gen, devices)
        elif gen == have[0]:
            newest[pool.get("name") or ""] = (gen, have[1] + devices)
    dra = sum(d for _, d in newest.values())
    if dra:
        out[DRA_KEY] = dra
    return out


def shortfall(before: dict[str, int], now: dict[str, int]) -> list[str]:
    """Each count below what it was before the upgrade, in words ("nvidia.com/gpu allocatable 0, was 2
    before the upgrade"); [] when every one is back."""
    out = []
    for name, was in sorted(before.items()):
        have = now.get(name, 0)
        if have < was:
            what = f"{NVIDIA_DRA_DRIVER} devices in the node's ResourceSlices" if name == DRA_KEY else \
                f"{name} allocatable"
            out.append(f"{what} {have}, was {was} before the upgrade")
    return out


def encode(c: dict[str, int]) -> str | None:
    """The annotation's value (None: nothing to compare: the node had no schedulable GPU)."""
    return json.dumps(c, sort_keys=True, separators=(",", ":")) if c else None


def decode(text: str | None) -> dict[str, int]:
    try:
        doc = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, int)} if isinstance(doc, dict) \
        else {}


def node_slices(kube: Kube, node: str) -> list[dict]:
    """The node's ResourceSlices of gpu.nvidia.com; [] where the API serves none (no DRA) or the
    daemon may not list them."""
    for v in DRA_VERSIONS:
        try:
            return kube.list(f"/apis/resource.k8s.io/{v}/resourceslices",
                             fields=f"spec.nodeName={node},spec.driver={NVIDIA_DRA_DRIVER}").get("items") or []
        except KubeError as e:
            if e.status == 404:
                continue
            if e.status == 403:
                return []
            raise
    return []
