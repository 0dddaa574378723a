import json
import os
import sys
from pathlib import Path

from tests.conftest import KERNEL_ENV_REAL, run_cli
from tests.kmodtools import run_without_kmod


def _driverd() -> str:
    exe = Path(sys.executable).parent / "driverd"
    return str(exe) if exe.exists() else f"{sys.executable} -m driverd"


def test_demo_runs_end_to_end(tmp_path):
    """On a machine as it comes (issue 17: no kmod installed), every stage of the demo runs: modinfo
    is read from the .ko files, the simulated kernel writes modules.dep itself."""
    r = run_without_kmod([*_driverd().split(), "demo", "--workdir", str(tmp_path / "demo")], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "kmod" not in out
    stages = [ln.split(". ", 1)[0] for ln in r.stdout.splitlines() if ln.startswith("== ") and ". " in ln]
    assert stages == [f"== {i}" for i in range(1, 11)], stages     # detect .. rollback, status, the cluster rollout
    assert "apply: done" in out and "RmFetchGspRmImages" in out
    assert "reload: failed at load-modules; rolled back to 550.127.05 (open), validated" in out
    assert "rollback: done" in out
    assert r.stdout.rstrip().splitlines()[-1].startswith("== done in")
    st = run_cli("status", "--root", str(tmp_path / "demo/host"), "--json")
    import json
    s = json.loads(st.stdout)
    # 535 -> 550.127.05 -> 550.127.08 failed and rolled back -> `driverd rollback`: 535 again, not the failed one
    assert s["loaded"] == {"version": "535.261.03", "flavor": "open"} and s["last_run"]["command"] == "rollback"
    assert s["last_run"]["state"] == "done"
    if os.geteuid() == 0:       # both halves: the user-space switched with the modules, there and back
        assert s["userspace"]["version"] == "535.261.03" and s["userspace"]["active"], s["userspace"]
        assert "switch the driver's user-space to 550.127.05" in out
        cache = (tmp_path / "demo/host/etc/ld.so.cache").read_bytes()
        assert b"/var/lib/driverd/driver/current/lib64/libcuda.so.1" in cache
    else:
        assert s["userspace"] is None and "the user-space half is left out" in out
    # the plan's configure-runtime step went through driverd.runtime: handler added, CDI spec written
    d = json.loads(run_cli("detect", "--root", str(tmp_path / "demo/host"), "--json", "--no-nvml").stdout)
    [ctd] = [x for x in d["runtimes"] if x["name"] == "containerd"]
    assert ctd["handlers"] == ["runc", "nvidia"]
    spec = (tmp_path / "demo/host/var/run/cdi/nvidia.yaml").read_text()
    assert "nvidia.com/gpu" in spec and "name: all" in spec
    # the modules.dep the simulated kernel wrote: depmod's format, the installed 535 package
    dep = next((tmp_path / "demo/host/lib/modules").glob("*/modules.dep")).read_text()
    assert "updates/driverd/nvidia-drm.ko: updates/driverd/nvidia-modeset.ko updates/driverd/nvidia.ko\n" in dep
    # detect and plan without kmod: the demo's simulated host and a captured real host tree
    host = str(tmp_path / "demo/host")
    for argv in (["detect", "--root", host, "--no-nvml", "--json"], ["plan", "--root", host, "--json"]):
        r = run_without_kmod([*_driverd().split(), *argv], tmp_path)
        assert r.returncode == 0 and "kmod" not in r.stderr, r.stderr
        assert json.loads(r.stdout)
    assert json.loads(r.stdout)["steps"] == []                     # the demo host is converged


def test_detect_and_plan_of_a_captured_host_without_kmod(tmp_path, unpack_host):
    root = str(unpack_host("h200-ubuntu-fc-580-open.tar.gz"))
    d = run_without_kmod([*_driverd().split(), "detect", "--root", root, "--no-nvml", "--json"], tmp_path)
    assert d.returncode == 0, d.stderr
    drv = json.loads(d.stdout)["driver"]
    assert drv["loaded"] and drv["version"] == "580.159.04" and drv["modules"][0]["name"] == "nvidia"
    # the host's own driver is replaced only on request (driver.manage = always); that plan needs a package
    p = run_without_kmod([*_driverd().split(), "plan", "--root", root, "--driver", "580.95.05", "--json"], tmp_path,
                         env={"DRIVERD_DRIVER_MANAGE": "always", "DRIVERD_PACKAGES_REPOSITORIES": "file:///srv/driverd"})
    assert p.returncode == 0, p.stderr
    assert [s["action"] for s in json.loads(p.stdout)["steps"]][:3] == ["blacklist-nouveau", "fetch-package",
                                                                         "install-package"]


def test_runtime_change_is_undone_when_a_later_step_fails(tmp_path):
    """configure-runtime has an undo: when a step after it fails, containerd's config is restored."""
    from driverd import config as config_mod
    from driverd.errors import DriverdError
    from driverd.apply.lifecycle import executor, make_context
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "host"
    make_host(root, dgx_spec())
    before = (root / "etc/containerd/config.toml").read_bytes()
    cfg = config_mod.load(Root(root), environ={}).with_overrides({"runtime.restart": "none"})
    ctx = make_context(Root(root), Runner(), cfg)
    steps = [{"action": "configure-runtime", "params": {"runtime": "containerd", "handler": "nvidia"}},
             {"action": "validate", "params": {"expect": ["999.1.1", "open"]}}]   # nothing is loaded: fails
    try:
        doc = executor(ctx).run("apply", steps)
    except DriverdError:
        doc = None
    assert doc is not None and doc["state"] == "rolled-back"
    assert (root / "etc/containerd/config.toml").read_bytes() == before
    journal = (root / "var/lib/driverd/journal.json").read_text()
    assert '"files_changed": [' in journal and "config.toml" in journal     # configure-runtime did write
    assert '"restore-files"' in journal                                      # and its undo ran


def _tree(root):
    import hashlib
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink()
                                       else str(p.readlink()) if p.is_symlink() else "dir")
            for p in sorted(root.rglob("*"))}


