"""The node state machine and the rollout phases, as tables: the one place that says which states a
node can be in, which handler of the node agent acts on each, whether it holds a slot of the
rollout (maxParallel, maxUnavailable), which driver the daemon's own reconciles keep meanwhile, and
where each state may go next. The agent dispatches through `NODE_STATES`, admission and the CLI read
`active` and the phases from here; `tests/cluster/test_states.py` proves every state has a handler
and every transition the agent and the coordinator make is declared.
"""
from __future__ import annotations

from driverd.datatypes import dataclass


IDLE, ADMITTED, CORDONED, WAITING, EVICTING, UNLOADING, REBOOT, VALIDATING, DONE, FAILED = (
    "idle", "admitted", "cordoned", "waiting-for-jobs", "evicting", "unloading", "reboot-required", "validating",
    "done", "failed")

# What the daemon's own (periodic) reconcile keeps while a node is in a state (`NodeState.pin`):
PIN_TARGET = "target"          # the rollout's driver (driverd.io/target): never undo or race the rollout
PIN_FAILED = "failed"          # what ran when the upgrade failed (driverd.io/pinned-driver, else previous)


@dataclass(frozen=True)
class NodeState:
    """One state of the node state machine: who acts in it, whether it holds a rollout slot, where it may go."""
    name: str
    handler: str                 # the NodeAgent method that acts on a node in this state
    active: bool                 # holds a rollout slot: counts against maxParallel and is unavailable
    pin: str | None              # PIN_TARGET | PIN_FAILED | None (the node's own configuration)
    next: frozenset[str]         # the states the handler (or, from a free state, admission) may record
    summary: str
    # recorded only by an earlier driverd: a node found in it is carried on, none is put into it now
    legacy: bool = False

    @property
    def free(self) -> bool:
        """Not in an upgrade: the agent answers preflights, admission may take the node."""
        return not self.active


def _s(name: str, handler: str, active: bool, pin: str | None, next_: tuple[str, ...], summary: str,
       legacy: bool = False) -> NodeState:
    return NodeState(name, handler, active, pin, frozenset(next_), summary, legacy)


# The preflight handler of the free states answers rollouts; their way out is the coordinator's
# admission (-> admitted). A node given back (aborted, deleted rollout) returns to idle.
NODE_STATES: dict[str, NodeState] = {s.name: s for s in (
    _s(IDLE, "_preflight", False, None, (ADMITTED,), "not in a rollout"),
    _s(ADMITTED, "_cordon", True, PIN_TARGET, (WAITING, EVICTING, IDLE, FAILED),
       "admitted by the coordinator; cordons and starts the drain in one transition (an admission no live "
       "rollout made: failed, AdmissionRejected)"),
    # the cordon was a transition of its own before it became the drain's start (issue 47)
    _s(CORDONED, "_after_cordon", True, PIN_TARGET, (WAITING, EVICTING, IDLE), "cordoned; drains next",
       legacy=True),
    _s(WAITING, "_wait_jobs", True, PIN_TARGET, (EVICTING, IDLE), "waiting for the rollout's job pods to finish"),
    _s(EVICTING, "_evict", True, PIN_TARGET, (EVICTING, UNLOADING, FAILED, IDLE),
       "evicting the GPU pods (PDBs respected; forced deletion only with spec.drain.force)"),
    _s(UNLOADING, "_transact", True, PIN_TARGET, (VALIDATING, REBOOT, FAILED),
       "the node transaction: unload, install, load, validate (rolled back on failure)"),
    _s(REBOOT, "_after_reboot", True, PIN_TARGET, (UNLOADING,),
       "waiting for the reboot coordinator (e.g. kured); the upgrade finishes after the reboot"),
    _s(VALIDATING, "_validate", True, PIN_TARGET, (DONE, FAILED), "driver loaded; waiting for the node to be Ready"),
    _s(DONE, "_preflight", False, PIN_TARGET, (ADMITTED,), "upgraded and uncordoned"),
    _s(FAILED, "_preflight", False, PIN_FAILED, (ADMITTED,),
       "the upgrade failed (the reason is on the node); only an admitted retry or a new rollout changes it"),
)}
ACTIVE = frozenset(s.name for s in NODE_STATES.values() if s.active)


def node_state(name: str | None) -> NodeState | None:
    """The state recorded on a node; None for a name this driverd does not know (an annotation
    written by hand or by another version)."""
    return NODE_STATES.get(name or IDLE)


@dataclass(frozen=True)
class Phase:
    """One rollout phase of status.phase: whether it ends the rollout, counts as success, and warns."""
    name: str
    ended: bool          # the rollout is over for its current spec: it holds no node
    ok: bool             # `kubectl driverd rollout status/wait` exit 0 (else 3)
    warning: bool        # its Event is a Warning


# The rollout phases the coordinator writes into status.phase.
PHASES: dict[str, Phase] = {p.name: p for p in (
    Phase("Pending", False, True, False),
    Phase("Preflight", False, True, False),
    Phase("Progressing", False, True, False),
    Phase("Paused", False, True, True),
    Phase("Completed", True, True, False),
    Phase("Failed", True, False, True),
    Phase("Refused", True, False, True),
    Phase("Aborted", True, True, False),
    Phase("Invalid", True, False, True),
    # a DriverPool's rollout whose driver the pool no longer wants (cluster/pools.py): the next revision replaces it
    Phase("Superseded", True, True, False),
)}
ENDED = tuple(p.name for p in PHASES.values() if p.ended)
