"""The resource types the server knows: built-ins here, custom resources added by ``crd``."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple = ()
    categories: tuple = ()
    status: bool = False                 # has a /status subresource (main writes ignore .status)
    storage: tuple | None = None         # (group, plural) of the shared storage, when not its own
    crd: dict | None = None              # the CRD version's schema/columns, for custom resources
    allow_unconditional_update: bool = True
    reset_status_on_create: bool = False
    singular: str = ""
    verbs: list = field(default_factory=lambda: list(VERBS))

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version(self) -> str:
        return self.api_version

    @property
    def group_resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def key(self) -> tuple[str, str]:
        return self.storage or (self.group, self.plural)

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def singular_name(self) -> str:
        return self.singular or self.kind.lower()


def _r(group, version, plural, kind, namespaced, short=(), cats=(), status=False, **kw) -> Resource:
    return Resource(group, version, plural, kind, namespaced, tuple(short), tuple(cats), status, **kw)


BUILTINS = [
    _r("", "v1", "namespaces", "Namespace", False, ["ns"], status=True),
    _r("", "v1", "nodes", "Node", False, ["no"], status=True),
    _r("", "v1", "pods", "Pod", True, ["po"], ["all"], status=True, reset_status_on_create=True),
    _r("", "v1", "events", "Event", True, ["ev"]),
    _r("", "v1", "serviceaccounts", "ServiceAccount", True, ["sa"]),
    _r("", "v1", "configmaps", "ConfigMap", True, ["cm"]),
    _r("", "v1", "secrets", "Secret", True),
    _r("", "v1", "services", "Service", True, ["svc"], ["all"], status=True),
    _r("", "v1", "endpoints", "Endpoints", True, ["ep"]),
    _r("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ["pvc"], status=True),
    _r("events.k8s.io", "v1", "events", "Event", True, ["ev"], storage=("", "events")),
    _r("coordination.k8s.io", "v1", "leases", "Lease", True),
    _r("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ["pdb"], status=True,
       reset_status_on_create=True),
    _r("apps", "v1", "daemonsets", "DaemonSet", True, ["ds"], ["all"], status=True, reset_status_on_create=True),
    _r("apps", "v1", "deployments", "Deployment", True, ["deploy"], ["all"], status=True, reset_status_on_create=True),
    _r("apps", "v1", "replicasets", "ReplicaSet", True, ["rs"], ["all"], status=True, reset_status_on_create=True),
    _r("apps", "v1", "statefulsets", "StatefulSet", True, ["sts"], ["all"], status=True, reset_status_on_create=True),
    _r("batch", "v1", "jobs", "Job", True, [], ["all"], status=True, reset_status_on_create=True),
    _r("batch", "v1", "cronjobs", "CronJob", True, ["cj"], ["all"], status=True, reset_status_on_create=True),
    _r("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, ["netpol"]),
    _r("node.k8s.io", "v1", "runtimeclasses", "RuntimeClass", False),
    _r("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
    _r("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
    _r("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    _r("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _r("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
       ["crd", "crds"], ["api-extensions"], status=True),
]


class Registry:
    """Served resources by group/version and plural; thread-safe for CRDs coming and going."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_gv: dict[str, dict[str, Resource]] = {}
        for r in BUILTINS:
            self.add(r)

    def add(self, r: Resource) -> None:
        with self._lock:
            gv = dict(self._by_gv.get(r.group_version, {}))
            gv[r.plural] = r
            self._by_gv[r.group_version] = gv

    def remove(self, group_version: str, plural: str) -> None:
        with self._lock:
            gv = dict(self._by_gv.get(group_version, {}))
            gv.pop(plural, None)
            if gv:
                self._by_gv[group_version] = gv
            else:
                self._by_gv.pop(group_version, None)

    def lookup(self, group_version: str, plural: str) -> Resource | None:
        return self._by_gv.get(group_version, {}).get(plural)

    def group_versions(self) -> dict[str, dict[str, Resource]]:
        return dict(self._by_gv)

    def all(self) -> list[Resource]:
        return [r for gv in list(self._by_gv.values()) for r in gv.values()]

    def resolve(self, ref) -> Resource:
        """A Resource from itself, ``"pods"``, ``"Pod"``, ``"leases.coordination.k8s.io"``, ``"deployments.apps"``,
        ``"apps/v1/deployments"`` or ``("apps/v1", "deployments")``."""
        if isinstance(ref, Resource):
            return ref
        if isinstance(ref, tuple):
            r = self.lookup(*ref)
            if r:
                return r
            raise KeyError(ref)
        s = str(ref)
        if s.count("/") >= 1:
            gv, _, plural = s.rpartition("/")
            r = self.lookup(gv, plural)
            if r:
                return r
        plural, _, group = s.partition(".")
        cands = [r for r in self.all() if (r.plural == plural.lower() or r.kind == plural
                                           or r.singular_name == plural.lower() or plural.lower() in r.short_names)
                 and (not group or r.group == group)]
        if not cands:
            raise KeyError(ref)
        # core and the storage owner first (events: core v1)
        cands.sort(key=lambda r: (r.storage is not None, r.group != "", r.group))
        return cands[0]
