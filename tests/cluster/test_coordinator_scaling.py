"""Issue 47: a coordinator's pass costs what changed, not the fleet. The nodes' index reads again only
the nodes its informer named since the last pass, and keeps each rollout's targets sorted node by node
(admission.Targets); deciding on them must give what deciding on every node gives, after any
sequence of changes; and a pass after one node's change reads that node alone, whatever the fleet's
size. The bench's scaling summary (bench/fleet.py --nodes 500,1000) takes its baseline from the
smallest fleet of the run."""
from __future__ import annotations

import importlib.util
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from driverd.cluster import admission
from driverd.cluster import coordinator as co
from driverd.cluster import model as m
from driverd.cluster.admission import decide, decide_on
from driverd.cluster.kube import parse_time
from driverd.cluster.nodeindex import NodeIndex
from driverd.cluster.states import NODE_STATES
from tests.conftest import REPO

KEY = "r/u1/1"


class Nodes:
    """The nodes' informer as the index reads it."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}
        self.rv = 1
        self.snapshots = 0

    def get(self, name: str) -> dict | None:
        return self.items.get(name)

    def snapshot(self) -> list[dict]:
        self.snapshots += 1
        return list(self.items.values())

    def put(self, obj: dict) -> None:
        self.items[obj["metadata"]["name"]] = obj


def node_obj(name: str, rv: int, *, state=None, rollout=KEY, pre=None, ready=True, since="", selected=True,
             skip=False, retry=False, cordoned=False) -> dict:
    ann = {}
    if state:
        ann.update({m.A_STATE: state, m.A_ROLLOUT: rollout, m.A_SINCE: "2026-01-01T00:00:00Z"})
    if pre is not None:
        ann[m.A_PREFLIGHT] = json.dumps({"rollout": KEY, "ok": pre, "needed": True, "reasons": [] if pre else ["no"]})
    if skip:
        ann[m.A_SKIP] = "true"
    if retry:
        ann[m.A_RETRY] = "1"
    return {"metadata": {"name": name, "resourceVersion": str(rv), "annotations": ann,
                         "labels": {"gpu": "yes" if selected else "no"}},
            "spec": {"unschedulable": cordoned},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "lastTransitionTime": since}]}}


def the_rollout(par: int, mu: int, canary: int, budget: int) -> m.Rollout:
    return m.Rollout.from_object({"metadata": {"name": "r", "uid": "u1", "generation": 1},
                                  "spec": {"driver": "550.127.05", "maxParallel": par, "maxUnavailable": mu,
                                           "canary": canary, "failureBudget": budget, "preflight": "Exclude",
                                           "notReadyTimeoutSeconds": 60,
                                           "nodeSelector": {"matchLabels": {"gpu": "yes"}}}})


change = hs.fixed_dictionaries({
    "node": hs.integers(0, 11),
    "state": hs.sampled_from([None, "unknown-state", *NODE_STATES]),
    "rollout": hs.sampled_from([KEY, "other/u2/1"]),
    "pre": hs.sampled_from([None, True, False]),
    "ready": hs.booleans(), "since": hs.sampled_from(["", "2026-01-01T00:00:00Z"]),
    "selected": hs.booleans(), "skip": hs.booleans(), "retry": hs.booleans(), "cordoned": hs.booleans(),
    "deleted": hs.booleans(), "relist": hs.booleans()})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a busy machine
@given(changes=hs.lists(change, min_size=1, max_size=25), par=hs.integers(1, 4), mu=hs.integers(1, 5),
       canary=hs.integers(0, 2), budget=hs.integers(0, 2), held=hs.sets(hs.integers(0, 11), max_size=3),
       refused=hs.sets(hs.integers(0, 11), max_size=3), late=hs.booleans())
def test_targets_kept_from_events_decide_as_every_node_does(changes, par, mu, canary, budget, held, refused, late):
    r = the_rollout(par, mu, canary, budget)
    member = lambda v: r.selects(v.labels)    # noqa: E731
    nodes, index = Nodes(), NodeIndex()
    for i in range(12):
        nodes.put(node_obj(f"n{i:02d}", 1, pre=True))
    now = parse_time("2026-01-01T00:10:00Z")   # NotReady since midnight: past the bound
    kw = dict(now=now, started=now - (1000 if late else 0),
              held={f"n{i:02d}": "rollout x: Progressing" for i in held},
              refused={f"n{i:02d}": "denied" for i in refused})
    index.sync(nodes)
    index.targets(r, r, member)
    for c in changes:
        name = f"n{c['node']:02d}"
        nodes.rv += 1
        if c["deleted"]:
            nodes.items.pop(name, None)
        else:
            nodes.put(node_obj(name, nodes.rv, state=c["state"], rollout=c["rollout"], pre=c["pre"], ready=c["ready"],
                               since=c["since"], selected=c["selected"], skip=c["skip"], retry=c["retry"],
                               cordoned=c["cordoned"]))
        # a re-list says only which nodes are gone: the next sync reads them all
        index.changed("SYNC", {}) if c["relist"] else index.changed("DELETED" if c["deleted"] else "MODIFIED",
                                                                    {"metadata": {"name": name}})
        index.sync(nodes)
        every = [m.NodeView.from_node(o) for o in nodes.items.values()]
        assert decide_on(index.targets(r, r, member), **kw) == decide(r, every, **kw)
        assert index.retry == {v.name for v in every if v.retry}
        assert set(index.active) == {v.name for v in every if v.active}


class Kube:
    """The API as the pass writes to it: each patch answered with the object patched."""

    def __init__(self, nodes: Nodes, rollouts: Nodes) -> None:
        self.nodes, self.rollouts = nodes, rollouts

    def patch(self, path: str, body: dict, **kw) -> dict:
        where = self.nodes if "/nodes/" in path else self.rollouts
        name = path.removesuffix("/status").rsplit("/", 1)[-1]
        obj = json.loads(json.dumps(where.items[name]))
        for k, v in body.items():
            if k == "metadata":
                obj["metadata"]["annotations"] = {**obj["metadata"].get("annotations", {}),
                                                  **(v.get("annotations") or {})}
            else:
                obj[k] = v
        where.rv += 1
        obj["metadata"]["resourceVersion"] = str(where.rv + 1000)
        return obj

    def create(self, path: str, body: dict, **kw) -> dict:
        return body


def _coordinator(n: int) -> tuple[co.Coordinator, Nodes]:
    nodes, rollouts = Nodes(), Nodes()
    for i in range(n):
        nodes.put(node_obj(f"n{i:04d}", 1, pre=True))
    rollouts.put({"metadata": {"name": "r", "uid": "u1", "generation": 1, "finalizers": [m.FINALIZER],
                               "creationTimestamp": "2026-01-01T00:00:00Z"},
                  "spec": {"driver": "550.127.05", "maxParallel": 2, "maxUnavailable": 2,
                           "nodeSelector": {"matchLabels": {"gpu": "yes"}}}})
    c = co.Coordinator(Kube(nodes, rollouts), "coord", "driverd", rollouts=rollouts, log=lambda msg: None,
                       clock=lambda: 1.7672256e9)
    c.nodes = nodes
    return c, nodes


def _one_change_pass(n: int, monkeypatch) -> dict[str, int]:
    """What a pass does after one node's change, in a fleet of n nodes that a rollout is upgrading."""
    c, nodes = _coordinator(n)
    c.act()                                  # the first pass reads every node and admits two
    c.act()
    assert c.admitted == 2
    calls = {"read": 0, "sorted": 0}
    from_node, put = m.NodeView.from_node, admission.Targets.put
    monkeypatch.setattr(m.NodeView, "from_node", classmethod(
        lambda cls, o: (calls.__setitem__("read", calls["read"] + 1), from_node(o))[1]))
    monkeypatch.setattr(admission.Targets, "put", lambda self, v: (calls.__setitem__("sorted", calls["sorted"] + 1),
                                                                   put(self, v))[1])
    nodes.rv += 1
    done = node_obj("n0000", 2000 + nodes.rv, state=m.DONE, pre=True)
    nodes.put(done)
    c._node_changed("MODIFIED", done)
    snapshots = nodes.snapshots
    c.act()
    calls["snapshots"] = nodes.snapshots - snapshots
    calls["admitted"] = c.admitted
    monkeypatch.undo()
    return calls


