"""The CDI spec's validation: a spec against the rules of the cdiVersion it declares, including the
oldest version each feature needs (the writer in cdi.py checks every spec it builds with it)."""
from __future__ import annotations

import re

KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_CLASS = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def _vt(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _edits(e: object, where: str, need: list[tuple[str, str]], errs: list[str]) -> None:
    if not isinstance(e, dict):
        errs.append(f"{where}: containerEdits must be a mapping")
        return
    allowed = {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids"}
    for k in e:
        if k not in allowed:
            errs.append(f"{where}: unknown containerEdits field {k!r}")
    if "intelRdt" in e or "additionalGids" in e:
        need.append(("0.7.0", f"{where}: intelRdt/additionalGids"))
    for i, env in enumerate(e.get("env") or []):
        if not isinstance(env, str) or "=" not in env or env.startswith("="):
            errs.append(f"{where}.env[{i}]: must be NAME=VALUE")
    for i, n in enumerate(e.get("deviceNodes") or []):
        w = f"{where}.deviceNodes[{i}]"
        if not isinstance(n, dict) or not isinstance(n.get("path"), str) or not n["path"].startswith("/"):
            errs.append(f"{w}: 'path' is required and must be absolute")
            continue
        if "hostPath" in n:
            need.append(("0.5.0", f"{w}: hostPath"))
        if "permissions" in n and (not isinstance(n["permissions"], str) or set(n["permissions"]) - set("rwm")):
            errs.append(f"{w}: permissions must be made of r, w, m")
        if "type" in n and n["type"] not in ("b", "c", "u", "p"):
            errs.append(f"{w}: type must be b, c, u or p")
    targets: set[str] = set()
    for i, m in enumerate(e.get("mounts") or []):
        w = f"{where}.mounts[{i}]"
        if not isinstance(m, dict) or not m.get("hostPath") or not str(m.get("containerPath", "")).startswith("/"):
            errs.append(f"{w}: hostPath and an absolute containerPath are required")
            continue
        if m["containerPath"] in targets:
            errs.append(f"{w}: containerPath {m['containerPath']} is mounted twice")
        targets.add(m["containerPath"])
        if not _strings(m.get("options", [])):
            errs.append(f"{w}: options must be a list of strings")
        if "type" in m:
            need.append(("0.4.0", f"{w}: type"))
    for i, h in enumerate(e.get("hooks") or []):
        w = f"{where}.hooks[{i}]"
        if not isinstance(h, dict) or not str(h.get("path", "")).startswith("/") or h.get("hookName") not in (
                "prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"):
            errs.append(f"{w}: needs a known hookName and an absolute path")
            continue
        if not _strings(h.get("args", [])):
            errs.append(f"{w}: args must be a list of strings")
        if not _strings(h.get("env", [])) or any("=" not in x for x in h.get("env", [])):
            errs.append(f"{w}: env must be a list of NAME=VALUE strings")


def _strings(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def validate(spec: object) -> list[str]:
    """Problems with `spec` under the rules of the CDI version it declares (empty: valid)."""
    errs: list[str] = []
    need: list[tuple[str, str]] = []
    if not isinstance(spec, dict):
        return ["the spec must be a mapping"]
    for k in spec:
        if k not in ("cdiVersion", "kind", "annotations", "devices", "containerEdits"):
            errs.append(f"unknown field {k!r}")
    ver = spec.get("cdiVersion")
    if ver not in KNOWN_VERSIONS:
        errs.append(f"cdiVersion {ver!r} is not a released CDI version ({', '.join(KNOWN_VERSIONS)})")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind.count("/") != 1:
        errs.append(f"kind {kind!r} must be vendor/class, e.g. nvidia.com/gpu")
    else:
        vendor, cls = kind.split("/")
        if not vendor or len(vendor) > 253 or not all(_LABEL.match(l) for l in vendor.split(".")):
            errs.append(f"kind {kind!r}: vendor must be a DNS subdomain")
        if not _CLASS.match(cls) or len(cls) > 63:
            errs.append(f"kind {kind!r}: class must be alphanumerics with - _ . inside, at most 63 characters")
        elif "." in cls:
            need.append(("0.6.0", "a dot in the kind's class"))
    if "annotations" in spec:
        need.append(("0.6.0", "spec annotations"))
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        errs.append("devices: at least one device is required")
        devices = []
    seen: set[str] = set()
    for i, d in enumerate(devices):
        if not isinstance(d, dict):
            errs.append(f"devices[{i}]: must be a mapping")
            continue
        name = d.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            errs.append(f"devices[{i}]: name {name!r} must start and end with an alphanumeric (- _ . inside)")
        elif name in seen:
            errs.append(f"devices[{i}]: duplicate name {name!r}")
        else:
            seen.add(name)
        for k in d:
            if k not in ("name", "annotations", "containerEdits"):
                errs.append(f"devices[{i}]: unknown field {k!r}")
        if "annotations" in d:
            need.append(("0.6.0", f"devices[{i}].annotations"))
        e = d.get("containerEdits")
        if not e:
            errs.append(f"devices[{i}]: containerEdits are required and must not be empty")
        else:
            _edits(e, f"devices[{i}].containerEdits", need, errs)
    if "containerEdits" in spec:
        _edits(spec["containerEdits"], "containerEdits", need, errs)
    if ver in KNOWN_VERSIONS:
        for minimum, what in need:
            if _vt(ver) < _vt(minimum):
                errs.append(f"{what} needs cdiVersion >= {minimum} (spec says {ver})")
    return errs
