"""Server-side printing: meta.k8s.io/v1 Table answers for kubectl get (built-in printers for the kinds we
care about, a CRD's additionalPrinterColumns, NAME/AGE otherwise)."""
from __future__ import annotations

from datetime import UTC, datetime

from tests.apiserver import jsonpath

_NAME_DESC = ("Name must be unique within a namespace. Is required when creating resources, although some resources "
              "may allow a client to request the generation of an appropriate name automatically. Name is primarily "
              "intended for creation idempotence and configuration definition. Cannot be updated. More info: "
              "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names")


def human_duration(seconds: float) -> str:
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m" if s % 60 == 0 else f"{m}m{s % 60}s"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h" if m % 60 == 0 else f"{h}h{m % 60}m"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{h // 24}d" if h % 24 == 0 else f"{h // 24}d{h % 24}h"
    if h < 24 * 365 * 2:
        return f"{h // 24}d"
    if h < 24 * 365 * 8:
        dy = (h // 24) % 365
        return f"{h // 24 // 365}y" if dy == 0 else f"{h // 24 // 365}y{dy}d"
    return f"{h // 24 // 365}y"


def age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    try:
        t = datetime.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        return "<unknown>"
    return human_duration((datetime.now(UTC) - t).total_seconds())


def _col(name, type_="string", fmt="", desc="", priority=0):
    return {"name": name, "type": type_, "format": fmt, "description": desc or name, "priority": priority}


def _cond(obj, t):
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == t), None)


def _node_row(o):
    c = _cond(o, "Ready")
    status = "Unknown" if c is None else ("Ready" if c.get("status") == "True" else "NotReady")
    if (o.get("spec") or {}).get("unschedulable"):
        status += ",SchedulingDisabled"
    labels = o["metadata"].get("labels") or {}
    roles = sorted({k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and "/" in k}
                   | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set()))
    info = (o.get("status") or {}).get("nodeInfo") or {}
    addrs = (o.get("status") or {}).get("addresses") or []
    ip = lambda t: next((a.get("address") for a in addrs if a.get("type") == t), "<none>")
    return [o["metadata"]["name"], status, ",".join(roles) or "<none>", age(o["metadata"].get("creationTimestamp")),
            info.get("kubeletVersion", ""), ip("InternalIP"), ip("ExternalIP"), info.get("osImage", "<unknown>"),
            info.get("kernelVersion", "<unknown>"), info.get("containerRuntimeVersion", "<unknown>")]


def _pod_row(o):
    spec, st = o.get("spec") or {}, o.get("status") or {}
    total = len(spec.get("containers") or [])
    css = st.get("containerStatuses") or []
    ready = sum(1 for c in css if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in css)
    reason = st.get("reason") or st.get("phase") or ""
    running = False
    for c in reversed(css):
        s = c.get("state") or {}
        if (s.get("waiting") or {}).get("reason"):
            reason = s["waiting"]["reason"]
        elif (s.get("terminated") or {}).get("reason"):
            reason = s["terminated"]["reason"]
        elif "terminated" in s:
            t = s["terminated"]
            reason = f"Signal:{t['signal']}" if t.get("signal") else f"ExitCode:{t.get('exitCode', 0)}"
        elif "running" in s and c.get("ready"):
            running = True
    if reason == "Completed" and running:
        reason = "Running" if _cond(o, "Ready") and _cond(o, "Ready").get("status") == "True" else "NotReady"
    if o["metadata"].get("deletionTimestamp"):
        reason = "Unknown" if st.get("reason") == "NodeLost" else "Terminating"
    gates = spec.get("readinessGates") or []
    return [o["metadata"]["name"], f"{ready}/{total}", reason, restarts, age(o["metadata"].get("creationTimestamp")),
            st.get("podIP") or "<none>", spec.get("nodeName") or "<none>", st.get("nominatedNodeName") or "<none>",
            "<none>" if not gates else f"0/{len(gates)}"]


def _pdb_row(o):
    spec, st = o.get("spec") or {}, o.get("status") or {}
    return [o["metadata"]["name"], str(spec["minAvailable"]) if "minAvailable" in spec else "N/A",
            str(spec["maxUnavailable"]) if "maxUnavailable" in spec else "N/A", st.get("disruptionsAllowed", 0),
            age(o["metadata"].get("creationTimestamp"))]


def _ns_row(o):
    return [o["metadata"]["name"], (o.get("status") or {}).get("phase", ""), age(o["metadata"].get("creationTimestamp"))]


def _lease_row(o):
    return [o["metadata"]["name"], (o.get("spec") or {}).get("holderIdentity", ""),
            age(o["metadata"].get("creationTimestamp"))]


def _event_row(o):
    io = o.get("involvedObject") or {}
    last = o.get("lastTimestamp") or o.get("eventTime") or o["metadata"].get("creationTimestamp")
    return [age(last), o.get("type", ""), o.get("reason", ""), f"{(io.get('kind') or '').lower()}/{io.get('name', '')}",
            o.get("message", "")]


def _cm_row(o):
    return [o["metadata"]["name"], len(o.get("data") or {}) + len(o.get("binaryData") or {}),
            age(o["metadata"].get("creationTimestamp"))]


