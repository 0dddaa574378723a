"""In-memory object storage with one global resourceVersion counter, history for watches, and the
API semantics of create / update / patch / delete (conflicts, generation, status subresource, finalizers).

Public methods (``resource`` is a name like ``"pods"``, ``"Pod"``, ``"leases.coordination.k8s.io"``,
``"apps/v1/deployments"`` or a :class:`Resource`); every method returns copies, safe to change:

- ``create(resource, obj, namespace=None, *, keep_status=False) -> dict``
  ``keep_status=True`` keeps ``.status`` for kinds whose create resets it (pods, deployments, jobs, PDBs...):
  a test convenience; over HTTP the reset always applies, as in Kubernetes.
- ``get(resource, name, namespace=None) -> dict`` (ApiError 404)
- ``list(resource, namespace=None, label_selector=None, field_selector=None) -> list[dict]``
- ``snapshot(...)`` -> ``(items, resourceVersion)``
- ``update(resource, obj, namespace=None, *, subresource=None) -> dict`` (PUT; 409 on a stale resourceVersion)
- ``update_status(resource, obj, namespace=None) -> dict`` (PUT .../status)
- ``patch(resource, name, patch, patch_type="merge"|"strategic"|"json"|<content type>, namespace=None,
  subresource=None) -> dict``
- ``delete(resource, name, namespace=None, *, grace_period_seconds=None, uid=None, resource_version=None) -> dict``
- ``watch(resource, namespace=None, resource_version=None, label_selector=None, field_selector=None) -> Watcher``
- ``resource_version`` (str), ``resolve(resource) -> Resource``, ``registry`` (served resources)
"""
from __future__ import annotations

import json
import random
import threading
import uuid
from collections import deque

from tests.apiserver import behaviors
from tests.apiserver.clock import now
from tests.apiserver.errors import (
    ApiError,
    FieldError,
    already_exists,
    bad_request,
    conflict,
    gone,
    invalid,
    not_found,
)
from tests.apiserver.patch import apply_patch
from tests.apiserver.resources import Registry, Resource
from tests.apiserver.selectors import FieldSelector, LabelSelector
from tests.apiserver.watch import ADDED, DELETED, MODIFIED, Event, Watcher

_PATCH_TYPES = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
                "json": "application/json-patch+json", "apply": "application/apply-patch+yaml"}
_GEN_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def _copy(o):
    return json.loads(json.dumps(o)) if o is not None else None


