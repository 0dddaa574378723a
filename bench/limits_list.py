#!/usr/bin/env python3
"""What an admitted node's limits check (driverd/cluster/agent/admission.py, `_beyond_limits`) costs the
API server and the node: it lists every Node of the cluster once per admitted node, so a rollout of N nodes
lists N x N Nodes. Measured on the real kube-apiserver (tests/controlplane.py; .ci/build-control-plane
builds it), with Nodes shaped like a GPU node's (the labels GPU feature discovery adds, driverd's
annotations, a kubelet's status with its images): the metadata-only list the check asks for against the
full list it asked for before, in the same run, alternating.

Usage: python3 bench/limits_list.py [--nodes 500] [--images 30] [-n 30]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _node(name: str) -> dict:
    labels = {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true",
              **{f"nvidia.com/gpu.feature-{j}": "value-" + "x" * 8 for j in range(20)}}
    ann = {"driverd.io/state": "idle", "driverd.io/rollout": "r/0d9c7c2e-uid/1", "driverd.io/message": "m" * 200}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels, "annotations": ann},
            "spec": {}}


def _status(images: int) -> dict:
    return {"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting "
                        "ready status", "lastHeartbeatTime": "2026-11-29T00:00:00Z",
                        "lastTransitionTime": "2026-11-29T00:00:00Z"}],
        "images": [{"names": [f"registry.example/team/image-{j}@sha256:" + "a" * 64, f"registry.example/team/image-{j}:v1"],
                    "sizeBytes": 123456789} for j in range(images)],
        "capacity": {"nvidia.com/gpu": "8", "cpu": "64"}, "allocatable": {"nvidia.com/gpu": "8", "cpu": "64"}}}


def main() -> int:
    from driverd.cluster.kube import Kube, Target, node_path
    from tests.controlplane import ControlPlane, find_binaries
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--images", type=int, default=30, help="images in each Node's status (a kubelet reports up to 50)")
    ap.add_argument("-n", type=int, default=30, help="lists of each kind")
    a = ap.parse_args()
    bindir, missing = find_binaries()
    if missing:
        print(f"limits_list.py: {missing}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="driverd-limits-"))
    cp = ControlPlane(bindir, work).start()
    try:
        for i in range(a.nodes):
            name = f"gpu-{i:04d}"
            cp.api("POST", node_path(), _node(name))
            cp.api("PATCH", node_path(name) + "/status", _status(a.images),
                   content_type="application/strategic-merge-patch+json")
        kube = Kube(Target(kubeconfig=cp.kubeconfig))
        took: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
        for meta in (False, True):                 # warm both paths once
            kube.list(node_path(), metadata_only=meta)
        for _ in range(a.n):
            for meta in (False, True):
                cpu0, t0 = cp.cpu_seconds("kube-apiserver"), time.perf_counter()
                doc = kube.list(node_path(), metadata_only=meta)
                took[meta].append((time.perf_counter() - t0, cp.cpu_seconds("kube-apiserver") - cpu0,
                                   len(json.dumps(doc))))
        out = {}
        for meta, xs in took.items():
            out["metadata" if meta else "full"] = {
                "wall_ms": round(statistics.median(x[0] for x in xs) * 1000, 1),
                # the mean: /proc counts CPU in 10 ms ticks, the sum over the runs is what is exact
                "apiserver_cpu_ms": round(sum(x[1] for x in xs) / len(xs) * 1000, 1),
                "mb": round(xs[0][2] / 1e6, 2)}
        f, m = out["full"], out["metadata"]
        print(f"{a.nodes} Nodes ({a.images} images each), {a.n} lists of each, alternating (time: median, CPU: mean):")
        for k, v in out.items():
            print(f"  {k:9s} {v['mb']:5.2f} MB   {v['wall_ms']:6.1f} ms list + parse   {v['apiserver_cpu_ms']:6.1f} ms "
                  "apiserver CPU")
        print(f"metadata / full: size {m['mb'] / f['mb']:.2f}, time {m['wall_ms'] / f['wall_ms']:.2f}, "
              f"apiserver CPU {m['apiserver_cpu_ms'] / max(f['apiserver_cpu_ms'], 0.1):.2f}")
        print(f"a rollout over all {a.nodes}: {a.nodes} such lists")
    finally:
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
