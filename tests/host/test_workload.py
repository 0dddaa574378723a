"""The workload check (driverd.host.workload) against stand-in libnvidia-ml / libcuda built by the tests:
the paths a real host shows — matching user-space, a kernel-only upgrade's stale libraries, no device,
a hung cuInit, a GPU whose context fails, memory that does not round-trip, an incomplete NVLink fabric,
no user-space at all. The real libraries run on the GPU machines (docs/testing.md)."""
from __future__ import annotations

import time

import pytest

from driverd.host import workload
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, h100, nvidia_version_line, write_host
from tests import cudastandin

GPUS = ["0000:1b:00.0", "0000:3b:00.0"]
NEW, OLD = "580.159.04", "535.261.03"


def host(tmp_path, loaded: str | None = NEW, gpus=GPUS):
    write_host(tmp_path, HostSpec(pci=[h100(a, "nvidia") for a in gpus],
                                  nvidia_version_text=nvidia_version_line(loaded, "open") if loaded else None))
    return Root(tmp_path)


def test_matching_userspace_is_workload_ready(tmp_path):
    root = host(tmp_path)
    cudastandin.install(tmp_path, NEW, GPUS)
    r = workload.check(root, NEW, GPUS)
    assert r.ok, r.problems
    assert r.userspace["version"] == NEW and r.userspace["lib_dir"] == "/usr/lib/x86_64-linux-gnu"
    assert r.nvml["driver_version"] == NEW and len(r.nvml["devices"]) == 2
    assert [d["pci_bus_id"] for d in r.cuda["devices"]] == ["0000:1b:00.0", "0000:3b:00.0"]
    assert all(d["ok"] and d["roundtrip_bytes"] == workload.ROUNDTRIP_BYTES for d in r.cuda["devices"])


def test_stale_userspace_after_a_kernel_only_upgrade_names_both_versions_and_the_fix(tmp_path):
    root = host(tmp_path, loaded=NEW)
    cudastandin.install(tmp_path, OLD, GPUS)
    r = workload.check(root, NEW, GPUS)
    assert not r.ok
    assert r.problems[0].startswith(f"user-space {OLD} does not match the loaded kernel driver {NEW}: "
                                    "NVML/RM version mismatch")
    assert "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH" in r.problems[0] and "803" not in r.reason()
    assert f"install the {NEW} user-space" in r.fix
    assert len(r.problems) == 1, r.problems           # one cause, said once
    # the file-only half says the same without loading anything
    us, quick = workload.quick(root, NEW)
    assert us.version == OLD and quick == [f"user-space {OLD} does not match the loaded kernel driver {NEW}"]


def test_nvml_that_reports_another_version_without_refusing_is_a_mismatch(tmp_path):
    """A library set whose file names say one version and whose NVML says another (a renamed file)."""
    root = host(tmp_path, loaded=NEW)
    d = cudastandin.install(tmp_path, NEW, GPUS)
    # NVML built for NEW reads the kernel's NEW, but claims to be OLD: the check compares what NVML says
    cudastandin.install(tmp_path, NEW, GPUS, only=("cuda",))
    nv = cudastandin._compile("nvml.c", "libnvidia-ml.so.1", {
        "STANDIN_VERSION": f'"{NEW}"', "STANDIN_RM_FILE": f'"{tmp_path}/proc/driver/nvidia/version"',
        "STANDIN_BUSIDS": '"' + ",".join(GPUS) + '"'})
    text = nv.read_bytes().replace(NEW.encode() + b"\0", OLD.encode() + b"\0", 1)
    (d / f"libnvidia-ml.so.{NEW}").write_bytes(text)
    r = workload.check(root, NEW, GPUS)
    assert any(p.startswith(f"user-space {OLD} does not match the loaded kernel driver {NEW}: NVML reports")
               for p in r.problems), r.problems


def test_a_gpu_that_pci_shows_but_nvml_and_cuda_do_not(tmp_path):
    root = host(tmp_path, gpus=GPUS + ["0000:86:00.0"])
    cudastandin.install(tmp_path, NEW, GPUS)
    r = workload.check(root, NEW, GPUS + ["0000:86:00.0"])
    assert not r.ok
    assert "NVML sees 2 GPU(s), PCI shows 3: not seen 0000:86:00.0" in r.problems
    assert "CUDA sees 2 GPU(s), PCI shows 3: not seen 0000:86:00.0" in r.problems


def test_no_driver_loaded_no_device(tmp_path):
    root = host(tmp_path, loaded=None)
    cudastandin.install(tmp_path, NEW, GPUS)
    r = workload.check(root, None, GPUS)
    assert not r.ok
    assert "NVML cannot start: the NVIDIA kernel driver is not loaded (NVML)" in r.problems
    assert "CUDA cannot initialise: cuInit returned CUDA_ERROR_NO_DEVICE" in r.problems


