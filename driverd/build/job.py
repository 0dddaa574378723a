"""`driverd build-matrix FILE --render-job`: the matrix as Kubernetes objects, for image pipelines
that build in a cluster instead of on one machine.

What is rendered (in this order, one `kubectl apply -f` for all of them):

1. a ConfigMap `<name>` holding the matrix file as it was read (`matrix.toml`) and the ids of the
   cells to build, one a line, in index order (`cells`). The mapping index -> cell is fixed when the
   manifests are rendered, so pods that finish (and change the repository) never shift another
   pod's cell.
2. an Indexed Job `<name>` (completionMode: Indexed, completions = number of missing cells): pod i
   runs `driverd build-matrix /etc/driverd/matrix/matrix.toml --cells /etc/driverd/matrix/cells
   --only-index $(JOB_COMPLETION_INDEX) --no-index --out /repo` and so builds exactly line i. A pod
   sees only a directory of its own on each shared volume (subPathExpr `<batch>/$(JOB_COMPLETION_INDEX)`,
   where <batch>, render_id(), names this cell list; the Job's annotation driverd.io/batch): the
   repository volume's
   `.driverd-incoming/<batch>/<i>` at /repo, the cache volume's `<batch>/<i>` at /ccache
   (`--ccache-volume`; `none`: no cache). What one pod writes, no other pod reads: a compromised or
   buggy pod can plant neither a compiled object under another cell's ccache key (ccache trusts
   whatever its directory holds: driverd.build.compiler_cache) nor a package in another cell's
   place. A retried pod of the same index (or a re-applied render of the same cell list) picks up what
   its earlier attempt compiled. A cell that does not compile (exit 3) fails only its own index
   (podFailurePolicy FailIndex, no retry: it would fail the same way); other failures are retried
   (backoffLimitPerIndex); an evicted or preempted pod does not count. Packages are written
   atomically (temporary name, rename). Each pod's cache is bounded by the cache's size divided among
   the batch's cells (at least 64 MiB; one cell of NVIDIA's modules stores about 30 MiB); the
   directories of earlier batches stay on the volume until an operator deletes them.
3. a Job `<name>-index`, created suspended, that takes the packages in and rewrites the repository
   index once the cells are built (`driverd repo index /repo --accept /repo/.driverd-incoming/<batch>
   --cells ...`: driverd.build.intake — from each pod's directory only the verified package of that
   index's own cell, renamed into the repository, never over one it holds; then the index, signed over
   the repository's packages). Pods never write the index themselves: several writers would race, and
   a pod's word is trusted for its own cell only. A pipeline waits for the
   build Job to finish (Complete, or Failed when a cell failed), then unsuspends the index Job:

       kubectl apply -f build.yaml
       until s=$(kubectl get job NAME -o jsonpath='{.status.conditions[?(@.status=="True")].type}') \
             && echo "$s" | grep -qE 'Complete|Failed'; do sleep 30; done
       kubectl patch job NAME-index --type=merge -p '{"spec":{"suspend":false}}'
       kubectl wait --for=condition=Complete job/NAME-index --timeout=30m

Nothing here talks to a cluster: the objects are plain dicts (rendered as YAML or JSON by the CLI).
"""
from __future__ import annotations

import re
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.errors import UsageError
from driverd.build.matrix import Cell, Matrix

MATRIX_MOUNT = "/etc/driverd/matrix"
REPO_MOUNT = "/repo"
WORK_MOUNT = "/work"
CCACHE_MOUNT = "/ccache"
SIGNING_MOUNT = "/etc/driverd/signing"
INDEX_KEY_MOUNT = "/etc/driverd/index-key"
EXIT_CELL_FAILED = 3          # build-matrix: a cell failed (compiler error, missing headers...)
DEFAULT_IMAGE = "driverd:builder-0.1.0"
DEFAULT_REPO_VOLUME = "pvc:driverd-repo"
# deploy/build-matrix/ccache-pvc.yaml: a 5 GiB ReadWriteMany claim for a cache bounded at 4 GiB (one
# cell of NVIDIA's modules adds about 30 MiB; ccache trims to the bound, the rest is headroom).
DEFAULT_CCACHE_VOLUME = "pvc:driverd-ccache"
DEFAULT_CCACHE_MAX_MB = 4096


@dataclass
class JobOptions:
    """The settings `build-matrix --render-job` renders the matrix's Kubernetes objects with."""
    image: str = DEFAULT_IMAGE
    repo_volume: str = DEFAULT_REPO_VOLUME     # pvc:NAME | host:PATH | nfs:SERVER:PATH
    ccache_volume: str = DEFAULT_CCACHE_VOLUME  # the same, or none
    ccache_max_mb: int = DEFAULT_CCACHE_MAX_MB
    name: str | None = None                    # default: driverd-build-<matrix file stem>
    namespace: str | None = None
    parallelism: int | None = None             # default: the matrix's `jobs`
    make_jobs: int | None = None
    cpu: str = "2"
    memory: str = "4Gi"
    install_headers: bool = True
    sign_secret: str | None = None             # Secret with `key` and `cert`: module signing
    index_sign_secret: str | None = None       # Secret with `key`: index signature
    backoff_limit_per_index: int = 2
    labels: dict[str, str] = field(default_factory=dict)