class Store:
    def __init__(self, history: int = 50000):
        self.registry = Registry()
        self._lock = threading.RLock()
        self._rv = 0
        self._data: dict[tuple, dict[tuple, dict]] = {}
        self._history: deque[Event] = deque()
        self._history_max = history
        self._compacted_rv = 0           # events at or below this rv are gone (410 for a watch from before it)
        self._watchers: dict[tuple, set] = {}
        self.behaviors = behaviors.Behaviors(self)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    # ------------------------------------------------------------------ helpers
    def resolve(self, ref) -> Resource:
        try:
            return self.registry.resolve(ref)
        except KeyError:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({ref})") from None

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    @property
    def lock(self):
        return self._lock

    def _ns(self, res: Resource, namespace, obj=None) -> str:
        if not res.namespaced:
            return ""
        return namespace or ((obj or {}).get("metadata") or {}).get("namespace") or "default"

    def _bucket(self, res: Resource) -> dict:
        return self._data.setdefault(res.key, {})

    def _encode(self, res: Resource, obj: dict) -> dict:
        """Storage form -> the form ``res`` serves (a converted copy, or the object itself)."""
        return self.behaviors.encode(res, obj)

    def _commit(self, res: Resource, type_: str, obj: dict, old: dict | None) -> dict:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        ns = obj["metadata"].get("namespace", "")
        key = (ns, obj["metadata"]["name"])
        bucket = self._bucket(res)
        if type_ == DELETED:
            bucket.pop(key, None)
        else:
            bucket[key] = obj
        ev = Event(self._rv, type_, res.key, ns, obj, old)
        self._history.append(ev)
        while len(self._history) > self._history_max:
            self._compacted_rv = self._history.popleft().rv
        for w in self._watchers.get(res.key, ()):
            if not w.namespace or w.namespace == ns:
                w.push(ev)
        self.behaviors.after(res, type_, obj, old)
        return obj

    def _current(self, res: Resource, name: str, ns: str) -> dict:
        obj = self._bucket(res).get((ns, name))
        if obj is None:
            raise not_found(res, name)
        return obj

    # ------------------------------------------------------------------ reads
    def get(self, resource, name: str, namespace: str | None = None) -> dict:
        res = self.resolve(resource)
        with self._lock:
            obj = self._current(res, name, self._ns(res, namespace))
            return _copy(self._encode(res, obj))

    def get_raw(self, res: Resource, name: str, namespace: str) -> dict:
        """The stored object itself (not a copy; do not change it), in ``res``' form."""
        with self._lock:
            return self._encode(res, self._current(res, name, self._ns(res, namespace)))

    def snapshot(self, resource, namespace=None, label_selector=None, field_selector=None, *, copies=True):
        res = self.resolve(resource)
        ls = label_selector if isinstance(label_selector, LabelSelector) or label_selector is None \
            else LabelSelector.parse(label_selector)
        fs = field_selector if isinstance(field_selector, FieldSelector) or field_selector is None \
            else FieldSelector.parse(field_selector, res.group, res.plural, self.behaviors.extra_fields(res))
        with self._lock:
            bucket = self._bucket(res)
            name = fs.exact_name() if fs else None
            if name is not None and namespace:
                cands = [bucket[(namespace, name)]] if (namespace, name) in bucket else []
            else:
                cands = [o for (ns, _), o in sorted(bucket.items()) if not namespace or ns == namespace]
            items = []
            for o in cands:
                o = self._encode(res, o)
                if ls is not None and not ls.empty() and not ls.matches(o["metadata"].get("labels")):
                    continue
                if fs is not None and not fs.empty() and not fs.matches(o):
                    continue
                items.append(_copy(o) if copies else o)
            return items, str(self._rv)

    def list(self, resource, namespace=None, label_selector=None, field_selector=None) -> list[dict]:
        return self.snapshot(resource, namespace, label_selector, field_selector)[0]

    # ------------------------------------------------------------------ writes
    def create(self, resource, obj: dict, namespace: str | None = None, *, keep_status: bool = False,
               dry_run: bool = False) -> dict:
        res = self.resolve(resource)
        obj = _copy(obj)
        if not isinstance(obj, dict):
            raise bad_request("the body of the request was not a JSON object")
        md = obj.setdefault("metadata", {})
        if md is None or not isinstance(md, dict):
            md = obj["metadata"] = {}
        self._check_type(res, obj)
        with self._lock:
            if res.namespaced:
                body_ns = md.get("namespace")
                ns = namespace or body_ns or "default"
                if namespace and body_ns and body_ns != namespace:
                    raise bad_request("the namespace of the provided object does not match the namespace sent on "
                                      "the request")
                md["namespace"] = ns
                if ("", ns) not in self._bucket(self.registry.resolve("namespaces")):
                    raise not_found(self.registry.resolve("namespaces"), ns)
            else:
                md.pop("namespace", None)
                ns = ""
            if not md.get("name"):
                if md.get("generateName"):
                    md["name"] = md["generateName"] + "".join(random.choice(_GEN_ALPHABET) for _ in range(5))
                else:
                    raise invalid(res.kind, res.group, "", [FieldError(
                        "metadata.name", "Required value", detail="name or generateName is required")])
            obj = self.behaviors.decode(res, obj)
            md = obj["metadata"]
            for k in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
                md.pop(k, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = now()
            md["generation"] = 1
            self.behaviors.prepare_create(res, obj, keep_status)
            self.behaviors.validate(res, obj, None)
            if (ns, md["name"]) in self._bucket(res):
                raise already_exists(res, md["name"])
            if dry_run:
                return _copy(self._encode(res, obj))
            self._commit(res, ADDED, obj, None)
            return _copy(self._encode(res, obj))

    def _check_type(self, res: Resource, obj: dict) -> None:
        av, kind = obj.get("apiVersion"), obj.get("kind")
        if av and av != res.api_version and not (res.crd and av.split("/")[0] == res.group):
            raise bad_request(f"the API version in the data ({av}) does not match the expected API version "
                              f"({res.api_version})")
        if kind and kind != res.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected kind ({res.kind})")
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind

    def update(self, resource, obj: dict, namespace: str | None = None, *, subresource: str | None = None,
               name: str | None = None, dry_run: bool = False) -> dict:
        res = self.resolve(resource)
        obj = _copy(obj)
        if not isinstance(obj, dict):
            raise bad_request("the body of the request was not a JSON object")
        md = obj.setdefault("metadata", {})
        self._check_type(res, obj)
        name = name or md.get("name")
        if md.get("name") and name != md["name"]:
            raise bad_request(f"the name of the object ({md['name']}) does not match the name on the URL ({name})")
        with self._lock:
            ns = self._ns(res, namespace, obj)
            if res.namespaced and md.get("namespace") and md["namespace"] != ns:
                raise bad_request("the namespace of the provided object does not match the namespace sent on the "
                                  "request")
            old = self._current(res, name, ns)
            return self._update(res, obj, old, subresource, dry_run)

    def update_status(self, resource, obj: dict, namespace: str | None = None) -> dict:
        return self.update(resource, obj, namespace, subresource="status")

    def _update(self, res: Resource, obj: dict, old: dict, subresource: str | None, dry_run=False) -> dict:
        md = obj.setdefault("metadata", {})
        rv = md.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(res, old["metadata"]["name"])
        if not rv and not res.allow_unconditional_update:
            raise invalid(res.kind, res.group, old["metadata"]["name"], [FieldError(
                "metadata.resourceVersion", "Invalid value", 0, "must be specified for an update", has_value=True)])
        obj = self.behaviors.decode(res, obj)
        md = obj["metadata"]
        omd = old["metadata"]
        if subresource == "status":
            new = _copy(old)
            if "status" in obj:
                new["status"] = obj["status"]
            else:
                new.pop("status", None)
            obj = new
            md = obj["metadata"]
        else:
            for k in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp",
                      "deletionGracePeriodSeconds"):
                if k in omd:
                    md[k] = omd[k]
                else:
                    md.pop(k, None)
            if res.status:
                if "status" in old:
                    obj["status"] = _copy(old["status"])
                else:
                    obj.pop("status", None)
            self.behaviors.prepare_update(res, obj, old)
        md["generation"] = omd.get("generation", 1)
        if _spec_of(obj) != _spec_of(old):
            md["generation"] += 1
        md["resourceVersion"] = omd["resourceVersion"]
        self.behaviors.validate(res, obj, old)
        if obj == old:
            return _copy(self._encode(res, old))
        if dry_run:
            return _copy(self._encode(res, obj))
        if md.get("deletionTimestamp") and not md.get("finalizers"):
            self._commit(res, DELETED, obj, old)
            return _copy(self._encode(res, obj))
        self._commit(res, MODIFIED, obj, old)
        return _copy(self._encode(res, obj))

    def patch(self, resource, name: str, patch, patch_type: str = "merge", namespace: str | None = None, *,
              subresource: str | None = None, dry_run: bool = False) -> dict:
        res = self.resolve(resource)
        ctype = _PATCH_TYPES.get(patch_type, patch_type)
        body = patch if isinstance(patch, (bytes, str)) else json.dumps(patch)
        if isinstance(body, str):
            body = body.encode()
        with self._lock:
            ns = self._ns(res, namespace)
            old = self._current(res, name, ns)
            current = _copy(self._encode(res, old))
            new = apply_patch(ctype, current, body, kind=res.kind, strategic_ok=res.crd is None)
            if not isinstance(new, dict):
                raise bad_request("the patched object is not a JSON object")
            new.setdefault("metadata", {})
            if (new["metadata"].get("name") or name) != name:
                raise bad_request(f"the name of the object ({new['metadata'].get('name')}) does not match the name "
                                  f"on the URL ({name})")
            new["metadata"]["name"] = name
            self._check_type(res, new)
            return self._update(res, new, old, subresource, dry_run)

    def delete(self, resource, name: str, namespace: str | None = None, *, grace_period_seconds: int | None = None,
               uid: str | None = None, resource_version: str | None = None, dry_run: bool = False) -> dict:
        """Delete now (no kubelet: pods go at once, after a MODIFIED event carrying deletionTimestamp when a grace
        period applies). Objects with finalizers only get deletionTimestamp; they go when the last finalizer does."""
        res = self.resolve(resource)
        with self._lock:
            ns = self._ns(res, namespace)
            old = self._current(res, name, ns)
            if uid and old["metadata"].get("uid") != uid:
                raise conflict(res, name, f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                               f"{old['metadata'].get('uid')}")
            if resource_version and old["metadata"].get("resourceVersion") != resource_version:
                raise conflict(res, name, "Precondition failed: ResourceVersion in precondition: "
                               f"{resource_version}, ResourceVersion in object meta: "
                               f"{old['metadata'].get('resourceVersion')}")
            if dry_run:
                return _copy(self._encode(res, old))
            obj = _copy(old)
            md = obj["metadata"]
            if md.get("finalizers"):
                if not md.get("deletionTimestamp"):
                    md["deletionTimestamp"] = now()
                    md["deletionGracePeriodSeconds"] = 0
                    self._commit(res, MODIFIED, obj, old)
                return _copy(self._encode(res, obj))
            grace = self.behaviors.grace_period(res, obj, grace_period_seconds)
            if grace:
                md["deletionTimestamp"] = now()
                md["deletionGracePeriodSeconds"] = grace
                self._commit(res, MODIFIED, obj, old)
                old, obj = obj, _copy(obj)
            self.behaviors.before_delete(res, obj)
            self._commit(res, DELETED, obj, old)
            return _copy(self._encode(res, obj))

    # ------------------------------------------------------------------ watch
    def watch(self, resource, namespace: str | None = None, resource_version: str | None = None,
              label_selector=None, field_selector=None, *, send_initial: bool | None = None) -> Watcher:
        """Open a watch. ``resource_version`` None/"" or "0": synthetic ADDED events for what exists, then
        changes. Otherwise changes after that version; ApiError 410 when the history no longer reaches it."""
        res = self.resolve(resource)
        ls = label_selector if isinstance(label_selector, LabelSelector) or label_selector is None \
            else LabelSelector.parse(label_selector)
        fs = field_selector if isinstance(field_selector, FieldSelector) or field_selector is None \
            else FieldSelector.parse(field_selector, res.group, res.plural, self.behaviors.extra_fields(res))
        w = Watcher(self, res, namespace or "", ls, fs)
        with self._lock:
            initial = send_initial if send_initial is not None else resource_version in (None, "", "0")
            if resource_version not in (None, "", "0"):
                try:
                    since = int(resource_version)
                except ValueError:
                    raise bad_request(f"invalid resource version: {resource_version}") from None
                if since < self._compacted_rv:
                    raise gone(f"too old resource version: {since} ({self._compacted_rv + 1})")
                for ev in self._history:
                    if ev.rv > since and ev.key == res.key and (not w.namespace or ev.namespace == w.namespace):
                        w.push(ev)
            if initial:
                for (ns, _), o in sorted(self._bucket(res).items()):
                    if not w.namespace or ns == w.namespace:
                        w.push(Event(0, ADDED, res.key, ns, o, None))
            w.last_rv = self._rv
            self._watchers.setdefault(res.key, set()).add(w)
        return w

    def _unwatch(self, w: Watcher) -> None:
        with self._lock:
            self._watchers.get(w.res.key, set()).discard(w)

    def bookmark_rv(self, w: Watcher) -> str | None:
        """The resourceVersion a BOOKMARK may carry now: the store's, when the watcher has nothing pending."""
        with self._lock:
            if w.pending():
                return None
            return str(self._rv)

    def close_watchers(self) -> None:
        with self._lock:
            ws = [w for s in self._watchers.values() for w in s]
        for w in ws:
            w.stop()

    def forget_history(self) -> None:
        """What an apiserver restart does to the watch cache: older resourceVersions answer 410 Gone."""
        with self._lock:
            self._history.clear()
            self._compacted_rv = self._rv

    # ------------------------------------------------------------------ bulk
    def delete_all(self, res: Resource, namespace: str | None = None) -> None:
        with self._lock:
            for (ns, name), obj in sorted(self._bucket(res).items()):
                if namespace is None or ns == namespace:
                    self._commit(res, DELETED, _copy(obj), obj)

    def count(self, resource) -> int:
        return len(self._bucket(self.resolve(resource)))


def _spec_of(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}
