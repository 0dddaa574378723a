"""The driver container image, built by images/build-image.sh from Debian packages and the project's own
wheel (mmdebstrap + umoci, no registry, no container engine), run with the real runc: the entrypoint,
pointed at a simulated host root bind-mounted at /host, goes ready, takes the fast path on a restart
(nothing reloaded), and stops cleanly on SIGTERM."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, require_binary

pytestmark = [pytest.mark.slow, pytest.mark.real]
TAG = "driver-test"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("building and running an image needs root")
    for t in ("mmdebstrap", "umoci", "runc"):
        require_binary(t)
    out = tmp_path_factory.mktemp("image") / "oci"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "images/build-image.sh"), "--variant", "driver", "--out", str(out),
                        "--tag", TAG], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"\nimage: built in {time.monotonic() - t0:.0f}s, {size / 2**20:.0f} MiB (OCI layout, compressed)")
    return out


def _bundle(image: Path, where: Path, host: Path, args: list[str] | None = None) -> Path:
    b = where / "bundle"
    if b.exists():
        shutil.rmtree(b)
    subprocess.run(["umoci", "unpack", "--image", f"{image}:{TAG}", str(b)], check=True, capture_output=True)
    cfg = json.loads((b / "config.json").read_text())
    if args:
        cfg["process"]["args"] = args
    cfg["process"]["terminal"] = False
    # The host's network (loopback) so the test reaches the health endpoints, as hostNetwork would.
    cfg["linux"]["namespaces"] = [n for n in cfg["linux"]["namespaces"] if n["type"] != "network"]
    cfg["mounts"].append({"destination": "/host", "type": "bind", "source": str(host), "options": ["rbind", "rw"]})
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    host = make_host(tmp_path / "host", dgx_spec(gpus=2, nvswitches=1, nouveau=False))
    repo = host / "srv/driverd-repo"                    # the repository, seen by the container at /host/srv/...
    make_packages(repo)
    cfg = host / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[driver]\nversion = "535.261.03"\nflavor = "open"\n'
                   '[packages]\nrepositories = ["file:///host/srv/driverd-repo"]\n[runtime]\nrestart = "none"\n')
    state = str(tmp_path / "state")
    port = _free_port()
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
    from driverd.host.modules import parse_nvidia_version
    vfile = host / "proc/driver/nvidia/version"
    ver = parse_nvidia_version(vfile.read_text())[0] if vfile.exists() else None
    return {"runs": runs, "journal": (d / "journal.json").read_bytes() if (d / "journal.json").exists() else None,
            "modules": (host / "proc/modules").read_text(), "loaded": ver,
            "pids": sorted(p.name for p in (host / "proc").iterdir() if p.name.isdigit())}