_DNS1123 = re.compile(r"[^a-z0-9-]+")


def job_name(matrix: Matrix, given: str | None = None) -> str:
    """A DNS-1123 name short enough for `<name>-index` and the pods' `<name>-<index>-<suffix>`."""
    if given:
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,44}[a-z0-9])?", given):
            raise UsageError(f"job name {given!r} is not usable", cause="a Job name is lower-case letters, digits "
                             "and '-', at most 46 characters (its pods add an index and a suffix)",
                             fix="pass --job-name like driverd-build-bookworm")
        return given
    stem = _DNS1123.sub("-", matrix.path.stem.lower()).strip("-") or "matrix"
    return ("driverd-build-" + stem)[:46].rstrip("-")


def repo_volume(spec: str) -> dict:
    """The shared repository volume: pvc:NAME, host:PATH (one node, tests/small sites) or nfs:SERVER:PATH."""
    return _volume("repo", spec, "--repo-volume", "the volume every build pod writes its package into")


def ccache_volume(spec: str) -> dict | None:
    """The shared compiler cache volume (same forms as the repository's), None for `none`."""
    if spec == "none":
        return None
    return _volume("ccache", spec, "--ccache-volume", "the compiler cache every build pod shares")


def _volume(name: str, spec: str, option: str, what: str) -> dict:
    kind, _, rest = spec.partition(":")
    if kind == "pvc" and rest:
        return {"name": name, "persistentVolumeClaim": {"claimName": rest}}
    if kind in ("host", "hostPath") and rest.startswith("/"):
        return {"name": name, "hostPath": {"path": rest, "type": "DirectoryOrCreate"}}
    if kind == "nfs" and ":" in rest:
        server, _, path = rest.partition(":")
        if server and path.startswith("/"):
            return {"name": name, "nfs": {"server": server, "path": path}}
    raise UsageError(f"{option} {spec!r} is not understood", cause=f"it names {what}",
                     fix="pass pvc:CLAIM (a ReadWriteMany claim), host:/PATH or nfs:SERVER:/EXPORT"
                     + (" or none" if name == "ccache" else ""))


def render_id(cells: list[Cell]) -> str:
    """The name of one cell list (index -> cell): the directory under which each pod of a Job rendered
    from it has its own (`<id>/<index>`) on the shared volumes. Another list — cells added, or some
    built and left out — gets other directories, so an index never reaches what a pod of another cell
    wrote."""
    import hashlib
    return "b-" + hashlib.sha256("".join(c.id + "\n" for c in cells).encode()).hexdigest()[:16]


