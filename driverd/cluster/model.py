"""What a rollout is and where a node stands in it: the DriverRollout's spec as a dataclass, the
per-node state machine's states, and the Node annotations and labels that record them. Pure: no
API calls here, so admission and the state machine can be reasoned about (and tested) as functions.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import field

# The node states and rollout phases are tables in cluster/states.py; the model speaks their names.
from driverd.cluster.states import (
    ACTIVE, ADMITTED, CORDONED, DONE, ENDED, EVICTING, FAILED, IDLE, REBOOT, UNLOADING, VALIDATING, WAITING)
from driverd.datatypes import dataclass
from driverd.errors import ClusterError

PREFIX = "driverd.io/"
# Node annotations (the state machine's record; they survive daemon restarts)
A_STATE = PREFIX + "state"
A_REASON = PREFIX + "reason"
A_MESSAGE = PREFIX + "message"
A_SINCE = PREFIX + "since"
A_ATTEMPT = PREFIX + "attempt"
A_ROLLOUT = PREFIX + "rollout"            # name/uid/generation the state belongs to
A_TARGET = PREFIX + "target"              # version/flavor being installed
A_PREVIOUS = PREFIX + "previous-driver"   # version/flavor that ran before, for the record
A_CORDONED = PREFIX + "cordoned-by-us"    # "true" only when driverd set spec.unschedulable
A_PREFLIGHT = PREFIX + "preflight"        # JSON: the node daemon's answer for rollout/generation
A_SKIP = PREFIX + "skip"                  # set by an operator: leave this node out
A_RETRY = PREFIX + "retry"                # set by an operator: try a failed node again
A_PINNED = PREFIX + "pinned-driver"       # version/flavor the daemon keeps after a failed upgrade
A_ABORT = PREFIX + "abort"                # on a DriverRollout: "true" = `kubectl driverd rollout abort`
A_ADMITTED_BY = PREFIX + "admitted-by"    # the coordinator (Lease holder) that admitted the node
A_GPUS_BEFORE = PREFIX + "gpus-before"    # JSON: what the scheduler could place on the node at its cordon
A_LEFT_WITH = PREFIX + "left-with-driver"   # JSON: the DaemonSets (ns/name) whose pods left with the driver -> the label that took them
A_WAITING = PREFIX + "waiting"            # what the node's desired driver or settings want that waits for a rollout
WAITING_SETTINGS = "configuration: "      # in A_WAITING, before the driver settings a rollout must apply
FINALIZER = "driverd.io/rollout"          # keeps a deleted rollout's spec until its nodes are given back
# Node labels (what is loaded; selectors and dashboards use them)
L_VERSION = PREFIX + "driver-version"
L_FLAVOR = PREFIX + "driver-flavor"
L_READY = PREFIX + "driver-ready"         # "true" while the driver is validated; GPU DaemonSets select it

# \A…\Z, not ^…$: Python's `$` also matches before a trailing newline ("570.195.03\n"), RE2's (the
# API server's schema patterns) does not; the parser must accept exactly what the schema accepts.
VERSION_RE = re.compile(r"\A[0-9]+\.[0-9]+(\.[0-9]+)?\Z")
PERCENT_RE = re.compile(r"\A[0-9]+%\Z")
NOT_READY_TIMEOUT_S = 300


def split_driver(text: str | None) -> tuple[str, str]:
    """A driver as the node annotations record it ("VERSION/FLAVOR", driverd.io/target, pinned-driver,
    previous-driver) as (version, flavor); ("", "") for none."""
    version, _, flavor = (text or "").partition("/")
    return version, flavor


def ident(obj: dict) -> str:
    """An object's identity for what a coordinator remembers of it: name and uid (a deleted and
    re-created object of the same name is another one; Rollout.ident says the same of a rollout)."""
    md = obj.get("metadata") or {}
    return f"{md.get('name', '')}/{md['uid']}" if md.get("uid") else md.get("name", "")


def ended(obj: dict) -> bool:
    """The rollout object is over for its current spec: its nodes are free for other rollouts."""
    md, st = obj.get("metadata") or {}, obj.get("status") or {}
    if (md.get("annotations") or {}).get(A_ABORT) == "true" and st.get("phase") == "Aborted":
        return True
    return st.get("phase") in ENDED and st.get("observedGeneration") == md.get("generation")


def oldest_first(obj: dict) -> tuple[str, str]:
    """The order rollouts are taken in, by the coordinator and by every node's daemon alike: by
    creation, and by name among those created in the same second (the API's timestamps have no
    finer grain) — so that both agree which of two rollouts is the older one."""
    md = obj.get("metadata") or {}
    return md.get("creationTimestamp") or "", md.get("name") or ""


class SpecError(ClusterError, ValueError):
    """A rollout field the schema let through but that cannot be carried out; names the field. A
    ClusterError (driverd's own error type, one line) and, as before, a ValueError."""

    def __init__(self, field_: str, message: str) -> None:
        super().__init__(f"spec.{field_}: {message}" if field_ else f"spec: {message}",
                         fix="correct the DriverRollout's spec (kubectl edit driverrollout NAME)")
        self.field = field_


_FIELDS = ("driver", "flavor", "nodeSelector", "maxParallel", "maxUnavailable", "canary", "canarySoakSeconds",
           "failureBudget", "preflight", "drain", "waitForJobs", "validation")


@dataclass(frozen=True)
class WorkloadPod:
    """spec.validation.workloadPod: a pod the node's daemon runs on the node after its GPUs are schedulable
    again, before the node is `done` (cluster/workloadpod.py). `timeout_s` None: the validation timeout."""
    image: str
    command: tuple[str, ...] = ()
    timeout_s: int | None = None

    @classmethod
    def from_spec(cls, spec) -> WorkloadPod | None:
        """The field as the schema lets it through, or a SpecError naming the part that cannot be used
        (the API server's schema is not the only writer to trust: fuzzing, older CRDs)."""
        where = "validation.workloadPod"
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise SpecError(where, f"is a {type(spec).__name__}, not an object with image, command, timeoutSeconds")
        image = spec.get("image")
        if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
            raise SpecError(where + ".image", f"{image!r} is not an image reference (required when "
                            "workloadPod is given)")
        command = spec.get("command")
        if command is not None and (not isinstance(command, list) or not all(isinstance(c, str) for c in command)):
            raise SpecError(where + ".command", f"{command!r} is not a list of strings")
        timeout = spec.get("timeoutSeconds")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1):
            raise SpecError(where + ".timeoutSeconds", f"{timeout!r} is not a number of seconds >= 1")
        return cls(image=image, command=tuple(command or ()), timeout_s=timeout)


