"""Workload-ready in the daemon: a converged host is ready only when a CUDA call works with the libraries
containers get. Stand-in libnvidia-ml / libcuda (tests/cudastandin) answer like NVIDIA's for the loaded
module's version; `validation.workload = on` asks for the check on a simulated host (auto runs it only
with the real kernel on the live host)."""
from __future__ import annotations

import json
import signal

from driverd.host import pci
from driverd.root import Root
from tests import cudastandin
from tests.conftest import run_cli
from tests.daemon.conftest import NEW, OLD, journal_runs, kernel_of, write_config

ON = '[validation]\nworkload = "on"\nworkload_timeout_s = 20\n'


def _gpus(root) -> list[str]:
    gpus, _, _ = pci.classify(Root(root), pci.scan(Root(root), []), [])
    return [g.pci_address for g in gpus]


def test_ready_only_when_cuda_works_and_a_stale_userspace_is_not_ready_without_touching_the_driver(
        host, packages, daemons):
    repo = packages["old"].parent
    cudastandin.install(host, OLD, _gpus(host))
    write_config(host, OLD, repo, extra=ON)
    d = daemons(host)
    _, ready = d.wait_notify("READY=1", 60)
    assert f"STATUS=converged: driver {OLD} (open) loaded and validated, workload-ready (CUDA on 2 GPU(s))" in ready
    assert d.metric("driverd_workload_ready") == 1
    assert d.metric("driverd_workload_check_duration_seconds_count") == 1
    # a pass with nothing changed keeps the verdict: no second CUDA check
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(r"converged: driver 535\.261\.03 .*workload-ready", 30, start=n)
    assert d.metric("driverd_workload_check_duration_seconds_count") == 1

    # What a kernel-only upgrade leaves: the user-space of another version in front of the loaded modules.
    cudastandin.install(host, NEW, _gpus(host))
    for f in (host / "usr/lib/x86_64-linux-gnu").glob(f"*.so.{OLD}"):
        f.unlink()
    runs = len(journal_runs(host))
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(rf"not converged: blocked: .*not workload-ready: user-space {NEW} does not match the loaded "
               rf"kernel driver {OLD}", 30, start=n)
    code, body = d.get("/readyz")
    assert code == 503 and f"user-space {NEW} does not match the loaded kernel driver {OLD}" in body
    assert d.metric("driverd_workload_ready") == 0 and d.metric("driverd_ready") == 0
    assert kernel_of(host).modules()["nvidia"].version == OLD       # reported, never "fixed" by an unload
    assert len(journal_runs(host)) == runs
    rc, _ = d.stop()
    assert rc == 0

    # A daemon that starts on that host never says READY=1.
    d2 = daemons(host)
    _, status = d2.wait_notify("STATUS=blocked", 60)
    assert "not workload-ready" in status
    assert not any("READY=1" in m for m in d2.all_messages)
    assert d2.get("/readyz")[0] == 503
    d2.stop()

    # plan and detect say the same, without loading a library
    r = run_cli("plan", "--root", str(host), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 3 and doc["verdict"] == "blocked", r.stderr
    assert doc["blocked_by"] == [f"not workload-ready: user-space {NEW} does not match the loaded kernel driver {OLD}"]
    r = run_cli("plan", "--root", str(host))
    assert f"BLOCKED:\n  - not workload-ready: user-space {NEW} does not match the loaded kernel driver {OLD}" in r.stdout
    assert "nothing to do" not in r.stdout
    r = run_cli("detect", "--root", str(host), "--no-nvml")
    assert f"userspace   {NEW} in /usr/lib/x86_64-linux-gnu" in r.stdout
    assert f"  not workload-ready: user-space {NEW} does not match the loaded kernel driver {OLD}" in r.stdout


def test_an_upgrade_that_would_leave_stale_libraries_is_blocked_before_anything_is_unloaded(host, packages, daemons):
    """A kernel-only upgrade (the 535 user-space stays): the plan says so before the unload."""
    repo = packages["old"].parent
    cudastandin.install(host, OLD, _gpus(host))
    write_config(host, OLD, repo, extra=ON)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    runs = len(journal_runs(host))
    n = len(d.lines)
    write_config(host, NEW, repo, extra=ON)
    d.wait_log(rf"not converged: blocked: .*not workload-ready after the load: the user-space is {OLD}, loading "
               rf"{NEW} would leave containers with an NVML/RM version mismatch; fix: install the {NEW} user-space",
               60, start=n)
    assert kernel_of(host).modules()["nvidia"].version == OLD and len(journal_runs(host)) == runs
    d.stop()


def test_a_gpu_cuda_cannot_use_fails_validation_and_the_upgrade_rolls_back(host, packages, daemons, tmp_path):
    """The 535 -> 550 upgrade loads 550, whose CUDA check fails on one GPU: the transaction rolls back
    to 535 and the daemon reports why (the GPU by bus id, the CUDA error by name)."""
    repo = packages["old"].parent
    gpus = _gpus(host)
    # libraries that serve both versions' kernels (the real ones serve one): GPU 1 fails its context
    both = tmp_path / "rm-version"
    both.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {OLD}  {NEW}  Release Build\n")
    cudastandin.install(host, OLD, gpus, rm_file=both)
    write_config(host, OLD, repo, extra=ON)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    cudastandin.install(host, NEW, gpus, fail_device=1, rm_file=both)
    n = len(d.lines)
    write_config(host, NEW, repo, extra=ON)
    m = d.wait_log(r"not converged: failed: (.*)", 90, start=n)
    assert f"GPU {gpus[1]}: cuDevicePrimaryCtxRetain returned CUDA_ERROR_OUT_OF_MEMORY" in m.group(1)
    assert "rolled back" in m.group(1) and "ROLLBACK FAILED" not in m.group(1), m.group(1)
    assert kernel_of(host).modules()["nvidia"].version == OLD
    assert journal_runs(host)[-1]["state"] == "rolled-back"
    code, body = d.get("/readyz")
    assert code == 503 and "cuDevicePrimaryCtxRetain" in body
    assert d.metric("driverd_workload_ready") == 0
    d.stop()


def test_the_daemon_writes_a_cdi_spec_with_the_validated_userspace_after_the_load(host, packages, daemons):
    """runtime.cdi: once the GPUs are visible and validated, the spec gives containers the device nodes
    and the driver's libraries; a second pass writes nothing."""
    import yaml
    repo = packages["old"].parent
    cudastandin.install(host, OLD, _gpus(host))
    spec_path = host / "var/run/cdi/nvidia.yaml"
    assert not spec_path.exists()
    write_config(host, OLD, repo, extra=ON)
    (host / "etc/driverd/config.toml").write_text((host / "etc/driverd/config.toml").read_text()
                                                  .replace('[runtime]\n', '[runtime]\ncdi = true\n'))
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    spec_path.unlink()          # the GPUs' spec gone (a tmpfs /var/run after a reboot): the next pass rewrites it
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(r"CDI spec /var/run/cdi/nvidia\.yaml written", 30, start=n)
    spec = yaml.safe_load(spec_path.read_text())
    mounts = {m["containerPath"] for m in spec["containerEdits"].get("mounts", [])}
    assert {f"/usr/lib/x86_64-linux-gnu/libcuda.so.{OLD}", f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{OLD}"} <= mounts
    assert {dev["name"] for dev in spec["devices"]} >= {"0", "1", "all"}
    before = spec_path.stat().st_mtime_ns
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(r"converged: driver 535\.261\.03", 30, start=n)
    assert spec_path.stat().st_mtime_ns == before
    d.stop()
