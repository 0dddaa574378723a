"""Admission: which nodes may start upgrading now. A pure function of the rollout and the nodes, so
that the guarantees can be stated and tested without a cluster:

- at no instant more than `maxParallel` target nodes are in an active state (admitted … uncordoning,
  reboot-required), and admitting never takes the number of unavailable target nodes (NotReady,
  cordoned by anyone, or active) past `maxUnavailable` — nodes already unavailable count;
- nodes are taken in a deterministic order (canary nodes first, then by name);
- nothing is admitted before every target node's daemon has answered the preflight for this
  generation of the rollout (or the preflight deadline passed: silence is a failed preflight);
- failed nodes count against `failureBudget`; one more failure than it allows pauses the rollout;
- a NotReady node is never admitted (its daemon cannot be trusted to act), a skipped one never;
  any target node not being upgraded (pending, done, failed, skipped) that is NotReady for longer
  than `notReadyTimeoutSeconds` is reported by name and no longer counts against maxUnavailable nor
  its percentage's base (it is gone, not capacity the rollout could take away); a failed one still
  counts against the failure budget; when only pending such nodes are left the rollout pauses
  (`NodesNotReady`) until they are Ready again or skipped;
- only a node in a free state (idle, done, failed) is admitted: what deploy/'s admission policy
  lets the coordinator write (a state this driverd does not know is its own daemon's to fail);
- nodes whose admission the API refused (`refused`: an admission policy, a webhook) are not
  admitted again until the coordinator tries them again; the status names them;
- a rollout is one object (uid) at one spec generation: a node done or failed for another target
  (an edited `spec.driver`) is pending again; nodes another rollout that has not ended holds
  (`held`) wait, and the message names that rollout.

Only the coordinator (the daemon holding the rollout Lease) acts on the decision.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import field
from itertools import chain, islice

from driverd.cluster.model import ACTIVE, DONE, FAILED, NodeView, Rollout
from driverd.cluster.states import node_state
from driverd.datatypes import dataclass

PREFLIGHT_DEADLINE_S = 120.0
REFUSED_RETRY_S = 30.0          # a refused admission is tried again after this (or when the node changes)
A_CANARY_APPROVED = "driverd.io/canary-approved"
PAUSED_WORDS = "spec.paused is true (resume: kubectl driverd rollout resume)"


@dataclass
class Decision:
    """What admission decides for one rollout in one pass: its phase, the nodes admitted now, and why."""
    phase: str                      # Preflight Refused Progressing Paused Completed Failed
    reason: str                     # CamelCase, as Kubernetes reasons are
    message: str
    admit: list[str] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    excluded: list[dict] = field(default_factory=list)      # {node, reason}: preflight said no
    failed: list[dict] = field(default_factory=list)        # {node, reason}
    waiting: list[str] = field(default_factory=list)        # nodes whose preflight answer is missing
    pending: list[str] = field(default_factory=list)        # target nodes not done, failed, upgrading or skipped
    held: dict = field(default_factory=dict)                # node -> the other rollout that holds it
    refused: dict = field(default_factory=dict)             # node -> the API's refusal of its admission
    not_ready: list[dict] = field(default_factory=list)     # {node, reason}: NotReady past the bound
    unavailable: int = 0
    limit_unavailable: int = 0

    def status(self, r: Rollout) -> dict:
        return {"phase": self.phase, "reason": self.reason, "message": self.message,
                "observedGeneration": r.generation, "nodes": self.counts,
                "maxUnavailable": self.limit_unavailable, "unavailable": self.unavailable,
                "preflightFailures": self.excluded[:50], "failedNodes": self.failed[:50],
                "notReadyNodes": self.not_ready[:50],
                "heldNodes": [{"node": k, "by": v} for k, v in sorted(self.held.items())][:50]}


def _pre_ok(n: NodeView, r: Rollout) -> bool | None:
    """The node's preflight answer for this rollout generation: True/False, None when missing."""
    p = n.preflight
    if not p or p.get("rollout") != r.key:
        return None
    return bool(p.get("ok"))


def _up_to_date(n: NodeView, r: Rollout) -> bool:
    p = n.preflight or {}
    return p.get("rollout") == r.key and p.get("ok") and not p.get("needed", True)


