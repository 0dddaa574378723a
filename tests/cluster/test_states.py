"""The node state table (driverd/cluster/states.py) is the whole state machine: every state has a
handler on the node agent, every transition the agent and the coordinator record is declared in
the table, nothing else names a state, and the CLI's exit codes follow the phase table."""
from __future__ import annotations

import types

import ast
import inspect
import re
from pathlib import Path

import pytest

from driverd.cluster import model as m
from driverd.cluster import states
from driverd.cluster.agent import NodeAgent
from tests.conftest import REPO

STATE_BY_CONST = {name: getattr(states, name) for name in dir(states)
                  if name.isupper() and isinstance(getattr(states, name), str) and getattr(states, name) in states.NODE_STATES}


def _agent_methods() -> dict[str, ast.FunctionDef]:
    """NodeAgent's methods with its mixins' (cluster/agent/admission.py, agent/finish.py), as Python
    looks them up."""
    out: dict[str, ast.FunctionDef] = {}
    for klass in reversed(NodeAgent.__mro__[:-1]):
        tree = ast.parse(Path(inspect.getsourcefile(klass)).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
        out.update({f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)})
    return out


def _direct(fn: ast.FunctionDef) -> tuple[set[str], set[str]]:
    """The states a method records itself (self._to(node, m.X); _fail -> failed; _give_back -> idle)
    and the other methods of the agent it calls."""
    recorded, calls = set(), set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == "self":
            if n.func.attr == "_to":
                arg = n.args[1]
                # a state constant, or a choice between two (`m.WAITING if r.jobs_selector else m.EVICTING`)
                for a in (arg.body, arg.orelse) if isinstance(arg, ast.IfExp) else (arg,):
                    assert isinstance(a, ast.Attribute) and a.attr in STATE_BY_CONST, ast.unparse(n)
                    recorded.add(STATE_BY_CONST[a.attr])
            elif n.func.attr == "_fail":
                recorded.add(states.FAILED)
            elif n.func.attr == "_give_back":
                recorded.add(states.IDLE)
            else:
                calls.add(n.func.attr)
    return recorded, calls


def _reachable(methods: dict[str, ast.FunctionDef], name: str) -> set[str]:
    seen, todo, out = set(), [name], set()
    while todo:
        cur = todo.pop()
        if cur in seen or cur not in methods:
            continue
        seen.add(cur)
        rec, calls = _direct(methods[cur])
        out |= rec
        todo += sorted(calls)
    return out


def test_every_state_has_a_handler_on_the_agent():
    methods = _agent_methods()
    missing = {s.name: s.handler for s in states.NODE_STATES.values() if s.handler not in methods}
    assert not missing, missing


def test_every_transition_the_agent_records_is_declared():
    methods = _agent_methods()
    undeclared = {}
    for s in states.NODE_STATES.values():
        made = _reachable(methods, s.handler) - {s.name}
        if s.active and s.name in (m.ADMITTED, m.CORDONED, m.WAITING, m.EVICTING):
            made.add(states.IDLE)       # tick gives these back when their rollout is aborted or deleted
        if made - s.next:
            undeclared[s.name] = sorted(made - s.next)
    assert not undeclared, f"transitions missing from NODE_STATES[...].next: {undeclared}"


def test_declared_transitions_are_all_made_and_every_state_is_reachable():
    methods = _agent_methods()
    made = {s.name: _reachable(methods, s.handler) for s in states.NODE_STATES.values()}
    for s in states.NODE_STATES.values():
        # the free states leave only by the coordinator's admission; active ones by their handler
        expected = {states.ADMITTED} if s.free else made[s.name] | ({states.IDLE} if states.IDLE in s.next else set())
        assert s.next <= expected | {s.name}, (s.name, sorted(s.next - expected))
    seen, todo = set(), [states.IDLE]
    while todo:
        cur = todo.pop()
        if cur not in seen:
            seen.add(cur)
            todo += sorted(states.NODE_STATES[cur].next)
    # a legacy state (recorded by an earlier driverd) is carried on where found, never entered
    assert seen == {s.name for s in states.NODE_STATES.values() if not s.legacy}, set(states.NODE_STATES) - seen
    assert all(not (set(s.next) & {t.name for t in states.NODE_STATES.values() if t.legacy})
               for s in states.NODE_STATES.values()), "a transition into a legacy state"


