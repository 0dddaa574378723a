"""The container images, built by images/build-image.sh from Debian packages and the project's own wheel
(mmdebstrap + umoci, no registry, no container engine), run with the real runc on the images' own
interpreter (Debian 12's python3, 3.11.2):
- driver: the entrypoint, pointed at a simulated host root bind-mounted at /host, goes ready, takes the
  fast path on a restart (nothing reloaded), and stops cleanly on SIGTERM; the same root file system
  run by images/run-rootfs.sh (host mode where the host's Python is too old) reads a host and runs the
  daemon to READY;
- builder: a build-matrix cell, run as the Indexed Job's pod runs it, extracts a source tarball,
  compiles a (small) module against the image's kernel headers and packs a verified package."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, require_binary

# An image build takes minutes (more on a busy machine); it runs inside the first test that needs it.
pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(2400)]
TAG = "driver-test"
BUILDER_TAG = "builder-test"
KERNEL = "6.1.0-47-cloud-amd64"        # headers installed by .ci/install-components, packaged into the builder


@pytest.fixture(scope="module")
def image(driver_image):
    return driver_image          # built once per run (tests/conftest.py): tests/node/ runs it too


def _build(variant: str, out: Path, tag: str, *extra: str) -> Path:
    t0 = time.monotonic()
    # Its own process group, killed whole on any way out (a timeout): mmdebstrap must not outlive the test.
    proc = subprocess.Popen(["bash", str(REPO / "images/build-image.sh"), "--variant", variant, "--out", str(out),
                             "--tag", tag, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)      # mmdebstrap unmounts and cleans up on SIGTERM
            proc.wait(60)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"\n{variant} image: built in {time.monotonic() - t0:.0f}s, {size / 2**20:.0f} MiB (OCI layout, compressed)")
    return out


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("building and running an image needs root")
    for t in ("mmdebstrap", "umoci", "runc"):
        require_binary(t)
    return _build("builder", tmp_path_factory.mktemp("builder") / "oci", BUILDER_TAG, "--kernel", KERNEL)


def _bundle(image: Path, where: Path, host: Path | None, args: list[str] | None = None, tag: str = TAG,
            binds: dict[str, Path] | None = None) -> Path:
    b = where / "bundle"
    if b.exists():
        shutil.rmtree(b)
    subprocess.run(["umoci", "unpack", "--image", f"{image}:{tag}", str(b)], check=True, capture_output=True)
    cfg = json.loads((b / "config.json").read_text())
    if args:
        cfg["process"]["args"] = args
    cfg["process"]["terminal"] = False
    # The host's network (loopback) so the test reaches the health endpoints, as hostNetwork would.
    cfg["linux"]["namespaces"] = [n for n in cfg["linux"]["namespaces"] if n["type"] != "network"]
    mounts = dict(binds or {})
    if host is not None:
        mounts["/host"] = host
    for dest, src in mounts.items():
        cfg["mounts"].append({"destination": dest, "type": "bind", "source": str(src), "options": ["rbind", "rw"]})
    (b / "config.json").write_text(json.dumps(cfg))
    return b


def _runc(*args, **kw):
    return subprocess.run(["runc", "--root", kw.pop("state"), *args], **kw)


def test_image_reads_a_host_at_slash_host(image, tmp_path):
    from driverd.sim.scenario import dgx_spec, make_host
    host = make_host(tmp_path / "host", dgx_spec(gpus=2, nvswitches=0, nouveau=False))
    b = _bundle(image, tmp_path, host, ["/usr/local/bin/driverd", "detect", "--root", "/host", "--json", "--no-nvml"])
    r = _runc("run", "-b", str(b), f"detect-{os.getpid()}", state=str(tmp_path / "state"), capture_output=True,
              text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["hostname"] == "dgx-h100-01" and len(facts["gpus"]) == 2
    assert facts["kernel"]["release"] == "6.1.0-47-cloud-amd64"


def test_the_coordinator_runs_in_the_image_as_its_deployment_runs_it(image, tmp_path):
    """deploy/base/coordinator.yaml's container: `driverd cluster coordinator --listen 0.0.0.0:9478` as uid
    65534 on a read-only root, no host. Against an API server that is not there it says so in one line and
    exits 1 at once (its probes and its restart then tell the operator); nothing needs a writable root."""
    import yaml
    dep = yaml.safe_load((REPO / "deploy/base/coordinator.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    kc = tmp_path / "kc"
    kc.mkdir()
    port = free_port()
    (kc / "config").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t0ken-in-a-file"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}]}))
    kc.chmod(0o755)
    (kc / "config").chmod(0o644)
    b = _bundle(image, tmp_path, None, ["/usr/local/bin/" + c["command"][0], *c["args"], "--kubeconfig",
                                        "/kc/config", "--identity", "driverd-coordinator-0"], binds={"/kc": kc})
    cfg = json.loads((b / "config.json").read_text())
    cfg["process"]["user"] = {"uid": pod["securityContext"]["runAsUser"], "gid": pod["securityContext"]["runAsGroup"]}
    cfg["root"]["readonly"] = c["securityContext"]["readOnlyRootFilesystem"]
    # the Deployment's environment (its plain values; the downward API's are the pod's name and namespace)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e} | {"HOME": "/nonexistent"}
    cfg["process"]["env"] = [e for e in cfg["process"]["env"] if e.split("=", 1)[0] not in env] + \
        [f"{k}={v}" for k, v in env.items()]
    (b / "config.json").write_text(json.dumps(cfg))
    r = _runc("run", "-b", str(b), f"coord-{os.getpid()}", state=str(tmp_path / "state"), capture_output=True,
              text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "cannot read the Lease driverd/driverd-rollout" in line and f"127.0.0.1:{port}" in line, line
    assert "t0ken-in-a-file" not in r.stderr + r.stdout



def _ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready after {timeout}s")


def _stop(cid: str, proc: subprocess.Popen, state: str) -> float:
    t0 = time.monotonic()
    _runc("kill", cid, "TERM", state=state, check=True)
    rc = proc.wait(timeout=20)
    took = time.monotonic() - t0
    assert rc == 0 and took < 10, (rc, took, proc.stderr.read()[-2000:])
    _runc("delete", "--force", cid, state=state)
    return took


def test_entrypoint_goes_ready_takes_the_fast_path_on_restart_and_stops_on_sigterm(image, tmp_path):
    from driverd.sim.scenario import dgx_spec, make_host, make_packages
    host = make_host(tmp_path / "host", dgx_spec(gpus=2, nvswitches=0, nouveau=False))
    repo = host / "srv/driverd-repo"                    # the repository, seen by the container at /host/srv/...
    make_packages(repo)
    cfg = host / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[driver]\nversion = "535.261.03"\nflavor = "open"\n'
                   '[packages]\nrepositories = ["file:///host/srv/driverd-repo"]\n[runtime]\nrestart = "none"\n'
                   '[modules]\nkernel = "sim"\n')          # a sample tree: the simulated kernel, asked for
    state = str(tmp_path / "state")
    port = free_port()
    args = ["/usr/local/bin/driverd", "container-entrypoint", "--root", "/host", "--listen", f"127.0.0.1:{port}"]
    times = []
    for i, expect_fast in enumerate((False, True)):
        b = _bundle(image, tmp_path, host, args)
        cid = f"entry-{os.getpid()}-{i}"
        before = _host_state(host)
        proc = subprocess.Popen(["runc", "--root", state, "run", "-b", str(b), cid], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            times.append(_ready(port, proc, 180))
            after = _host_state(host)
            if expect_fast:     # the restart: no new run, nothing unloaded or restarted
                assert after == before, (before, after)
            else:
                assert after["loaded"] == "535.261.03" and after["runs"] >= 1
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert b"driverd_" in r.read()
            _stop(cid, proc, state)
        finally:
            if proc.poll() is None:
                proc.kill()
                _runc("delete", "--force", cid, state=state)
    print(f"\ncontainer: first start ready in {times[0]:.1f}s, restart (fast path) ready in {times[1]:.1f}s")


def _host_state(host: Path) -> dict:
    d = host / "var/lib/driverd"
    runs = len(list((d / "journal.d").glob("*.json"))) + (1 if (d / "journal.json").exists() else 0)
    from driverd.driver.ident import parse_version_file as parse_nvidia_version
    vfile = host / "proc/driver/nvidia/version"
    ver = parse_nvidia_version(vfile.read_text())[0] if vfile.exists() else None
    return {"runs": runs, "journal": (d / "journal.json").read_bytes() if (d / "journal.json").exists() else None,
            "modules": (host / "proc/modules").read_text(), "loaded": ver,
            "pids": sorted(p.name for p in (host / "proc").iterdir() if p.name.isdigit())}


# -- builder: one build-matrix cell inside the image ---------------------------------------------

# A small kernel module laid out like NVIDIA's source (modules/nvidia-open-kernel/ with Kbuild carrying
# NV_VERSION_STRING, a top-level Makefile taking SYSSRC/SYSOUT, an nvidia/ directory): the real source
# takes minutes to compile; this one seconds, through the same extraction, kbuild, strip, modinfo and
# packing. The real source's build is tests/test_package_real.py's (on the same Python, 3.11.2).
_TINY = {
    "Kbuild": 'obj-m := nvidia.o\nnvidia-y := nvidia/nv.o\nccflags-y += -DNV_VERSION_STRING=\\"535.261.03\\"\n',
    "Makefile": "modules:\n\t$(MAKE) -C $(SYSOUT) M=$(CURDIR) modules\n",
    "nvidia/nv.c": '#include <linux/module.h>\nMODULE_LICENSE("Dual MIT/GPL");\nMODULE_VERSION(NV_VERSION_STRING);\n'
                   "static int __init nv_init(void) { return 0; }\nstatic void __exit nv_exit(void) {}\n"
                   "module_init(nv_init);\nmodule_exit(nv_exit);\n",
}


def _tiny_source(path: Path) -> Path:
    import io
    import tarfile
    with tarfile.open(path, "w:xz") as t:
        for name, text in _TINY.items():
            data = text.encode()
            ti = tarfile.TarInfo(f"nv/modules/nvidia-open-kernel/{name}")
            ti.size, ti.mode = len(data), 0o644
            t.addfile(ti, io.BytesIO(data))
    return path


def test_builder_image_builds_a_matrix_cell_as_the_indexed_job_pod_does(builder, tmp_path):
    from driverd.package.archive import verify_package
    inp, repo, work, cache = tmp_path / "in", tmp_path / "repo", tmp_path / "work", tmp_path / "ccache"
    for d in (inp, repo, work, cache):
        d.mkdir()
    _tiny_source(inp / "nv.tar.xz")
    (inp / "matrix.toml").write_text(
        f'[headers.debian]\npath = "/usr/src/linux-headers-{{release}}"\n'
        '[[drivers]]\nversion = "535.261.03"\nflavors = ["open"]\nsources = { open = "/in/nv.tar.xz" }\n'
        f'[[kernels]]\nrelease = "{KERNEL}"\ndistro = "debian"\narch = "x86_64"\n')
    (inp / "cells").write_text(f"535.261.03-open-{KERNEL}-x86_64\n")
    # The pod's arguments, as driverd.build.job renders them (no /host: a build pod has none).
    args = ["/usr/local/bin/driverd", "build-matrix", "/in/matrix.toml", "--cells", "/in/cells", "--only-index", "0",
            "--no-index", "--out", "/repo", "--work-dir", "/work", "--jobs", "1", "--ccache", "on",
            "--ccache-dir", "/ccache", "--json"]
    b = _bundle(builder, tmp_path, None, args, tag=BUILDER_TAG,
                binds={"/in": inp, "/repo": repo, "/work": work, "/ccache": cache})
    t0 = time.monotonic()
    r = _runc("run", "-b", str(b), f"build-{os.getpid()}", state=str(tmp_path / "state"), capture_output=True,
              text=True, timeout=600)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "unexpected error" not in r.stderr
    pkgs = sorted(repo.glob("driverd-535.261.03-open-*.tar.zst"))
    assert len(pkgs) == 1, (list(repo.iterdir()), r.stdout[-2000:])
    m = verify_package(pkgs[0])
    assert m.kernel_release == KERNEL and m.vermagic.split()[0] == KERNEL
    assert [f.path for f in m.files] == ["modules/nvidia.ko"]
    assert m.provenance.compiler and m.provenance.compiler.startswith("gcc")
    (cell,) = json.loads(r.stdout)["cells"]
    assert cell["ccache"]["misses"] > 0 and any(cache.iterdir())     # the image's ccache, into the shared volume
    print(f"\nbuilder image: one cell (small module) built in the container in {took:.1f}s")


# -- host mode from the image's root file system (hosts whose Python is too old) ------------------

def _rootfs(image: Path, where: Path) -> Path:
    b = where / "rootfs-bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{image}:{TAG}", str(b)], check=True, capture_output=True)
    return b / "rootfs"


def test_run_rootfs_runs_host_mode_on_the_images_interpreter(image, tmp_path):
    from driverd.sim.scenario import dgx_spec, make_host
    require_binary("unshare")
    rootfs = _rootfs(image, tmp_path)
    host = make_host(tmp_path / "host", dgx_spec(gpus=2, nvswitches=0, nouveau=False))
    run = ["bash", str(REPO / "images/run-rootfs.sh"), "--rootfs", str(rootfs), "--host", str(host), "--"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIVERD_", "NOTIFY_"))}
    r = subprocess.run(run + ["detect", "--json", "--no-nvml"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["root"] == "/host" and facts["hostname"] == "dgx-h100-01" and len(facts["gpus"]) == 2
    # The daemon, as a Type=notify unit would run it: converges the host from a repository, READY=1 on a
    # socket under the host root, SIGTERM stops it.
    from driverd.sim.scenario import make_packages
    make_packages(host / "srv/driverd-repo")
    cfg = host / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[driver]\nversion = "535.261.03"\nflavor = "open"\n'
                   '[packages]\nrepositories = ["file:///host/srv/driverd-repo"]\n[runtime]\nrestart = "none"\n'
                   '[modules]\nkernel = "sim"\n')          # a sample tree: the simulated kernel, asked for
    sock_dir = host / "run/systemd"
    sock_dir.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_dir / "notify"))
    sock.settimeout(120)
    proc = subprocess.Popen(run + ["daemon", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "NOTIFY_SOCKET": str(sock_dir / "notify")})
    try:
        got = ""
        t0 = time.monotonic()
        while "READY=1" not in got:
            got += sock.recv(4096).decode() + "\n"
        ready = time.monotonic() - t0
        assert _host_state(host)["loaded"] == "535.261.03"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
        print(f"\nrun-rootfs: daemon ready in {ready:.1f}s on the image's python3")
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # After the daemon: the installed wheel's other user-facing commands on the image's interpreter
    # (tests/test_wheel.py does the same in a venv): none may end in driverd's "unexpected error" (a file
    # missing from the wheel) or a traceback.
    t0 = time.monotonic()
    for argv, want in ((["plan", "--driver", "535.261.03"], "535.261.03"), (["gpus"], "H100"),
                       (["config"], "[driver]\nversion = "), (["status"], "in sync"),
                       (["demo", "--workdir", "/tmp/demo"], "== done in")):
        r = subprocess.run(run + argv, capture_output=True, text=True, timeout=600, env=env)
        out = r.stdout + r.stderr
        assert "unexpected error" not in out and "Traceback" not in out, (argv, out[-3000:])
        assert want in out, (argv, out[-3000:])
    r = subprocess.run(["chroot", str(rootfs), "/usr/local/bin/kubectl-driverd", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "rollout" in r.stdout, r.stderr
    print(f"\nimage smoke (plan, gpus, config, status, demo) through run-rootfs: {time.monotonic() - t0:.1f}s")


# -- --packages: the index and what it names, checked before anything is built (issue 30) ----------

def test_build_image_refuses_a_package_the_index_does_not_name_before_building(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("build-image.sh needs root")
    for t in ("mmdebstrap", "umoci"):
        require_binary(t)
    from tests.test_image_context import _repo
    repo = _repo(tmp_path)
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "images/build-image.sh"), "--variant", "driver", "--out",
                        str(tmp_path / "oci"), "--packages", str(repo), "--package", "index-signing.key"],
                       capture_output=True, text=True, timeout=300, start_new_session=True)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line == f"build-image: refusing --packages {repo}: index-signing.key is not a package {repo}/index.json names"
    assert not (tmp_path / "oci").exists() and time.monotonic() - t0 < 60      # refused before mmdebstrap ran