def test_dry_run_changes_nothing_and_writes_no_journal(tmp_path):
    from driverd.repo.index import write_index
    from driverd.sim.scenario import dgx_spec, make_companion_packages, make_host, make_packages
    root, repo = tmp_path / "host", tmp_path / "repo"
    make_host(root, dgx_spec())
    make_packages(repo)
    make_companion_packages(repo)           # the host has 4 NVSwitches: its fabric manager comes with the driver
    write_index(repo, verify=False)
    (root / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (root / "etc/driverd/config.toml").write_text(
        f'[driver]\nversion = "535.261.03"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
        '[runtime]\nruntimes = ["containerd"]\nrestart = "none"\n[companions]\nfetch = true\n')
    before = _tree(root)
    for cmd in (["apply"], ["load"], ["unload"], ["reload", "--package", str(next(repo.glob("driverd-550.127.05-*")))]):
        r = run_cli(*cmd, "--root", str(root), "--dry-run", "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["dry_run"] is True and out["steps"], out
    assert _tree(root) == before
    apply = json.loads(run_cli("apply", "--root", str(root), "--dry-run", "--json").stdout)
    assert [s["action"] for s in apply["steps"]][:4] == ["snapshot", "blacklist-nouveau", "unload-nouveau", "fetch-package"]
    assert all(s["state"].startswith("would run") for s in apply["steps"])


def test_real_kernel_refuses_to_change_a_captured_tree_before_journaling(unpack_host):
    root = unpack_host("h200-ubuntu-fc-580-open.tar.gz")
    before = _tree(root)
    r = run_cli("unload", "--root", str(root), env=KERNEL_ENV_REAL)      # a captured host: the real kernel
    assert r.returncode == 2 and "not the live host" in r.stderr and "Traceback" not in r.stderr
    assert _tree(root) == before
    st = json.loads(run_cli("status", "--root", str(root), "--json", env=KERNEL_ENV_REAL).stdout)
    assert st["loaded"] == {"version": "580.159.04", "flavor": "open"}