def test_the_coordinator_only_admits_and_only_free_nodes_are_admitted():
    src = (REPO / "driverd/cluster/coordinator.py").read_text()
    targets = set(re.findall(r"state_patch\(m\.([A-Z_]+)", src))
    assert targets == {"ADMITTED"}, targets
    for s in states.NODE_STATES.values():
        assert (states.ADMITTED in s.next) == s.free or s.name == states.REBOOT, s.name


def test_no_state_outside_the_table():
    """Every state name the cluster code or the CLI spells is one of the table's."""
    known = set(states.NODE_STATES)
    for path in [*(REPO / "driverd/cluster").glob("*.py"), REPO / "driverd/cli/cluster_cmds.py",
                 REPO / "driverd/cli/rollout_status.py",
                 REPO / "driverd/daemon/cluster_mode.py"]:
        for attr in re.findall(r"\bm\.([A-Z][A-Z_]+)\b", path.read_text()):
            val = getattr(m, attr, None)
            assert val is not None, f"{path.name}: m.{attr} does not exist"
            if isinstance(val, str) and attr in STATE_BY_CONST:
                assert val in known
    assert not hasattr(m, "INSTALLING") and not hasattr(m, "UNCORDONING")
    assert m.ACTIVE == states.ACTIVE == {s.name for s in states.NODE_STATES.values() if s.active}


def test_every_phase_the_coordinator_writes_is_in_the_phase_table():
    text = "".join((REPO / "driverd/cluster" / f).read_text() for f in ("admission.py", "coordinator.py", "poolkeeper.py"))
    written = set(re.findall(r'"phase": "(\w+)"', text)) | set(re.findall(r'Decision\("(\w+)"', text))
    written |= set(re.findall(r'd\.phase(?:, d\.\w+)*(?:, d\.\w+)? = "(\w+)"', text))
    written |= set(re.findall(r'"(\w+)" if \w+ else "(\w+)"', text)[0])
    from driverd.cluster.pools import SUPERSEDED
    written |= {SUPERSEDED} if re.search(r'"phase": pl\.SUPERSEDED', text) else set()
    assert written and written <= set(states.PHASES), written - set(states.PHASES)
    assert set(states.ENDED) == {"Completed", "Failed", "Refused", "Aborted", "Invalid", "Superseded"}


@pytest.mark.parametrize("phase,reason,status_rc,wait_rc", [
    ("Completed", "Completed", 0, 0), ("Completed", "NoTargets", 3, 3), ("Failed", "NodesFailed", 3, 3),
    ("Refused", "PreflightFailed", 3, 3), ("Aborted", "Aborted", 0, 3), ("Progressing", "Progressing", 0, 3),
    ("Bogus", "", 3, 3)])
def test_cli_exit_codes_follow_the_phase_table(phase, reason, status_rc, wait_rc):
    from driverd.cli.rollout_status import _exit
    assert _exit({"phase": phase, "reason": reason}) == status_rc
    assert _exit({"phase": phase, "reason": reason}, ended_only=True) == wait_rc


