"""Kubernetes' own OpenAPI v3 documents (vendored, see README.md here) served at /openapi/v3, and
``validate(obj)``: the errors an object has against them (jsonschema)."""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
from importlib import resources as _res

K8S_VERSION = "v1.32"


def _file(path: str) -> str:
    return path.replace("/", "__") + "_openapi.json.gz"


def vendored_paths() -> list[str]:
    names = [p.name for p in _res.files(__package__).joinpath(K8S_VERSION).iterdir() if p.name.endswith(".json.gz")]
    return sorted(n[:-len("_openapi.json.gz")].replace("__", "/") for n in names)


@functools.cache
def raw(path: str) -> bytes | None:
    """The document for ``api/v1`` or ``apis/GROUP/VERSION`` as bytes, None when not vendored."""
    f = _res.files(__package__).joinpath(K8S_VERSION, _file(path))
    if not f.is_file():
        return None
    return gzip.decompress(f.read_bytes())


@functools.cache
def document(path: str) -> dict | None:
    b = raw(path)
    return json.loads(b) if b is not None else None


@functools.cache
def etag(path: str) -> str:
    b = raw(path) or b""
    return hashlib.sha512(b).hexdigest().upper()


def generated(group: str, version: str, resources: list) -> bytes:
    """A minimal document for a group/version we have no vendored document for (custom resources): its paths with
    their PATCH operations (kubectl reads the fieldValidation parameter there) and the CRD schemas."""
    paths, schemas = {}, {}
    for r in resources:
        gvk = {"group": group, "version": version, "kind": r.kind}
        base = f"/apis/{group}/{version}" + ("/namespaces/{namespace}" if r.namespaced else "") + f"/{r.plural}/{{name}}"
        params = [{"name": n, "in": "query", "schema": {"type": "string"}, "uniqueItems": True}
                  for n in ("dryRun", "fieldManager", "fieldValidation", "force")]
        body = {"content": {t: {"schema": {"type": "object"}} for t in (
            "application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml")}}
        paths[base] = {"patch": {"operationId": f"patch{r.kind}", "x-kubernetes-group-version-kind": gvk,
                                 "x-kubernetes-action": "patch", "parameters": params, "requestBody": body,
                                 "responses": {"200": {"description": "OK"}}}}
        sch = dict((r.crd or {}).get("schema") or {"type": "object"})
        sch["x-kubernetes-group-version-kind"] = [gvk]
        rev = ".".join(reversed(group.split(".")))
        schemas[f"{rev}.{version}.{r.kind}"] = sch
    doc = {"openapi": "3.0.0", "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"}, "paths": paths,
           "components": {"schemas": schemas}}
    return json.dumps(doc).encode()


# ------------------------------------------------------------------ validation

def _gv_path(api_version: str) -> str:
    return f"api/{api_version}" if "/" not in api_version else f"apis/{api_version}"


def _strict(node):
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.cache
def _validator(api_version: str, kind: str, strict: bool):
    import jsonschema
    doc = document(_gv_path(api_version))
    if doc is None:
        return None
    group, _, version = api_version.rpartition("/")
    comps = doc.get("components", {}).get("schemas", {})
    name = None
    for n, s in comps.items():
        for g in s.get("x-kubernetes-group-version-kind") or []:
            if g.get("group", "") == group and g.get("version") == version and g.get("kind") == kind:
                name = n
    if name is None:
        return None
    comps = _strict(comps) if strict else comps
    # apiVersion/kind/metadata are always known; status is the server's
    root = {"$ref": f"#/components/schemas/{name}", "components": {"schemas": comps}}
    return jsonschema.Draft7Validator(root)


def _path(err) -> str:
    out = ""
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validate(obj: dict, *, strict: bool = True) -> list[str]:
    """Errors of ``obj`` against Kubernetes' OpenAPI schema for its apiVersion/kind, as ``path: message`` strings
    (empty when valid). ``strict`` also reports fields the schema does not declare, as kubectl's
    ``--validate=strict`` would. Unknown apiVersion/kind is itself an error."""
    if not isinstance(obj, dict):
        return ["<root>: the object must be a mapping"]
    av, kind = obj.get("apiVersion"), obj.get("kind")
    if not av or not kind:
        return ["<root>: apiVersion and kind are required"]
    v = _validator(av, kind, strict)
    if v is None:
        return [f"<root>: no schema for {kind} in {av} (Kubernetes {K8S_VERSION})"]
    errs = []
    for e in sorted(v.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        msg = e.message
        if e.validator == "additionalProperties" and e.validator_value is False:
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            for x in extra:
                p = _path(e)
                errs.append(f"{p + '.' if p else ''}{x}: unknown field \"{x}\"")
            continue
        errs.append(f"{_path(e) or '<root>'}: {msg}")
    return errs
