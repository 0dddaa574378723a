"""Issue 34: what the coordinator writes, and how, in a large fleet. Every node's daemon watches every
DriverRollout, so a status write is an event for each node: progress is written less often as the
fleet grows (a phase change at once). A pass's admissions are independent patches of their own
nodes: they are written concurrently, never more than ADMIT_AT_ONCE at a time. A client stand-in
records the writes; the clock is the test's."""
from __future__ import annotations

import threading

from driverd.cluster import coordinator as co
from driverd.cluster import model as m
from driverd.cluster.kube import KubeError


class Writes:
    """The API as far as these writes go: records every patch, answers with the patched object."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.patches: list[tuple[str, dict]] = []
        self.hold, self.lock = hold, threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.requests = 0

    def patch(self, path: str, body: dict, **kw) -> dict:
        with self.lock:
            self.patches.append((path, body))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.hold is not None:
                self.hold.wait(5)       # the writes of one pass are all in flight before any answers
            if "refuse" in path:
                raise KubeError(422, "Invalid", "refused by a site policy")
            md = dict(body.get("metadata") or {}, name=path.rsplit("/", 1)[-1], resourceVersion="2", uid="u")
            return dict(body, metadata=md)
        finally:
            with self.lock:
                self.in_flight -= 1

    def create(self, path: str, body: dict, **kw) -> dict:
        return body


class Cache:
    def __init__(self, objs: list[dict] = ()) -> None:
        self.items = {o["metadata"]["name"]: o for o in objs}

    def put(self, obj: dict) -> None:
        pass

    def get(self, name: str) -> dict | None:
        return self.items.get(name)

    def snapshot(self) -> list[dict]:
        return list(self.items.values())


def _coordinator(kube, nodes: int, clock: list[float], monkeypatch) -> co.Coordinator:
    monkeypatch.setattr(co.time, "monotonic", lambda: clock[0])
    c = co.Coordinator(kube, "gpu-0000", "driverd", rollouts=Cache(), log=lambda msg: None,
                       clock=lambda: 1.8e9 + clock[0])
    c.nodes = Cache([{"metadata": {"name": f"gpu-{i:04d}", "resourceVersion": "1"}} for i in range(nodes)])
    c.index.sync(c.nodes)
    return c


def _progress_writes(nodes: int, monkeypatch) -> tuple[int, co.Coordinator, Writes]:
    """Thirty seconds of a rollout whose counts change every 0.1 s: the status writes it makes."""
    kube, clock = Writes(), [0.0]
    c = _coordinator(kube, nodes, clock, monkeypatch)
    obj = {"metadata": {"name": "r"}, "status": {}}
    for step in range(300):
        clock[0] = step / 10
        c._status(obj, {"phase": "Progressing", "reason": "Progressing", "nodes": {"done": step}})
    return len(kube.patches), c, kube


def test_progress_is_written_less_often_as_the_fleet_grows(monkeypatch):
    small, _, _ = _progress_writes(20, monkeypatch)
    large, c, kube = _progress_writes(1000, monkeypatch)
    assert 28 <= small <= 31                      # once a second, as status_interval_s says
    # a thousand watchers: no more than STATUS_EVENTS_PER_S events a second, so once per 10 s
    assert 3 <= large <= 4 and large * 1000 / 30 <= co.STATUS_EVENTS_PER_S + 34
    # the write held back is due at the end of its interval: the pass loop waits for it, not longer
    assert c._status_due is not None and c._status_due <= 30 + 10
    # a phase change is written at once, inside the interval
    n = len(kube.patches)
    c._status({"metadata": {"name": "r"}, "status": {}}, {"phase": "Paused", "reason": "FailureBudgetSpent"})
    assert len(kube.patches) == n + 1 and kube.patches[-1][1]["status"]["phase"] == "Paused"


def test_a_pass_writes_its_admissions_concurrently_and_each_refusal_is_its_own(monkeypatch):
    hold = threading.Event()
    kube, clock = Writes(hold), [0.0]
    c = _coordinator(kube, 20, clock, monkeypatch)
    r = m.Rollout.from_object({"metadata": {"name": "r", "generation": 1, "uid": "x"},
                               "spec": {"driver": "550.127.05", "maxParallel": 20, "maxUnavailable": 20}})
    names = [f"gpu-{i:04d}" for i in range(12)]
    names[5] = "refuse-gpu-0005"
    c.nodes.items["refuse-gpu-0005"] = {"metadata": {"name": "refuse-gpu-0005", "resourceVersion": "1"}}
    del c.nodes.items["gpu-0005"]
    c.index.changed("SYNC", {})
    c.index.sync(c.nodes)
    threading.Timer(0.5, hold.set).start()
    said: list = []
    results = c._admit_all(r, names, {"metadata": {"name": "r", "uid": "x"}}, said)
    assert kube.most_in_flight == co.ADMIT_AT_ONCE      # concurrent, and never more than that
    assert results.count("admitted") == 11 and results[5] == "refused"
    assert len(said) == 11 and all(p[1]["metadata"]["resourceVersion"] == "1" for p in kube.patches)


class _Held:
    """The Lease as the pass loop sees it: held; its release recorded in the order of the writes."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def holding(self) -> bool:
        return True

    def release(self) -> None:
        self.order.append("release")


class _Watch:
    def __init__(self) -> None:
        self.synced, self.tried = threading.Event(), threading.Event()      # an Informer that has listed
        self.synced.set()
        self.tried.set()

    def start(self):
        return self

    def close(self) -> None:
        pass


def test_a_stopping_coordinator_gives_the_lease_up_after_its_pass_ends(monkeypatch):
    """A daemon stopped in the middle of a pass (a rollout completing): the pass's last write (the
    phase change's Event) goes out while the Lease is still ours; only then is the Lease given up.
    Before, close() released it at once and the API server refused that Event (403, the
    driverd-coordinator-scope policy: "does not hold the Lease"), as seen in CI."""
    order: list[str] = []
    in_pass, clock = threading.Event(), [0.0]
    c = _coordinator(Writes(), 2, clock, monkeypatch)
    c.lease, c.lease_watch, c.nodes = _Held(order), _Watch(), _Watch()

    def act() -> float:
        in_pass.set()
        c.stop.wait(5)          # the daemon is told to stop while this pass still writes
        threading.Event().wait(0.3)
        order.append("event")
        return 1.0
    c.act = act
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    assert in_pass.wait(5)
    c.close()
    t.join(5)
    assert order == ["event", "release"]
