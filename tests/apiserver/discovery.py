"""Discovery documents (legacy form): /api, /api/v1, /apis, /apis/G, /apis/G/V, /version."""
from __future__ import annotations

import hashlib

VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-driverd-sim", "gitCommit": "0" * 40,
           "gitTreeState": "clean", "buildDate": "2024-12-11T00:00:00Z", "goVersion": "go1.23.3", "compiler": "gc",
           "platform": "linux/amd64"}

_SUBRESOURCE_VERBS = {"status": ["get", "patch", "update"]}


def _hash(s: str) -> str:
    import base64
    return base64.b64encode(hashlib.sha256(s.encode()).digest()[:8]).decode()


def api_versions(address: str) -> dict:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}]}


def _groups(registry) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for gv in sorted(registry.group_versions()):
        if "/" in gv:
            g, v = gv.split("/", 1)
            groups.setdefault(g, []).append(v)
    return groups


def _preferred(versions: list[str]) -> str:
    def rank(v):
        import re
        m = re.match(r"^v(\d+)(alpha|beta)?(\d*)$", v)
        if not m:
            return (0, 0, 0, v)
        stab = {"alpha": 1, "beta": 2, None: 3}[m.group(2)]
        return (stab, int(m.group(1)), int(m.group(3) or 0), v)
    return max(versions, key=rank)


def _group(name: str, versions: list[str]) -> dict:
    pref = _preferred(versions)
    vs = sorted(versions, key=lambda v: v != pref)
    return {"name": name, "versions": [{"groupVersion": f"{name}/{v}", "version": v} for v in vs],
            "preferredVersion": {"groupVersion": f"{name}/{pref}", "version": pref}}


def api_group_list(registry) -> dict:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [_group(g, vs) for g, vs in _groups(registry).items()]}


def api_group(registry, name: str) -> dict | None:
    vs = _groups(registry).get(name)
    if not vs:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name, vs)}


def resource_list(registry, group_version: str) -> dict | None:
    rs = registry.group_versions().get(group_version)
    if not rs:
        return None
    out = []
    for r in sorted(rs.values(), key=lambda r: r.plural):
        e = {"name": r.plural, "singularName": r.singular_name, "namespaced": r.namespaced, "kind": r.kind,
             "verbs": list(r.verbs)}
        if r.short_names:
            e["shortNames"] = list(r.short_names)
        if r.categories:
            e["categories"] = list(r.categories)
        e["storageVersionHash"] = _hash(f"{r.group}/{r.version}/{r.kind}")
        out.append(e)
        if r.status:
            out.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": r.namespaced,
                        "kind": r.kind, "verbs": _SUBRESOURCE_VERBS["status"]})
        if (r.group, r.plural) == ("", "pods"):
            out.append({"name": "pods/eviction", "singularName": "", "namespaced": True, "group": "policy",
                        "version": "v1", "kind": "Eviction", "verbs": ["create"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": out}
