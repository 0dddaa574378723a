"""CustomResourceDefinitions: serving their resources (discovery, scope, names, status subresource, printer
columns) and enforcing their openAPIV3Schema (prune, default, validate) on writes."""
from __future__ import annotations

import re

from tests.apiserver import context
from tests.apiserver import schema as structural
from tests.apiserver.clock import now
from tests.apiserver.errors import FieldError, bad_request, invalid
from tests.apiserver.resources import Resource

_CRD = ("CustomResourceDefinition", "apiextensions.k8s.io")


def prepare_crd(obj: dict) -> None:
    spec = obj.setdefault("spec", {})
    names = spec.setdefault("names", {})
    if names.get("kind") and not names.get("listKind"):
        names["listKind"] = names["kind"] + "List"
    if names.get("plural") and not names.get("singular") and names.get("kind"):
        names["singular"] = names["kind"].lower()
    t = now()
    obj["status"] = {
        "acceptedNames": {k: names[k] for k in ("plural", "singular", "kind", "listKind", "shortNames", "categories")
                          if k in names},
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "message": "no conflicts found",
             "lastTransitionTime": t},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": t}],
        "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
    }


def validate_crd(obj: dict, old: dict | None) -> None:
    name = obj["metadata"]["name"]
    spec = obj.get("spec") or {}
    names = spec.get("names") or {}
    errs = []
    if not spec.get("group"):
        errs.append(FieldError("spec.group", "Required value"))
    if not names.get("plural"):
        errs.append(FieldError("spec.names.plural", "Required value"))
    if not names.get("kind"):
        errs.append(FieldError("spec.names.kind", "Required value"))
    if spec.get("group") and names.get("plural") and name != f"{names['plural']}.{spec['group']}":
        errs.append(FieldError("metadata.name", "Invalid value", name, 'must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errs.append(FieldError("spec.scope", "Unsupported value", spec.get("scope"),
                               'supported values: "Cluster", "Namespaced"'))
    versions = spec.get("versions") or []
    if not versions or sum(1 for v in versions if v.get("storage")) != 1:
        errs.append(FieldError("spec.versions", "Invalid value", None, "must have exactly one version marked as "
                               "storage version", has_value=False))
    for i, v in enumerate(versions):
        if not (v.get("schema") or {}).get("openAPIV3Schema"):
            errs.append(FieldError(f"spec.versions[{i}].schema.openAPIV3Schema", "Required value",
                                   detail="schemas are required"))
    if old is not None:
        os_ = old.get("spec") or {}
        if os_.get("group") != spec.get("group"):
            errs.append(FieldError("spec.group", "Invalid value", spec.get("group"), "field is immutable"))
        if os_.get("scope") != spec.get("scope"):
            errs.append(FieldError("spec.scope", "Invalid value", spec.get("scope"), "field is immutable"))
    if errs:
        raise invalid(*_CRD, name, errs)


def resources_of(obj: dict) -> list[Resource]:
    spec = obj.get("spec") or {}
    names = spec.get("names") or {}
    out = []
    for v in spec.get("versions") or []:
        if not v.get("served", True):
            continue
        sch = (v.get("schema") or {}).get("openAPIV3Schema")
        out.append(Resource(
            group=spec["group"], version=v["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope") == "Namespaced", short_names=tuple(names.get("shortNames") or ()),
            categories=tuple(names.get("categories") or ()), status="status" in (v.get("subresources") or {}),
            crd={"schema": sch, "columns": v.get("additionalPrinterColumns") or [], "name": obj["metadata"]["name"],
                 "selectableFields": v.get("selectableFields") or [],
                 "scale": (v.get("subresources") or {}).get("scale")},
            allow_unconditional_update=False, singular=names.get("singular") or names["kind"].lower()))
    return out


def register(store, obj: dict) -> None:
    spec = obj.get("spec") or {}
    served = {r.version: r for r in resources_of(obj)}
    for r in store.registry.all():
        if r.crd is not None and r.group == spec.get("group") and r.plural == (spec.get("names") or {}).get("plural") \
                and r.version not in served:
            store.registry.remove(r.group_version, r.plural)
    for r in served.values():
        store.registry.add(r)


def unregister(store, obj: dict) -> None:
    spec = obj.get("spec") or {}
    plural = (spec.get("names") or {}).get("plural")
    rs = [r for r in store.registry.all() if r.crd is not None and r.group == spec.get("group") and r.plural == plural]
    if rs:
        store.delete_all(rs[0])
    for r in rs:
        store.registry.remove(r.group_version, r.plural)


def prepare_custom(res: Resource, obj: dict, old: dict | None) -> None:
    sch = res.crd.get("schema")
    if old is None and res.status:
        obj.pop("status", None)
    if sch:
        removed: list[str] = []
        structural.prune(obj, sch, root=True, removed=removed)
        if removed and context.field_validation() == "Strict":
            raise bad_request(f'{res.kind} in version "{res.version}" cannot be handled as a {res.kind}: strict '
                              "decoding error: " + ", ".join(f'unknown field "{p}"' for p in removed))
        structural.default(obj, sch)


def validate_custom(res: Resource, obj: dict, old: dict | None) -> None:
    name = obj["metadata"].get("name", "")
    errs = []
    if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", name):
        errs.append(FieldError("metadata.name", "Invalid value", name, "a lowercase RFC 1123 subdomain must consist of "
                               "lower case alphanumeric characters, '-' or '.', and must start and end with an "
                               "alphanumeric character (e.g. 'example.com', regex used for validation is "
                               "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"))
    sch = res.crd.get("schema")
    if sch:
        errs += structural.validate(obj, sch)
    if errs:
        raise invalid(res.kind, res.group, name, errs)
