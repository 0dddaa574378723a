"""The Kubernetes API, the one way driverd reaches it: the official `kubernetes` client for
configuration, authentication and transport (in-cluster service account, or a kubeconfig with the
usual --kubeconfig/--context/$KUBECONFIG conventions), objects as plain dicts.

Why dicts and not the client's typed models: a node daemon reads a handful of fields of a few
objects, and the typed models' (de)serialisation costs more CPU than everything else it does.

Retries (tenacity): connection errors, 5xx and 429 are retried with jittered exponential backoff;
409 conflicts are the caller's to resolve by re-reading (`update()` does that). The client is
imported only when a command needs the cluster, so host-only commands never pay for it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

from driverd.datatypes import dataclass
from driverd.errors import EXIT_USAGE, ClusterError, DriverdError
from driverd.redact import redact_obj

GROUP, VERSION = "driverd.io", "v1alpha1"
ROLLOUTS = f"/apis/{GROUP}/{VERSION}/driverrollouts"
POOLS = f"/apis/{GROUP}/{VERSION}/driverpools"
RETRY_STATUS = (429, 500, 502, 503, 504)
OUTAGE_STATUS = (502, 503, 504)


class KubeError(ClusterError):
    """An API answer that is not a success, with Kubernetes' own status reason and message."""

    def __init__(self, status: int, reason: str, message: str, body: dict | None = None) -> None:
        self.status, self.reason, self.body = status, reason, body or {}
        super().__init__(f"Kubernetes API: {status} {reason}: {message}")
        self.api_message = message

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404


class Unreachable(ClusterError):
    """No answer from the API server. `connect` says whether it failed before a connection was made
    (refused, a name that does not resolve, TLS refused, connect timeout): a command run by a person
    says so at once, as kubectl does; a daemon retries those too (the API server may be restarting)."""

    def __init__(self, message: str, *, connect: bool = False, **kw) -> None:
        super().__init__(message, **kw)
        self.connect = connect


@dataclass
class Target:
    """Which Kubernetes API to reach and how: a kubeconfig and context, or the in-cluster service account."""
    kubeconfig: str | None = None
    context: str | None = None
    in_cluster: bool | None = None     # None: in-cluster when running in a pod, else kubeconfig
    # Credentials that make this process run a program (exec plugin, auth-provider) or send a file's
    # content (tokenFile). An operator's kubectl plugin allows them, as kubectl does; the daemon, which
    # runs as root, only with cluster.allow_exec_credentials (daemon/cluster_mode.py).
    allow_exec: bool = True


# What a kubeconfig user may authenticate with only when Target.allow_exec says so.
_RUNS_OR_SENDS = (("exec", "an exec plugin", "which the daemon would run as root"),
                  ("auth-provider", "an auth-provider", "which the daemon would run or refresh as root"),
                  ("tokenFile", "a tokenFile", "whose content the daemon would send to the API server"))
# The files a kubeconfig names: trust (the API server's CA) and secrets (client key, token).
_NAMED_FILES = {"cluster": ("certificate-authority",), "user": ("client-certificate", "client-key", "tokenFile")}


def _configuration(t: Target):
    from kubernetes import client, config
    cfg = client.Configuration()
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not t.kubeconfig
    where = t.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        if t.in_cluster or (t.in_cluster is None and in_pod):
            config.load_incluster_config(client_configuration=cfg)
            cfg.driverd_source = "the pod's service account"
        else:
            merged = _kubeconfig(t, where)
            config.load_kube_config_from_dict(merged, context=t.context, client_configuration=cfg,
                                              persist_config=False)
            cfg.driverd_source = f"context {t.context or merged['current-context']} in {where}"
    except DriverdError:
        raise
    except Exception as e:      # the loaders raise ConfigException, TypeError, FileNotFoundError ...
        raise ClusterError(f"no usable Kubernetes credentials: {e}",
                           fix=f"pass --kubeconfig FILE (tried {where}) or run inside the cluster",
                           exit_code=EXIT_USAGE) from None
    return cfg