def test_a_hung_cuinit_is_killed_and_says_where(tmp_path):
    root = host(tmp_path)
    cudastandin.install(tmp_path, NEW, GPUS, hang=True)
    t0 = time.monotonic()
    r = workload.check(root, NEW, GPUS, timeout_s=3)
    assert time.monotonic() - t0 < 15
    assert not r.ok and r.hung_at == "cuInit"
    assert r.problems == ["the CUDA check did not finish within 3s (stuck at cuInit): a hung GPU or driver"]
    assert r.nvml["ok"], "what finished before the hang is kept"


def test_every_gpus_context_is_made_at_once(tmp_path):
    """Issue 47: the check makes the GPUs' contexts concurrently (an 8-GPU node waited 8 contexts one after
    the other). The stand-in makes a context only while every GPU's is being made at the same time."""
    gpus = [f"0000:{0x1b + 0x20 * i:02x}:00.0" for i in range(4)]
    root = host(tmp_path, gpus=gpus)
    cudastandin.install(tmp_path, NEW, gpus, together=True)
    r = workload.check(root, NEW, gpus)
    assert r.ok, r.problems
    assert [d["pci_bus_id"] for d in r.cuda["devices"]] == gpus          # in the GPUs' order, whatever finished first


def test_one_hung_gpu_among_several_is_named_while_the_others_finish(tmp_path):
    gpus = [f"0000:{0x1b + 0x20 * i:02x}:00.0" for i in range(4)]
    root = host(tmp_path, gpus=gpus)
    cudastandin.install(tmp_path, NEW, gpus, hang_device=2)
    # long enough for the three other GPUs to finish on a busy machine: the verdict must name only the hung one
    r = workload.check(root, NEW, gpus, timeout_s=15)
    assert not r.ok and r.hung_at == "device 2", r.hung_at
    assert r.problems == ["the CUDA check did not finish within 15s (stuck at device 2): a hung GPU or driver"]


def test_one_gpu_whose_context_fails_is_named_by_bus_id(tmp_path):
    root = host(tmp_path)
    cudastandin.install(tmp_path, NEW, GPUS, fail_device=1)
    r = workload.check(root, NEW, GPUS)
    assert r.problems == ["GPU 0000:3b:00.0: cuDevicePrimaryCtxRetain returned CUDA_ERROR_OUT_OF_MEMORY"]


def test_memory_that_does_not_round_trip(tmp_path):
    root = host(tmp_path)
    cudastandin.install(tmp_path, NEW, GPUS, corrupt=True)
    r = workload.check(root, NEW, GPUS)
    assert len(r.problems) == 2
    assert all("the memory round trip returned other bytes than were written" in p for p in r.problems)


@pytest.mark.parametrize("state,ok", [(3, True), (2, False), (1, False)])
def test_nvlink_fabric_state_where_nvml_reports_one(tmp_path, state, ok):
    root = host(tmp_path)
    cudastandin.install(tmp_path, NEW, GPUS, fabric_state=state)
    r = workload.check(root, NEW, GPUS)
    assert r.ok is ok, r.problems
    if not ok:
        word = workload.FABRIC_STATES[state]
        assert r.problems[0] == (f"GPU 0000:1b:00.0: NVLink fabric registration {word}: CUDA cannot use the GPU "
                                 "until it completes")
        assert "nvidia-fabricmanager" in r.fix


def test_no_userspace_at_all(tmp_path):
    root = host(tmp_path)
    r = workload.check(root, NEW, GPUS)
    assert not r.ok and r.nvml is None and r.cuda is None
    assert r.problems[0].startswith(f"no NVIDIA user-space (libcuda.so.1, libnvidia-ml.so.1) found for the "
                                    f"loaded driver {NEW}")


def test_the_driver_root_is_preferred_and_never_mixed_with_the_hosts_own(tmp_path):
    """/usr/local/nvidia/lib64 (the GPU machines' layout) wins over stale libraries in the system dirs."""
    root = host(tmp_path)
    cudastandin.install(tmp_path, OLD, GPUS)
    cudastandin.install(tmp_path, NEW, GPUS, libdir="/usr/local/nvidia/lib64")
    r = workload.check(root, NEW, GPUS)
    assert r.ok, r.problems
    assert r.userspace["driver_root"] == "/usr/local/nvidia" and r.userspace["version"] == NEW


def test_a_host_managed_driver_that_is_not_workload_ready_is_shown_blocked_not_nothing_to_do():
    """Seen on the GPU machine: the plan's text said "nothing to do" while it exited 3."""
    from driverd.cli.host_cmds import render_plan
    text = render_plan({"driver_managed_by": "the host (owner unknown)", "kernel_release": "6.18", "flavor_reason": "why",
                        "steps": [], "modules": ["nvidia"], "driver_version": NEW, "flavor": "open", "warnings": [],
                        "blocked_by": [f"not workload-ready: user-space {OLD} does not match the loaded kernel driver "
                                       f"{NEW} (the driver is left to the host)"]})
    assert f"BLOCKED:\n  - not workload-ready: user-space {OLD}" in text and "nothing to do" not in text


