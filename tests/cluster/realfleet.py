"""A fleet on the real control plane as a cluster runs it: every daemon with its node-bound token,
deploy/'s admission policies applied, the product's DEFAULT Lease duration, and the coordinator of its
own identity (deploy/'s driverd-coordinator, a token bound to its pod), started first so that it takes
the Lease and keeps it. Plus what the tests read
back: the rollout's phase history (a watch of the rollout, every (phase, reason) it took) and the
refusals kube-apiserver sent driverd's ServiceAccount (its audit log)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from driverd.cluster import model as m
from driverd.cluster.informer import Informer
from driverd.cluster.kube import Kube, Target, lease_path, rollout_path
from driverd.cluster.lease import LEASE_DURATION_S, LEASE_NAME
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.controlplane import reset
from tests.kubetools import kubeconfig_token

API = "driverd.io/v1alpha1"
SA_USER = "system:serviceaccount:driverd:driverd"
COORDINATOR_USER = "system:serviceaccount:driverd:driverd-coordinator"


def rollout(name: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "DriverRollout", "metadata": {"name": name}, "spec": {"driver": NEW, **spec}}


def hosts(*names: str) -> dict:
    return {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": list(names)}]}


def holder(f: Fleet) -> str | None:
    return ((f.admin.find(lease_path("driverd", LEASE_NAME)) or {}).get("spec") or {}).get("holderIdentity")


def start_with_coordinator(f: Fleet) -> Fleet:
    """Start the fleet's coordinator (deploy/'s own identity, Fleet.COORDINATOR) first: it creates the
    Lease (a fresh control plane has none) and renews it every third of the default duration, so it
    coordinates the whole test; then the nodes' daemons (their own side only)."""
    assert f.lease_s == LEASE_DURATION_S, "the product's default Lease, not a short test Lease"
    assert f.coordinator_mode == "own", f.coordinator_mode
    f._start_sim()
    f.start_coordinator()
    assert f.wait(lambda: holder(f) == Fleet.COORDINATOR, 30), f"the coordinator did not take the Lease: {holder(f)}"
    for name in f.nodes:
        f.start_node(name)
    assert f.wait(lambda: all(v.driver == OLD for v in views(f).values()), 60), "daemons did not label their nodes"
    return f


def coordinator_token(f: Fleet, name: str = Fleet.COORDINATOR) -> str:
    """The token coordinator `name` runs with (what a compromised coordinator would hold)."""
    return kubeconfig_token(f.coordinator_kubeconfig(name))


def views(f: Fleet) -> dict[str, m.NodeView]:
    return {n["metadata"]["name"]: m.NodeView.from_node(n) for n in f.admin.list("/api/v1/nodes")["items"]}


class PhaseLog:
    """Every (phase, reason) a rollout's status took, in order, from a watch of the rollouts."""

    def __init__(self, f: Fleet) -> None:
        self.seen: dict[str, list[tuple[str, str]]] = {}
        self.lock = threading.Lock()
        self.inf = Informer(Kube(Target(kubeconfig=f.kubeconfig)), rollout_path(), name="phase-log",
                            on_change=self._changed).start()
        self.inf.synced.wait(30)

    def _changed(self, kind: str, obj: dict) -> None:
        if kind in ("SYNC", "DELETED"):
            return
        st = obj.get("status") or {}
        if not st.get("phase"):
            return
        with self.lock:
            h = self.seen.setdefault(obj["metadata"]["name"], [])
            cur = (st["phase"], st.get("reason") or "")
            if not h or h[-1] != cur:
                h.append(cur)

    def phases(self, name: str) -> list[str]:
        """The phases in order, consecutive repeats (another reason) folded."""
        with self.lock:
            out: list[str] = []
            for p, _ in self.seen.get(name, []):
                if not out or out[-1] != p:
                    out.append(p)
            return out

    def moves(self, name: str) -> list[str]:
        """The phases without `Preflight` (which the first status skips when every node has answered
        before the coordinator's first pass), consecutive repeats folded."""
        out: list[str] = []
        for p in self.phases(name):
            if p != "Preflight" and (not out or out[-1] != p):
                out.append(p)
        return out

    def history(self, name: str) -> list[tuple[str, str]]:
        with self.lock:
            return list(self.seen.get(name, []))

    def close(self) -> None:
        self.inf.close()


def wait_phase(f: Fleet, name: str, phases, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ro = f.admin.get(rollout_path(name))
        st = ro.get("status") or {}
        if st.get("phase") in phases and st.get("observedGeneration") == ro["metadata"]["generation"]:
            return ro
        time.sleep(0.2)
    raise AssertionError(f"rollout {name} never reached {phases}: {f.admin.get(rollout_path(name)).get('status')}; "
                         "nodes: " + "; ".join(f"{n}: {v.state} {v.reason} {v.message[:200]}"
                                               for n, v in views(f).items()))


def audit_mark(cp) -> int:
    """Where the control plane's audit log stands now (it is the session's: earlier tests wrote to it)."""
    return len(cp.audit_log.read_bytes()) if cp.audit_log.exists() else 0


def refusals(cp, since: int) -> list[str]:
    """Every request of driverd's ServiceAccounts (the node daemons', the coordinator's) kube-apiserver answered 403 after the audit log stood
    at `since` (audit_mark), as `VERB URI: message`."""
    out = []
    events: dict[str, dict] = {}
    with open(cp.audit_log, "rb") as fh:
        fh.seek(since)
        for line in fh.read().decode().splitlines():
            ev = json.loads(line)
            if ev.get("user", {}).get("username") in (SA_USER, COORDINATOR_USER) and ev.get("stage") == "ResponseComplete":
                events[ev["auditID"]] = ev
    for ev in events.values():
        st = ev.get("responseStatus") or {}
        if st.get("code") == 403:
            out.append(f"{ev.get('verb')} {ev.get('requestURI')}: {st.get('message', '')}")
    return out


def node_events(f: Fleet, node: str, reason: str) -> list[dict]:
    return [e for e in f.admin.list("/api/v1/namespaces/default/events")["items"]
            if e["involvedObject"].get("name") == node and e["involvedObject"].get("kind") == "Node"
            and e.get("reason") == reason]


def rollout_events(f: Fleet, name: str, reason: str | None = None) -> list[dict]:
    evs = [e for e in f.admin.list("/api/v1/namespaces/default/events")["items"]
           if e["involvedObject"].get("name") == name and e["involvedObject"].get("kind") == "DriverRollout"
           and (reason is None or e.get("reason") == reason)]
    return sorted(evs, key=lambda e: (e.get("firstTimestamp") or "", e["metadata"].get("resourceVersion", "")))


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)[:3000]


@pytest.fixture
def make(deployed, tmp_path):
    """make(n, **kw) -> a built Fleet of n simulated nodes on the deployed control plane (the default Lease),
    its audit mark and operator kubeconfig set; every fleet made is stopped after the test."""
    reset(deployed)
    made: list[Fleet] = []

    def build(n: int, **kw) -> Fleet:
        f = Fleet(tmp_path / f"fleet{len(made)}", n, server=deployed, **kw).build()   # the default Lease
        f.audit_from = audit_mark(deployed)
        f.operator_kubeconfig = deployed.operator_kubeconfig(str(tmp_path / "operator.kubeconfig"))
        made.append(f)
        return f
    yield build
    for f in made:
        f.stop()