class _Sorted:
    """Names kept in order, with a set beside them: an update is a binary search and a move of the
    list's pointers (a fleet's few thousand), never a Python loop over the fleet."""
    __slots__ = ("names", "set")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.set: set[str] = set()

    def add(self, name: str) -> None:
        if name not in self.set:
            self.set.add(name)
            insort(self.names, name)

    def discard(self, name: str) -> None:
        if name in self.set:
            self.set.discard(name)
            del self.names[bisect_left(self.names, name)]

    def __contains__(self, name: object) -> bool:
        return name in self.set

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Targets:
    """A rollout's target nodes, each sorted once into what `decide` asks of it (done, failed,
    upgrading, skipped, pending and its preflight answer, Ready, available). The coordinator keeps one
    per rollout and `put`s only the nodes whose record changed: a pass then costs what changed, not
    the fleet (every node, every rollout, every pass grew its CPU per node with the fleet, issue 47).
    `decide(r, nodes)` is `decide_on(Targets.of(r, nodes))`: one rule, whichever way it is fed."""

    def __init__(self, r: Rollout) -> None:
        self.r = r
        self.views: dict[str, NodeView] = {}
        self.mine: set[str] = set()                 # its record names this rollout (any generation)
        self.done: set[str] = set()
        self.done_since: dict[str, float] = {}      # done -> when (the canary's soak starts at the last)
        self.failed = _Sorted()
        self.failed_entry: dict[str, dict] = {}
        self.active: set[str] = set()
        self.skipped: set[str] = set()
        self.pending = _Sorted()                    # none of the four above
        self.unanswered = _Sorted()                 # pending, no preflight answer for this generation
        self.refusing = _Sorted()                   # pending, its preflight said no
        self.refusal: dict[str, dict] = {}
        self.eligible = _Sorted()                   # pending, its preflight said yes, a state we know
        self.unknown: set[str] = set()              # pending, a state this driverd does not know
        self.not_ready: dict[str, float | None] = {}    # NotReady -> since (its condition's transition)
        self.unavailable: set[str] = set()

    @classmethod
    def of(cls, r: Rollout, nodes: Iterable[NodeView]) -> Targets:
        t = cls(r)
        for n in nodes:
            if r.selects(n.labels):
                t.put(n)
        return t

    def __len__(self) -> int:
        return len(self.views)

    def put(self, n: NodeView) -> None:
        """The node (a target of the rollout) as it is now."""
        from driverd.cluster.kube import parse_time
        r, name = self.r, n.name
        self.discard(name)
        self.views[name] = n
        mine = n.in_rollout(r)
        # done/failed count only for the current target: after an edit of spec.driver they are pending again
        fits = n.target in ("", r.target)
        done = (mine and n.state == DONE and fits) or _up_to_date(n, r)
        failed = mine and n.state == FAILED and not n.retry and fits
        active = mine and n.state in ACTIVE
        skipped = n.skip and not active
        if mine:
            self.mine.add(name)
        if done:
            self.done.add(name)
            if (since := parse_time(n.since)) is not None:
                self.done_since[name] = since
        if failed:
            self.failed.add(name)
            self.failed_entry[name] = {"node": name, "reason": f"{n.reason}: {n.message}".strip(": ")}
        if active:
            self.active.add(name)
        if skipped:
            self.skipped.add(name)
        if not (done or failed or active or skipped):
            self.pending.add(name)
            known = node_state(n.state) is not None
            pre = _pre_ok(n, r)
            if pre is None:
                self.unanswered.add(name)
            elif not pre:
                self.refusing.add(name)
                self.refusal[name] = {"node": name, "reason": "; ".join((n.preflight or {}).get("reasons")
                                                                        or ["preflight failed"])}
            elif known:
                self.eligible.add(name)
            if not known:
                self.unknown.add(name)
        if not n.ready:
            self.not_ready[name] = parse_time(n.ready_since)
        if n.unavailable:
            self.unavailable.add(name)

    def discard(self, name: str) -> None:
        """The node is no target (any more)."""
        if self.views.pop(name, None) is None:
            return
        for s in (self.mine, self.done, self.active, self.skipped, self.unknown, self.unavailable):
            s.discard(name)
        for d in (self.done_since, self.failed_entry, self.refusal, self.not_ready):
            d.pop(name, None)
        for o in (self.failed, self.pending, self.unanswered, self.refusing, self.eligible):
            o.discard(name)


def decide(r: Rollout, nodes: list[NodeView], *, now: float, started: float, canary_approved: bool = False,
           held: Mapping[str, str] | None = None, refused: Mapping[str, str] | None = None) -> Decision:
    return decide_on(Targets.of(r, nodes), now=now, started=started, canary_approved=canary_approved,
                     held=held, refused=refused)


