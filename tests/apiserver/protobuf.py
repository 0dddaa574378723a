"""Just enough of Kubernetes' protobuf encoding to read the request bodies kubectl's typed clients send
(``kubectl create configmap|secret|namespace|serviceaccount``): the ``k8s\\0`` envelope (runtime.Unknown) and the
field numbers of those kinds (from their generated.proto). Anything else: None (the caller answers 415)."""
from __future__ import annotations

import base64
from datetime import UTC

MAGIC = b"k8s\x00"


def _varint(b: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        c = b[i]
        i += 1
        out |= (c & 0x7F) << shift
        if c < 0x80:
            return out, i
        shift += 7


def _fields(b: bytes):
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(b, i)
        elif wt == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        elif wt == 1:
            v, i = b[i:i + 8], i + 8
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wt}")
        yield num, wt, v


def _map(entries: list[bytes], value=lambda v: v.decode()) -> dict:
    out = {}
    for e in entries:
        k = v = b""
        for n, _, x in _fields(e):
            if n == 1:
                k = x
            elif n == 2:
                v = x
        out[k.decode()] = value(v)
    return out


def _time(b: bytes) -> str:
    from datetime import datetime
    secs = next((v for n, _, v in _fields(b) if n == 1), 0)
    return datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_STR, _INT, _BOOL = "str", "int", "bool"
_OWNER = {1: ("kind", _STR), 3: ("name", _STR), 4: ("uid", _STR), 5: ("apiVersion", _STR), 6: ("controller", _BOOL),
          7: ("blockOwnerDeletion", _BOOL)}
_META = {1: ("name", _STR), 2: ("generateName", _STR), 3: ("namespace", _STR), 5: ("uid", _STR),
         6: ("resourceVersion", _STR), 7: ("generation", _INT), 11: ("labels", "map"), 12: ("annotations", "map"),
         13: ("ownerReferences", ("list", _OWNER)), 14: ("finalizers", "strlist")}
_REF = {1: ("name", _STR)}
KINDS = {
    "ConfigMap": {1: ("metadata", _META), 2: ("data", "map"), 3: ("binaryData", "bytesmap"), 4: ("immutable", _BOOL)},
    "Secret": {1: ("metadata", _META), 2: ("data", "bytesmap"), 3: ("type", _STR), 4: ("stringData", "map"),
               5: ("immutable", _BOOL)},
    "Namespace": {1: ("metadata", _META), 2: ("spec", {1: ("finalizers", "strlist")})},
    "ServiceAccount": {1: ("metadata", _META), 2: ("secrets", ("list", _REF)),
                       3: ("imagePullSecrets", ("list", _REF)), 4: ("automountServiceAccountToken", _BOOL)},
}


def _message(b: bytes, spec: dict) -> dict:
    out: dict = {}
    grouped: dict[int, list] = {}
    for n, _, v in _fields(b):
        grouped.setdefault(n, []).append(v)
    for n, vals in grouped.items():
        if n not in spec:
            continue
        name, kind = spec[n]
        if kind == _STR:
            if vals[-1]:
                out[name] = vals[-1].decode()
        elif kind == _INT:
            if vals[-1]:
                out[name] = vals[-1]
        elif kind == _BOOL:
            out[name] = bool(vals[-1])
        elif kind == "map":
            out[name] = _map(vals)
        elif kind == "bytesmap":
            out[name] = _map(vals, lambda v: base64.b64encode(v).decode())
        elif kind == "strlist":
            out[name] = [v.decode() for v in vals]
        elif isinstance(kind, tuple):
            out[name] = [_message(v, kind[1]) for v in vals]
        elif isinstance(kind, dict):
            out[name] = _message(vals[-1], kind)
    return out


def decode(body: bytes) -> dict | None:
    if not body.startswith(MAGIC):
        return None
    try:
        f = {n: v for n, _, v in _fields(body[len(MAGIC):])}
        tm = {n: v.decode() for n, _, v in _fields(f.get(1, b""))}
        api_version, kind = tm.get(1, ""), tm.get(2, "")
        if kind not in KINDS or api_version != "v1":
            return None
        obj = {"apiVersion": api_version, "kind": kind}
        obj.update(_message(f.get(2, b""), KINDS[kind]))
        return obj
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
