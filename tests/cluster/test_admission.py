"""Admission as a function: the limits hold for any fleet, nodes go in a fixed order, nothing starts
before the preflight, failures spend the budget, canaries go first."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from driverd.cluster import model as m
from driverd.cluster.admission import PREFLIGHT_DEADLINE_S, decide, reopened
from driverd.cluster.kube import parse_time


def rollout(**spec) -> m.Rollout:
    base = {"driver": "550.127.05", "maxParallel": 2, "maxUnavailable": 2}
    base.update(spec)
    return m.Rollout.from_object({"metadata": {"name": "r", "generation": 1}, "spec": base})


def node(name, *, state=None, ready=True, cordoned=False, pre=True, needed=True, labels=None, skip=False,
         retry=None, rollout_key="r/1", since=None, ready_since="") -> m.NodeView:
    ann = {}
    if state:
        ann.update({m.A_STATE: state, m.A_ROLLOUT: rollout_key})
    if since:
        ann[m.A_SINCE] = since
    if pre is not None:
        ann[m.A_PREFLIGHT] = json.dumps({"rollout": rollout_key, "ok": pre, "needed": needed,
                                         "reasons": [] if pre else ["no package for kernel 6.1.0-47"]})
    if skip:
        ann[m.A_SKIP] = "true"
    if retry:
        ann[m.A_RETRY] = retry
    return m.NodeView.from_node({"metadata": {"name": name, "annotations": ann, "labels": labels or {}},
                                 "spec": {"unschedulable": cordoned},
                                 "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                                            "lastTransitionTime": ready_since}]}})


def test_admits_in_name_order_up_to_max_parallel():
    d = decide(rollout(maxParallel=2, maxUnavailable=5), [node(f"n{i}") for i in (3, 1, 2, 0)], now=0, started=0)
    assert d.admit == ["n0", "n1"]
    assert d.phase == "Progressing"


def test_unavailable_nodes_count_against_the_limit():
    nodes = [node("a", cordoned=True), node("b", ready=False), node("c"), node("d"), node("e")]
    d = decide(rollout(maxParallel=5, maxUnavailable=3), nodes, now=0, started=0)
    # a is cordoned by an admin (already unavailable: admitting it costs nothing), b is NotReady (never
    # admitted), c fills the limit of 3 unavailable
    assert d.admit == ["a", "c"]
    assert d.unavailable == 3


def test_percentage_rounds_down_but_never_below_one():
    assert rollout(maxUnavailable="5%").unavailable_limit(500) == 25
    assert rollout(maxUnavailable="5%").unavailable_limit(10) == 1
    assert rollout(maxUnavailable="33%").unavailable_limit(10) == 3


def test_nothing_starts_before_every_preflight_answer():
    d = decide(rollout(), [node("a"), node("b", pre=None)], now=10, started=0)
    assert d.admit == [] and d.phase == "Preflight" and d.waiting == ["b"]
    late = decide(rollout(preflight="Exclude"), [node("a"), node("b", pre=None)], now=PREFLIGHT_DEADLINE_S + 1,
                  started=0)
    assert late.admit == ["a"]
    assert "did not answer the preflight" in late.excluded[0]["reason"]


def test_refuse_policy_names_the_nodes_that_would_fail():
    d = decide(rollout(), [node("a"), node("b", pre=False)], now=0, started=0)
    assert d.phase == "Refused" and d.admit == []
    assert "b: no package for kernel 6.1.0-47" in d.message
    ex = decide(rollout(preflight="Exclude"), [node("a"), node("b", pre=False)], now=0, started=0)
    assert ex.admit == ["a"] and ex.counts["excluded"] == 1


def test_up_to_date_nodes_are_done_without_admission():
    d = decide(rollout(), [node("a", needed=False), node("b")], now=0, started=0)
    assert d.admit == ["b"] and d.counts["done"] == 1


def test_failure_budget_pauses_with_the_reason():
    nodes = [node("a", state=m.FAILED), node("b", state=m.FAILED), node("c")]
    d = decide(rollout(failureBudget=1), nodes, now=0, started=0)
    assert d.phase == "Paused" and d.reason == "FailureBudgetSpent" and d.admit == []
    assert "retry with `kubectl driverd node retry NODE`" in d.message
    ok = decide(rollout(failureBudget=2), nodes, now=0, started=0)
    assert ok.admit == ["c"]
    retried = decide(rollout(failureBudget=0), [node("a", state=m.FAILED, retry="now"), node("c")], now=0, started=0)
    assert retried.admit == ["a", "c"]


LONG_AGO = "2026-01-01T00:00:00Z"
LATER = parse_time(LONG_AGO) + 3600         # an hour after it: past any notReadyTimeoutSeconds used here


def test_any_node_not_upgrading_that_is_not_ready_past_the_bound_leaves_the_budget():
    """Issue 33: a failed node that stays NotReady held maxUnavailable for ever (`1/1 unavailable, 1
    failed`, healthy nodes idle); it leaves the count as a pending one does, and still counts as failed."""
    r = rollout(maxParallel=1, maxUnavailable=1, failureBudget=1, notReadyTimeoutSeconds=60)
    nodes = [node("a", state=m.FAILED, ready=False, ready_since=LONG_AGO), node("b"), node("c")]
    d = decide(r, nodes, now=LATER, started=LATER)
    assert d.admit == ["b"] and d.counts["failed"] == 1 and d.unavailable == 1
    assert [n["node"] for n in d.not_ready] == ["a"] and "a" in d.message
    # within the bound it still counts (and holds the one slot)
    soon = decide(r, nodes, now=parse_time(LONG_AGO) + 30, started=LATER)
    assert soon.admit == [] and soon.unavailable == 1 and soon.not_ready == []
    # a done node or a skipped one NotReady for good is gone as well; one being upgraded is not
    others = [node("d", state=m.DONE, ready=False, ready_since=LONG_AGO),
              node("s", skip=True, ready=False, ready_since=LONG_AGO), node("b")]
    assert decide(r, others, now=LATER, started=LATER).admit == ["b"]
    upgrading = [node("u", state=m.VALIDATING, ready=False, ready_since=LONG_AGO), node("b")]
    u = decide(rollout(maxParallel=2, maxUnavailable=1, notReadyTimeoutSeconds=60), upgrading, now=LATER, started=LATER)
    assert u.admit == [] and u.unavailable == 1 and u.not_ready == []
    # the failure budget still counts the gone failed node
    spent = decide(rollout(failureBudget=0, notReadyTimeoutSeconds=60), nodes, now=LATER, started=LATER)
    assert spent.phase == "Paused" and spent.reason == "FailureBudgetSpent" and spent.admit == []
    # everything else done: the rollout ends Failed naming the failed node, not Paused/NodesNotReady
    end = decide(r, [nodes[0], node("b", state=m.DONE), node("c", state=m.DONE)], now=LATER, started=LATER)
    assert (end.phase, end.reason) == ("Failed", "NodesFailed")
    # only a pending node gone: Paused/NodesNotReady, as before
    left = decide(r, [node("p", ready=False, ready_since=LONG_AGO), node("b", state=m.DONE)], now=LATER, started=LATER)
    assert (left.phase, left.reason) == ("Paused", "NodesNotReady") and "p" in left.message


def test_only_free_nodes_and_no_refused_ones_are_admitted():
    """What deploy/'s policy lets the coordinator write: an admission from idle, done or failed. A
    state this driverd does not know is not admitted (its own daemon fails it); a node whose
    admission the API refused is not admitted again until the coordinator tries it again."""
    d = decide(rollout(), [node("a", state="upgrading-v2"), node("b")], now=0, started=0)
    assert d.admit == ["b"]
    only = decide(rollout(), [node("a", state="upgrading-v2")], now=0, started=0)
    assert only.admit == [] and only.phase == "Progressing" and "upgrading-v2" in only.message
    refused = decide(rollout(), [node("a"), node("b")], now=0, started=0, refused={"a": "403 Forbidden: no"})
    assert refused.admit == ["b"] and refused.refused == {"a": "403 Forbidden: no"}
    assert "refused the admission of 1 node(s): a: 403 Forbidden: no" in refused.message
    alone = decide(rollout(), [node("a")], now=0, started=0, refused={"a": "403 Forbidden: no"})
    assert alone.admit == [] and alone.phase == "Progressing" and "a: 403 Forbidden: no" in alone.message


def test_an_ended_rollout_is_reopened_only_by_an_operators_verb_on_its_nodes():
    """Issue 33: a Refused rollout came back to life when its nodes answered a later rollout's
    preflight. Ended is terminal: only `node skip` of a node that refused it (Refused) or `node retry`
    of a node it left failed (Failed) reopens it."""
    r = rollout()
    refused = {"phase": "Refused", "preflightFailures": [{"node": "a", "reason": "no package"}]}
    answered_elsewhere = [node("a", pre=False), node("b", rollout_key="later/1"), node("c", rollout_key="later/1")]
    assert reopened(r, refused, answered_elsewhere) is None
    assert reopened(r, refused, [node("a", pre=False, skip=True), node("b")]) == "node skip a"
    assert reopened(r, refused, [node("a", pre=False), node("b", skip=True)]) is None     # not a blocker
    failed = {"phase": "Failed"}
    assert reopened(r, failed, [node("a", state=m.FAILED), node("b", state=m.DONE)]) is None
    assert reopened(r, failed, [node("a", state=m.FAILED, retry="now")]) == "node retry a"
    assert reopened(r, failed, [node("a", state=m.FAILED, retry="now", rollout_key="other/1")]) is None
    for phase in ("Completed", "Aborted", "Invalid"):
        assert reopened(r, {"phase": phase}, [node("a", state=m.FAILED, retry="now", skip=True)]) is None


def test_canary_goes_alone_then_pauses_until_approved():
    nodes = [node(f"n{i}") for i in range(5)]
    d = decide(rollout(canary=1, maxParallel=3, maxUnavailable=3), nodes, now=0, started=0)
    assert d.admit == ["n0"]
    nodes[0] = node("n0", state=m.DONE, since="2026-01-01T00:00:00Z")
    paused = decide(rollout(canary=1, maxParallel=3, maxUnavailable=3), nodes, now=0, started=0)
    assert paused.phase == "Paused" and paused.reason == "CanaryDone" and not paused.admit
    go = decide(rollout(canary=1, maxParallel=3, maxUnavailable=3), nodes, now=0, started=0, canary_approved=True)
    assert go.admit == ["n1", "n2", "n3"]


def test_skipped_and_unselected_nodes_are_left_alone():
    r = m.Rollout.from_object({"metadata": {"name": "r", "generation": 1},
                               "spec": {"driver": "550.127.05", "maxParallel": 5, "maxUnavailable": 5,
                                        "nodeSelector": {"matchLabels": {"pool": "a"}}}})
    nodes = [node("a", labels={"pool": "a"}), node("b", labels={"pool": "b"}), node("c", labels={"pool": "a"}, skip=True)]
    d = decide(r, nodes, now=0, started=0)
    assert d.admit == ["a"] and d.counts["total"] == 2 and d.counts["skipped"] == 1


def test_spec_errors_name_the_field():
    with pytest.raises(m.SpecError, match="spec.maxUnavailable"):
        rollout(maxUnavailable="lots")
    with pytest.raises(m.SpecError, match="spec.driver"):
        rollout(driver="latest")
    with pytest.raises(m.SpecError, match="spec.maxParallel"):
        rollout(maxParallel=0)


def test_selector_syntax_round_trips():
    labels, exprs = m.selector_string("pool=a100,zone in (a,b),!tainted,gpu")
    r = m.Rollout.from_object({"metadata": {"name": "r"}, "spec": {"driver": "550.1", "nodeSelector": {
        "matchLabels": labels, "matchExpressions": list(exprs)}}})
    assert r.selects({"pool": "a100", "zone": "b", "gpu": "x"})
    assert not r.selects({"pool": "a100", "zone": "c", "gpu": "x"})
    assert not r.selects({"pool": "a100", "zone": "a", "gpu": "x", "tainted": "1"})
    assert r.label_selector() == "pool=a100,zone in (a,b),!tainted,gpu"
    with pytest.raises(ValueError, match="cannot read"):
        m.selector_string("pool=(")


@settings(max_examples=200, deadline=None)
@given(n=hs.integers(1, 30), par=hs.integers(1, 6), mu=hs.integers(1, 8),
       down=hs.sets(hs.integers(0, 29), max_size=5), cordoned=hs.sets(hs.integers(0, 29), max_size=5),
       fail=hs.sets(hs.integers(0, 29), max_size=3))
def test_limits_hold_through_a_whole_rollout(n, par, mu, down, cordoned, fail):
    """Simulate admission to the end: after every decision, active <= maxParallel and unavailable
    <= max(limit, what was unavailable before we touched anything); nodes start in name order."""
    r = rollout(maxParallel=par, maxUnavailable=mu, failureBudget=30)
    state = {f"n{i:02d}": None for i in range(n)}
    base_unavail = sum(1 for i in range(n) if i in down or i in cordoned)
    order = []
    for _ in range(4 * n + 4):
        nodes = [node(k, state=v, ready=int(k[1:]) not in down, cordoned=int(k[1:]) in cordoned)
                 for k, v in state.items()]
        d = decide(r, nodes, now=0, started=0)
        for k in d.admit:
            state[k] = m.ADMITTED
            order.append(k)
        active = [k for k, v in state.items() if v in m.ACTIVE]
        assert len(active) <= par
        unavail = sum(1 for k, v in state.items()
                      if v in m.ACTIVE or int(k[1:]) in down or int(k[1:]) in cordoned)
        assert unavail <= max(r.unavailable_limit(n), base_unavail)
        for k in active[:1]:              # the oldest active node finishes
            state[k] = m.FAILED if int(k[1:]) in fail else m.DONE
        if d.phase in ("Completed", "Failed") and not active:
            break
    assert order == sorted(order)
    never = {f"n{i:02d}" for i in down}
    assert not never & set(order)


def test_a_paused_rollout_says_paused_while_its_nodes_answer_the_edited_spec():
    """`rollout pause` is a spec edit (a new generation): while the nodes answer its preflight the
    rollout is Paused, not Progressing "waiting for node preflight answers"."""
    r = m.Rollout.from_object({"metadata": {"name": "r", "generation": 2},
                               "spec": {"driver": "550.127.05", "paused": True}})
    nodes = [node("a", state=m.DONE), node("b")]            # both answered generation 1 only
    d = decide(r, nodes, now=0, started=0)
    assert (d.phase, d.reason) == ("Paused", "PausedBySpec") and d.admit == []


def test_after_an_edit_nobody_goes_before_every_node_answered_the_new_generation():
    """The order holds after a spec edit too: a node that answered the new generation first is not
    admitted ahead of one earlier in the order that has not answered yet."""
    r = m.Rollout.from_object({"metadata": {"name": "r", "generation": 2},
                               "spec": {"driver": "550.127.05", "maxParallel": 1, "maxUnavailable": 1}})
    done = node("a", state=m.DONE)
    d = decide(r, [done, node("b"), node("c", rollout_key="r/2")], now=0, started=0)
    assert d.admit == [] and (d.phase, d.reason) == ("Progressing", "WaitingForPreflight") and "b" in d.message
    d = decide(r, [done, node("b", rollout_key="r/2"), node("c", rollout_key="r/2")], now=0, started=0)
    assert d.admit == ["b"]