def decide_on(t: Targets, *, now: float, started: float, canary_approved: bool = False,
              held: Mapping[str, str] | None = None, refused: Mapping[str, str] | None = None) -> Decision:
    """decide() on the rollout's targets as sorted by `Targets`: it looks at the nodes a decision
    names (a wave's candidates, the NotReady, the held, the refused), never at every target."""
    r = t.r
    pending = t.pending.set
    held = {k: held[k] for k in sorted(held.keys() & pending)} if held else {}
    refused = {k: refused[k] for k in sorted(refused.keys() & pending)} if refused else {}
    # a target node NotReady past the bound and not being upgraded: named, and out of the budget's
    # count and base (a failed one stays failed: the failure budget counts it)
    gone: dict[str, float] = {}
    for name in sorted(t.not_ready):
        since = t.not_ready[name]
        if name not in t.active and since is not None and max(0.0, now - since) > r.not_ready_timeout_s:
            gone[name] = max(0.0, now - since)
    gone_pending = sorted(name for name in gone if name in pending)
    limit = r.unavailable_limit(len(t) - len(gone))
    # a state this driverd does not know: not free, so not admitted (its daemon fails it: UnknownState)
    unknown = t.unknown
    waiting = [name for name in t.unanswered if name not in held and name not in gone] if held or gone \
        else list(t.unanswered)
    late = now - started > PREFLIGHT_DEADLINE_S
    excluded = [t.refusal[name] for name in t.refusing]
    if late:
        excluded += [{"node": name, "reason": f"its driverd did not answer the preflight within "
                      f"{PREFLIGHT_DEADLINE_S:.0f}s (is the daemon running on it?)"} for name in waiting]
        waiting = []
    bad = {e["node"] for e in excluded}
    if gone:
        excluded = [e for e in excluded if e["node"] not in gone]
        bad -= set(gone)
    # in name order: pending, a yes to this generation's preflight (so neither excluded nor waiting), a
    # state we know, and not held, gone or refused
    candidates: Iterator[NodeView] = (t.views[name] for name in t.eligible
                                      if name not in held and name not in gone and name not in refused)
    first = next(candidates, None)
    if first is not None:
        candidates = chain((first,), candidates)
    # every target that is NotReady is unavailable: those gone are the NotReady ones left out
    unavailable = len(t.unavailable) - len(gone)
    failed = [t.failed_entry[name] for name in t.failed]
    counts = {"total": len(t), "done": len(t.done), "failed": len(failed), "upgrading": len(t.active),
              "pending": len(t.pending) - len(bad), "skipped": len(t.skipped), "excluded": len(bad) if r.preflight ==
              "Exclude" else 0, "notReady": len(gone)}
    d = Decision("Progressing", "Progressing", "", counts=counts, excluded=excluded, failed=failed,
                 waiting=waiting, pending=list(t.pending), unavailable=unavailable,
                 limit_unavailable=limit, held=held, refused=refused,
                 not_ready=[{"node": k, "reason": f"NotReady for {v:.0f}s (more than notReadyTimeoutSeconds "
                             f"{r.not_ready_timeout_s})"} for k, v in sorted(gone.items())])
    started_any = bool(t.mine)
    active, done = len(t.active), len(t.done)
    if not t:
        d.phase, d.reason, d.message = "Completed", "NoTargets", "no node matches the rollout's nodeSelector"
        return d
    if waiting and not started_any:
        d.phase, d.reason = "Preflight", "WaitingForPreflight"
        d.message = f"waiting for {len(waiting)} node(s) to answer the preflight: {', '.join(waiting[:5])}"
        return d
    if held and first is None and not active:
        d.phase, d.reason = "Preflight" if not started_any else "Progressing", "NodesHeld"
        d.message = (f"{len(held)} node(s) take part in another rollout that has not ended: " + ", ".join(
            f"{k} ({v})" for k, v in sorted(held.items())[:5]) + " (it must end, be aborted or deleted first)")
        return d
    if excluded and r.preflight == "Refuse" and not started_any:
        d.phase, d.reason = "Refused", "PreflightFailed"
        d.message = (f"{len(excluded)} node(s) cannot take driver {r.driver}: " + "; ".join(
            f"{e['node']}: {e['reason']}" for e in excluded[:3]) + " (fix them, skip them with `kubectl driverd node "
            "skip NODE`, or set spec.preflight=Exclude)")
        return d
    if len(failed) > r.failure_budget:
        d.phase, d.reason = "Paused", "FailureBudgetSpent"
        d.message = (f"{len(failed)} node(s) failed, the failure budget is {r.failure_budget}: " + "; ".join(
            f"{f['node']}: {f['reason']}" for f in d.failed[:3]) + " (retry with `kubectl driverd node retry NODE` "
            "or raise spec.failureBudget)")
        return d
    if first is None and not active:
        if refused:
            d.message = _refused_words(refused)
            return d
        if gone_pending:
            d.phase, d.reason = "Paused", "NodesNotReady"
            d.message = (f"{len(gone_pending)} target node(s) NotReady for more than {r.not_ready_timeout_s}s: "
                         + ", ".join(gone_pending[:5]) + f" ({done}/{len(t)} done; they are upgraded "
                         "once Ready again, or leave them out with `kubectl driverd node skip NODE`)")
            return d
        if unknown:
            d.message = (f"{len(unknown)} node(s) record a state this driverd does not know: " + ", ".join(
                [f"{name} ({t.views[name].state})" for name in sorted(unknown)][:5]) + " (their daemons fail them "
                "as UnknownState; then `kubectl driverd node retry NODE`)")
            return d
        if t.pending and not bad:
            if r.paused:        # a paused rollout says so while its nodes answer an edited spec
                d.phase, d.reason, d.message = "Paused", "PausedBySpec", PAUSED_WORDS
                return d
            d.message = "waiting for node preflight answers"
            return d
        d.phase = "Failed" if failed else "Completed"
        d.reason = "NodesFailed" if failed else "Completed"
        d.message = (f"{done} node(s) run driver {r.driver}" + (f", {len(failed)} failed" if failed else "")
                     + (f", {len(bad)} excluded by the preflight" if bad else "")
                     + (f", {len(t.skipped)} skipped" if t.skipped else ""))
        return d
    if r.paused:
        d.phase, d.reason, d.message = "Paused", "PausedBySpec", PAUSED_WORDS
        return d
    # canary: the first N nodes in order go alone; then pause, or continue after the soak time
    budget = r.max_parallel - active
    if r.canary:
        in_canary = done + len(failed) + active
        if in_canary < r.canary:
            candidates = islice(candidates, r.canary - in_canary)
        elif not canary_approved:
            if active:
                candidates = iter(())
            elif r.canary_soak_s is None:
                d.phase, d.reason = "Paused", "CanaryDone"
                d.message = (f"the {r.canary} canary node(s) are done; continue with `kubectl driverd rollout "
                             f"resume {r.name}`")
                return d
            else:
                soak_from = max(t.done_since.values(), default=None)
                left = (soak_from or now) + r.canary_soak_s - now
                if left > 0:
                    d.reason, d.message = "CanarySoak", f"canary done; soaking {left:.0f}s more before the rest"
                    return d
    if waiting:
        # an edited spec is a new generation: nobody goes before every target node answered it, so the
        # order (canary, then by name) holds after an edit too
        d.reason = "WaitingForPreflight"
        d.message = (f"waiting for {len(waiting)} node(s) to answer the preflight of generation {r.generation}: "
                     + ", ".join(waiting[:5]))
        return d
    for n in candidates:
        if budget <= 0:
            break
        if not n.ready:
            continue
        if not n.unavailable and unavailable + 1 > limit:
            break
        d.admit.append(n.name)
        budget -= 1
        if not n.unavailable:
            unavailable += 1
    d.unavailable = unavailable
    d.counts["upgrading"] = active + len(d.admit)
    d.counts["pending"] -= len(d.admit)
    d.message = (f"{done}/{len(t)} done, {active + len(d.admit)} upgrading, "
                 f"{unavailable}/{limit} unavailable" + (f", {len(failed)} failed" if failed else "")
                 + (f"; NotReady for more than {r.not_ready_timeout_s}s: {', '.join(sorted(gone)[:5])}" if gone else "")
                 + (f"; held by other rollouts: {', '.join(sorted(held)[:5])}" if held else "")
                 + (f"; {_refused_words(refused)}" if refused else ""))
    return d


