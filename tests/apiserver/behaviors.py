"""What each kind does beyond plain storage: defaults, status resets, conversion, side effects.

The store calls these hooks under its lock; they may call back into the store (it is re-entrant)."""
from __future__ import annotations

from tests.apiserver import crd, events, eviction
from tests.apiserver.errors import FieldError, invalid
from tests.apiserver.watch import ADDED, DELETED, MODIFIED

_DNS1123_SUB = __import__("re").compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class Behaviors:
    def __init__(self, store):
        self.store = store

    # -- conversion between the served form and the storage form
    def encode(self, res, obj):
        if res.storage == ("", "events") and res.group == "events.k8s.io":
            return events.to_events_v1(obj)
        if res.crd is not None and obj.get("apiVersion") != res.api_version:
            obj = dict(obj)
            obj["apiVersion"] = res.api_version
        return obj

    def decode(self, res, obj):
        if res.storage == ("", "events") and res.group == "events.k8s.io":
            return events.to_core(obj)
        return obj

    def extra_fields(self, res):
        if res.crd is not None:
            return tuple(f.get("jsonPath", "").lstrip(".") for f in res.crd.get("selectableFields") or [])
        return ()

    # -- create / update
    def prepare_create(self, res, obj, keep_status):
        kind = (res.group, res.plural)
        if res.reset_status_on_create and not keep_status:
            obj.pop("status", None)
        if kind == ("", "pods"):
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("schedulerName", "default-scheduler")
            spec.setdefault("serviceAccountName", "default")
            spec.setdefault("securityContext", {})
            spec.setdefault("enableServiceLinks", True)
            for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
                if isinstance(c, dict):
                    c.setdefault("terminationMessagePath", "/dev/termination-log")
                    c.setdefault("terminationMessagePolicy", "File")
                    c.setdefault("imagePullPolicy", "Always" if str(c.get("image", "")).endswith(":latest")
                                 or ":" not in str(c.get("image", "")).rsplit("/", 1)[-1] else "IfNotPresent")
            st = obj.setdefault("status", {})
            st.setdefault("phase", "Pending")
            st.setdefault("qosClass", "BestEffort")
        elif kind == ("", "namespaces"):
            obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        elif kind == ("", "nodes"):
            obj.setdefault("spec", {})
        elif kind == ("policy", "poddisruptionbudgets"):
            obj.setdefault("status", {}).update({"disruptionsAllowed": 0, "currentHealthy": 0,
                                                 "desiredHealthy": 0, "expectedPods": 0})
        elif kind == ("apiextensions.k8s.io", "customresourcedefinitions"):
            crd.prepare_crd(obj)
        if res.crd is not None:
            crd.prepare_custom(res, obj, None)

    def prepare_update(self, res, obj, old):
        kind = (res.group, res.plural)
        if kind == ("", "namespaces"):
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        if res.crd is not None:
            crd.prepare_custom(res, obj, old)

    def validate(self, res, obj, old):
        name = obj["metadata"].get("name", "")
        if res.plural not in ("events",) and res.crd is None and not _DNS1123_SUB.match(name) or len(name) > 253:
            raise invalid(res.kind, res.group, name, [FieldError(
                "metadata.name", "Invalid value", name,
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")])
        if (res.group, res.plural) == ("apiextensions.k8s.io", "customresourcedefinitions"):
            crd.validate_crd(obj, old)
        if res.crd is not None:
            crd.validate_custom(res, obj, old)

    def grace_period(self, res, obj, requested):
        if (res.group, res.plural) != ("", "pods"):
            return 0
        if requested is not None:
            return max(0, int(requested))
        if not (obj.get("spec") or {}).get("nodeName"):
            return 0
        if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Pending"):
            return 0
        return int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30) or 0)

    def before_delete(self, res, obj):
        kind = (res.group, res.plural)
        if kind == ("", "namespaces"):
            ns = obj["metadata"]["name"]
            for r in self.store.registry.all():
                if r.namespaced and r.storage is None:
                    self.store.delete_all(r, ns)
        elif kind == ("apiextensions.k8s.io", "customresourcedefinitions"):
            crd.unregister(self.store, obj)

    # -- after a committed change (under the store lock)
    def after(self, res, type_, obj, old):
        kind = (res.group, res.plural)
        if kind == ("apiextensions.k8s.io", "customresourcedefinitions") and type_ in (ADDED, MODIFIED):
            crd.register(self.store, obj)
        if kind in (("", "pods"), ("policy", "poddisruptionbudgets")) and type_ in (ADDED, MODIFIED, DELETED):
            eviction.sync_budgets(self.store, obj["metadata"].get("namespace", ""), res, obj, type_)