def _missing_kubeconfig(t: Target, where: str, paths: list[str]) -> ClusterError | None:
    """A kubeconfig that is not there, said as such (not as "pass --kubeconfig FILE" to someone who did)."""
    missing = [p for p in paths if not os.path.exists(p)]
    if t.kubeconfig and missing:
        return ClusterError(f"kubeconfig {missing[0]} does not exist",
                            fix="pass --kubeconfig the path of an existing kubeconfig (the one kubectl uses is "
                                "$KUBECONFIG or ~/.kube/config)", exit_code=EXIT_USAGE)
    if paths and len(missing) == len(paths):
        named = "$KUBECONFIG names " + ", ".join(missing) if os.environ.get("KUBECONFIG") else f"{missing[0]}"
        return ClusterError(f"no kubeconfig: {named}, which does not exist",
                            fix="pass --kubeconfig FILE or set KUBECONFIG to an existing kubeconfig, or run "
                                "inside the cluster", exit_code=EXIT_USAGE)
    return None


def _kubeconfig(t: Target, where: str):
    """The kubeconfig the client will load (the client's own merge of `where`, ':'-separated), read only
    from files nobody but root — or the user running a one-shot command — can change
    (driverd.fsutil.trusted_file: the kubeconfig, and the CA, client certificate, key and token files it
    names), and refused when its context's user runs a program or sends a file's content and the
    target does not allow that."""
    from kubernetes.config.kube_config import ConfigException, KubeConfigMerger

    from driverd.errors import ConfigError
    from driverd.fsutil import trusted_file
    paths = [os.path.expanduser(p) for p in where.split(":") if p]
    missing = _missing_kubeconfig(t, where, paths)
    if missing is not None:
        raise missing
    for p in paths:
        trusted_file(p, "kubeconfig", missing_ok=True)          # a missing one of several is skipped, as kubectl does
    merged = KubeConfigMerger(":".join(paths)).config
    if merged is None:
        raise ClusterError(f"no usable Kubernetes credentials: no kubeconfig at {where}",
                           fix=f"pass --kubeconfig FILE (tried {where}) or run inside the cluster",
                           exit_code=EXIT_USAGE)
    try:
        name = t.context or merged["current-context"]
        ctx = merged["contexts"].get_with_name(name)["context"]
        user_name = ctx.safe_get("user")
        user = merged["users"].get_with_name(user_name, safe=True) if user_name and merged.safe_get("users") else None
        user = user["user"] if user is not None and user.safe_get("user") else None
        cluster = merged["clusters"].get_with_name(ctx["cluster"])["cluster"]
    except ConfigException as e:
        raise ClusterError(f"no usable Kubernetes credentials: {e}",
                           fix=f"fix the kubeconfig {where} or pass --context", exit_code=EXIT_USAGE) from None
    source = (user.path if user is not None else None) or paths[0]
    if user is not None and not t.allow_exec:
        for key, kind, why in _RUNS_OR_SENDS:
            v = user.safe_get(key)
            if not v:
                continue
            what = (v.get("command") or v.get("name") or "") if isinstance(v, dict) else str(v)
            raise ConfigError(
                f"refusing kubeconfig {source}: user {user_name!r} of context {name!r} authenticates with {kind}"
                + (f" ({what})" if what else "") + f", {why}",
                cause="cluster.allow_exec_credentials is off: the daemon authenticates only with a token or a "
                      "client certificate written in its kubeconfig",
                fix="put a token bound to this Node in the kubeconfig (kubectl create token driverd -n driverd "
                    "--bound-object-kind Node --bound-object-name NODE), or set cluster.allow_exec_credentials = "
                    "true if root may run it")
    for node, keys in (("cluster", _NAMED_FILES["cluster"]), ("user", _NAMED_FILES["user"])):
        entry = cluster if node == "cluster" else user
        if entry is None:
            continue
        base = os.path.dirname(os.path.abspath(entry.path)) if entry.path else os.getcwd()
        for key in keys:
            f = entry.safe_get(key)
            if isinstance(f, str) and f:
                trusted_file(os.path.join(base, os.path.expanduser(f)), f"kubeconfig {source}'s {key}",
                             missing_ok=True)
    return merged


