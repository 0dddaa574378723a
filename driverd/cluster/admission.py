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

from dataclasses import dataclass, field

from driverd.cluster.model import ACTIVE, DONE, FAILED, NodeView, Rollout
from driverd.cluster.states import node_state

PREFLIGHT_DEADLINE_S = 120.0
REFUSED_RETRY_S = 30.0          # a refused admission is tried again after this (or when the node changes)
A_CANARY_APPROVED = "driverd.io/canary-approved"
PAUSED_WORDS = "spec.paused is true (resume: kubectl driverd rollout resume)"


@dataclass
class Decision:
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


def _not_ready_for(n: NodeView, now: float) -> float:
    from driverd.cluster.kube import parse_time
    t = parse_time(n.ready_since)
    return 0.0 if n.ready or t is None else max(0.0, now - t)


def decide(r: Rollout, nodes: list[NodeView], *, now: float, started: float, canary_approved: bool = False,
           held: dict | None = None, refused: dict | None = None) -> Decision:
    held, refused = dict(held or {}), dict(refused or {})
    targets = sorted((n for n in nodes if r.selects(n.labels)), key=lambda n: n.name)
    mine = [n for n in targets if n.in_rollout(r)]
    # done/failed count only for the current target: after an edit of spec.driver they are pending again
    done = [n for n in targets if (n.in_rollout(r) and n.state == DONE and n.target in ("", r.target))
            or _up_to_date(n, r)]
    failed = [n for n in mine if n.state == FAILED and not n.retry and n.target in ("", r.target)]
    active = [n for n in mine if n.state in ACTIVE]
    skipped = [n for n in targets if n.skip and n not in active]
    settled = {n.name for n in done + failed + active + skipped}
    pending = [n for n in targets if n.name not in settled]
    held = {n.name: held[n.name] for n in pending if n.name in held}
    refused = {n.name: refused[n.name] for n in pending if n.name in refused}
    # a target node NotReady past the bound and not being upgraded: named, and out of the budget's
    # count and base (a failed one stays failed: the failure budget counts it)
    upgrading = {n.name for n in active}
    gone = {n.name: t for n in targets if n.name not in upgrading and (t := _not_ready_for(n, now)) > r.not_ready_timeout_s}
    gone_pending = sorted(n.name for n in pending if n.name in gone)
    limit = r.unavailable_limit(len(targets) - len(gone))
    # a state this driverd does not know: not free, so not admitted (its daemon fails it: UnknownState)
    unknown = {n.name for n in pending if node_state(n.state) is None}
    waiting = [n.name for n in pending if _pre_ok(n, r) is None and n.name not in held and n.name not in gone]
    late = now - started > PREFLIGHT_DEADLINE_S
    excluded = [{"node": n.name, "reason": "; ".join(n.preflight.get("reasons") or ["preflight failed"])}
                for n in pending if _pre_ok(n, r) is False]
    if late:
        excluded += [{"node": name, "reason": f"its driverd did not answer the preflight within "
                      f"{PREFLIGHT_DEADLINE_S:.0f}s (is the daemon running on it?)"} for name in waiting]
        waiting = []
    bad = {e["node"] for e in excluded}
    excluded = [e for e in excluded if e["node"] not in gone]
    bad -= set(gone)
    candidates = [n for n in pending if n.name not in bad and n.name not in waiting and n.name not in held
                  and n.name not in gone and n.name not in unknown and n.name not in refused]
    unavailable = sum(1 for n in targets if n.unavailable and n.name not in gone)
    counts = {"total": len(targets), "done": len(done), "failed": len(failed), "upgrading": len(active),
              "pending": len(pending) - len(bad), "skipped": len(skipped), "excluded": len(bad) if r.preflight ==
              "Exclude" else 0, "notReady": len(gone)}
    d = Decision("Progressing", "Progressing", "", counts=counts, excluded=excluded,
                 failed=[{"node": n.name, "reason": f"{n.reason}: {n.message}".strip(": ")} for n in failed],
                 waiting=waiting, pending=[n.name for n in pending], unavailable=unavailable,
                 limit_unavailable=limit, held=held, refused=refused,
                 not_ready=[{"node": k, "reason": f"NotReady for {v:.0f}s (more than notReadyTimeoutSeconds "
                             f"{r.not_ready_timeout_s})"} for k, v in sorted(gone.items())])
    started_any = bool(mine)
    if not targets:
        d.phase, d.reason, d.message = "Completed", "NoTargets", "no node matches the rollout's nodeSelector"
        return d
    if waiting and not started_any:
        d.phase, d.reason = "Preflight", "WaitingForPreflight"
        d.message = f"waiting for {len(waiting)} node(s) to answer the preflight: {', '.join(waiting[:5])}"
        return d
    if held and not candidates and not active:
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
    if not candidates and not active:
        if refused:
            d.message = _refused_words(refused)
            return d
        if gone_pending:
            d.phase, d.reason = "Paused", "NodesNotReady"
            d.message = (f"{len(gone_pending)} target node(s) NotReady for more than {r.not_ready_timeout_s}s: "
                         + ", ".join(gone_pending[:5]) + f" ({len(done)}/{len(targets)} done; they are upgraded "
                         "once Ready again, or leave them out with `kubectl driverd node skip NODE`)")
            return d
        if unknown:
            d.message = (f"{len(unknown)} node(s) record a state this driverd does not know: " + ", ".join(
                [f"{n.name} ({n.state})" for n in pending if n.name in unknown][:5]) + " (their daemons fail them "
                "as UnknownState; then `kubectl driverd node retry NODE`)")
            return d
        if pending and not candidates and not bad:
            if r.paused:        # a paused rollout says so while its nodes answer an edited spec
                d.phase, d.reason, d.message = "Paused", "PausedBySpec", PAUSED_WORDS
                return d
            d.message = "waiting for node preflight answers"
            return d
        d.phase = "Failed" if failed else "Completed"
        d.reason = "NodesFailed" if failed else "Completed"
        d.message = (f"{len(done)} node(s) run driver {r.driver}" + (f", {len(failed)} failed" if failed else "")
                     + (f", {len(bad)} excluded by the preflight" if bad else "")
                     + (f", {len(skipped)} skipped" if skipped else ""))
        return d
    if r.paused:
        d.phase, d.reason, d.message = "Paused", "PausedBySpec", PAUSED_WORDS
        return d
    # canary: the first N nodes in order go alone; then pause, or continue after the soak time
    budget = r.max_parallel - len(active)
    if r.canary:
        in_canary = len(done) + len(failed) + len(active)
        if in_canary < r.canary:
            candidates = candidates[:r.canary - in_canary]
        elif not canary_approved:
            if active:
                candidates = []
            elif r.canary_soak_s is None:
                d.phase, d.reason = "Paused", "CanaryDone"
                d.message = (f"the {r.canary} canary node(s) are done; continue with `kubectl driverd rollout "
                             f"resume {r.name}`")
                return d
            else:
                soak_from = _latest_done(done)
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
    d.counts["upgrading"] = len(active) + len(d.admit)
    d.counts["pending"] -= len(d.admit)
    d.message = (f"{len(done)}/{len(targets)} done, {len(active) + len(d.admit)} upgrading, "
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


def _latest_done(done: list[NodeView]) -> float | None:
    from driverd.cluster.kube import parse_time
    ts = [t for t in (parse_time(n.since) for n in done) if t is not None]
    return max(ts) if ts else None