def test_a_pass_reads_only_the_nodes_that_changed_whatever_the_fleet(monkeypatch):
    small, large = _one_change_pass(50, monkeypatch), _one_change_pass(400, monkeypatch)
    # the node done frees its slot and the next one is admitted: the pass read the node that changed
    # (and the record of the one it admitted, for its attempt), sorted that one into the rollout's
    # targets, and listed nothing
    assert small == large == {"read": 2, "sorted": 1, "snapshots": 0, "admitted": 3}, (small, large)


def test_a_re_list_makes_the_next_pass_read_every_node():
    c, nodes = _coordinator(20)
    c.act()
    gone = nodes.items.pop("n0003")
    c._node_changed("DELETED", gone)
    nodes.rv += 1
    nodes.put(node_obj("n0005", 3000, pre=False))      # changed while the watch was cut: no event of its own
    c._node_changed("SYNC", {})
    c.act()
    assert "n0003" not in c.index.views and c.index.views["n0005"].preflight["ok"] is False
    assert set(c.index.views) == set(nodes.items)


def test_the_bench_compares_each_size_with_the_smallest_fleet_of_the_run():
    spec = importlib.util.spec_from_file_location("fleet_bench_scaling", REPO / "bench/fleet.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(n, p, cpu, req, ratio):
        return {"nodes": n, "max_parallel": p, "cpu_ms_per_node": {"coordinator": cpu},
                "api_requests_per_node": req, "makespan_ratio": ratio}
    rows = bench._scaling([{"nodes": 1000, "runs": [run(1000, 50, 9.0, 21.0, 1.02), run(1000, 10, 20.0, 22.0, 1.01)]},
                           {"nodes": 500, "runs": [run(500, 50, 7.5, 20.5, 1.03), run(500, 10, 19.0, 21.5, 1.0)]}])
    assert rows == [{"max_parallel": 50, "nodes": [500, 1000], "coordinator_cpu_ms_per_node": [7.5, 9.0],
                     "coordinator_cpu_ratio": 1.2, "api_requests_per_node": [20.5, 21.0],
                     "makespan_ratio": [1.03, 1.02]},
                    {"max_parallel": 10, "nodes": [500, 1000], "coordinator_cpu_ms_per_node": [19.0, 20.0],
                     "coordinator_cpu_ratio": 1.05, "api_requests_per_node": [21.5, 22.0],
                     "makespan_ratio": [1.0, 1.01]}]
    assert bench._sizes("500, 1000") == [500, 1000]