class Kube:
    """A thin REST client over the official client's ApiClient. Thread-safe (urllib3 pools)."""

    def __init__(self, target: Target | None = None, *, retry_for_s: float = 60.0, configuration=None,
                 fail_fast: bool = False, connect_timeout_s: float | None = None) -> None:
        """`fail_fast` (a person's command): a connection that cannot be made (refused, unresolvable,
        TLS, `connect_timeout_s`) is reported at once; only answers that say "later" (5xx, 429) and
        connections broken mid-request are retried within `retry_for_s`."""
        from kubernetes import client
        self.target = target or Target()
        self.fail_fast, self.connect_timeout_s = fail_fast, connect_timeout_s
        self.configuration = configuration or _configuration(self.target)
        self.configuration.retries = False           # ours, below; the pool's own would hide 5xx/429
        self.api = client.ApiClient(self.configuration)
        # what a Node's managedFields name as the manager of driverd's writes (the agent names the
        # writer of an admission it refuses from them)
        from driverd import __version__
        self.api.user_agent = f"driverd/{__version__}"
        self.retry_for_s = retry_for_s
        self.requests = 0                             # how many API calls this client made
        self._count = threading.Lock()

    @property
    def host(self) -> str:
        return self.configuration.host

    # -- raw -----------------------------------------------------------------------------------
    def _call(self, method: str, path: str, *, query: dict | None = None, body: Any = None,
              content_type: str | None = None, timeout: float | tuple | None = 30.0, stream: bool = False,
              accept: str = "application/json"):
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            # Annotations, conditions, Events and rollout status quote reasons that may name a
            # repository URL: its credentials never reach the API server (issue 21).
            body = redact_obj(body)
        q = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in (query or {}).items() if v is not None]
        m, url, hdrs, b, _ = self.api.param_serialize(method, path, query_params=q, header_params=headers,
                                                      body=body, auth_settings=["BearerToken"])
        with self._count:
            self.requests += 1
        if self.connect_timeout_s is not None and isinstance(timeout, (int, float)):
            timeout = (self.connect_timeout_s, timeout)
        try:
            resp = self.api.call_api(m, url, header_params=hdrs, body=b, _request_timeout=timeout)
        except Exception as e:                      # urllib3 MaxRetryError, ProtocolError, timeouts ...
            why, connect = _unreachable_why(e)
            source = getattr(self.configuration, "driverd_source", None)
            raise Unreachable(f"cannot reach the Kubernetes API at {self.host}: {why}", connect=connect,
                              fix="check that the API server runs at that address"
                                  + (f" (the server of {source})" if source else "")
                                  + ", or choose another cluster with --kubeconfig FILE or --context NAME") from None
        if stream and 200 <= resp.status < 300:
            return resp.response
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise _error(resp.status, data)
        return json.loads(data) if data else {}

    def request(self, method: str, path: str, *, retry_429: bool = True, retry: bool = True, **kw) -> dict:
        """One call, retried on connection errors, 5xx and 429 with jittered backoff. An eviction's
        429 is an answer (a PodDisruptionBudget forbids it), not overload: retry_429=False. With
        retry=False the caller owns the retries (the drain backs off and counts them against its
        timeout)."""
        if not retry:
            return self._call(method, path, **kw)
        from tenacity import (
            Retrying,
            retry_if_exception,
            stop_after_delay,
            wait_random_exponential,
        )

        def retryable(e: BaseException) -> bool:
            if self.fail_fast and isinstance(e, Unreachable) and e.connect:
                return False
            return _retryable(e) and (retry_429 or not (isinstance(e, KubeError) and e.status == 429))
        for attempt in Retrying(retry=retry_if_exception(retryable), stop=stop_after_delay(self.retry_for_s),
                                wait=wait_random_exponential(multiplier=0.2, max=5), reraise=True,
                                before_sleep=self._said_unreachable):
            with attempt:
                out = self._call(method, path, **kw)
                self._outage_said = False
                return out
        raise AssertionError("unreachable")

    def _said_unreachable(self, state) -> None:
        """The first failed try of an outage is said at once (a daemon or agent on an API server it cannot
        reach sat silent for its whole retry window; kubectl answers in a second), once until a call
        succeeds again."""
        e = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(e, Unreachable) or getattr(self, "_outage_said", False):
            return
        self._outage_said = True
        from driverd.log import warning
        warning(f"{e.message}; retrying for up to {self.retry_for_s:.0f}s")

    # -- objects ---------------------------------------------------------------------------------
    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def find(self, path: str) -> dict | None:
        try:
            return self.get(path)
        except KubeError as e:
            if e.not_found:
                return None
            raise

    def list(self, path: str, *, labels: str | None = None, fields: str | None = None, retry: bool = True,
             metadata_only: bool = False) -> dict:
        """metadata_only: each item's metadata alone (name, labels, annotations: a PartialObjectMetadataList),
        for a reader that needs nothing else: a real Node's status (its images, conditions) is most of its
        size (issue 47, bench/limits_list.py: 500 such Nodes 4.57 -> 1.56 MB, the API server's CPU 38 -> 17 ms). An API
        server that cannot answer it answers the whole objects (the Accept header names both)."""
        return self.request("GET", path, retry=retry, accept=METADATA_LIST if metadata_only else "application/json",
                            query={"labelSelector": labels or None, "fieldSelector": fields or None})

    def create(self, path: str, obj: dict, *, retry_429: bool = True, retry: bool = True,
               dry_run: bool = False) -> dict:
        """dry_run: the API server validates and defaults the object and answers it, storing nothing."""
        return self.request("POST", path, body=obj, retry_429=retry_429, retry=retry,
                            query={"dryRun": "All"} if dry_run else None)

    def replace(self, path: str, obj: dict) -> dict:
        return self.request("PUT", path, body=obj)

    def patch(self, path: str, patch: dict | list, kind: str = "merge", *, dry_run: bool = False) -> dict:
        """dry_run: the API server applies the patch, runs admission and answers the result, storing nothing."""
        ctype = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.request("PATCH", path, body=patch, content_type=ctype,
                            query={"dryRun": "All"} if dry_run else None)

    def delete(self, path: str, *, dry_run: bool = False) -> dict:
        return self.request("DELETE", path, query={"dryRun": "All"} if dry_run else None)

    def update(self, path: str, mutate: Callable[[dict], dict | None], attempts: int = 20) -> dict | None:
        """Read, change, write with the read resourceVersion; on 409 read again. `mutate` returns the
        new object, or None for "nothing to change" (then nothing is written)."""
        for _ in range(attempts):
            cur = self.get(path)
            new = mutate(json.loads(json.dumps(cur)))
            if new is None:
                return cur
            try:
                return self.replace(path, new)
            except KubeError as e:
                if not e.conflict:
                    raise
        raise ClusterError(f"{path}: still conflicting after {attempts} re-reads", fix="retry later")

    def watch(self, path: str, *, resource_version: str | None = None, labels: str | None = None,
              fields: str | None = None, timeout_s: int = 300, stop: threading.Event | None = None
              ) -> Iterator[dict]:
        """The watch events ({type, object}) of one watch request; ends when the server closes it,
        after timeout_s, or when `stop` is set (checked between events). ERROR events are raised."""
        q = {"watch": "true", "allowWatchBookmarks": "true", "resourceVersion": resource_version,
             "labelSelector": labels, "fieldSelector": fields, "timeoutSeconds": str(timeout_s)}
        resp = self._call("GET", path, query=q, timeout=(10, timeout_s + 30), stream=True)
        try:
            buf = b""
            for chunk in resp.stream(4096, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    if ev.get("type") == "ERROR":
                        o = ev.get("object") or {}
                        raise KubeError(int(o.get("code") or 500), o.get("reason") or "Error", o.get("message", ""), o)
                    yield ev
                if stop is not None and stop.is_set():
                    return
        except (OSError, ValueError) as e:
            if stop is not None and stop.is_set():
                return
            raise Unreachable(f"watch on {path} broke: {_short(e)}") from None
        except Exception as e:      # urllib3 ProtocolError / ReadTimeoutError: the stream ended
            if isinstance(e, KubeError):
                raise
            if type(e).__module__.startswith("urllib3"):
                return
            raise
        finally:
            resp.release_conn()


# the Accept header of a metadata-only list (meta.k8s.io/v1, served since Kubernetes 1.15), then the plain list
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"


def outage(e: BaseException) -> bool:
    """No answer from the API server: none reached, or it says it is shutting down or overloaded
    (502/503/504). A 500 is an answer (the Eviction API's for a pod under two PodDisruptionBudgets)."""
    return isinstance(e, Unreachable) or (isinstance(e, KubeError) and e.status in OUTAGE_STATUS)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, Unreachable) or (isinstance(e, KubeError) and (e.status in RETRY_STATUS
                                                                         or policy_not_configured(e)))


