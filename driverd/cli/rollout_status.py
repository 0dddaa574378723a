"""A rollout's status as `kubectl driverd rollout status` shows it: the document (-o json/yaml), its
table, and the exit code that follows the phase table (cluster/states.py)."""
from __future__ import annotations

from driverd.cli.kubeprint import _cells, _shown

NO_STATUS_AFTER_S = 30        # a rollout without any status this long after its creation: no coordinator runs


def _age_s(obj: dict) -> float:
    import time

    from driverd.cluster.kube import parse_time
    created = parse_time((obj.get("metadata") or {}).get("creationTimestamp"))
    return max(0.0, time.time() - created) if created else 0.0


def status_doc(rollout: dict, nodes: list[dict]) -> dict:
    from driverd.cluster import model as m
    try:
        r = m.Rollout.from_object(rollout)
        targets = [n for n in nodes if r.selects(n["metadata"].get("labels") or {})]
    except m.SpecError:
        targets = []
    views = sorted((m.NodeView.from_node(n) for n in targets), key=lambda v: v.name)
    name = rollout["metadata"]["name"]
    st = rollout.get("status") or {}
    reason, message = st.get("reason", ""), st.get("message", "")
    if not st and _age_s(rollout) > NO_STATUS_AFTER_S:
        # nobody coordinates: the coordinator writes every rollout's status within seconds (issue 44: its own
        # Deployment, on no GPU node)
        reason = "NoCoordinator"
        message = (f"no coordinator has written this rollout's status in {int(_age_s(rollout))}s: is deploy/'s "
                   "coordinator running? `kubectl -n driverd get deploy driverd-coordinator` (it runs on no GPU "
                   "node; `kubectl -n driverd get lease driverd-rollout` names its holder)")
    return {"rollout": name, "driver": rollout["spec"].get("driver"), "flavor": rollout["spec"].get("flavor", "auto"),
            "phase": st.get("phase", "Pending"), "reason": reason, "message": message,
            "counts": st.get("nodes") or {}, "preflightFailures": st.get("preflightFailures") or [],
            "nodes": [{"node": v.name, "state": v.state if v.in_rollout_name(name) else m.IDLE,
                       "driver": v.driver, "flavor": v.flavor, "reason": v.reason, "message": v.message,
                       "since": v.since, "cordonedByUs": v.cordoned_by_us, "attempt": v.attempt}
                      for v in views]}


def _human_status(d: dict, wide: bool = False) -> str:
    from driverd.cli.output import table
    from driverd.cluster.states import FAILED
    c = d["counts"]
    head = _shown(f"rollout {d['rollout']}: driver {d['driver']} ({d['flavor']}) — {d['phase']}"
                  + (f" ({d['reason']})" if d["reason"] and d["reason"] != d["phase"] else "")
                  + (f"\n  {d['message']}" if d["message"] else ""), keep="\n")
    if wide:        # the whole message, and what -o table leaves out
        rows = [["NODE", "STATE", "DRIVER", "FLAVOR", "REASON", "SINCE", "ATTEMPT", "CORDONED", "MESSAGE"]]
        rows += [[n["node"], n["state"], n["driver"] or "-", n["flavor"] or "-", n["reason"] or "-",
                  n["since"] or "-", str(n["attempt"] or "-"), "yes" if n["cordonedByUs"] else "no",
                  " ".join((n["message"] or "-").split())] for n in d["nodes"]]
    else:
        rows = [["NODE", "STATE", "DRIVER", "FLAVOR", "REASON", "SINCE"]]
        rows += [[n["node"], n["state"], n["driver"] or "-", n["flavor"] or "-",
                  (n["reason"] + (": " + n["message"] if n["state"] == FAILED and n["message"] else ""))[:100] or "-",
                  n["since"] or "-"] for n in d["nodes"]]
    summary = (f"  {c.get('done', 0)}/{c.get('total', len(d['nodes']))} done, {c.get('upgrading', 0)} upgrading, "
               f"{c.get('pending', 0)} pending, {c.get('failed', 0)} failed"
               + (f", {c.get('skipped')} skipped" if c.get("skipped") else "")
               + (f", {c.get('excluded')} excluded" if c.get("excluded") else ""))
    pre = "".join(f"\n  preflight: {_shown(p['node'])}: {_shown(p['reason'])}" for p in d["preflightFailures"][:10])
    return head + "\n" + table(_cells(rows)) + "\n" + summary + pre


def _exit(d: dict, *, ended_only: bool = False) -> int:
    """0 for a rollout that is fine (status) or Completed (wait), else 3; a rollout that matched no
    node is not a success (the selector is probably wrong). Phases come from cluster/states.py."""
    from driverd.cluster.states import PHASES
    phase = PHASES.get(d["phase"])
    ok = phase is not None and (phase.name == "Completed" if ended_only else phase.ok)
    return 0 if ok and d["reason"] != "NoTargets" else 3