def reopened(r: Rollout, status: dict, nodes: list[NodeView]) -> str | None:
    """What reopens a rollout that ended for its current spec, or None: an ended rollout is terminal
    and holds no node — its nodes answering a later rollout's preflight change nothing — until an
    operator acts on one of its nodes: `kubectl driverd node retry` of a node it left failed (phase
    Failed), `kubectl driverd node skip` of a node whose preflight refused it (phase Refused). (A
    spec edit is a new generation: not ended in the first place.)"""
    phase = status.get("phase")
    targets = {n.name: n for n in nodes if r.selects(n.labels)}
    if phase == "Failed":
        names = sorted(n.name for n in targets.values() if n.in_rollout(r) and n.state == FAILED and n.retry)
        if names:
            return "node retry " + ", ".join(names[:5])
    if phase == "Refused":
        names = sorted(e["node"] for e in status.get("preflightFailures") or []
                       if e.get("node") in targets and targets[e["node"]].skip)
        if names:
            return "node skip " + ", ".join(names[:5])
    return None


def _refused_words(refused: dict) -> str:
    return (f"the API server refused the admission of {len(refused)} node(s): " + "; ".join(
        f"{k}: {v}" for k, v in sorted(refused.items())[:3]) + f" (tried again when the node changes, at the "
        f"latest after {REFUSED_RETRY_S:.0f}s; status.conditions AdmissionRefused)")
