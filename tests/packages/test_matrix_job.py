"""`driverd build-matrix FILE --render-job`: the matrix as a Kubernetes Indexed Job - one pod per
missing cell, index -> cell fixed by the rendered ConfigMap, each pod building exactly its cell into
the shared repository without touching the index, then a suspended Job that indexes the repository.
Checked by the real kubectl (offline, and against the real kube-apiserver of tests/controlplane.py:
server-side validation with strict field checks, then created), and by running each pod's own
command line here."""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from driverd.build import matrix as mx
from driverd.build import job as mj
from driverd.build.modules import BuildResult
from driverd.sim.fakepkg import make_fake_package
from tests.conftest import REPO, run_cli
from tests.kubetools import kubectl, kubectl_binary

MATRIX = REPO / "kernels" / "debian-bookworm.toml"
HELD = "535.261.03-proprietary-6.1.0-47-cloud-amd64-x86_64"


@pytest.fixture
def repo(tmp_path):
    """A repository that already holds one cell of the Debian matrix."""
    out = tmp_path / "repo"
    make_fake_package(out, "535.261.03", "6.1.0-47-cloud-amd64", flavor="proprietary")
    return out


def _render(*args: str) -> subprocess.CompletedProcess:
    r = run_cli("build-matrix", str(MATRIX), "--render-job", *args)
    assert r.returncode == 0, r.stderr
    return r


