"""Kubernetes-shaped API errors: each carries the metav1.Status body the real server would send."""
from __future__ import annotations


class ApiError(Exception):
    """An error answered as a ``Status`` object (kind Status, status Failure) with an HTTP code."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason}
        if self.details:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(res, name: str | None, kind: str | None = None) -> dict:
    d = {}
    if name:
        d["name"] = name
    if res is not None and res.group:
        d["group"] = res.group
    d["kind"] = kind or (res.plural if res is not None else "")
    return d


def not_found(res, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.group_resource} "{name}" not found', _details(res, name))


def already_exists(res, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{res.group_resource} "{name}" already exists', _details(res, name))


def conflict(res, name: str, why: str = "the object has been modified; please apply your changes to the "
             "latest version and try again") -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.group_resource} "{name}": {why}',
                    _details(res, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def method_not_allowed(message: str = "the server does not allow this method on the requested resource") -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)


def unsupported_media(message: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType", message)


def go_value(v) -> str:
    """A value the way Go's ``%#v`` prints it inside field errors (strings quoted, numbers bare)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace('\\', '\\\\').replace('"', '\\"') + '"'
    if v is None:
        return "null"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, dict):
        return "map[string]interface {}{" + ", ".join(f'"{k}":{go_value(x)}' for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[]interface {}{" + ", ".join(go_value(x) for x in v) + "}"
    return str(v)


class FieldError:
    """One field.ErrorList entry: ``<field>: <Type>: <value>: <detail>``."""

    def __init__(self, field: str, type_: str, value=None, detail: str = "", reason: str = "", has_value=True):
        self.field, self.type, self.value, self.detail = field, type_, value, detail
        self.reason = reason or {"Invalid value": "FieldValueInvalid", "Required value": "FieldValueRequired",
                                 "Unsupported value": "FieldValueNotSupported", "Forbidden": "FieldValueForbidden",
                                 "Duplicate value": "FieldValueDuplicate", "Too long": "FieldValueTooLong",
                                 "Too many": "FieldValueTooMany"}.get(type_, "FieldValueInvalid")
        self.has_value = has_value and type_ not in ("Required value", "Forbidden")

    def body(self) -> str:
        s = self.type
        if self.has_value:
            s += ": " + go_value(self.value)
        if self.detail:
            s += ": " + self.detail
        return s

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}" if self.field else self.body()


def invalid(kind: str, group: str, name: str, errs: list[FieldError]) -> ApiError:
    qual = f"{kind}.{group}" if group else kind
    text = str(errs[0]) if len(errs) == 1 else "[" + ", ".join(str(e) for e in errs) + "]"
    details = {"name": name, "group": group, "kind": kind,
               "causes": [{"reason": e.reason, "message": e.body(), "field": e.field} for e in errs]}
    if not group:
        del details["group"]
    return ApiError(422, "Invalid", f'{qual} "{name}" is invalid: {text}', details)