def policy_not_configured(e: KubeError) -> bool:
    """A ValidatingAdmissionPolicy whose paramKind is a CRD the API server's admission has not
    discovered yet refuses every matching request ("failed to configure policy: failed to find resource
    referenced by paramKind"). It is transient: the apiserver resets its discovery mapper every 30 s
    (k8s.io/apiserver pkg/server/options/admission.go) and recompiles the policy within a second — so
    right after `kubectl apply -k deploy/...` a DriverRollout creation is retried, not refused."""
    return e.status == 422 and "failed to configure policy" in e.api_message


def _error(status: int, data: bytes) -> KubeError:
    try:
        body = json.loads(data)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return KubeError(status, body.get("reason") or "Error", body.get("message") or data[:200].decode(errors="replace"),
                     body)


def _unreachable_why(e: BaseException) -> tuple[str, bool]:
    """What went wrong with a request that got no answer, in words, and whether no connection was
    made at all. From the exception and its causes (urllib3 wraps the socket's errors)."""
    import socket
    import ssl
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in chain and len(chain) < 10:
        chain.append(x)
        x = getattr(x, "reason", None) if isinstance(getattr(x, "reason", None), BaseException) else \
            (x.__cause__ or x.__context__)
    names = {c.__class__.__name__ for c in chain}
    if any(isinstance(c, ConnectionRefusedError) for c in chain):
        return "connection refused (nothing listens there)", True
    if any(isinstance(c, socket.gaierror) for c in chain) or "NameResolutionError" in names:
        return "the server's host name does not resolve", True
    if any(isinstance(c, ssl.SSLError) for c in chain) or "SSLError" in names:
        return f"TLS failed: {_short(chain[-1])}", True
    if "ConnectTimeoutError" in names:
        return "connecting timed out", True
    return _short(e), False


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else e.__class__.__name__
    return s[:200]


# -- paths ---------------------------------------------------------------------------------------
def node_path(name: str | None = None) -> str:
    return "/api/v1/nodes" + (f"/{quote(name, safe='')}" if name else "")


def pods_path(namespace: str | None = None, name: str | None = None) -> str:
    if namespace is None:
        return "/api/v1/pods"
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{quote(name, safe='')}" if name else "")


def rollout_path(name: str | None = None, status: bool = False) -> str:
    return ROLLOUTS + (f"/{quote(name, safe='')}" if name else "") + ("/status" if status else "")


def pool_path(name: str | None = None, status: bool = False) -> str:
    return POOLS + (f"/{quote(name, safe='')}" if name else "") + ("/status" if status else "")


def lease_path(namespace: str, name: str | None = None) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases" + (f"/{name}" if name else "")


def now_rfc3339(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def micro_time(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"


def parse_time(s: str | None) -> float | None:
    """An RFC 3339 time of the API (UTC when it names no offset) as seconds since the epoch; None when
    absent or not a time. Fast: a coordinator's pass reads a time of every node of the fleet."""
    if not s:
        return None
    from datetime import datetime, timezone
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
