"""Issue 47, DriverPools: the pool keeper's pass costs what changed, not the fleet. The pools' members are
kept node by node in the nodes' index (nodeindex.Membership) and a pool's plan is made again only when
something it reads changed; after any sequence of node, pool and rollout changes (and re-lists) the
kept assignment must be pools.assign over every node, and what the keeper writes for each pool must be
pools.plan over that assignment; and a pass after one node's change looks at that node's pool alone."""
from __future__ import annotations

import copy
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from driverd.cluster import model as m
from driverd.cluster import pools as pl
from driverd.cluster.kube import now_rfc3339
from driverd.cluster.nodeindex import NodeIndex
from driverd.cluster.poolkeeper import PoolKeeper

OLD, NEW = "550.127.05", "570.195.03"
T0 = 1.7672256e9


class Objects:
    """An informer as the index and the keeper read it (nodes, pools, rollouts)."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}
        self.synced = threading.Event()
        self.synced.set()
        self.rv = 1

    def get(self, name: str) -> dict | None:
        return self.items.get(name)

    def snapshot(self) -> list[dict]:
        return list(self.items.values())

    def put(self, obj: dict) -> None:
        self.items[obj["metadata"]["name"]] = obj

    def bump(self, obj: dict) -> dict:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.put(obj)
        return obj


def pool_obj(name: str, uid: str, driver: str, selector: dict, gen: int = 1) -> dict:
    return {"apiVersion": pl.API_VERSION, "kind": pl.KIND,
            "metadata": {"name": name, "uid": uid, "generation": gen},
            "spec": {"driver": driver, "nodeSelector": {"matchLabels": selector}}}


def node_obj(name: str, *, pool: str | None, zone: str, driver: str | None, waiting: bool, skip: bool,
             state: str | None, rollout: str, ready: bool) -> dict:
    labels = {"zone": zone} | ({"pool": pool} if pool else {}) | ({m.L_VERSION: driver} if driver else {})
    ann = {m.A_WAITING: m.WAITING_SETTINGS + "NVreg_X=1"} if waiting else {}
    if skip:
        ann[m.A_SKIP] = "true"
    if state:
        ann.update({m.A_STATE: state, m.A_ROLLOUT: rollout, m.A_SINCE: "2026-01-01T00:00:00Z"})
    return {"metadata": {"name": name, "labels": labels, "annotations": ann},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


SELECTORS = [{"pool": "a"}, {"pool": "b"}, {"zone": "1"}, {"pool": "c"}]

step = hs.one_of(
    hs.fixed_dictionaries({"do": hs.just("node"), "node": hs.integers(0, 9),
                           "pool": hs.sampled_from([None, "a", "b", "c"]), "zone": hs.sampled_from(["0", "1"]),
                           "driver": hs.sampled_from([None, OLD, NEW]), "waiting": hs.booleans(),
                           "skip": hs.booleans(), "state": hs.sampled_from([None, m.DONE, m.FAILED, m.ADMITTED]),
                           "rollout": hs.sampled_from(["a-1/ua-1/1", "b-1/ub-1/1", "c-2/uc-2/1"]),
                           "ready": hs.booleans(), "deleted": hs.booleans(), "relist": hs.booleans()}),
    hs.fixed_dictionaries({"do": hs.just("pool"), "pool": hs.sampled_from("abc"),
                           "what": hs.sampled_from(["driver", "selector", "status", "recreate", "delete"]),
                           "selector": hs.integers(0, 3)}),
    hs.fixed_dictionaries({"do": hs.just("rollout"), "pool": hs.sampled_from("abc"),
                           "what": hs.sampled_from(["Completed", "Failed", "Progressing", "delete"])}),
    hs.fixed_dictionaries({"do": hs.just("tick"), "s": hs.sampled_from([0, 1, 120])}))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a busy machine
@given(steps=hs.lists(step, min_size=1, max_size=40))
def test_kept_members_and_plans_are_those_of_every_node(steps):
    nodes, pools, rollouts = Objects(), Objects(), Objects()
    for i, (name, sel) in enumerate(zip("abc", SELECTORS)):
        pools.bump(pool_obj(name, f"u{name}-0", OLD, sel))
    for i in range(10):
        nodes.bump(node_obj(f"n{i}", pool="abc"[i % 3], zone="0", driver=OLD, waiting=False, skip=False,
                            state=None, rollout="", ready=True))
    t = [T0]
    # the statuses are written (every time they change): the pools' next passes plan from them
    keeper = PoolKeeper(Kube(pools, rollouts, t), "coord", pools=pools, rollouts=rollouts, write_rollout_status=lambda o, s:
                        wrote.append(("supersede", m.ident(o))), log=lambda msg: None, clock=lambda: t[0],
                        status_interval_s=0.0)
    wrote: list[tuple] = []
    write = keeper._status
    keeper._status = lambda obj, st: (wrote.append(("status", obj["metadata"]["name"], st)), write(obj, st))[1]
    create = keeper._create
    keeper._create = lambda pool, body: (wrote.append(("create", pool.name, copy.deepcopy(body))), create(pool, body))[1]
    index, uids = NodeIndex(), 0
    for s in steps:
        if s["do"] == "node":
            name = f"n{s['node']}"
            if s["deleted"]:
                nodes.items.pop(name, None)
            else:
                nodes.bump(node_obj(name, **{k: s[k] for k in ("pool", "zone", "driver", "waiting", "skip", "state",
                                                                 "rollout", "ready")}))
            index.changed("SYNC", {}) if s["relist"] else index.changed("MODIFIED", {"metadata": {"name": name}})
        elif s["do"] == "pool":
            obj = copy.deepcopy(pools.items.get(s["pool"]))
            if obj is None or s["what"] == "recreate":
                uids += 1
                pools.bump(pool_obj(s["pool"], f"u{s['pool']}-{uids}", OLD, SELECTORS[s["selector"]]))
            elif s["what"] == "delete":
                del pools.items[s["pool"]]
            elif s["what"] == "status":        # another writer's (an older coordinator's) status
                obj["status"] = {}
                pools.bump(obj)
            else:
                if s["what"] == "driver":
                    obj["spec"]["driver"] = NEW if obj["spec"]["driver"] == OLD else OLD
                else:
                    obj["spec"]["nodeSelector"] = {"matchLabels": SELECTORS[s["selector"]]}
                obj["metadata"]["generation"] += 1
                pools.bump(obj)
        elif s["do"] == "rollout":
            mine = sorted((o for o in rollouts.items.values() if o["metadata"]["labels"].get(pl.L_POOL) == s["pool"]),
                          key=pl.revision)
            if mine and s["what"] == "delete":
                del rollouts.items[mine[-1]["metadata"]["name"]]
            elif mine:
                o = copy.deepcopy(mine[-1])
                o["status"] = {"phase": s["what"], "observedGeneration": 1}
                rollouts.bump(o)
        else:
            t[0] += s["s"]
        index.sync(nodes)
        wrote.clear()
        # what the pass reads: its writes (statuses, rollouts created) are read by the passes after it
        good, _ = pl.read(pools.snapshot())
        seen = rollouts.snapshot()
        assert keeper.act(index)
        every = [m.NodeView.from_node(o) for o in nodes.items.values()]
        full = pl.assign(good, every)
        if good:
            assert index.membership(good).assignment() == full
        expected: list[tuple] = []
        for pool in good:
            p = pl.plan(pool, full, seen, now=now_rfc3339(t[0]), previous=pool.obj.get("status"))
            expected += [("supersede", m.ident(o)) for o in p.supersede]
            if p.create is not None:
                expected.append(("create", pool.name, p.create))
                seen = seen + [o for o in [rollouts.items.get(p.create["metadata"]["name"])] if o]
            expected.append(("status", pool.name, p.status))
        assert [w for w in wrote if w[0] != "status" or w[1] in {p.name for p in good}] == expected


class Kube:
    """The API as the keeper writes to it: a pool's status patched, a pool's rollout created (each with
    a new resourceVersion); Events taken and forgotten."""

    def __init__(self, pools: Objects, rollouts: Objects | None = None, t: list[float] | None = None) -> None:
        self.pools, self.rollouts, self.t = pools, rollouts, t or [T0]

    def patch(self, path: str, body: dict, **kw) -> dict:
        name = path.removesuffix("/status").rsplit("/", 1)[-1]
        return self.pools.bump(dict(copy.deepcopy(self.pools.items[name]), **body))

    def create(self, path: str, body: dict, **kw) -> dict:
        if self.rollouts is None or not path.endswith("/driverrollouts"):
            return body
        new = copy.deepcopy(body)
        new["metadata"] |= {"uid": "r-" + new["metadata"]["name"], "generation": 1,
                            "creationTimestamp": now_rfc3339(self.t[0])}
        return self.rollouts.bump(new)


def _one_change_pass(n: int, monkeypatch) -> dict[str, int]:
    """What the keeper's pass does after one node's change, in a fleet of n nodes in four pools."""
    nodes, pools, rollouts = Objects(), Objects(), Objects()
    for name in "abcd":
        pools.bump(pool_obj(name, f"u{name}", OLD, {"pool": name}))
    for i in range(n):
        nodes.bump(node_obj(f"n{i:04d}", pool="abcd"[i % 4], zone="0", driver=OLD, waiting=False, skip=False,
                            state=None, rollout="", ready=True))
    keeper = PoolKeeper(Kube(pools, rollouts), "coord", pools=pools, rollouts=rollouts, write_rollout_status=lambda o, s: None,
                        log=lambda msg: None, clock=lambda: T0, status_interval_s=0.0)
    index = NodeIndex()
    for _ in range(3):              # the statuses written, then read back: each pool's plan is kept
        index.sync(nodes)
        keeper.act(index)
    calls = {"plans": 0, "selected": 0, "members": 0}
    plan, selecting, runs_desired = pl.plan, pl.selecting, pl.Pool.runs_desired

    def count(what, f):
        return lambda *a, **kw: (calls.__setitem__(what, calls[what] + 1), f(*a, **kw))[1]
    monkeypatch.setattr(pl, "plan", count("plans", plan))
    monkeypatch.setattr(pl, "selecting", count("selected", selecting))
    monkeypatch.setattr(pl.Pool, "runs_desired", count("members", runs_desired))
    index.sync(nodes)
    keeper.act(index)                # nothing changed: no pool is looked at
    quiet = dict(calls)
    changed = node_obj("n0000", pool="a", zone="0", driver=OLD, waiting=False, skip=False, state=None, rollout="",
                       ready=False)
    nodes.bump(changed)
    index.changed("MODIFIED", changed)
    index.sync(nodes)
    keeper.act(index)
    monkeypatch.undo()
    assert quiet == {"plans": 0, "selected": 0, "members": 0}, quiet
    return calls


def test_a_pass_after_one_node_change_plans_that_nodes_pool_alone(monkeypatch):
    small, large = _one_change_pass(40, monkeypatch), _one_change_pass(400, monkeypatch)
    # the changed node's pool is assigned (one node) and planned again; the other three pools are not
    # looked at (a pool's plan still reads each of its members: a quarter of the fleet here)
    assert small["plans"] == large["plans"] == 1 and small["selected"] == large["selected"] == 1, (small, large)
    assert large["members"] <= 3 * 400 // 4, large
