"""Issue 46 (first slice): the fabric manager that would start after the load must be the loaded driver's
version — NVIDIA's refuses another ("... don't match with driver version ..."), the fabric never completes,
and the upgrade rolls back. The plan is BLOCKED before anything is unloaded when the fabric manager the host
would start is known to be of another version; the fabric manager stand-in (driverd/sim/fabricmanager.py) is
a real executable that refuses as NVIDIA's does."""
from __future__ import annotations

import subprocess

import pytest

from driverd.sim import fabricmanager as fmsim
from tests.apply.conftest import drv, journal, kernel_of

OLD, NEW = "535.261.03", "550.127.05"


@pytest.fixture
def host(tmp_path, packages):
    """A 2-GPU host with one NVSwitch (fabric manager wanted), package `old` installed, not loaded."""
    from driverd.install.modules import install
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "root"
    make_host(root, dgx_spec(gpus=2, nvswitches=1, nouveau=False))
    install(Root(root), packages["old"], Runner())
    return root


def _version_file(root, version: str) -> None:
    p = root / "proc/driver/nvidia/version"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (dvs-builder@U16)\n"
                 "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def test_the_stand_in_refuses_another_driver_with_nvidias_message_and_completes_the_fabric_with_its_own(tmp_path):
    exe = fmsim.write(tmp_path / "usr/bin/nv-fabricmanager", NEW)
    env = {"PATH": "/usr/bin:/bin", "DRIVERD_SIM_ROOT": str(tmp_path)}
    _version_file(tmp_path, OLD)
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert (f"fabric manager NVIDIA GPU driver interface version {NEW} don't match with driver version {OLD}. "
            "Please update with matching NVIDIA driver package.") in r.stderr
    assert "don't match" in (tmp_path / fmsim.LOG.lstrip("/")).read_text()
    assert not (tmp_path / "run/driverd-sim/fabric-state").exists()
    _version_file(tmp_path, NEW)
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    r = subprocess.run([str(exe), "--version"], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == f"Fabric Manager version is : {NEW}"


def _want_new(root, packages) -> None:
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[driver]\nversion = "{NEW}"\nflavor = "open"\n[packages]\nrepositories = '
                   f'["file://{packages["new"].parent}"]\n[runtime]\nrestart = "none"\n')


def test_an_upgrade_whose_fabric_manager_is_the_hosts_other_version_is_blocked_before_anything_is_unloaded(
        host, packages):
    """The HGX host's fabric manager came with its 535 driver (a distribution package, or here the
    stand-in): loading 550 would start it, it would refuse 550 and the upgrade would roll back. Before,
    the plan went ahead; now it is BLOCKED naming both versions and the ways to provide 550's."""
    fmsim.write(host / "usr/bin/nv-fabricmanager", OLD)
    assert drv(host, "load").returncode == 0
    assert (host / "run/driverd-sim/fabric-state").read_text() == "completed\n"      # 535's runs with 535
    _want_new(host, packages)
    r = drv(host, "plan")
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"no fabric manager of driver {NEW} is available: /usr/bin/nv-fabricmanager ({OLD}" in r.stdout, r.stdout
    assert "driverd build-companion" in r.stdout and 'daemons.fabricmanager = "false"' in r.stdout
    before = journal(host)["run_id"]
    r = drv(host, "apply")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "fabric manager" in r.stdout + r.stderr
    k = kernel_of(host)
    assert k.is_loaded("nvidia") and OLD in (host / "proc/driver/nvidia/version").read_text()   # nothing unloaded
    assert journal(host)["run_id"] == before                                                  # no run started


def test_an_nvswitch_host_with_no_fabric_manager_at_all_is_blocked_and_nothing_is_loaded(host, packages):
    """No fabric manager on the host and none of driverd's: CUDA could never use the GPUs (the fabric
    never completes). Before, the plan went ahead; now load and upgrade are BLOCKED, exit 3, nothing loaded."""
    cfg = host / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    want = f'[driver]\nversion = "{OLD}"\nflavor = "open"\n[runtime]\nrestart = "none"\n'
    cfg.write_text(want)
    r = drv(host, "plan")
    assert r.returncode == 3, r.stdout + r.stderr
    assert (f"no fabric manager of driver {OLD} is available: the host has none (/usr/bin/nv-fabricmanager is "
            "missing)") in r.stdout, r.stdout
    r = drv(host, "load")
    assert r.returncode == 3, r.stdout + r.stderr
    assert not kernel_of(host).is_loaded("nvidia")
    assert not (host / "run/driverd-sim/fabric-state").exists()
    # the way out the message names: the host does not want one
    cfg.write_text(want + "[daemons]\nfabricmanager = \"false\"\n")
    assert drv(host, "plan").returncode == 0


def test_an_upgrade_with_the_new_versions_fabric_manager_goes_ahead_and_the_fabric_completes(host, packages):
    fmsim.write(host / "usr/bin/nv-fabricmanager", OLD)
    assert drv(host, "load").returncode == 0
    fmsim.write(host / "usr/bin/nv-fabricmanager", NEW)           # the operator installed 550's
    _want_new(host, packages)
    r = drv(host, "plan")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"/usr/bin/nv-fabricmanager ({NEW}: its --version) is started" in r.stdout, r.stdout
    r = drv(host, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert NEW in (host / "proc/driver/nvidia/version").read_text()
    assert (host / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    assert f"fabric manager {NEW}: fabric configured" in (host / fmsim.LOG.lstrip("/")).read_text()


@pytest.mark.parametrize("spec, kind, wants", [
    ("hgx_b200_spec", "nvlink5-switch-tray", ["wants fabricmanager", "nvlsm (after mlx5_core, ib_core, ib_umad"]),
    ("gb200_spec", "nvlink5-imex", ["wants imex", "imex-channel0 (/dev/nvidia-caps-imex-channels/channel0 is missing",
                                    "NVreg_CreateImexChannel0=1"]),
])
def test_plan_says_which_nvlink5_fabric_the_host_has_and_what_it_needs(tmp_path, spec, kind, wants):
    import json
    from driverd.sim import scenario
    root = scenario.make_host(tmp_path / "h", getattr(scenario, spec)())
    r = drv(root, "plan", "--driver", "570.172.08", "--json")
    assert r.returncode in (0, 3), r.stdout + r.stderr
    p = json.loads(r.stdout)
    assert p["fabric"].startswith(f"{kind}: "), p["fabric"]
    for w in wants:
        assert w in p["fabric"], (w, p["fabric"])
    text = drv(root, "plan", "--driver", "570.172.08").stdout
    assert f"fabric: {kind}: " in text, text
    fm = [s for s in p["steps"] if s["action"] == "start-fabricmanager"]
    if kind == "nvlink5-switch-tray":      # no NVSwitch on PCI: the switch trays still want fabric manager
        assert fm and "NVLink5 switch trays managed from this host" in fm[0]["reason"], p["steps"]
    else:
        assert not fm                      # GB200: no local fabric manager (IMEX instead)
