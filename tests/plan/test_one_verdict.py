"""`driverd plan`, `driverd apply --dry-run`, `driverd status` and the daemon's reconcile pass reach the
same verdict for the same host, because one function (driverd.apply.hostplan.plan_for_host) decides for all.
Checked over every kind of host tree the tests have: the captured live hosts (real kernel boundary,
read-only trees) and simulated hosts in each state (fresh, converged, blocked, host-managed)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from driverd.root import Root
from driverd.runner import Runner
from tests.conftest import FIXTURES, run_cli

OLD, NEW = "535.261.03", "550.127.05"


def _config(root: Path, version: str, repo: Path | None = None, extra: str = "") -> None:
    p = root / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    repos = f'[packages]\nrepositories = ["file://{repo}"]\n' if repo else ""
    p.write_text(f'[driver]\nversion = "{version}"\nflavor = "{"open" if repo else "auto"}"\n{repos}[runtime]\nrestart = "none"\n{extra}')


def _sim_env(kernel: str) -> dict:
    return {"DRIVERD_MODULES_KERNEL": kernel}


def _plan_verdict(root: Path, env: dict) -> str:
    r = run_cli("--root", str(root), "--json", "plan", env=env)
    assert r.returncode in (0, 3), r.stderr
    return json.loads(r.stdout)["verdict"]


def _dry_run_verdict(root: Path, env: dict) -> str:
    r = run_cli("--root", str(root), "--json", "apply", "--dry-run", env=env)
    if r.returncode == 3 and "blocked" in r.stderr:
        return "blocked"
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    would = [s for s in out["steps"] if s["state"] != "in place" and s["action"] not in ("snapshot", "validate",
                                                                                          "check-parameters",
                                                                                          "check-signers",
                                                                                          "verify-package")]
    return "steps" if would else "converged"


def _reconcile_verdict(root: Path, kernel: str) -> tuple[str, object]:
    """The daemon's pass, in process, on the tree (the CLI's composition root picks the backends)."""
    from driverd.cli.context import Context
    from driverd.config import load
    from driverd.apply.reconcile import Reconciler
    before = os.environ.get("DRIVERD_MODULES_KERNEL")
    os.environ["DRIVERD_MODULES_KERNEL"] = kernel
    try:
        ctx = Context(Root(str(root)), False, False, None)
        cfg = load(ctx.root, None)
        res = Reconciler(lambda c: ctx.step_context(c), lambda *a, **k: None, lock_wait_s=5).reconcile(cfg)
    finally:
        if before is None:
            del os.environ["DRIVERD_MODULES_KERNEL"]
        else:
            os.environ["DRIVERD_MODULES_KERNEL"] = before
    if res.state == "blocked":
        return "blocked", res
    if res.state == "reboot-required":
        return "reboot-required", res
    return ("steps" if res.runs else "converged"), res


def _status_verdict(root: Path, env: dict) -> str:
    r = run_cli("--root", str(root), "--json", "status", env=env)
    assert r.returncode == 0, r.stderr
    w = json.loads(r.stdout)["wanted"]
    assert w["in_sync"] is (w["verdict"] == "converged"), w
    return w["verdict"]


def _all_three(root: Path, kernel: str) -> tuple[str, str, str, object]:
    """plan's, apply --dry-run's and the daemon's pass's verdicts; status's (issue 32) must be plan's."""
    env = _sim_env(kernel)
    p, d = _plan_verdict(root, env), _dry_run_verdict(root, env)
    assert _status_verdict(root, env) == p
    r, res = _reconcile_verdict(root, kernel)
    return p, d, r, res


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    from driverd.sim.scenario import make_packages
    d = tmp_path_factory.mktemp("repo")
    make_packages(d)
    return d


def _sim_host(tmp_path: Path, name: str, **kw) -> Path:
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / name
    make_host(root, dgx_spec(gpus=2, nvswitches=0, nic=False, **kw))
    return root


@pytest.mark.parametrize("capture", sorted(p.name for p in (FIXTURES / "hosts").glob("*.tar.gz")))
def test_captured_live_hosts_one_verdict(capture, unpack_host):
    """Every captured live host: plan, apply --dry-run and the daemon agree (real kernel boundary)."""
    root = unpack_host(capture)
    loaded = (root / "proc/driver/nvidia/version").is_file()
    version = "580.159.04" if loaded else "570.195.03"
    _config(root, version)
    p, d, r, res = _all_three(root, "real")
    assert p == d == r, (p, d, r, res.reason)
    if loaded:      # the driver another packager put there runs and works: converged, nothing written
        assert p == "converged" and res.converged, res.reason
        assert "left to the host (owner unknown)" in res.reason


def test_simulated_hosts_one_verdict(tmp_path, repo):
    fresh = _sim_host(tmp_path, "fresh", nouveau=False)
    _config(fresh, OLD, repo)
    assert _all_three(fresh, "sim")[:3] == ("steps",) * 3     # reconcile carried the steps out ...
    p, d, r, res = _all_three(fresh, "sim")                    # ... and now all three say converged
    assert (p, d, r) == ("converged",) * 3 and res.converged, res.reason
    assert "nvidia_modeset" not in (fresh / "proc/modules").read_text()   # no display GPU, nothing needs it

    # A GPU user the upgrade would have to stop, with unload_policy = refuse: blocked, all three.
    _config(fresh, NEW, repo)
    holder = fresh / "proc/4242"
    holder.mkdir()
    (holder / "comm").write_text("python3\n")
    (holder / "cmdline").write_bytes(b"python3\0train.py\0")
    (holder / "fd").mkdir()
    os.symlink("/dev/nvidia0", holder / "fd/3")
    p, d, r, res = _all_three(fresh, "sim")
    assert (p, d, r) == ("blocked",) * 3, res.reason
    assert "pid 4242" in res.reason
    shutil.rmtree(holder)


def test_host_managed_driver_is_left_alone(tmp_path):
    """A loaded driver with no module file on disk and no package record: under manage = auto the plan
    is empty, the daemon converges validating the modules that run, and nothing is written to the
    host's driver configuration."""
    from driverd.sim.hosttree import Module
    from driverd.sim.scenario import dgx_spec, make_host
    spec = dgx_spec(gpus=1, nvswitches=0, nic=False, nouveau=False)
    spec.modules += [Module("nvidia", 14299136, 0, ("nvidia_uvm",), "580.159.04"), Module("nvidia_uvm", 1830912, 0, (), "")]
    root = make_host(tmp_path / "managed", spec)
    from driverd.sim.hosttree import nvidia_version_line
    (root / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
    (root / "proc/driver/nvidia/version").write_text(nvidia_version_line("580.159.04", "open"))
    gdir = root / "proc/driver/nvidia/gpus/0000:18:00.0"
    gdir.mkdir(parents=True, exist_ok=True)
    (gdir / "information").write_text("Model: \t\t NVIDIA H100\n")
    _config(root, "580.159.04", extra='runtimes = ["none"]\n')     # (lands in [runtime])
    etc_before = sorted(str(p.relative_to(root)) for p in (root / "etc").rglob("*"))
    p, d, r, res = _all_three(root, "sim")
    assert (p, d, r) == ("converged",) * 3, res.reason
    assert res.converged and "nvidia, nvidia_uvm" in res.reason
    assert sorted(str(p.relative_to(root)) for p in (root / "etc").rglob("*")) == etc_before
