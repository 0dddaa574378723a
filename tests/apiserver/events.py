"""events.k8s.io/v1 Event <-> core v1 Event: one storage (core v1), two served forms, as in Kubernetes."""
from __future__ import annotations

_RENAMES = [  # (events.k8s.io/v1, core/v1)
    ("regarding", "involvedObject"), ("note", "message"), ("deprecatedCount", "count"),
    ("deprecatedFirstTimestamp", "firstTimestamp"), ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedSource", "source"), ("reportingController", "reportingComponent"),
]
_SAME = ("metadata", "eventTime", "action", "reason", "type", "related", "reportingInstance")


def to_core(ev: dict) -> dict:
    out = {"apiVersion": "v1", "kind": "Event"}
    for k in _SAME:
        if k in ev:
            out[k] = ev[k]
    for new, old in _RENAMES:
        if new in ev:
            out[old] = ev[new]
    if "series" in ev and ev["series"] is not None:
        out["series"] = {"count": ev["series"].get("count"), "lastObservedTime": ev["series"].get("lastObservedTime")}
    return out


def to_events_v1(ev: dict) -> dict:
    out = {"apiVersion": "events.k8s.io/v1", "kind": "Event"}
    for k in _SAME:
        if k in ev:
            out[k] = ev[k]
    for new, old in _RENAMES:
        if old in ev:
            out[new] = ev[old]
    if ev.get("series"):
        out["series"] = {"count": ev["series"].get("count"), "lastObservedTime": ev["series"].get("lastObservedTime")}
    if not out.get("eventTime"):
        # Kubernetes serves null here for events written through core/v1 without eventTime; clients that require
        # the field (the Python client's models do) then fail, so this view fills it from the legacy timestamps.
        t = ev.get("firstTimestamp") or ev.get("lastTimestamp") or (ev.get("metadata") or {}).get("creationTimestamp")
        if t:
            out["eventTime"] = t[:19] + ".000000Z"
    return out