def _agent_at(state: str):
    """A node agent whose node records `state`, with its API side replaced by a recorder."""
    agent = NodeAgent.__new__(NodeAgent)
    node = {"metadata": {"name": "n1", "annotations": {m.A_STATE: state, m.A_ROLLOUT: "r/uid/1"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    agent._labels_checked = True
    agent._kernel_news = []
    agent.view = lambda: (node, m.NodeView.from_node(node))
    agent.calls = []
    agent._fail = lambda node, v, reason, message: agent.calls.append(("fail", reason, message))
    agent._preflight = lambda v: agent.calls.append(("preflight", v.state))
    return agent


def test_an_unknown_state_fails_the_node_naming_it():
    agent = _agent_at("installing")          # a state an old version listed and never handled
    assert agent.tick() is None
    (kind, reason, message), = agent.calls
    assert (kind, reason) == ("fail", "UnknownState") and "'installing'" in message and "retry" in message


@pytest.mark.parametrize("state", [states.IDLE, states.DONE, states.FAILED])
def test_free_states_answer_preflights(state):
    agent = _agent_at(state)
    agent.tick()
    assert agent.calls == [("preflight", state)]


def test_cluster_mode_pins_from_the_table(tmp_path):
    from driverd.cluster import desired as dz
    from driverd.config import load
    from driverd.daemon.cluster_mode import ClusterMode
    from driverd.root import Root

    class _Agent:
        def __init__(self, node):
            self.nodes = {"n1": node}

        def set_waiting(self, text):
            pass
    base = load(Root(str(tmp_path)), None, environ={})
    host = {"version": "535.9", "flavor": "open"}        # what the host has (loaded, or last converged to)
    for state, ann, want in [
            (states.EVICTING, {m.A_TARGET: "550.1/open"}, ("550.1", "open")),
            (states.DONE, {m.A_TARGET: "550.1/auto"}, ("550.1", base["driver.flavor"])),
            (states.FAILED, {m.A_PINNED: "535.2/proprietary", m.A_PREVIOUS: "1.0/open"}, ("535.2", "proprietary")),
            (states.FAILED, {m.A_PREVIOUS: "535.3/open"}, ("535.3", "open")),
            # free and pinned by no record: the driver the host has, never the configuration's
            (states.IDLE, {m.A_TARGET: "9.9/open"}, ("535.9", "open")),
            ("made-up", {m.A_TARGET: "9.9/open"}, ("535.9", "open"))]:
        cm = ClusterMode.__new__(ClusterMode)
        cm.node, cm.log, cm._said_behind, cm._said_waiting, cm._said = "n1", lambda msg: None, "", "", set()
        cm.make_context = lambda cfg: types.SimpleNamespace(root=Root(str(tmp_path)))   # no converge recorded
        cm.agent = _Agent({"metadata": {"name": "n1", "annotations": {m.A_STATE: state, **ann}}})
        cm.have = lambda cfg: dict(host)
        cm.desired = lambda cfg, node: dz.Desired("570.1", "auto", "configuration")
        got, hold = cm.keep(base)
        assert not hold and (got["driver.version"], got["driver.flavor"]) == want, state
        assert cm.busy() == (state in states.ACTIVE)


def test_left_with_driver_reads_both_forms_and_nothing_from_garbage():
    """driverd.io/left-with-driver: DaemonSet -> the label that brings it back; the list an older daemon
    wrote mid-upgrade reads as driver-ready for each (waited for as before); garbage reads as none."""
    from driverd.cluster import model as mm
    dp = "nvidia.com/gpu.deploy.device-plugin"
    assert mm.left_with({mm.A_LEFT_WITH: '{"gpu-operator/dp": "%s"}' % dp}) == {"gpu-operator/dp": dp}
    assert mm.left_with({mm.A_LEFT_WITH: '["kube-system/plugin"]'}) == {"kube-system/plugin": mm.L_READY}
    assert mm.left_with({mm.A_LEFT_WITH: "{not json"}) == {} and mm.left_with({mm.A_LEFT_WITH: "3"}) == {}
    assert mm.left_with(None) == {} and mm.left_with({}) == {}
    d = {"gpu-operator/dp": dp, "kube-system/plugin": mm.L_READY}
    assert mm.left_with({mm.A_LEFT_WITH: mm.left_with_value(d)}) == d and mm.left_with_value({}) is None


def test_an_api_server_away_is_said_in_one_line_and_retried():
    """The agent's loop: an API server that does not answer (the cordon now reads the node's pods too) is
    said as what it is, with its fix, and the tick comes again - not logged as an unexpected error."""
    import threading

    from driverd.cluster.kube import Unreachable
    agent = NodeAgent.__new__(NodeAgent)
    agent.stop, agent.wake, said, waits = threading.Event(), threading.Event(), [], []
    agent.start, agent.log = (lambda: agent), said.append
    agent.nodes = agent.rollouts = agent.pools = type("Synced", (), {"synced": threading.Event()})()
    agent.nodes.synced.set()
    calls = iter([Unreachable("cannot reach the Kubernetes API at https://10.0.0.1:6443: connection refused",
                              fix="check that the API server runs at that address")])

    def tick():
        try:
            raise next(calls)
        except StopIteration:
            agent.stop.set()
            return 0
    agent.tick = tick
    agent.wake.wait = lambda t=None: waits.append(t)
    agent.run()
    assert len(said) == 1 and "unexpected" not in said[0] and "connection refused" in said[0] \
        and "check that the API server runs" in said[0], said
    assert waits == [5.0], waits
