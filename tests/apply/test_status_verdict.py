"""issue 32 item 3: `status` said "in sync" on the 4-NVSwitch sandbox while fabric manager was stopped
(after a killed reload), although `plan` listed start-fabricmanager. `status`, `plan` and the daemon's
pass give one verdict for a host: the one apply/hostplan makes."""
from __future__ import annotations

import json

import pytest

from driverd.root import Root
from tests.apply.conftest import drv, status
from tests.daemon.conftest import OLD, write_config
from tests.kmod.conftest import kernel_of, packages  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def hgx_repo(packages, tmp_path_factory):
    """The driver packages and their fabric manager companions (the demo's repository)."""
    import shutil
    from driverd.repo.index import write_index
    from driverd.sim.scenario import make_companion_packages
    repo = tmp_path_factory.mktemp("hgx-repo") / "repo"
    shutil.copytree(packages["old"].parent, repo)
    make_companion_packages(repo)
    write_index(repo, verify=False)
    return repo


def _sandbox(tmp_path, hgx_repo):
    """The demo's shape: 4 NVSwitches (fabric manager wanted, its companion fetched with the driver), OLD
    applied through driverd."""
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "root"
    make_host(root, dgx_spec(gpus=2, nvswitches=4, nouveau=False))
    write_config(root, OLD, hgx_repo, extra="[companions]\nfetch = true\n")
    r = drv(root, "apply")
    assert r.returncode == 0, r.stderr
    return root


def _stop_fabricmanager(root) -> None:
    from driverd.sim.services import SimServices
    svc = SimServices(kernel_of(root))
    svc.stop("nv-fabricmanager")
    assert not svc.running("nv-fabricmanager") and svc.running("nvidia-persistenced")


def _plan(root) -> dict:
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_status_plan_and_the_daemons_pass_agree_on_a_stopped_fabric_manager(tmp_path, hgx_repo):
    root = _sandbox(tmp_path, hgx_repo)
    s, p = status(root), _plan(root)
    assert s["wanted"]["in_sync"] is True and p["verdict"] == "converged", (s["wanted"], p["steps"])
    assert "in sync" in drv(root, "status").stdout

    _stop_fabricmanager(root)
    p = _plan(root)
    assert p["verdict"] == "steps" and "start-fabricmanager" in [st["action"] for st in p["steps"]]
    s = status(root)
    w = s["wanted"]
    assert w["in_sync"] is False and w["verdict"] == p["verdict"], w
    assert any(d.startswith("start-fabricmanager") for d in w["differs"]), w
    text = drv(root, "status").stdout
    assert "in sync" not in text and "DIFFERS: start-fabricmanager" in text, text

    # the daemon's pass: the same planner finds the same step, starts fabric manager, and is converged
    from driverd.apply.reconcile import Reconciler
    from driverd.cli.context import Context
    from driverd import config
    import argparse
    args = argparse.Namespace(root=str(root), json=False, config=None, command="daemon")
    ctx = Context.from_args(args)
    cfg = config.load(Root(root), environ={})
    res = Reconciler(lambda c: ctx.step_context(c, "sim"), lambda *a, **k: None).reconcile(cfg)
    assert res.converged, res.reason
    (run,) = res.runs
    assert "start-fabricmanager" in [st["action"] for st in run["steps"]]
    assert status(root)["wanted"]["in_sync"] is True and _plan(root)["verdict"] == "converged"


def _restore_containerd_config(root) -> None:
    from driverd.sim.scenario import CONTAINERD_CONFIG
    (root / "etc/containerd/config.toml").write_text(CONTAINERD_CONFIG)


def _stop_persistenced(root) -> None:
    from driverd.sim.services import SimServices
    SimServices(kernel_of(root)).stop("nvidia-persistenced")


@pytest.mark.parametrize("drift,action", [(_stop_persistenced, "start-persistenced"),
                                          (_restore_containerd_config, "configure-runtime")])
def test_status_is_not_in_sync_where_the_plan_has_a_step(tmp_path, hgx_repo, drift, action):
    """Any step the plan would take, not only a different driver, means "not in sync"."""
    root = _sandbox(tmp_path, hgx_repo)
    drift(root)
    p = _plan(root)
    assert p["verdict"] == "steps" and action in [st["action"] for st in p["steps"]], p["steps"]
    w = status(root)["wanted"]
    assert w["in_sync"] is False and w["verdict"] == "steps" and action in w["plan"], w
    assert any(d.startswith(f"{action}: ") for d in w["differs"]), w
    assert drv(root, "apply").returncode == 0
    w = status(root)["wanted"]
    assert w["in_sync"] is True and w["differs"] == [] and _plan(root)["verdict"] == "converged", w


def test_a_blocked_plan_is_not_in_sync(tmp_path, hgx_repo):
    """An upgrade the GPU's users block: plan says blocked (exit 3), and so does status."""
    from tests.daemon.conftest import NEW
    root = _sandbox(tmp_path, hgx_repo)
    kernel_of(root).spawn("python3", ["/dev/nvidiactl", "/dev/nvidia0"], cmdline="python3 train.py")
    write_config(root, NEW, hgx_repo, extra="[companions]\nfetch = true\n")
    r = drv(root, "plan", "--json")
    assert r.returncode == 3, r.stderr
    p = json.loads(r.stdout)
    w = status(root)["wanted"]
    assert p["verdict"] == w["verdict"] == "blocked" and w["in_sync"] is False, (w, p)
    assert any(d.startswith("blocked: the GPU is in use by") for d in w["differs"]), w
    assert "DIFFERS: blocked: the GPU is in use by" in drv(root, "status").stdout
