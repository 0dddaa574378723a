"""Which driver the daemon's own reconcile keeps in cluster mode (driverd/cluster/desired.py): a
changed desired driver never reaches a node that has one outside admission; only a joining node
installs its desired driver directly."""
from __future__ import annotations

from driverd.cluster import desired as dz
from driverd.cluster import model as m

X = {"version": "535.261.03", "flavor": "open"}
WANT = dz.Desired("570.195.03", "auto", "pool a100")


def test_a_node_with_a_driver_keeps_it_when_its_desired_driver_changes():
    k = dz.keep({}, X, WANT)
    assert (k.version, k.flavor, k.hold, k.joining) == ("535.261.03", "open", "", False)
    assert k.behind == "570.195.03/auto" and "waits for a rollout" in k.source and "pool a100" in k.source


def test_a_rebooted_node_loads_back_what_it_ran_not_its_new_desired_driver():
    # nothing loaded after the reboot; the record says what driverd last converged it to
    k = dz.keep({m.A_STATE: m.IDLE}, X, WANT)
    assert (k.version, k.joining) == ("535.261.03", False)
    # after a kernel update even the record may be all there is; with no record, the package installed
    # for the running kernel
    k = dz.keep({}, {"version": "550.1", "flavor": "open"}, WANT)
    assert (k.version, k.joining) == ("550.1", False)


def test_only_a_joining_node_installs_its_desired_driver():
    k = dz.keep({}, None, WANT)
    assert (k.version, k.flavor, k.joining, k.hold) == ("570.195.03", "auto", True, "")
    assert "pool a100" in k.source


def test_a_joining_node_without_a_usable_desired_driver_waits():
    k = dz.keep({}, None, dz.Desired(None, "", "pools", why="pools a and b both select it"))
    assert k.joining and k.version is None and "pools a and b both select it" in k.hold


def test_the_rollout_record_still_wins():
    # mid-rollout and done: the target; failed: what ran when it failed — whatever the host or pool say
    assert dz.keep({m.A_STATE: m.EVICTING, m.A_TARGET: "550.2/open"}, X, WANT).version == "550.2"
    assert dz.keep({m.A_STATE: m.DONE, m.A_TARGET: "550.2/open"}, None, WANT).version == "550.2"
    assert dz.keep({m.A_STATE: m.FAILED, m.A_PINNED: "535.3/open"}, X, WANT).version == "535.3"
    # a record that names no driver pins nothing
    assert dz.keep({m.A_STATE: m.DONE}, X, WANT).version == "535.261.03"
