"""Label selectors (string syntax and metav1.LabelSelector) and field selectors, as the API server parses them."""
from __future__ import annotations

import re

from tests.apiserver.errors import bad_request

_TOKEN = re.compile(r"\s*(!=|==|=|\(|\)|,|!|[^\s!=(),]+)")


def _tokens(s: str) -> list[str]:
    out, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m or m.end() == pos:
            if s[pos:].strip() == "":
                break
            raise bad_request(f"unable to parse requirement: invalid label selector: {s!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


class LabelSelector:
    """A parsed label selector: a list of (key, op, values) requirements, all of which must hold."""

    def __init__(self, reqs: list[tuple[str, str, tuple]]):
        self.reqs = reqs

    @classmethod
    def parse(cls, s: str | None) -> LabelSelector:
        s = (s or "").strip()
        reqs = []
        if not s:
            return cls(reqs)
        toks, i = _tokens(s), 0

        def err(msg="unable to parse requirement"):
            return bad_request(f"unable to parse requirement: {msg}: {s}")
        while i < len(toks):
            if toks[i] == "!":
                if i + 1 >= len(toks):
                    raise err()
                reqs.append((toks[i + 1], "!", ()))
                i += 2
            else:
                key = toks[i]
                i += 1
                if i >= len(toks) or toks[i] == ",":
                    reqs.append((key, "exists", ()))
                elif toks[i] in ("=", "==", "!="):
                    op = "!=" if toks[i] == "!=" else "="
                    val = ""
                    if i + 1 < len(toks) and toks[i + 1] not in (",",):
                        val = toks[i + 1]
                        i += 2
                    else:
                        i += 1
                    reqs.append((key, op, (val,)))
                elif toks[i] in ("in", "notin"):
                    op = toks[i]
                    if i + 1 >= len(toks) or toks[i + 1] != "(":
                        raise err("found '" + (toks[i + 1] if i + 1 < len(toks) else "") + "', expected: '('")
                    i += 2
                    vals = []
                    while i < len(toks) and toks[i] != ")":
                        if toks[i] != ",":
                            vals.append(toks[i])
                        i += 1
                    if i >= len(toks):
                        raise err("found '', expected: ')'")
                    i += 1
                    reqs.append((key, op, tuple(vals)))
                else:
                    raise err(f"found '{toks[i]}', expected: in, notin, =, ==, !=, gt, lt")
            if i < len(toks):
                if toks[i] != ",":
                    raise err(f"found '{toks[i]}', expected: ','")
                i += 1
        return cls(reqs)

    @classmethod
    def from_dict(cls, sel: dict | None) -> LabelSelector | None:
        """metav1.LabelSelector -> selector; None for a nil selector (matches nothing), empty {} matches all."""
        if sel is None:
            return None
        reqs = [(k, "=", (str(v),)) for k, v in (sel.get("matchLabels") or {}).items()]
        for e in sel.get("matchExpressions") or []:
            op = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}.get(e.get("operator"))
            if not op:
                raise bad_request(f"{e.get('operator')!r} is not a valid label selector operator")
            reqs.append((e.get("key", ""), op, tuple(e.get("values") or ())))
        return cls(reqs)

    def empty(self) -> bool:
        return not self.reqs

    def matches(self, labels: dict | None) -> bool:
        labels = labels or {}
        for key, op, vals in self.reqs:
            has = key in labels
            v = labels.get(key)
            if op == "=" and not (has and v == vals[0]):
                return False
            if op == "!=" and has and v == vals[0]:
                return False
            if op == "in" and not (has and v in vals):
                return False
            if op == "notin" and has and v in vals:
                return False
            if op == "exists" and not has:
                return False
            if op == "!" and has:
                return False
        return True


# Fields each kind supports in fieldSelector (besides metadata.name and metadata.namespace).
FIELDS = {
    ("", "pods"): {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                   "spec.hostNetwork", "status.phase", "status.podIP", "status.podIPs", "status.nominatedNodeName"},
    ("", "nodes"): {"spec.unschedulable"},
    ("", "namespaces"): {"status.phase"},
    ("", "secrets"): {"type"},
    ("", "events"): {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                     "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath",
                     "reason", "reportingComponent", "source", "type"},
    ("events.k8s.io", "events"): {"regarding.kind", "regarding.namespace", "regarding.name", "regarding.uid",
                                  "regarding.apiVersion", "regarding.resourceVersion", "regarding.fieldPath",
                                  "reason", "reportingController", "type", "deprecatedSource"},
    ("batch", "jobs"): {"status.successful"},
    ("apps", "replicasets"): {"status.replicas"},
}


def _field_value(obj: dict, path: str) -> str:
    if path == "source":
        path = "source.component"
    if path == "deprecatedSource":
        path = "deprecatedSource.component"
    if path == "status.podIPs":
        return ",".join(p.get("ip", "") for p in (obj.get("status") or {}).get("podIPs") or [])
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return "false" if path in ("spec.unschedulable", "spec.hostNetwork") else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


class FieldSelector:
    def __init__(self, reqs: list[tuple[str, str, str]]):
        self.reqs = reqs

    @classmethod
    def parse(cls, s: str | None, group: str = "", plural: str = "", extra_fields=()) -> FieldSelector:
        reqs = []
        for part in (s or "").split(","):
            part = part.strip()
            if not part:
                continue
            m = re.match(r"^([^=!]+)(==|=|!=)(.*)$", part)
            if not m:
                raise bad_request(f"invalid selector: '{s}'; can't understand '{part}'")
            key, op, val = m.group(1).strip(), m.group(2), m.group(3).strip()
            allowed = {"metadata.name", "metadata.namespace"} | FIELDS.get((group, plural), set()) | set(extra_fields)
            if key not in allowed:
                raise bad_request(f'field label not supported: {key}')
            reqs.append((key, "!=" if op == "!=" else "=", val))
        return cls(reqs)

    def empty(self) -> bool:
        return not self.reqs

    def matches(self, obj: dict) -> bool:
        for key, op, val in self.reqs:
            have = _field_value(obj, key)
            if (have == val) != (op == "="):
                return False
        return True

    def exact_name(self) -> str | None:
        for key, op, val in self.reqs:
            if key == "metadata.name" and op == "=":
                return val
        return None
