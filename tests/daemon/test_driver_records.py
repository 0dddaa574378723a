"""The driver is one thing in driverd's records (issue 45): the converged fingerprint covers both halves
(a user-space-only change is not the container's fast path), the last converge has one record (the
cluster side and the fast path read the same driver), and a host converged by the previous driverd is
read as converged."""
from __future__ import annotations

import json
import os
import re

from driverd.build.userspace import build_from_run_dir
from tests.apply.test_userspace_txn import USDIR, gpus, in_use, us_package
from tests.daemon.conftest import OLD, journal_runs, write_config
from tests.packages import usfake

ON = '[validation]\nworkload = "on"\nworkload_timeout_s = 20\n'
FAST = re.escape(f"fast path: driver {OLD} (open) is loaded and valid")
CHANGED = re.escape("no fast path: the configuration, kernel or installed driver (package or user-space) changed")


def _rebuilt(node, version: str, into: str):
    """Another build of `version`'s user-space (its firmware differs): another package of the same version."""
    d = usfake.run_dir(node.parent / f"rebuilt-{os.urandom(3).hex()}", version,
                       rm_file=node / "proc/driver/nvidia/version", gpus=tuple(gpus(node)))
    fw = d / "firmware" / "gsp_ga10x.bin"
    fw.write_bytes(fw.read_bytes() + b"rebuilt\n")
    out = node / into.lstrip("/")
    out.mkdir(parents=True, exist_ok=True)
    return build_from_run_dir(d, out).ref


def _restart(node, daemons, expect: str):
    env = {"DRIVERD_ROOT": str(node)}
    d = daemons(node, "container-entrypoint", env=env, root_arg=False)
    d.wait_notify("READY=1", 90)
    d.wait_log(expect, 30)
    assert d.stop()[0] == 0
    return d


def test_a_userspace_only_change_is_not_the_fast_path(node, packages, daemons):
    repo = packages["old"].parent
    first = us_package(node, OLD)
    write_config(node, OLD, repo, extra=f'[userspace]\npackage = "{USDIR}"\n{ON}')
    _restart(node, daemons, re.escape("no fast path: no converged state is recorded"))
    assert in_use(node) == first.sha256
    _restart(node, daemons, FAST)                            # nothing changed: the fast path

    # The configuration names another build of the same version: only the user-space differs.
    second = _rebuilt(node, OLD, "/var/cache/driverd-userspace-2")
    assert second.sha256 != first.sha256
    write_config(node, OLD, repo, extra=f'[userspace]\npackage = "/var/cache/driverd-userspace-2"\n{ON}')
    _restart(node, daemons, CHANGED)
    assert in_use(node) == second.sha256
    assert journal_runs(node)[-1]["command"] == "apply"
    _restart(node, daemons, FAST)

    # The tree in use damaged behind driverd's back (a file of it gone): not ready at once on it either.
    tree = node / "var/lib/driverd/driver/current"
    victim = next(p for p in sorted((tree / "firmware").rglob("*")) if p.is_file())
    victim.unlink()
    _restart(node, daemons, CHANGED)
    assert victim.is_file() and in_use(node) == second.sha256


def test_the_cluster_side_reads_the_driver_of_the_last_converge(node, packages, daemons):
    """A host converged to OLD by a host-mode daemon, with a stale record of an older driverd's cluster mode
    (node-driver.json names another driver) and nothing loaded (a reboot): the driver it has is OLD, the
    converge's, for the cluster side as for the fast path and the reboot gate."""
    from driverd.config import load as load_config
    from driverd.driver.ident import DriverId
    from driverd.driver.state import DriverState
    from driverd.install import rebootgate as rg
    from driverd.root import Root
    from tests.daemon.conftest import kernel_of
    repo = packages["old"].parent
    write_config(node, OLD, repo)
    _restart(node, daemons, re.escape("no fast path: no converged state is recorded"))
    rec = json.loads((node / "var/lib/driverd/daemon/converged.json").read_text())
    assert rec["driver"] == {"version": OLD, "flavor": "open"}
    (node / "var/lib/driverd/node-driver.json").write_text(json.dumps({"version": "525.147.05", "flavor": "open"}))
    kernel_of(node).reboot()
    cfg = load_config(Root(node), environ={})
    state = DriverState.from_config(Root(node), cfg, kernel_of(node).release)
    assert state.loaded() is None
    assert state.has() == state.last_converged() == DriverId(OLD, "open")
    assert rg.wanted_driver(Root(node), cfg, None)["version"] == OLD
    # only an older driverd's record: it is read
    (node / "var/lib/driverd/daemon/converged.json").unlink()
    assert state.has() == DriverId("525.147.05", "open")


FIXTURE = "tests/fixtures/converged-by-driverd-0.x.tar.xz"


def test_a_host_converged_by_the_previous_driverd_is_read_as_converged(tmp_path):
    """FIXTURE: a simulated host converged (driver 535.261.03 open, driverd's user-space of that version) by
    the driverd before issue 45 (commit 82863cb: its container entrypoint, two starts, the second on the fast
    path), packed as it left it. Its records are read as they are: the plan is empty, the record of the
    converge is about this host (the fast path's test), and a damaged user-space still is not."""
    from driverd import safetar
    from driverd.apply import fingerprint as fpr
    from driverd.apply import lifecycle as lc
    from driverd.config import load as load_config
    from driverd.root import Root
    from driverd.runner import Runner
    from tests.conftest import REPO
    from tests.apply.conftest import drv
    safetar.extract_file(REPO / FIXTURE, tmp_path, links="rooted")
    node = tmp_path / "root"
    cfg_file = node / "etc/driverd/config.toml"
    # its stand-in libraries answer for the path of the version file where the fixture was made: no CUDA
    # check here (validation.* is not part of what a converge fingerprints)
    cfg_file.write_text(cfg_file.read_text().replace('workload = "on"', 'workload = "off"'))
    rec = json.loads((node / "var/lib/driverd/daemon/converged.json").read_text())
    assert "userspace_sha256" not in rec                   # the previous format

    plan = json.loads(drv(node, "plan", "--json").stdout)
    assert plan["verdict"] == "converged" and not plan["steps"], plan
    cfg = load_config(Root(node), environ={})
    sctx = lc.make_context(Root(node), Runner(), cfg, "sim")
    assert fpr.matches(rec, sctx, cfg)

    tree = node / "var/lib/driverd/driver/current"
    next(p for p in sorted((tree / "firmware").rglob("*")) if p.is_file()).unlink()
    assert not fpr.matches(rec, sctx, cfg)