def render(matrix: Matrix, cells: list[Cell], opts: JobOptions) -> list[dict]:
    """ConfigMap + Indexed build Job + suspended index Job for `cells` (the missing ones)."""
    from driverd.build.intake import INCOMING
    name = job_name(matrix, opts.name)
    batch = render_id(cells)
    own = f"{batch}/$(JOB_COMPLETION_INDEX)"     # expanded by the kubelet from the container's env
    labels = {"app.kubernetes.io/name": "driverd", "app.kubernetes.io/component": "build-matrix",
              "driverd.io/matrix": name, **opts.labels}
    meta = {"name": name, "labels": dict(labels)}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    ids = [c.id for c in cells]
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": dict(meta, annotations={
              "driverd.io/cells": str(len(ids)),
              "driverd.io/matrix-file": str(matrix.path)}),
          "data": {"matrix.toml": matrix.path.read_text(), "cells": "".join(i + "\n" for i in ids)}}
    volumes = [repo_volume(opts.repo_volume),
               {"name": "matrix", "configMap": {"name": name}},
               {"name": "work", "emptyDir": {}}]
    mounts = [{"name": "repo", "mountPath": REPO_MOUNT, "subPathExpr": f"{INCOMING}/{own}"},
              {"name": "matrix", "mountPath": MATRIX_MOUNT, "readOnly": True},
              {"name": "work", "mountPath": WORK_MOUNT}]
    args = ["build-matrix", f"{MATRIX_MOUNT}/matrix.toml", "--cells", f"{MATRIX_MOUNT}/cells",
            "--only-index", "$(JOB_COMPLETION_INDEX)", "--no-index", "--out", REPO_MOUNT,
            "--work-dir", WORK_MOUNT, "--jobs", "1"]
    if opts.make_jobs:
        args += ["--make-jobs", str(opts.make_jobs)]
    if opts.install_headers:
        args.append("--install-headers")
    cache = ccache_volume(opts.ccache_volume)
    env: list[dict] = []
    if cache is not None:
        volumes.append(cache)
        mounts.append({"name": "ccache", "mountPath": CCACHE_MOUNT, "subPathExpr": own})
        # on, not auto: an image without ccache fails its cells at once (exit 3) instead of building
        # every one cold unnoticed.
        args += ["--ccache", "on", "--ccache-dir", CCACHE_MOUNT]
        per_pod = max(64, opts.ccache_max_mb // max(1, len(ids)))      # the volume's bound, split among cells
        env.append({"name": "DRIVERD_BUILD_CCACHE_MAX_MB", "value": str(per_pod)})
    else:
        args += ["--ccache", "off"]
    if opts.sign_secret:
        volumes.append({"name": "signing", "secret": {"secretName": opts.sign_secret, "defaultMode": 0o400}})
        mounts.append({"name": "signing", "mountPath": SIGNING_MOUNT, "readOnly": True})
        args += ["--sign-key", f"{SIGNING_MOUNT}/key", "--sign-cert", f"{SIGNING_MOUNT}/cert"]
    build_container = {
        "name": "build", "image": opts.image, "command": ["driverd"], "args": args,
        "env": [
            # Set by the Job controller too; declared here so that $(JOB_COMPLETION_INDEX) in args is
            # expanded by the kubelet whatever the cluster version.
            {"name": "JOB_COMPLETION_INDEX",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            *env,
        ],
        "resources": {"requests": {"cpu": opts.cpu, "memory": opts.memory}},
        "volumeMounts": mounts,
    }
    completions = len(ids)
    build = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": dict(meta, annotations={
            "driverd.io/cells": ",".join(ids),
            "driverd.io/batch": batch,
            "driverd.io/next": f"when this Job is Complete or Failed: kubectl patch job {name}-index "
                               "--type=merge -p '{\"spec\":{\"suspend\":false}}'"}),
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": max(1, min(opts.parallelism or matrix.jobs or 1, max(completions, 1))),
            "backoffLimitPerIndex": opts.backoff_limit_per_index,
            "podFailurePolicy": {"rules": [
                # a cell that does not compile fails the same way every time: fail its index at once
                {"action": "FailIndex", "onExitCodes": {"containerName": "build", "operator": "In",
                                                        "values": [EXIT_CELL_FAILED]}},
                # an evicted or preempted pod is not the cell's fault
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {"restartPolicy": "Never", "containers": [build_container], "volumes": volumes},
            },
        },
    }
    index_args = ["repo", "index", REPO_MOUNT, "--accept", f"{REPO_MOUNT}/{INCOMING}/{batch}",
                  "--cells", f"{MATRIX_MOUNT}/cells"]
    index_volumes = [repo_volume(opts.repo_volume), {"name": "matrix", "configMap": {"name": name}}]
    index_mounts = [{"name": "repo", "mountPath": REPO_MOUNT},
                    {"name": "matrix", "mountPath": MATRIX_MOUNT, "readOnly": True}]
    if opts.index_sign_secret:
        index_volumes.append({"name": "index-key", "secret": {"secretName": opts.index_sign_secret,
                                                               "defaultMode": 0o400}})
        index_mounts.append({"name": "index-key", "mountPath": INDEX_KEY_MOUNT, "readOnly": True})
        index_args += ["--sign-key", f"{INDEX_KEY_MOUNT}/key"]
    index_labels = dict(labels, **{"app.kubernetes.io/component": "repo-index"})
    index_meta = dict(meta, name=f"{name}-index", labels=index_labels,
                      annotations={"driverd.io/after": f"job/{name}"})
    index = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": index_meta,
        "spec": {
            "suspend": True,           # the pipeline unsuspends it once the build Job has finished
            "completions": 1, "parallelism": 1, "backoffLimit": 2, "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": index_labels},
                "spec": {"restartPolicy": "Never", "containers": [{
                    "name": "index", "image": opts.image, "command": ["driverd"], "args": index_args,
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                    "volumeMounts": index_mounts}], "volumes": index_volumes},
            },
        },
    }
    return [cm, build, index]


def to_yaml(objs: list[dict]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:     # no &anchors: every object reads on its own
            return True

    def text(dumper, data: str):        # the matrix file and the cell list as readable blocks
        style = "|" if "\n" in data and not any(ln != ln.rstrip() for ln in data.splitlines()) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)
    Dumper.add_representer(str, text)
    return "".join("---\n" + yaml.dump(o, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)
                   for o in objs)


def to_json(objs: list[dict]) -> dict:
    return {"apiVersion": "v1", "kind": "List", "items": objs}
