"""Structural OpenAPI v3 schemas of CustomResourceDefinitions: pruning, defaulting and validation with
Kubernetes' field-error wording. CEL rules (x-kubernetes-validations) and string formats are not checked."""
from __future__ import annotations

import copy
import re

from tests.apiserver.errors import FieldError, go_value

_ROOT_KEEP = ("apiVersion", "kind", "metadata")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def prune(obj, schema: dict | None, root: bool = False, removed: list | None = None, path: str = ""):
    """Drop fields the schema does not declare (unless x-kubernetes-preserve-unknown-fields); their paths are
    appended to ``removed``."""
    if schema is None:
        return obj
    if isinstance(obj, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
        embedded = schema.get("x-kubernetes-embedded-resource") is True
        for k in list(obj):
            if (root or embedded) and k in _ROOT_KEEP:
                if k == "metadata" and root:
                    continue
                continue
            if props is not None and k in props:
                prune(obj[k], props[k], False, removed, _join(path, k))
            elif isinstance(addl, dict):
                prune(obj[k], addl, False, removed, _join(path, k))
            elif addl is True or preserve:
                continue
            else:
                del obj[k]
                if removed is not None:
                    removed.append(_join(path, k))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, x in enumerate(obj):
            prune(x, schema["items"], False, removed, f"{path}[{i}]")
    return obj


def default(obj, schema: dict | None):
    """Set ``default`` values of absent properties, recursively through present objects and arrays."""
    if schema is None:
        return obj
    if isinstance(obj, dict):
        for k, sub in (schema.get("properties") or {}).items():
            if k not in obj and "default" in sub:
                obj[k] = copy.deepcopy(sub["default"])
            if k in obj:
                default(obj[k], sub)
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for k in obj:
                if k not in (schema.get("properties") or {}):
                    default(obj[k], addl)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for x in obj:
            default(x, schema["items"])
    return obj


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _type_ok(v, t: str) -> bool:
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    return True


def validate(obj, schema: dict | None, path: str = "", root: bool = True) -> list[FieldError]:
    errs: list[FieldError] = []
    if schema is None:
        return errs
    _validate(obj, schema, path, errs, root)
    return errs


def _validate(v, s: dict, path: str, errs: list, root: bool = False) -> None:
    shown = path or "<root>"
    if v is None:
        if s.get("nullable") or root:
            return
        t = s.get("type")
        if t:
            errs.append(FieldError(path, "Invalid value", "null", f"{shown} in body must be of type {t}: \"null\""))
        return
    if s.get("x-kubernetes-int-or-string"):
        if not (isinstance(v, str) or _type_ok(v, "integer")):
            errs.append(FieldError(path, "Invalid value", _type_name(v),
                                   f"{shown} in body must be of type integer,string: \"{_type_name(v)}\""))
            return
    else:
        t = s.get("type")
        if t and not _type_ok(v, t):
            errs.append(FieldError(path, "Invalid value", _type_name(v),
                                   f"{shown} in body must be of type {t}: \"{_type_name(v)}\""))
            return
    if "enum" in s and v not in s["enum"]:
        errs.append(FieldError(path, "Unsupported value", v, "supported values: "
                               + ", ".join(go_value(e) for e in s["enum"])))
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s:
            if s.get("exclusiveMinimum") is True and not v > s["minimum"]:
                errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should be greater than "
                                       f"{go_value(s['minimum'])}"))
            elif v < s["minimum"]:
                errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should be greater than or equal "
                                       f"to {go_value(s['minimum'])}"))
        if "maximum" in s:
            if s.get("exclusiveMaximum") is True and not v < s["maximum"]:
                errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should be less than "
                                       f"{go_value(s['maximum'])}"))
            elif v > s["maximum"]:
                errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should be less than or equal to "
                                       f"{go_value(s['maximum'])}"))
        if s.get("multipleOf") and (v / s["multipleOf"]) != int(v / s["multipleOf"]):
            errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should be a multiple of "
                                   f"{go_value(s['multipleOf'])}"))
    if isinstance(v, str):
        if "minLength" in s and len(v) < s["minLength"]:
            errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should be at least {s['minLength']} "
                                   "chars long"))
        if "maxLength" in s and len(v) > s["maxLength"]:
            errs.append(FieldError(path, "Too long", v, f"may not be more than {s['maxLength']} bytes",
                                   has_value=False))
        if "pattern" in s and not re2_search(s["pattern"], v):
            errs.append(FieldError(path, "Invalid value", v, f"{shown} in body should match '{s['pattern']}'"))
    if isinstance(v, list):
        if "minItems" in s and len(v) < s["minItems"]:
            errs.append(FieldError(path, "Invalid value", len(v), f"{shown} in body should have at least "
                                   f"{s['minItems']} items"))
        if "maxItems" in s and len(v) > s["maxItems"]:
            errs.append(FieldError(path, "Too many", len(v), f"must have at most {s['maxItems']} items"))
        if s.get("uniqueItems") or s.get("x-kubernetes-list-type") == "set":
            seen = []
            for i, x in enumerate(v):
                if x in seen:
                    errs.append(FieldError(f"{path}[{i}]", "Duplicate value", x))
                seen.append(x)
        if isinstance(s.get("items"), dict):
            for i, x in enumerate(v):
                _validate(x, s["items"], f"{path}[{i}]", errs)
    if isinstance(v, dict):
        props = s.get("properties") or {}
        for r in s.get("required") or []:
            if r not in v:
                errs.append(FieldError(_join(path, r), "Required value"))
        if "minProperties" in s and len(v) < s["minProperties"]:
            errs.append(FieldError(path, "Invalid value", len(v), f"{shown} in body should have at least "
                                   f"{s['minProperties']} properties"))
        if "maxProperties" in s and len(v) > s["maxProperties"]:
            errs.append(FieldError(path, "Too many", len(v), f"must have at most {s['maxProperties']} items"))
        addl = s.get("additionalProperties")
        for k, x in v.items():
            if root and k in _ROOT_KEEP:
                continue
            if k in props:
                _validate(x, props[k], _join(path, k), errs)
            elif isinstance(addl, dict):
                _validate(x, addl, _join(path, k), errs)
    for sub in s.get("allOf") or []:
        _validate(v, sub, path, errs)
    if s.get("anyOf") and not any(not validate(v, sub, path, root=False) for sub in s["anyOf"]):
        errs.append(FieldError(path, "Invalid value", v, f"{shown} in body must be valid against one of anyOf"))
    if s.get("oneOf"):
        n = sum(1 for sub in s["oneOf"] if not validate(v, sub, path, root=False))
        if n != 1:
            errs.append(FieldError(path, "Invalid value", v, f"{shown} in body must be valid against exactly one of "
                                   "oneOf"))
    if isinstance(s.get("not"), dict) and not validate(v, s["not"], path, root=False):
        errs.append(FieldError(path, "Invalid value", v, f"{shown} in body must not be valid against not"))


def re2_pattern(pattern: str) -> str:
    r"""A schema pattern (Go's RE2 syntax) for Python's `re`, with RE2's meaning of `$`: the end of
    the text only. Python's `$` also matches before a trailing newline, so `^[0-9]+$` would accept
    "570\n", which kube-apiserver rejects. `$` outside a character class becomes `\Z`."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append("\\Z" if c == "$" and not in_class else c)
        i += 1
    return "".join(out)


def re2_search(pattern: str, value: str) -> bool:
    return re.search(re2_pattern(pattern), value) is not None