@dataclass(frozen=True)
class Rollout:
    """A DriverRollout's spec at one generation, as driverd reads the custom resource."""
    name: str
    generation: int
    driver: str
    uid: str = ""
    flavor: str = "auto"
    match_labels: dict = field(default_factory=dict)
    match_expressions: tuple = ()
    max_parallel: int = 1
    max_unavailable: int | str = 1
    canary: int = 0
    canary_soak_s: int | None = None
    failure_budget: int = 0
    preflight: str = "Refuse"
    drain_selector: str = ""
    drain_timeout_s: int = 600
    drain_force: bool = False
    drain_empty_dir: bool = False
    jobs_selector: str = ""
    jobs_timeout_s: int = 3600
    validation_timeout_s: int = 300
    workload_pod: WorkloadPod | None = None       # spec.validation.workloadPod (optional)
    paused: bool = False
    not_ready_timeout_s: int = NOT_READY_TIMEOUT_S
    deleting: bool = False
    status: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def ident(self) -> str:
        """This rollout object (a deleted and re-created one of the same name is another)."""
        return f"{self.name}/{self.uid}" if self.uid else self.name

    @property
    def key(self) -> str:
        """What a node's record and preflight answer refer to: this object at this spec generation."""
        return f"{self.ident}/{self.generation}"

    @property
    def target(self) -> str:
        return f"{self.driver}/{self.flavor}"

    @property
    def workload_timeout_s(self) -> int:
        """How long the validation workload pod may take to succeed (its own timeoutSeconds, else the
        validation timeout)."""
        wp = self.workload_pod
        return wp.timeout_s if wp is not None and wp.timeout_s is not None else self.validation_timeout_s

    @classmethod
    def from_object(cls, obj: dict) -> Rollout:
        """The custom resource as a Rollout; raises SpecError naming the field that cannot be used.
        A field of the wrong JSON type (a list where a number belongs...) is a SpecError too, never a
        TypeError: the API server's schema is not the only writer to trust (found by fuzzing)."""
        if not isinstance(obj, dict):
            raise SpecError("", f"the object is a {type(obj).__name__}, not a DriverRollout")
        try:
            return cls._from_object(obj)
        except SpecError:
            raise
        except (TypeError, AttributeError, ValueError, KeyError, OverflowError) as e:
            where = next((k for k in _FIELDS if k in str(e)), None)
            raise SpecError(where or "", f"a field has the wrong type or form ({type(e).__name__}: "
                                         f"{' '.join(str(e).split())[:200]})") from None

    @classmethod
    def _from_object(cls, obj: dict) -> Rollout:
        md, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        driver = str(spec.get("driver") or "")
        if not VERSION_RE.match(driver):
            raise SpecError("driver", f"{driver!r} is not a driver version (e.g. 570.195.03)")
        flavor = spec.get("flavor") or "auto"
        if flavor not in ("auto", "open", "proprietary"):
            raise SpecError("flavor", f"{flavor!r} is not one of auto, open, proprietary")
        sel = spec.get("nodeSelector") or {}
        exprs = tuple((e.get("key"), e.get("operator"), tuple(e.get("values") or ()))
                      for e in sel.get("matchExpressions") or ())
        for k, op, vals in exprs:
            if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
                raise SpecError("nodeSelector.matchExpressions", f"operator {op!r} for {k!r} is not In, NotIn, "
                                "Exists or DoesNotExist")
            if op in ("In", "NotIn") and not vals:
                raise SpecError("nodeSelector.matchExpressions", f"{k} {op} needs values")
        mu = spec.get("maxUnavailable", 1)
        if isinstance(mu, str) and not PERCENT_RE.match(mu):
            if mu.isascii() and mu.isdigit():
                mu = int(mu)
            else:
                raise SpecError("maxUnavailable", f"{mu!r} is neither a number nor a percentage like 10%")
        if isinstance(mu, str) and not 1 <= int(mu[:-1]) <= 100:
            # 0% would never let a node go (as 0 does); above 100% means nothing
            raise SpecError("maxUnavailable", f"{mu} is not a percentage between 1% and 100%")
        drain, jobs, val = spec.get("drain") or {}, spec.get("waitForJobs") or {}, spec.get("validation") or {}
        r = cls(name=md.get("name", ""), generation=int(md.get("generation") or 1), driver=driver, flavor=flavor,
                uid=str(md.get("uid") or ""), deleting=bool(md.get("deletionTimestamp")),
                not_ready_timeout_s=int(spec.get("notReadyTimeoutSeconds", NOT_READY_TIMEOUT_S)),
                match_labels=dict(sel.get("matchLabels") or {}), match_expressions=exprs,
                max_parallel=int(spec.get("maxParallel", 1)), max_unavailable=mu, canary=int(spec.get("canary", 0)),
                canary_soak_s=None if spec.get("canarySoakSeconds") is None else int(spec["canarySoakSeconds"]),
                failure_budget=int(spec.get("failureBudget", 0)), preflight=spec.get("preflight") or "Refuse",
                drain_selector=drain.get("podSelector") or "", drain_timeout_s=int(drain.get("timeoutSeconds", 600)),
                drain_force=bool(drain.get("force", False)), drain_empty_dir=bool(drain.get("deleteEmptyDirData", False)),
                jobs_selector=jobs.get("podSelector") or "", jobs_timeout_s=int(jobs.get("timeoutSeconds", 3600)),
                validation_timeout_s=int(val.get("timeoutSeconds", 300)), paused=bool(spec.get("paused", False)),
                workload_pod=WorkloadPod.from_spec(val.get("workloadPod")), status=obj.get("status") or {})
        for name, v, lo in (("maxParallel", r.max_parallel, 1), ("canary", r.canary, 0),
                            ("failureBudget", r.failure_budget, 0), ("drain.timeoutSeconds", r.drain_timeout_s, 1),
                            ("validation.timeoutSeconds", r.validation_timeout_s, 1),
                            ("notReadyTimeoutSeconds", r.not_ready_timeout_s, 1)):
            if v < lo:
                raise SpecError(name, f"{v} is below the minimum {lo}")
        if isinstance(r.max_unavailable, int) and r.max_unavailable < 1:
            raise SpecError("maxUnavailable", f"{r.max_unavailable} would never let a node be upgraded (minimum 1)")
        if r.preflight not in ("Exclude", "Refuse"):
            raise SpecError("preflight", f"{r.preflight!r} is not Exclude or Refuse")
        return r

    def selects(self, labels: dict) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for k, op, vals in self.match_expressions:
            has = k in labels
            if (op == "In" and labels.get(k) not in vals) or (op == "NotIn" and has and labels[k] in vals) \
                    or (op == "Exists" and not has) or (op == "DoesNotExist" and has):
                return False
        return True

    def label_selector(self) -> str:
        """The node selector in the API's labelSelector syntax (server-side filtering)."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for k, op, vals in self.match_expressions:
            parts.append({"In": f"{k} in ({','.join(vals)})", "NotIn": f"{k} notin ({','.join(vals)})",
                          "Exists": k, "DoesNotExist": f"!{k}"}[op])
        return ",".join(parts)

    def unavailable_limit(self, targets: int) -> int:
        """maxUnavailable as a node count: a percentage (1%…100%) of the target nodes, rounded down,
        at least 1 (5% of 10 nodes is one node at a time, not a rollout that can never start)."""
        mu = self.max_unavailable
        if isinstance(mu, str):
            return max(1, math.floor(targets * int(mu[:-1]) / 100))
        return mu


def selector_string(text: str) -> tuple[dict, tuple]:
    """`kubectl driverd rollout start --selector` (the labelSelector syntax) as matchLabels and
    matchExpressions; raises ValueError naming the term it cannot read."""
    labels: dict = {}
    exprs: list = []
    for term in _split_terms(text):
        m = re.fullmatch(r"\s*([A-Za-z0-9./_-]+)\s+(in|notin)\s+\(([^)]*)\)\s*", term)
        if m:
            exprs.append({"key": m[1], "operator": "In" if m[2] == "in" else "NotIn",
                          "values": [v.strip() for v in m[3].split(",") if v.strip()]})
            continue
        m = re.fullmatch(r"\s*([A-Za-z0-9./_-]+)\s*(==|=|!=)\s*([A-Za-z0-9._-]*)\s*", term)
        if m and m[2] != "!=":
            labels[m[1]] = m[3]
            continue
        if m:
            exprs.append({"key": m[1], "operator": "NotIn", "values": [m[3]]})
            continue
        m = re.fullmatch(r"\s*(!?)([A-Za-z0-9./_-]+)\s*", term)
        if m:
            exprs.append({"key": m[2], "operator": "DoesNotExist" if m[1] else "Exists"})
            continue
        raise ValueError(f"cannot read the selector term {term.strip()!r}")
    return labels, tuple(exprs)


def _split_terms(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


@dataclass(frozen=True)
class NodeView:
    """One node as admission and the CLI see it: its record and its availability."""
    name: str
    state: str
    rollout: str | None          # the rollout key the state belongs to
    reason: str
    message: str
    since: str
    ready: bool
    ready_since: str             # the Ready condition's lastTransitionTime
    unschedulable: bool
    cordoned_by_us: bool
    driver: str | None           # label: what is loaded
    flavor: str | None
    labels: dict
    preflight: dict | None
    skip: bool
    retry: str | None
    attempt: int
    target: str = ""             # version/flavor the record's rollout installs
    waiting: str = ""            # the desired driver or settings the node's daemon keeps out until a rollout

    @classmethod
    def from_node(cls, node: dict) -> NodeView:
        md = node.get("metadata") or {}
        ann, labels = md.get("annotations") or {}, md.get("labels") or {}
        rc = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        ready = rc.get("status") == "True"
        try:
            pre = json.loads(ann[A_PREFLIGHT]) if ann.get(A_PREFLIGHT) else None
        except ValueError:
            pre = None
        try:
            attempt = int(ann.get(A_ATTEMPT) or 0)
        except ValueError:
            attempt = 0
        return cls(name=md.get("name", ""), state=ann.get(A_STATE) or IDLE, rollout=ann.get(A_ROLLOUT),
                   reason=ann.get(A_REASON, ""), message=ann.get(A_MESSAGE, ""), since=ann.get(A_SINCE, ""),
                   ready=ready, ready_since=rc.get("lastTransitionTime") or "", unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
                   cordoned_by_us=ann.get(A_CORDONED) == "true", driver=labels.get(L_VERSION),
                   flavor=labels.get(L_FLAVOR), labels=labels, preflight=pre,
                   skip=(ann.get(A_SKIP) or "").lower() in ("true", "1", "yes"), retry=ann.get(A_RETRY),
                   attempt=attempt, target=ann.get(A_TARGET) or "", waiting=ann.get(A_WAITING) or "")

    def in_rollout(self, r: Rollout) -> bool:
        """The record belongs to this rollout object (any generation of its spec)."""
        return self.rollout is not None and self.rollout.rpartition("/")[0] == r.ident

    def in_rollout_name(self, name: str) -> bool:
        return self.rollout is not None and self.rollout.split("/")[0] == name

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def unavailable(self) -> bool:
        """Counts against maxUnavailable: NotReady, cordoned (by anyone), or being upgraded."""
        return (not self.ready) or self.unschedulable or self.active


def left_with(annotations: dict | None) -> dict[str, str]:
    """driverd.io/left-with-driver: DaemonSet (namespace/name) -> the node label whose `true` brings its
    pods back (driver-ready, or a GPU Operator component's deploy label). A list (the form before the
    labels were kept) reads as driver-ready for each; anything unreadable as none."""
    try:
        doc = json.loads((annotations or {}).get(A_LEFT_WITH) or "{}")
    except ValueError:
        return {}
    if isinstance(doc, list):
        return {str(ref): L_READY for ref in doc}
    return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}


def left_with_value(left: dict[str, str]) -> str | None:
    """The value of driverd.io/left-with-driver for `left` (left_with's form); None (no annotation) when empty."""
    return json.dumps(left, sort_keys=True) if left else None


def state_patch(state: str, reason: str, message: str = "", *, since: str, rollout: str | None = None,
                extra: dict | None = None) -> dict:
    """The merge patch that records a transition on the Node (one request per transition)."""
    ann = {A_STATE: state, A_REASON: reason, A_MESSAGE: message[:1000], A_SINCE: since}
    if rollout is not None:
        ann[A_ROLLOUT] = rollout
    ann.update(extra or {})
    return {"metadata": {"annotations": ann}}
