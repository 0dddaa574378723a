"""Issue 42: in a cluster only a rollout changes a node's driver settings, so a DriverRollout of the
driver the node already runs must carry a settings change: the node's preflight answers `needed` for a
change of any driver setting (config.DRIVER_SETTINGS) against what the node last converged to, and
`needed: False` when nothing differs. The node agent's own path: LocalHost over a simulated host that
the daemon's pass converged (which records the settings it converged with)."""
from __future__ import annotations

import shutil

import pytest

from driverd.config import DRIVER_SETTINGS, SCHEMA
from driverd.sim.fleethosts import CONFIG, OLD
from driverd.sim.scenario import RELEASE

# A rollout names its driver version itself (driver_config overrides the node's driver.version with it):
# the configuration's version is no setting a rollout of the same version could carry.
NOT_A_ROLLOUT_SETTING = {"driver.version"}
SETTINGS = [k for k in DRIVER_SETTINGS if k not in NOT_A_ROLLOUT_SETTING]

# Values an operator would write where the type alone does not give one (free text), or where the first
# other choice is not what one would set on this node: it has no NVSwitch and no NVLink5 fabric, so a fabric
# manager and IMEX are turned off (the fleet's other nodes may have them), never forced on.
OPERATOR_VALUES = {"userspace.root": "/srv/driverd/driver", "userspace.package": "/srv/driverd/userspace",
                   "daemons.fabricmanager": "false", "daemons.imex": "false"}


def changed_value(key: str, current):
    """A value of `key` other than the converged one, as a ConfigMap edit would set it. `auto` is never
    chosen: it lets the node decide, which may well be what it runs (the flavour open on an H100)."""
    spec = SCHEMA[key]
    if key in OPERATOR_VALUES:
        return OPERATOR_VALUES[key]
    if spec.type == "bool":
        return True if current is None else not current
    if spec.type == "int":
        return current * 4 if current else 60
    if spec.type == "params":
        return {"nvidia": {"NVreg_EnableGpuFirmware": "0"}}
    assert spec.choices(), f"a new driver setting {key} ({spec.type}): give it a changed value in OPERATOR_VALUES"
    return next(c for c in spec.choices() if c not in (current, "auto"))


@pytest.fixture(scope="module")
def converged(tmp_path_factory):
    """A GPU node on driver OLD (open), converged by the daemon's pass with a simulated fleet node's
    configuration (every other driver setting at its default)."""
    from driverd.repo.index import write_index
    from driverd.sim import install_backends
    from driverd.sim.fakepkg import make_fake_package
    from driverd.sim.hosttree import HostSpec, h100, write_host
    from driverd.sim.scenario import CONTAINERD_CONFIG, make_userspace_packages
    install_backends()
    work = tmp_path_factory.mktemp("preflight-settings")
    repo, root = work / "repo", work / "converged"
    make_fake_package(repo, OLD, RELEASE)
    make_fake_package(repo, OLD, RELEASE, flavor="proprietary")     # the other flavour of the same version
    write_index(repo)
    write_host(root, HostSpec(release=RELEASE, pci=[h100("0000:18:00.0", None, 0)], hostname="gpu",
                              files={"/etc/containerd/config.toml": CONTAINERD_CONFIG, "/usr/bin/containerd": ""}))
    (root / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (root / "etc/driverd/config.toml").write_text(CONFIG.format(version=OLD, repo=repo))
    # the user-space packages userspace.package may name (a directory of them on the host)
    make_userspace_packages(root / OPERATOR_VALUES["userspace.package"].lstrip("/"), versions=(OLD,))
    host, cfg = _node(root)
    res = host.transact(cfg)
    assert res.state in ("done", "converged", "nothing-to-do"), res
    from driverd.apply import fingerprint as fpr
    assert fpr.recorded_settings(fpr.read(host.make_context(cfg).root, cfg)) == cfg.driver_settings()
    return root


def _node(root):
    """The node agent's host (cluster/nodehost.LocalHost, its reconciler a cluster-mode daemon's) and the
    node's configuration."""
    from driverd.apply import lifecycle as lc
    from driverd.apply.reconcile import Reconciler
    from driverd.cluster.nodehost import LocalHost
    from driverd.config import load
    from driverd.root import Root
    from driverd.runner import Runner
    r = Root(str(root))

    def make_context(c):
        return lc.make_context(r, Runner(), c, "sim", log=lambda *a, **k: None)
    return LocalHost(make_context, Reconciler(make_context, lambda *a, **k: None, reload_drift=False)), \
        load(r, None, environ={})


@pytest.fixture
def node(converged, tmp_path):
    """A copy of the converged node: a preflight must not change its host, and no test sees another's."""
    root = tmp_path / "node"
    shutil.copytree(converged, root, symlinks=True)
    return _node(root)


def _preflight(host, cfg) -> dict:
    # the rollout of the driver the node runs, as `kubectl driverd rollout start --driver OLD` makes it
    return host.preflight(cfg, "same-driver/1", OLD, "auto", leaving=set(), staying={})


def test_a_rollout_of_the_running_driver_is_not_needed_when_no_setting_differs(node):
    host, cfg = node
    answer = _preflight(host, cfg)
    assert answer["ok"] and answer["needed"] is False, answer
    assert answer["reasons"] == [f"already runs {OLD} (open) with the configured settings"]


@pytest.mark.parametrize("key", SETTINGS)
def test_a_rollout_of_the_running_driver_is_needed_when_a_driver_setting_differs(node, key):
    host, cfg = node
    edited = cfg.with_overrides({key: changed_value(key, cfg[key])}, source="the ConfigMap")
    assert edited[key] != cfg[key]
    answer = _preflight(host, edited)
    # ok as well: each value is one this node can take, so the rollout goes ahead and applies it drained
    assert answer["needed"] is True and answer["ok"] is True, answer
    if key == "driver.flavor":
        # the other flavour of the same version is another driver: the rollout installs that package
        assert answer["flavor"] == edited[key] and answer["reasons"][0].startswith(f"package {OLD}/{edited[key]} ")
    else:
        assert answer["reasons"][0].startswith(f"runs {OLD} (open) with other settings than configured: {key}"), \
            answer


def test_every_driver_setting_but_the_version_is_covered():
    """A setting added to the schema is covered by the parametrization above without a word here."""
    assert set(DRIVER_SETTINGS) - set(SETTINGS) == NOT_A_ROLLOUT_SETTING