def _objects(repo, *extra: str) -> list[dict]:
    r = _render("--out", str(repo), "--image", "registry.example/driverd:builder-0.1.0", *extra)
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_one_pod_per_missing_cell(repo):
    cm, job, index = _objects(repo, "--repo-volume", "pvc:driverd-repo", "--jobs", "2")
    missing = [c.id for c in mx.load(MATRIX).cells if c.id != HELD]
    assert cm["kind"] == "ConfigMap" and cm["data"]["cells"].splitlines() == missing
    assert cm["data"]["matrix.toml"] == MATRIX.read_text()
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed" and spec["completions"] == 3
    assert spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/driverd:builder-0.1.0" and c["command"] == ["driverd"]
    assert c["args"][:2] == ["build-matrix", "/etc/driverd/matrix/matrix.toml"]
    assert ["--only-index", "$(JOB_COMPLETION_INDEX)"] == c["args"][c["args"].index("--only-index"):][:2]
    assert "--no-index" in c["args"] and c["args"][c["args"].index("--out") + 1] == "/repo"
    assert {"name": "repo", "persistentVolumeClaim": {"claimName": "driverd-repo"}} in pod["volumes"]
    assert {"name": "matrix", "configMap": {"name": cm["metadata"]["name"]}} in pod["volumes"]
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "FailIndex", "onExitCodes": {"containerName": "build", "operator": "In",
                                                               "values": [3]}}
    assert index["metadata"]["name"] == job["metadata"]["name"] + "-index"
    assert index["spec"]["suspend"] is True and "completionMode" not in index["spec"]
    batch = job["metadata"]["annotations"]["driverd.io/batch"]
    assert index["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "repo", "index", "/repo", "--accept", f"/repo/.driverd-incoming/{batch}", "--cells", "/etc/driverd/matrix/cells"]
    # a pod sees its own directory of the repository volume only
    assert {"name": "repo", "mountPath": "/repo", "subPathExpr": f".driverd-incoming/{batch}/$(JOB_COMPLETION_INDEX)"} \
        in c["volumeMounts"]
    assert "build-matrix: rendered job driverd-build-debian-bookworm: 3 of 4 cell(s)" in _render(
        "--out", str(repo)).stderr


def test_json_output_is_a_list_and_options(repo):
    r = _render("--out", str(repo), "-o", "json", "--repo-volume", "nfs:nas.example:/export/driverd",
                "--job-name", "nightly", "--namespace", "builds", "--sign-secret", "mok", "--index-sign-secret",
                "idx", "--all-cells")
    doc = json.loads(r.stdout)
    assert doc["apiVersion"] == "v1" and doc["kind"] == "List"
    cm, job, index = doc["items"]
    assert all(o["metadata"]["namespace"] == "builds" for o in doc["items"])
    assert job["metadata"]["name"] == "nightly" and index["metadata"]["name"] == "nightly-index"
    assert job["spec"]["completions"] == 4                  # --all-cells
    pod = job["spec"]["template"]["spec"]
    assert {"name": "repo", "nfs": {"server": "nas.example", "path": "/export/driverd"}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--sign-key") + 1] == "/etc/driverd/signing/key"
    assert index["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--sign-key",
                                                                                "/etc/driverd/index-key/key"]
    bad = run_cli("build-matrix", str(MATRIX), "--render-job", "--repo-volume", "s3://bucket")
    assert bad.returncode == 2 and "--repo-volume 's3://bucket' is not understood" in bad.stderr


def test_each_pod_has_a_cache_directory_of_its_own_on_the_cache_volume(repo):
    """Every pod compiles through ccache (on: an image without ccache fails its cells at once) into its own
    directory of the cache volume (issue 44: no pod reads objects another pod could have stored), bounded by
    build.ccache_max_mb split among the cells; `none` renders no cache at all."""
    _, job, index = _objects(repo)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    batch = job["metadata"]["annotations"]["driverd.io/batch"]
    assert {"name": "ccache", "persistentVolumeClaim": {"claimName": "driverd-ccache"}} in pod["volumes"]
    assert {"name": "ccache", "mountPath": "/ccache", "subPathExpr": f"{batch}/$(JOB_COMPLETION_INDEX)"} \
        in c["volumeMounts"]
    assert c["args"][c["args"].index("--ccache"):][:4] == ["--ccache", "on", "--ccache-dir", "/ccache"]
    assert {"name": "DRIVERD_BUILD_CCACHE_MAX_MB", "value": str(4096 // 3)} in c["env"]
    assert "ccache" not in json.dumps(index)                # the indexer compiles nothing
    _, job, _ = _objects(repo, "--ccache-volume", "host:/var/cache/driverd-ccache", "-o", "yaml")
    pod = job["spec"]["template"]["spec"]
    assert {"name": "ccache", "hostPath": {"path": "/var/cache/driverd-ccache", "type": "DirectoryOrCreate"}} \
        in pod["volumes"]
    r = run_cli("build-matrix", str(MATRIX), "--out", str(repo), "--render-job", env={"DRIVERD_BUILD_CCACHE_MAX_MB": "900"})
    assert {"name": "DRIVERD_BUILD_CCACHE_MAX_MB", "value": "300"} in \
        [d for d in yaml.safe_load_all(r.stdout) if d][1]["spec"]["template"]["spec"]["containers"][0]["env"]
    r = run_cli("build-matrix", str(MATRIX), "--out", str(repo), "--render-job", "--ccache-volume", "none")
    assert r.returncode == 0, r.stderr
    job = [d for d in yaml.safe_load_all(r.stdout) if d][1]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert not any(v["name"] == "ccache" for v in pod["volumes"]) and "/ccache" not in json.dumps(c)
    assert c["args"][c["args"].index("--ccache"):][:2] == ["--ccache", "off"]
    bad = run_cli("build-matrix", str(MATRIX), "--render-job", "--ccache-volume", "emptydir")
    assert bad.returncode == 2 and "--ccache-volume 'emptydir' is not understood" in bad.stderr
    assert "or none" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_cache_claim_in_deploy_is_the_default_volume():
    (pvc,) = [d for d in yaml.safe_load_all((REPO / "deploy/build-matrix/ccache-pvc.yaml").read_text()) if d]
    assert pvc["kind"] == "PersistentVolumeClaim" and f"pvc:{pvc['metadata']['name']}" == mj.DEFAULT_CCACHE_VOLUME
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]          # pods of one Job run on any node at once
    size = pvc["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and int(size[:-2]) * 1024 > mj.DEFAULT_CCACHE_MAX_MB   # room above the bound


def _server_errors(cp, tmp_path, objs: list[dict]) -> str:
    """What kube-apiserver says of the objects (a server-side dry run, unknown fields refused): '' if valid."""
    lst = {"apiVersion": "v1", "kind": "List", "items": objs}
    r = kubectl(cp.kubectl_env(tmp_path), "create", "--dry-run=server", "--validate=strict", "-f", "-",
                input=json.dumps(lst), check=False)
    return "" if r.returncode == 0 else r.stderr


def _namespace(cp, name: str) -> str:
    cp.ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


@pytest.mark.real
def test_rendered_objects_match_the_kubernetes_schema(repo, tmp_path, control_plane):
    ns = _namespace(control_plane, "matrix-schema")
    pvc = [d for d in yaml.safe_load_all((REPO / "deploy/build-matrix/ccache-pvc.yaml").read_text()) if d]
    for objs in (_objects(repo) + pvc,
                 _objects(repo, "--repo-volume", "host:/srv/driverd-repo", "--sign-secret", "k"),
                 _objects(repo, "--ccache-volume", "nfs:nas.example:/export/ccache"),
                 _objects(tmp_path / "nothing-yet", "--ccache-volume", "none")):
        for o in objs:
            o["metadata"]["namespace"] = ns
        assert _server_errors(control_plane, tmp_path, objs) == ""
    full = tmp_path / "full"                                 # nothing missing: an empty Job, still valid
    for c in mx.load(MATRIX).cells:
        make_fake_package(full, c.driver, c.release, flavor=c.flavor)
    objs = _objects(full)
    assert objs[1]["spec"]["completions"] == 0 and objs[0]["data"]["cells"] == ""
    for o in objs:
        o["metadata"]["namespace"] = ns
    assert _server_errors(control_plane, tmp_path, objs) == ""
    bad = json.loads(json.dumps(objs))                        # and the check can fail: a misspelt field
    bad[1]["spec"]["completionz"] = 1
    assert "completionz" in _server_errors(control_plane, tmp_path, bad)


def _as_kubelet(c: dict, i: int, volumes: dict[str, Path]) -> dict[str, Path]:
    """Where each mountPath of container `c` leads for the pod of index i, as the kubelet mounts it: the
    volume's directory, or its subPathExpr with the container's $(JOB_COMPLETION_INDEX) expanded."""
    out = {}
    for m in c["volumeMounts"]:
        sub = m.get("subPathExpr", "").replace("$(JOB_COMPLETION_INDEX)", str(i))
        d = volumes[m["name"]] / sub if sub else volumes[m["name"]]
        d.mkdir(parents=True, exist_ok=True)
        out[m["mountPath"]] = d
    return out


def _pod_args(args: list[str], mounts: dict[str, Path], i: int) -> list[str]:
    out = []
    for a in args:
        a = a.replace("$(JOB_COMPLETION_INDEX)", str(i))
        for mp in sorted(mounts, key=len, reverse=True):
            if a == mp or a.startswith(mp + "/"):
                a = str(mounts[mp]) + a[len(mp):]
                break
        out.append(a)
    return out


def _run_pod(c: dict, i: int, volumes: dict[str, Path], build_fn) -> list[str]:
    """The build container's command line for index i, run here (build_fn in place of the compiler)."""
    mounts = _as_kubelet(c, i, volumes)
    from driverd.cli import build_parser
    ns = build_parser().parse_args(_pod_args(c["args"], mounts, i))
    cells = [ln for ln in Path(ns.cells).read_text().splitlines() if ln]
    res = mx.run(mx.load(ns.matrix), ns.out, work_dir=ns.work_dir, cell_ids=cells, only_index=ns.only_index,
                 index=not ns.no_index, jobs=ns.jobs, build_fn=build_fn, progress=mx.Progress(1, enabled=False))
    return [r.cell.id for r in res if r.status == "built"]


def _volumes(tmp_path, repo, cm) -> dict[str, Path]:
    etc = tmp_path / "etc-matrix"
    etc.mkdir()
    for k, v in cm["data"].items():
        (etc / k).write_text(v)
    return {"repo": repo, "matrix": etc, "work": tmp_path / "work", "ccache": tmp_path / "ccache-volume"}


def _fake_build(*, source, kernel, flavor, out, **kw):
    return BuildResult(make_fake_package(out, "535.261.03", kernel, flavor=flavor), False, 0.1)


def test_each_index_builds_exactly_its_cell_and_the_index_job_takes_it_in(repo, tmp_path):
    """Every pod's command line, run here as the pod would run it (the matrix and the cell list from the
    ConfigMap, $(JOB_COMPLETION_INDEX) expanded, each volume mounted at its subPathExpr as the kubelet
    does), builds one cell into its own directory and leaves the index alone; the index Job's command
    takes each pod's package in and indexes the repository."""
    cm, job, index = _objects(repo)
    vols = _volumes(tmp_path, repo, cm)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    built = [_run_pod(c, i, vols, _fake_build) for i in range(job["spec"]["completions"])]
    assert built == [[x] for x in cm["data"]["cells"].splitlines()]
    assert not (repo / "index.json").exists()                    # pods never write the index
    assert len(list(repo.glob("*.tar.zst"))) == 1                # nor the repository: their own directories
    (ic,) = index["spec"]["template"]["spec"]["containers"]
    r = run_cli(*_pod_args(ic["args"], _as_kubelet(ic, 0, vols), 0), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["packages"] == 4 and [x["status"] for x in doc["intake"]] == ["accepted"] * 3
    assert len(list(repo.glob("*.tar.zst"))) == 4


def test_the_index_job_signs_only_the_package_each_pod_built_for_its_own_cell(repo, tmp_path):
    """Issue 44, item 3: the index Job signed every package of the shared repository volume — a package
    another pod put in a cell's place included. A compromised pod of index 0 now writes only into its own
    directory: its forged package of cell 1 (built by it, with other modules) is refused there, the genuine
    cell-1 package of pod 1 is taken in, and the signed index lists that one."""
    import hashlib
    cm, job, index = _objects(repo)
    vols = _volumes(tmp_path, repo, cm)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    cells = cm["data"]["cells"].splitlines()
    victim = next(x for x in mx.load(MATRIX).cells if x.id == cells[1])

    def compromised(*, source, kernel, flavor, out, **kw):
        # its own cell as asked, and — the attack — cell 1's package with modules of its own making, put
        # where the pod's /repo leads, under the canonical name (what the old layout made the repository)
        evil = make_fake_package(out, victim.driver, victim.release, flavor=victim.flavor, text_size=4096)
        del evil
        return _fake_build(source=source, kernel=kernel, flavor=flavor, out=out)
    _run_pod(c, 0, vols, compromised)
    for i in range(1, job["spec"]["completions"]):
        _run_pod(c, i, vols, _fake_build)
    (ic,) = index["spec"]["template"]["spec"]["containers"]
    key = tmp_path / "index-key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)],
                   check=True, capture_output=True)
    r = run_cli(*_pod_args(ic["args"], _as_kubelet(ic, 0, vols), 0), "--sign-key", str(key), "--json")
    assert r.returncode == 3, r.stderr                           # something was refused: the pipeline sees it
    doc = json.loads(r.stdout)
    refused = [x for x in doc["intake"] if x["status"] == "refused"]
    assert len(refused) == 1 and refused[0]["index"] == 0
    assert f"it is the package of cell {victim.id}, not of this index's cell {cells[0]}" in refused[0]["reason"]
    entry = next(e for e in doc["entries"] if e["kernel_release"] == victim.release and e["flavor"] == victim.flavor)
    genuine = next(p for p in repo.glob("*.tar.zst") if p.name.endswith(f".{entry['sha256']}.tar.zst"))
    assert hashlib.sha256(genuine.read_bytes()).hexdigest() == entry["sha256"]
    assert not Path(refused[0]["package"]).name.endswith(f".{entry['sha256']}.tar.zst")     # the forged one
    assert Path(refused[0]["package"]).exists()                  # left where the pod put it, for an operator


def test_the_pod_command_line_selects_one_cell(repo, tmp_path):
    """The real CLI with a pod's arguments (--dry-run: nothing compiled): one cell per index, and an
    index out of range is bad usage."""
    cm, job, _ = _objects(repo)
    cells = tmp_path / "cells"
    cells.write_text(cm["data"]["cells"])
    for i, want in enumerate(cm["data"]["cells"].splitlines()):
        r = run_cli("build-matrix", str(MATRIX), "--cells", str(cells), "--only-index", str(i), "--no-index",
                    "--out", str(repo), "--dry-run", "--json")
        assert r.returncode == 0, r.stderr
        assert [c["id"] for c in json.loads(r.stdout)["cells"]] == [want]
    r = run_cli("build-matrix", str(MATRIX), "--cells", str(cells), "--only-index", "3", "--out", str(repo),
                "--dry-run")
    assert r.returncode == 2 and "--only-index 3 is out of range: 3 cell(s)" in r.stderr
    stale = tmp_path / "stale"
    stale.write_text("535.261.03-open-9.9.9-x86_64\n")
    r = run_cli("build-matrix", str(MATRIX), "--cells", str(stale), "--only-index", "0", "--out", str(repo),
                "--dry-run")
    assert r.returncode == 2 and "render the Job again" in r.stderr


@pytest.mark.real
def test_kubectl_reads_the_rendered_objects_offline(repo, tmp_path):
    """kubectl needs a server for create/apply, even with --dry-run=client; kustomize parses and
    re-emits the objects without one."""
    kubectl_binary()
    d = tmp_path / "k"
    d.mkdir()
    (d / "build.yaml").write_text(_render("--out", str(repo)).stdout)
    (d / "kustomization.yaml").write_text("resources: [build.yaml]\n")
    r = kubectl(dict(__import__("os").environ), "kustomize", str(d))
    kinds = [(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(r.stdout) if o]
    assert sorted(kinds) == sorted([("ConfigMap", "driverd-build-debian-bookworm"),
                                    ("Job", "driverd-build-debian-bookworm"),
                                    ("Job", "driverd-build-debian-bookworm-index")])


@pytest.mark.real
def test_kubectl_creates_the_rendered_objects_on_an_api_server(repo, tmp_path, control_plane):
    import uuid
    ns = _namespace(control_plane, f"matrix-{uuid.uuid4().hex[:8]}")
    rendered = _render("--out", str(repo), "--namespace", ns).stdout
    env = control_plane.kubectl_env(tmp_path)
    r = kubectl(env, "create", "--validate=strict", "-f", "-", input=rendered)
    assert "job.batch/driverd-build-debian-bookworm created" in r.stdout
    got = json.loads(kubectl(env, "-n", ns, "get", "job", "driverd-build-debian-bookworm", "-o", "json").stdout)
    assert got["spec"]["completionMode"] == "Indexed" and got["spec"]["completions"] == 3
    idx = json.loads(kubectl(env, "-n", ns, "get", "job", "driverd-build-debian-bookworm-index", "-o", "json").stdout)
    assert idx["spec"]["suspend"] is True
    # the pipeline's next step, as the Job's annotation spells it (run in the Job's namespace, as a user
    # whose context names it would)
    nxt = got["metadata"]["annotations"]["driverd.io/next"].split(": ", 1)[1]
    kubectl(env, "-n", ns, *shlex.split(nxt)[1:])
    idx = json.loads(kubectl(env, "-n", ns, "get", "job", "driverd-build-debian-bookworm-index", "-o", "json").stdout)
    assert idx["spec"]["suspend"] is False
    cells = kubectl(env, "-n", ns, "get", "configmap", "driverd-build-debian-bookworm", "-o",
                    "jsonpath={.data.cells}").stdout
    assert cells.splitlines() == [c.id for c in mx.load(MATRIX).cells if c.id != HELD]


def test_job_name_rules():
    m = mx.load(MATRIX)
    assert mj.job_name(m) == "driverd-build-debian-bookworm"
    with pytest.raises(Exception, match="not usable"):
        mj.job_name(m, "Nightly_Build")
    assert len(mj.job_name(mx.Matrix(REPO / ("x" * 80 + ".toml"), []))) <= 46