def _ds_row(o):
    st = o.get("status") or {}
    sel = ((o.get("spec") or {}).get("template") or {}).get("spec", {}).get("nodeSelector") or {}
    return [o["metadata"]["name"], st.get("desiredNumberScheduled", 0), st.get("currentNumberScheduled", 0),
            st.get("numberReady", 0), st.get("updatedNumberScheduled", 0), st.get("numberAvailable", 0),
            ",".join(f"{k}={v}" for k, v in sel.items()) or "<none>", age(o["metadata"].get("creationTimestamp"))]


def _deploy_row(o):
    st = o.get("status") or {}
    return [o["metadata"]["name"], f"{st.get('readyReplicas', 0)}/{(o.get('spec') or {}).get('replicas', 1)}",
            st.get("updatedReplicas", 0), st.get("availableReplicas", 0), age(o["metadata"].get("creationTimestamp"))]


def _job_row(o):
    st, spec = o.get("status") or {}, o.get("spec") or {}
    conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
    status = "Complete" if conds.get("Complete") == "True" else "Failed" if conds.get("Failed") == "True" else \
        "Suspended" if spec.get("suspend") else "Running"
    return [o["metadata"]["name"], status, f"{st.get('succeeded', 0)}/{spec.get('completions', 1)}",
            "", age(o["metadata"].get("creationTimestamp"))]


def _crd_row(o):
    return [o["metadata"]["name"], o["metadata"].get("creationTimestamp", "")]


_AGE = _col("Age", "string", "", "CreationTimestamp is a timestamp representing the server time when this object "
            "was created.")
PRINTERS = {
    ("", "nodes"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Status"), _col("Roles"), _AGE, _col("Version"),
                     _col("Internal-IP", priority=1), _col("External-IP", priority=1), _col("OS-Image", priority=1),
                     _col("Kernel-Version", priority=1), _col("Container-Runtime", priority=1)], _node_row),
    ("", "pods"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Ready"), _col("Status"),
                    _col("Restarts", "string"), _AGE, _col("IP", priority=1), _col("Node", priority=1),
                    _col("Nominated Node", priority=1), _col("Readiness Gates", priority=1)], _pod_row),
    ("policy", "poddisruptionbudgets"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Min Available"),
                                          _col("Max Unavailable"), _col("Allowed Disruptions", "integer"), _AGE],
                                         _pdb_row),
    ("", "namespaces"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Status"), _AGE], _ns_row),
    ("coordination.k8s.io", "leases"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Holder"), _AGE], _lease_row),
    ("", "events"): ([_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"), _col("Message")], _event_row),
    ("", "configmaps"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Data", "integer"), _AGE], _cm_row),
    ("apps", "daemonsets"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Desired", "integer"),
                              _col("Current", "integer"), _col("Ready", "integer"), _col("Up-to-date", "integer"),
                              _col("Available", "integer"), _col("Node Selector"), _AGE], _ds_row),
    ("apps", "deployments"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Ready"), _col("Up-to-date", "integer"),
                               _col("Available", "integer"), _AGE], _deploy_row),
    ("batch", "jobs"): ([_col("Name", fmt="name", desc=_NAME_DESC), _col("Status"), _col("Completions"),
                         _col("Duration"), _AGE], _job_row),
    ("apiextensions.k8s.io", "customresourcedefinitions"): ([_col("Name", fmt="name", desc=_NAME_DESC),
                                                             _col("Created At", "date")], _crd_row),
}


def _crd_columns(res):
    cols = res.crd.get("columns") or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    defs = [_col("Name", fmt="name", desc=_NAME_DESC)]
    parsed = []
    for c in cols:
        defs.append({"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                     "description": c.get("description", ""), "priority": c.get("priority", 0)})
        try:
            parsed.append((c.get("type", "string"), jsonpath.parse(c.get("jsonPath", ""))))
        except ValueError:
            parsed.append((c.get("type", "string"), None))

    def row(o):
        cells = [o["metadata"]["name"]]
        for typ, path in parsed:
            vals = jsonpath.find(o, path) if path is not None else []
            if not vals:
                cells.append(None)
            elif len(vals) > 1:
                cells.append(" ".join(_fmt(v) for v in vals))
            elif typ == "date":
                cells.append(age(vals[0]) if isinstance(vals[0], str) else vals[0])
            elif typ == "string":
                cells.append(_fmt(vals[0]))
            else:
                cells.append(vals[0])
        return cells
    return defs, row


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        import json
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def printer_for(res):
    if res.crd is not None:
        return _crd_columns(res)
    key = res.storage or (res.group, res.plural)
    if key in PRINTERS and res.storage is None:
        return PRINTERS[key]
    return [_col("Name", fmt="name", desc=_NAME_DESC), _AGE], \
        (lambda o: [o["metadata"]["name"], age(o["metadata"].get("creationTimestamp"))])


def partial(obj: dict) -> dict:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def table(res, objs: list[dict], *, include_object: str = "Metadata", headers: bool = True, rv: str = "",
          cont: str = "", remaining: int | None = None) -> dict:
    cols, row = printer_for(res)
    rows = []
    for o in objs:
        r = {"cells": row(o)}
        if include_object == "Object":
            r["object"] = o
        elif include_object != "None":
            r["object"] = partial(o)
        rows.append(r)
    md = {"resourceVersion": rv} if rv else {}
    if cont:
        md["continue"] = cont
    if remaining:
        md["remainingItemCount"] = remaining
    out = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": md}
    if headers:
        out["columnDefinitions"] = cols
    out["rows"] = rows
    return out
