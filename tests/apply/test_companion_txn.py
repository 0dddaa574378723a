"""Issue 46: the fabric manager is a part of the driver, switched with it in one transaction. A simulated
HGX host (8 GPUs, 4 NVSwitches) runs 535 with driverd's 535 fabric manager companion; the host's own fabric
manager is the distribution's 535. The 550 companion is in the repository beside the 550 kernel package
(built by build-companion from an archive in NVIDIA's layout, made by the test: no real one is reachable
here; its nv-fabricmanager is the version-checking stand-in, driverd/sim/fabricmanager.py)."""
from __future__ import annotations

import shutil

import pytest

from driverd.driver.companions import CompanionPlaces, current
from driverd.install import companion as ci
from driverd.install.modules import install
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim import fabricmanager as fmsim
from driverd.sim.scenario import dgx_spec, make_host
from tests.apply.conftest import drv, journal
from tests.packages import companionfake as cf

OLD, NEW = "535.261.03", "550.127.05"
P = CompanionPlaces("fabricmanager")


def _fm(tmp, version: str, script: str):
    from driverd.build.companion import build_from_archive
    arch = cf.archive(tmp / f"a-{version}", "fabricmanager", version,
                      edit=lambda ms: cf.swap(ms, "bin/nv-fabricmanager", data=script.encode()))
    return build_from_archive(arch, tmp / "out").ref.path


def _hgx(tmp_path, packages, new_fm_script: str):
    from driverd.repo.index import write_index
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(packages["new"], repo)
    new_fm = _fm(tmp_path / "b-new", NEW, new_fm_script)
    shutil.copy(new_fm, repo)
    from driverd.sim.scenario import make_userspace_packages
    make_userspace_packages(repo, (NEW,))          # userspace.fetch: the user-space is switched with them
    write_index(repo)
    root = make_host(tmp_path / "root", dgx_spec(gpus=8, nvswitches=4, nouveau=False))
    fmsim.write(root / "usr/bin/nv-fabricmanager", OLD)             # the distribution's, of the host's driver
    cfg = root / "usr/share/nvidia/nvswitch/fabricmanager.cfg"      # and its configuration, edited by the operator
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("LOG_LEVEL=2\nDAEMONIZE=1\nFABRIC_MODE=1\nTOPOLOGY_FILE_PATH=/usr/share/nvidia/nvswitch\n")
    install(Root(root), packages["old"], Runner())
    ci.install(Root(root), _fm(tmp_path / "b-old", OLD, fmsim.script(OLD)), places=P, driver=OLD)
    assert drv(root, "load").returncode == 0
    assert (root / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[driver]\nversion = "{NEW}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
                   '[userspace]\nfetch = true\n[companions]\nfetch = true\n[runtime]\nrestart = "none"\n')
    return root


def test_535_to_550_switches_the_fabric_manager_with_the_driver(tmp_path, packages):
    root = _hgx(tmp_path, packages, fmsim.script(NEW))
    r = drv(root, "plan")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "install-companion" in r.stdout and "driverd's companion package from packages.repositories" in r.stdout
    assert "the settings edited in /usr/share/nvidia/nvswitch/fabricmanager.cfg are carried" in r.stdout, r.stdout
    r = drv(root, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert NEW in (root / "proc/driver/nvidia/version").read_text()
    assert current(Root(root), P).version == NEW
    assert (root / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    assert f"fabric manager {NEW}: fabric configured" in (root / fmsim.LOG.lstrip("/")).read_text()
    # the operator's FABRIC_MODE and LOG_LEVEL carried into 550's configuration (not the host's file path), which
    # the running fabric manager was started with
    conf = (root / P.records.lstrip("/") / "fabricmanager.cfg").read_text()
    assert "FABRIC_MODE=1" in conf and "LOG_LEVEL=2" in conf and "TOPOLOGY_FILE_PATH" not in conf, conf
    cmdlines = [p.read_text() for p in (root / "proc").glob("*/cmdline")]
    assert any("nv-fabricmanager" in c and f"{P.records}/fabricmanager.cfg" in c for c in cmdlines), cmdlines
    steps = {s["action"]: s for s in journal(root)["steps"]}
    comp = steps["install-companion"]
    assert comp["result"]["carried"] == {"LOG_LEVEL": "2", "FABRIC_MODE": "1"}
    assert comp["status"] == "done" and comp["finished_at"] >= comp["started_at"]
    order = [s["action"] for s in journal(root)["steps"]]
    assert order.index("unload-modules") < order.index("install-companion") < order.index("load-modules") \
        < order.index("start-fabricmanager")


def test_a_550_fabric_manager_that_fails_rolls_back_the_driver_and_its_fabric_manager_to_535(tmp_path, packages):
    broken = (f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Fabric Manager version is : {NEW}'; exit 0; fi\n"
              "mkdir -p \"$DRIVERD_SIM_ROOT/var/log\"\n"
              "echo 'fabric manager: NVSwitch 0000:c0:00.0 training failed' | tee -a \"$DRIVERD_SIM_ROOT/var/log/"
              "fabricmanager.log\" >&2\nexit 1\n")
    root = _hgx(tmp_path, packages, broken)
    r = drv(root, "apply")
    assert r.returncode == 3, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "nv-fabricmanager" in out and "/var/log/fabricmanager.log" in out, out
    assert OLD in (root / "proc/driver/nvidia/version").read_text()               # the modules back
    assert current(Root(root), P).version == OLD                                      # its fabric manager back
    assert (root / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    assert journal(root)["state"] == "rolled-back"
