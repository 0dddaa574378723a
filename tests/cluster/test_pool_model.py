"""DriverPools as pure functions (driverd/cluster/pools.py): which pool a node belongs to, overlap,
which rollout may take which node, when a pool needs its next rollout, and its status."""
from __future__ import annotations

import pytest

from driverd.cluster import model as m
from driverd.cluster import pools as pl

OLD, NEW = "535.261.03", "550.127.05"
NOW = "2026-01-01T00:00:00Z"


def pool(name, driver=NEW, selector=None, uid=None, **spec) -> dict:
    return {"apiVersion": pl.API_VERSION, "kind": pl.KIND,
            "metadata": {"name": name, "uid": uid or f"uid-{name}", "generation": 1},
            "spec": {"driver": driver, "nodeSelector": {"matchLabels": selector if selector is not None
                                                       else {"pool": name}}, **spec}}


def node(name, driver=OLD, labels=None, ann=None, ready=True) -> m.NodeView:
    lab = dict(labels or {})
    if driver:
        lab.update({m.L_VERSION: driver, m.L_FLAVOR: "open"})
    return m.NodeView.from_node({"metadata": {"name": name, "labels": lab, "annotations": ann or {}},
                                 "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})


def rollout_of(p: pl.Pool, rev: int, *, phase=None, gen=1, driver=None, uid=None) -> dict:
    o = pl.rollout_object(p, rev)
    o["metadata"].update(uid=uid or f"r-uid-{rev}", generation=gen, creationTimestamp=f"2026-01-01T00:00:0{rev}Z")
    if driver:
        o["spec"]["driver"] = driver
    if phase:
        o["status"] = {"phase": phase, "observedGeneration": gen}
    return o


def test_nodes_are_assigned_to_one_pool_or_none_and_overlap_names_both_pools():
    a100, h100 = pl.Pool.from_object(pool("a100")), pl.Pool.from_object(pool("h100"))
    wide = pl.Pool.from_object(pool("wide", selector={"zone": "z1"}))
    views = [node("n1", labels={"pool": "a100"}), node("n2", labels={"pool": "h100", "zone": "z1"}),
             node("n3", labels={"pool": "x"})]
    a = pl.assign([a100, h100, wide], views)
    assert [v.name for v in a.members["a100"]] == ["n1"]
    assert a.members["h100"] == [] and a.members["wide"] == []
    assert a.overlapped == {"n2": ["h100", "wide"]}
    assert a.conflicts["h100"] == {"wide": ["n2"]} and a.conflicts["wide"] == {"h100": ["n2"]}
    assert a.conflicts["a100"] == {}
    assert [v.name for v in a.free] == ["n3"]


def test_desired_driver_is_the_pools_then_the_configurations_and_none_when_pools_overlap():
    a100 = pl.Pool.from_object(pool("a100", flavor="open"))
    wide = pl.Pool.from_object(pool("wide", driver="570.1", selector={}))
    d = pl.desired_for({"pool": "a100"}, [a100], "1.0", "auto")
    assert (d.version, d.flavor, d.source) == (NEW, "open", "pool a100")
    d = pl.desired_for({"pool": "b"}, [a100], "1.0", "auto")
    assert (d.version, d.source) == ("1.0", "configuration")
    d = pl.desired_for({"pool": "a100"}, [a100, wide], "1.0", "auto")
    assert d.version is None and "a100 and wide" in d.why
    assert pl.desired_for({}, [], None, "auto").why


def test_a_pools_rollout_takes_its_members_only_and_any_other_rollout_only_nodes_in_no_pool():
    a100, wide = pl.Pool.from_object(pool("a100")), pl.Pool.from_object(pool("wide", selector={"zone": "z1"}))
    ro = pl.rollout_object(a100, 1)
    plain = {"metadata": {"name": "r"}, "spec": {"driver": NEW}}        # selects every node
    assert pl.takes(ro, {"pool": "a100"}, [a100, wide])
    assert not pl.takes(ro, {"pool": "a100", "zone": "z1"}, [a100, wide])    # overlapped: nobody's
    assert not pl.takes(ro, {"pool": "b"}, [a100, wide])                       # not selected
    assert not pl.takes(plain, {"pool": "a100"}, [a100, wide])
    assert pl.takes(plain, {"pool": "b"}, [a100, wide])
    # a rollout owned by a pool that does not exist (any more) takes no node
    assert not pl.takes(ro, {"pool": "a100"}, [wide])


def test_the_pools_rollout_is_a_copy_of_its_spec_owned_by_it():
    p = pl.Pool.from_object(pool("a100", maxParallel=3, canary=1))
    o = pl.rollout_object(p, 4)
    assert o["metadata"]["name"] == "a100-4" and o["metadata"]["labels"] == {pl.L_POOL: "a100"}
    assert o["metadata"]["annotations"] == {pl.A_REVISION: "4"}
    assert o["metadata"]["ownerReferences"] == [{"apiVersion": pl.API_VERSION, "kind": "DriverPool",
                                                 "name": "a100", "uid": "uid-a100", "controller": True}]
    assert o["spec"] == p.obj["spec"] and pl.owner(o) == ("a100", "uid-a100")


def test_an_invalid_pool_names_the_field_and_the_pools_fix():
    with pytest.raises(pl.PoolSpecError) as e:
        pl.Pool.from_object(pool("a100", maxUnavailable="0%"))
    assert e.value.field == "maxUnavailable" and "kubectl edit driverpool a100" in e.value.one_line()
    good, bad = pl.read([pool("a100", maxUnavailable="0%"), pool("b")])
    assert [p.name for p in good] == ["b"] and "maxUnavailable" in bad["a100"]


def test_changing_a_pools_driver_creates_the_next_revision_and_supersedes_the_running_one():
    p = pl.Pool.from_object(pool("a100", driver="570.1"))
    views = [node("n1", labels={"pool": "a100"}, driver=NEW), node("n2", labels={"pool": "a100"}, driver=NEW)]
    a = pl.assign([p], views)
    running = rollout_of(p, 1, phase="Progressing", driver=NEW)
    plan = pl.plan(p, a, [running], now=NOW)
    assert [o["metadata"]["name"] for o in plan.supersede] == ["a100-1"]
    assert plan.create["metadata"]["name"] == "a100-2" and plan.create["spec"]["driver"] == "570.1"
    assert plan.status["rollout"] == "a100-2" and plan.status["nodes"]["behind"] == 2
    # a first pool over nodes on another driver: revision 1
    plan = pl.plan(p, a, [], now=NOW)
    assert plan.create["metadata"]["name"] == "a100-1" and not plan.supersede


def test_no_rollout_while_the_current_one_runs_or_all_run_the_driver():
    p = pl.Pool.from_object(pool("a100"))
    behind = [node("n1", labels={"pool": "a100"})]
    assert pl.plan(p, pl.assign([p], behind), [rollout_of(p, 1, phase="Progressing")], now=NOW).create is None
    current = [node("n1", labels={"pool": "a100"}, driver=NEW)]
    plan = pl.plan(p, pl.assign([p], current), [], now=NOW)
    assert plan.create is None and plan.status["nodes"] == {"total": 1, "current": 1, "behind": 0, "joining": 0,
                                                            "overlapped": 0}
    assert {c["type"]: c["status"] for c in plan.status["conditions"]} == {"Converged": "True", "Overlap": "False"}


def test_a_node_new_to_the_pool_gets_a_new_revision_once_but_never_a_loop():
    p = pl.Pool.from_object(pool("a100"))
    done = rollout_of(p, 1, phase="Completed")
    ident = "a100-1/r-uid-1"
    # n2 came into the pool (a label changed) after revision 1 completed, on the old driver
    views = [node("n1", labels={"pool": "a100"}, driver=NEW, ann={m.A_STATE: m.DONE, m.A_ROLLOUT: ident + "/1"}),
             node("n2", labels={"pool": "a100"})]
    plan = pl.plan(p, pl.assign([p], views), [done], now=NOW)
    assert plan.create["metadata"]["name"] == "a100-2"
    # a node revision 1 dealt with — failed there, refused by its preflight, silent — makes none
    for ann, st in (({m.A_STATE: m.FAILED, m.A_ROLLOUT: ident + "/1"}, {}),
                    ({m.A_PREFLIGHT: '{"rollout": "%s/1", "ok": false, "reasons": ["no package"]}' % ident}, {}),
                    ({}, {"preflightFailures": [{"node": "n2", "reason": "did not answer"}]})):
        done = rollout_of(p, 1, phase="Completed")
        done["status"].update(st)
        views = [node("n2", labels={"pool": "a100"}, ann=ann)]
        assert pl.plan(p, pl.assign([p], views), [done], now=NOW).create is None, ann or st
    # skipped and joining nodes need no rollout
    views = [node("n3", labels={"pool": "a100"}, ann={m.A_SKIP: "true"}), node("n4", driver=None,
                                                                               labels={"pool": "a100"})]
    plan = pl.plan(p, pl.assign([p], views), [], now=NOW)
    assert plan.create is None
    why = {b["node"]: b["reason"] for b in plan.status["behindNodes"]}
    assert why["n3"].startswith("skipped") and why["n4"].startswith("no driver yet: joining")
    assert plan.status["nodes"]["joining"] == 1


def test_a_completed_status_over_nodes_that_only_answered_yes_does_not_strand_the_pool():
    """Issue 44: once every node of revision 1 had answered its preflight (yes, the driver is needed), a
    node holding the Lease wrote `phase: Completed` on it; no node was ever admitted. Before the fix the
    answers counted as dealt with: no next revision, the pool's nodes never got its driver."""
    p = pl.Pool.from_object(pool("a100"))
    ident = "a100-1/r-uid-1"
    yes = {m.A_PREFLIGHT: '{"rollout": "%s/1", "ok": true, "needed": true}' % ident}
    views = [node(f"n{i}", labels={"pool": "a100"}, ann=yes) for i in range(3)]
    for phase in ("Completed", "Failed"):
        plan = pl.plan(p, pl.assign([p], views), [rollout_of(p, 1, phase=phase)], now=NOW)
        assert plan.create is not None and plan.create["metadata"]["name"] == "a100-2", phase
        assert plan.status["nodes"]["behind"] == 3
    # an aborted or refused revision dealt with them: a new one would only repeat it
    for phase in ("Aborted", "Refused"):
        assert pl.plan(p, pl.assign([p], views), [rollout_of(p, 1, phase=phase)], now=NOW).create is None, phase
    # a node that says it needs nothing (already on the driver by its own account) is dealt with
    nothing = {m.A_PREFLIGHT: '{"rollout": "%s/1", "ok": true, "needed": false}' % ident}
    views = [node("n1", labels={"pool": "a100"}, ann=nothing)]
    assert pl.plan(p, pl.assign([p], views), [rollout_of(p, 1, phase="Completed")], now=NOW).create is None


def test_overlapping_pools_start_no_rollout_and_both_say_so():
    a100, wide = pl.Pool.from_object(pool("a100")), pl.Pool.from_object(pool("wide", selector={"zone": "z1"}))
    views = [node("n1", labels={"pool": "a100"}), node("n2", labels={"pool": "a100", "zone": "z1"})]
    a = pl.assign([a100, wide], views)
    for p, other in ((a100, "wide"), (wide, "a100")):
        plan = pl.plan(p, a, [], now=NOW)
        assert plan.create is None
        cond = {c["type"]: c for c in plan.status["conditions"]}["Overlap"]
        assert cond["status"] == "True" and cond["reason"] == "ConflictingNodeSelector"
        assert f"pool {other} also selects n2" in cond["message"]
        why = {b["node"]: b["reason"] for b in plan.status["behindNodes"]}
        assert why["n2"].startswith(f"also selected by pool {other}")
    assert pl.plan(a100, a, [], now=NOW).status["nodes"]["overlapped"] == 1


def test_behind_nodes_say_why_and_conditions_keep_their_transition_time():
    p = pl.Pool.from_object(pool("a100"))
    ro = rollout_of(p, 1, phase="Progressing")
    ro["status"]["reason"] = "Progressing"
    ident = f"a100-1/r-uid-1/1"
    views = [node("n1", labels={"pool": "a100"}, ann={m.A_STATE: m.EVICTING, m.A_ROLLOUT: ident, m.A_REASON: "Evicting"}),
             node("n2", labels={"pool": "a100"}, ann={m.A_STATE: m.FAILED, m.A_ROLLOUT: ident,
                                                      m.A_REASON: "RolledBack", m.A_MESSAGE: "load failed"}),
             node("n3", labels={"pool": "a100"}, ready=False),
             node("n4", labels={"pool": "a100"})]
    st = pl.plan(p, pl.assign([p], views), [ro], now=NOW).status
    why = {b["node"]: b["reason"] for b in st["behindNodes"]}
    assert why["n1"] == "upgrading in rollout a100-1: evicting (Evicting)"
    assert why["n2"] == "failed in rollout a100-1: RolledBack: load failed"
    assert why["n3"].startswith("NotReady")
    assert why["n4"] == "waiting in rollout a100-1 (Progressing: Progressing)"
    conv = {c["type"]: c for c in st["conditions"]}["Converged"]
    assert (conv["status"], conv["reason"], conv["lastTransitionTime"]) == ("False", "RollingOut", NOW)
    later = pl.plan(p, pl.assign([p], views), [ro], now="2026-01-02T00:00:00Z", previous=st).status
    assert {c["type"]: c for c in later["conditions"]}["Converged"]["lastTransitionTime"] == NOW


def test_settings_waiting_on_members_start_one_revision_per_edit():
    """Issue 42: a ConfigMap edit of driver settings (module parameters, module set, unload policy) waits on
    a pool member until a rollout applies it — and a hand-made rollout cannot take pool members. The pool
    itself starts the next revision for it (its drain, canary and limits), once per edit: never a loop."""
    p = pl.Pool.from_object(pool("a100"))
    ident = "a100-1/r-uid-1"
    wait = {m.A_WAITING: 'configuration: modules.parameters.nvidia.NVreg_EnableGpuFirmware: (unset) -> "0"',
            m.A_STATE: m.DONE, m.A_ROLLOUT: ident + "/1"}
    views = [node("n1", labels={"pool": "a100"}, driver=NEW, ann=wait),
             node("n2", labels={"pool": "a100"}, driver=NEW)]
    done = rollout_of(p, 1, phase="Completed")
    plan = pl.plan(p, pl.assign([p], views), [done], now=NOW)
    assert plan.create is not None and plan.create["metadata"]["name"] == "a100-2", plan.status
    made_for = plan.create["metadata"]["annotations"][pl.A_SETTINGS]
    assert made_for and plan.create["spec"]["driver"] == NEW
    b = {x["node"]: x["reason"] for x in plan.status["behindNodes"]}
    assert list(b) == ["n1"] and "NVreg_EnableGpuFirmware" in b["n1"] and "in rollout a100-2" in b["n1"]
    assert plan.status["nodes"]["current"] == 1
    # while revision 2 runs, and after it ended with the same settings still waiting: no third revision
    for phase in ("Progressing", "Completed", "Failed"):
        r2 = rollout_of(p, 2, phase=phase)
        r2["metadata"]["annotations"][pl.A_SETTINGS] = made_for
        plan = pl.plan(p, pl.assign([p], views), [done, r2], now=NOW)
        assert plan.create is None, phase
    assert "the next edit of the settings starts another revision" in \
        {x["node"]: x["reason"] for x in plan.status["behindNodes"]}["n1"]
    # another edit after it: the next revision
    views[0] = node("n1", labels={"pool": "a100"}, driver=NEW,
                    ann=wait | {m.A_WAITING: "configuration: modules.load_drm: (unset) -> true"})
    plan = pl.plan(p, pl.assign([p], views), [done, r2], now=NOW)
    assert plan.create["metadata"]["name"] == "a100-3"
    # a skipped node's settings, or a node on another driver (the driver's revision carries them), start none
    views = [node("n1", labels={"pool": "a100"}, driver=NEW, ann=wait | {m.A_SKIP: "true"})]
    assert pl.plan(p, pl.assign([p], views), [done], now=NOW).create is None
    # none waiting: converged
    plan = pl.plan(p, pl.assign([p], [node("n2", labels={"pool": "a100"}, driver=NEW)]), [done], now=NOW)
    assert plan.create is None and plan.status["nodes"]["behind"] == 0