@pytest.mark.parametrize("libs", [None, OLD])
def test_a_loaded_driver_with_a_missing_or_stale_userspace_is_not_converged(tmp_path, libs):
    """The plan (what detect, plan, apply and the daemon share) is blocked for the loaded driver, with the
    workload check on; off, the same host is converged."""
    from driverd import config
    from driverd.apply.hostplan import plan_for_host
    from driverd.sim.hosttree import Module
    write_host(tmp_path, HostSpec(pci=[h100(a, "nvidia") for a in GPUS], nvidia_version_text=nvidia_version_line(NEW, "open"),
                                  modules=[Module("nvidia", refcount=0, version=NEW)]))
    if libs:
        cudastandin.install(tmp_path, libs, GPUS)
    env = {"DRIVERD_MODULES_KERNEL": "sim", "DRIVERD_DRIVER_MANAGE": "never"}
    blocked = plan_for_host(Root(tmp_path), config.load(Root(tmp_path), environ={**env, "DRIVERD_VALIDATION_WORKLOAD": "on"})).plan
    want = (f"no NVIDIA user-space (libcuda.so.1, libnvidia-ml.so.1) found for the loaded driver {NEW}" if libs is None
            else f"user-space {OLD} does not match the loaded kernel driver {NEW}")
    assert blocked.verdict == "blocked" and blocked.blocked_by[0].startswith(f"not workload-ready: {want}"), blocked.blocked_by
    off = plan_for_host(Root(tmp_path), config.load(Root(tmp_path), environ={**env, "DRIVERD_VALIDATION_WORKLOAD": "off"})).plan
    assert off.verdict == "converged", off.blocked_by


def test_the_root_child_imports_nothing_from_the_callers_directory_or_environment(tmp_path, monkeypatch):
    """Issue 44, item 4: the probe runs as root. A json.py (every probe imports json) planted in the
    directory the caller stands in, and a PYTHONPATH/PYTHONSTARTUP pointing at another user's directory,
    must never be imported by it: the child is isolated (-I) and runs in /."""
    root = host(tmp_path / "host")
    cudastandin.install(tmp_path / "host", NEW, GPUS)
    planted = tmp_path / "users-dir"
    planted.mkdir()
    marker = tmp_path / "imported-as-root"
    for name in ("json", "ctypes", "sitecustomize", "startup"):
        (planted / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    monkeypatch.chdir(planted)
    monkeypatch.setenv("PYTHONPATH", str(planted))
    monkeypatch.setenv("PYTHONSTARTUP", str(planted / "startup.py"))
    r = workload.check(root, NEW, GPUS)
    assert not marker.exists(), f"planted modules imported by the root child: {marker.read_text().split()}"
    assert r.ok, r.problems


def test_the_probe_child_starts_without_site_and_gets_only_the_modules_it_names(tmp_path, monkeypatch):
    """Issue 47: the probe's child runs without `site` (a site-packages `.pth` cost every check 40 ms on
    the GPU hosts); the third-party modules it names reach it by the directory this process found them
    in, and nothing else of site-packages does."""
    import json
    import subprocess
    import sys

    from driverd.runner import CHILD_CWD, python_child
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "named_mod.py").write_text("")
    (mods / "report_mod.py").write_text(
        "import json, sys\nimport named_mod\n"
        "print(json.dumps({'no_site': sys.flags.no_site, 'site': 'site' in sys.modules, "
        "'named': named_mod.__file__, 'path': sys.path}))\n")
    monkeypatch.syspath_prepend(str(mods))
    out = subprocess.run(python_child("report_mod", site_modules=("report_mod", "named_mod", "not_installed")),
                         capture_output=True, text=True, cwd=CHILD_CWD, check=True).stdout
    doc = json.loads(out)
    assert doc["no_site"] == 1 and not doc["site"]
    assert doc["named"] == str(mods / "named_mod.py")
    assert not any(p.endswith("site-packages") for p in doc["path"]), doc["path"]
    # without named modules only driverd's own directory is added: the test's path does not travel
    bare = subprocess.run(python_child("report_mod"), capture_output=True, text=True, cwd=CHILD_CWD)
    assert bare.returncode != 0 and "No module named" in bare.stderr and "report_mod" in bare.stderr
    assert sys.flags.no_site == 0


def test_nvml_report_carries_each_gpus_persistence_mode(tmp_path):
    """The validation's persistence check reads it from here (driverd.kmod.load.validate, issue 47)."""
    root = host(tmp_path)
    cudastandin.install(tmp_path, NEW, GPUS)
    assert [d["persistence_mode"] for d in workload.check(root, NEW, GPUS).nvml["devices"]] == [True, True]
    cudastandin.install(tmp_path, NEW, GPUS, persistence=False)
    r = workload.check(root, NEW, GPUS)
    assert r.ok and [d["persistence_mode"] for d in r.nvml["devices"]] == [False, False]
