"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and Kubernetes strategic merge patch.

Strategic merge needs the patch strategy of each list. The real server reads it from the Go struct tags
(``patchStrategy:"merge" patchMergeKey:"name"``); here ``MERGE_KEYS`` lists those of the types we serve, by
field name (with the few names whose key depends on where they sit resolved by their parent path).
Lists not named there are replaced, as for atomic lists in Kubernetes.
"""
from __future__ import annotations

import copy
import json

from tests.apiserver.errors import ApiError, bad_request

# field name -> merge key ("" = a list of primitives merged as a set)
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
    "env": "name", "ports": "containerPort", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "imagePullSecrets": "name", "conditions": "type", "taints": "key", "ownerReferences": "uid",
    "finalizers": "", "hostAliases": "ip", "topologySpreadConstraints": "topologyKey", "addresses": "type",
    "podIPs": "ip", "hostIPs": "ip", "resourceClaims": "name", "resizePolicy": "resourceName",
    "schedulingGates": "name", "secrets": "name",
}
# (parent path suffix, field) overrides: service ports merge on port, and a few lists that are atomic
OVERRIDES = {
    ("Service", "spec.ports"): "port",
}
ATOMIC_PATHS = {"metadata.managedFields"}


def merge_key_for(path: str, fieldname: str, kind: str = ""):
    """The merge key of list ``fieldname`` at dotted ``path`` (None: replace the list; "": primitive set)."""
    if path in ATOMIC_PATHS:
        return None
    if (kind, path) in OVERRIDES:
        return OVERRIDES[(kind, path)]
    if fieldname == "finalizers" and path != "metadata.finalizers":
        return None
    if fieldname == "conditions" and not path.startswith("status"):
        return None
    if fieldname == "ports" and not path.endswith(("containers.ports", "Containers.ports")):
        return None
    if fieldname == "secrets" and kind != "ServiceAccount":
        return None
    return MERGE_KEYS.get(fieldname)


# ---------------------------------------------------------------- RFC 7386

def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# ---------------------------------------------------------------- RFC 6902

def _unescape(tok: str) -> str:
    return tok.replace("~1", "/").replace("~0", "~")


def _pointer(doc, path: str):
    if path == "":
        return None, None
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", "the server rejected our request due to an error in our request")
    toks = [_unescape(t) for t in path[1:].split("/")]
    parent = doc
    for t in toks[:-1]:
        if isinstance(parent, dict):
            if t not in parent:
                raise _jp_error(f"doc is missing path: {path}: missing value")
            parent = parent[t]
        elif isinstance(parent, list):
            try:
                parent = parent[int(t)]
            except (ValueError, IndexError):
                raise _jp_error(f"doc is missing path: {path}: missing value") from None
        else:
            raise _jp_error(f"doc is missing path: {path}: missing value")
    return parent, toks[-1]


def _jp_error(msg: str) -> ApiError:
    return ApiError(422, "Invalid", msg)


def _get(parent, tok, path):
    if isinstance(parent, dict):
        if tok not in parent:
            raise _jp_error(f"doc is missing key: {path}: missing value")
        return parent[tok]
    if isinstance(parent, list):
        try:
            i = int(tok)
            if i < 0:
                raise ValueError
            return parent[i]
        except (ValueError, IndexError):
            raise _jp_error(f"doc is missing index: {path}: missing value") from None
    raise _jp_error(f"doc is missing path: {path}: missing value")


def json_patch(doc, ops):
    if not isinstance(ops, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op:
            raise bad_request("invalid JSON patch operation")
        kind, path = op["op"], op.get("path", "")
        if kind in ("add", "replace", "test") and "value" not in op:
            raise _jp_error("Unexpected kind: missing value")
        if kind in ("move", "copy"):
            src_parent, src_tok = _pointer(doc, op.get("from", ""))
            value = copy.deepcopy(_get(src_parent, src_tok, op.get("from")))
            if kind == "move":
                _remove(src_parent, src_tok, op.get("from"))
            doc = _add(doc, path, value)
        elif kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            parent, tok = _pointer(doc, path)
            _remove(parent, tok, path)
        elif kind == "replace":
            if path == "":
                doc = copy.deepcopy(op["value"])
                continue
            parent, tok = _pointer(doc, path)
            _get(parent, tok, path)
            if isinstance(parent, list):
                parent[int(tok)] = copy.deepcopy(op["value"])
            else:
                parent[tok] = copy.deepcopy(op["value"])
        elif kind == "test":
            cur = doc if path == "" else _get(*_pointer(doc, path), path)
            if cur != op["value"]:
                raise _jp_error(f"testing value {path} failed: test failed")
        else:
            raise _jp_error(f"Unexpected kind: {kind}")
    return doc


def _add(doc, path, value):
    if path == "":
        return value
    parent, tok = _pointer(doc, path)
    if isinstance(parent, dict):
        parent[tok] = value
    elif isinstance(parent, list):
        if tok == "-":
            parent.append(value)
        else:
            try:
                i = int(tok)
            except ValueError:
                raise _jp_error(f"add operation does not apply: doc is missing path: \"{path}\": missing value") from None
            if i < 0 or i > len(parent):
                raise _jp_error(f"add operation does not apply: doc is missing path: \"{path}\": missing value")
            parent.insert(i, value)
    else:
        raise _jp_error(f"add operation does not apply: doc is missing path: \"{path}\": missing value")
    return doc


def _remove(parent, tok, path):
    if isinstance(parent, dict):
        if tok not in parent:
            raise _jp_error(f"remove operation does not apply: doc is missing path: \"{path}\": missing value")
        del parent[tok]
    elif isinstance(parent, list):
        try:
            del parent[int(tok)]
        except (ValueError, IndexError):
            raise _jp_error(f"remove operation does not apply: doc is missing path: \"{path}\": missing value") from None
    else:
        raise _jp_error(f"remove operation does not apply: doc is missing path: \"{path}\": missing value")


# ---------------------------------------------------------------- strategic merge

_DIRECTIVE = "$patch"
_DEL_PRIM = "$deleteFromPrimitiveList/"
_ORDER = "$setElementOrder/"
_RETAIN = "$retainKeys"


def strategic_merge(original: dict, patch: dict, kind: str = "") -> dict:
    if not isinstance(patch, dict):
        raise bad_request("strategic merge patch must be a JSON object")
    return _smp_map(copy.deepcopy(original) if isinstance(original, dict) else {}, patch, "", kind)


def _join(path, k):
    return f"{path}.{k}" if path else k


def _smp_map(orig: dict, patch: dict, path: str, kind: str) -> dict:
    directive = patch.get(_DIRECTIVE)
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: v for k, v in patch.items() if k != _DIRECTIVE}
    if directive not in (None, "merge"):
        raise bad_request(f"Unknown patch type: {directive}")
    out = orig
    retain = patch.get(_RETAIN)
    if retain is not None:
        out = {k: v for k, v in out.items() if k in retain}
    orders = {}
    for k, v in patch.items():
        if k in (_DIRECTIVE, _RETAIN):
            continue
        if k.startswith(_DEL_PRIM):
            name = k[len(_DEL_PRIM):]
            if isinstance(out.get(name), list):
                out[name] = [x for x in out[name] if x not in (v or [])]
            continue
        if k.startswith(_ORDER):
            orders[k[len(_ORDER):]] = v
            continue
        sub = _join(path, k)
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict):
            cur = out.get(k)
            merged = _smp_map(copy.deepcopy(cur) if isinstance(cur, dict) else {}, v, sub, kind)
            if merged is None:
                out.pop(k, None)
            else:
                out[k] = merged
        elif isinstance(v, list):
            mk = merge_key_for(sub, k, kind)
            cur = out.get(k)
            if mk is None:
                out[k] = _strip_directives(v)
            else:
                out[k] = _smp_list(cur if isinstance(cur, list) else [], v, mk, sub, kind)
        else:
            out[k] = v
    for name, order in orders.items():
        if isinstance(out.get(name), list):
            mk = merge_key_for(_join(path, name), name, kind)
            out[name] = _apply_order(out[name], order, mk)
    return out


def _strip_directives(v):
    if isinstance(v, dict):
        return {k: _strip_directives(x) for k, x in v.items() if not k.startswith("$")}
    if isinstance(v, list):
        return [_strip_directives(x) for x in v]
    return v


def _smp_list(orig: list, patch: list, mk: str, path: str, kind: str) -> list:
    if mk == "":                                   # primitive list with merge strategy: set union
        for item in patch:
            if isinstance(item, dict) and item.get(_DIRECTIVE) == "replace":
                return [x for x in patch if not isinstance(x, dict)]
        out = list(orig)
        for item in patch:
            if item not in out:
                out.append(item)
        return out
    for item in patch:
        if isinstance(item, dict) and item.get(_DIRECTIVE) == "replace":
            return [_strip_directives(x) for x in patch if not (isinstance(x, dict) and x.get(_DIRECTIVE))]
    out = [copy.deepcopy(x) for x in orig]
    for item in patch:
        if not isinstance(item, dict):
            raise bad_request(f"map: {item!r} does not contain declared merge key: {mk}")
        directive = item.get(_DIRECTIVE)
        if mk not in item:
            raise bad_request(f"map: map[{', '.join(f'{k}:{v}' for k, v in item.items())}] does not contain "
                              f"declared merge key: {mk}")
        idx = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(mk) == item[mk]), None)
        if directive == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(_smp_map({}, item, path, kind) or {})
        else:
            out[idx] = _smp_map(out[idx], item, path, kind) or {}
    return out


def _apply_order(items: list, order: list, mk) -> list:
    def ident(x):
        return x.get(mk) if mk and isinstance(x, dict) else json.dumps(x, sort_keys=True)
    wanted = [o.get(mk) if mk and isinstance(o, dict) else json.dumps(o, sort_keys=True) for o in order]
    pos = {w: i for i, w in enumerate(wanted)}
    ordered = sorted([x for x in items if ident(x) in pos], key=lambda x: pos[ident(x)])
    rest = [x for x in items if ident(x) not in pos]
    return ordered + rest


def apply_patch(content_type: str, original: dict, body: bytes, *, kind: str = "", strategic_ok: bool = True) -> dict:
    """Apply a PATCH request body of ``content_type`` to ``original`` and return the new object."""
    ct = (content_type or "").split(";")[0].strip().lower()
    try:
        patch = json.loads(body or b"null")
    except ValueError as e:
        if ct == "application/apply-patch+yaml":
            import yaml
            patch = yaml.safe_load(body)
        else:
            raise bad_request(f"error decoding patch: {e}") from None
    if ct == "application/json-patch+json":
        return json_patch(original, patch)
    if ct == "application/merge-patch+json":
        if not isinstance(patch, dict):
            raise bad_request("error decoding patch: merge patch must be a JSON object")
        return merge_patch(original, patch)
    if ct == "application/strategic-merge-patch+json":
        if not strategic_ok:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           "accepted media types include: application/json-patch+json, application/merge-patch+json, "
                           "application/apply-patch+yaml")
        return strategic_merge(original, patch, kind)
    if ct == "application/apply-patch+yaml":
        if not isinstance(patch, dict):
            raise bad_request("error decoding YAML: apply patch must be an object")
        return _apply_configuration(original, patch, kind, strategic_ok)
    raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media "
                   "types include: application/json-patch+json, application/merge-patch+json, "
                   "application/apply-patch+yaml" + (", application/strategic-merge-patch+json" if strategic_ok else ""))


def _apply_configuration(original: dict, applied: dict, kind: str, strategic_ok: bool) -> dict:
    """Server-side apply, approximated: the applied configuration is merged in (strategic lists where known).
    Field ownership, conflicts and removal of fields no longer applied are NOT emulated."""
    if strategic_ok:
        return strategic_merge(original, applied, kind)
    return merge_patch(original, applied)
