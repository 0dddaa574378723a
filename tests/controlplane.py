"""The real Kubernetes control plane for tests: etcd, kube-apiserver and kube-controller-manager, built
from upstream's Go modules by .ci/build-control-plane, run on loopback with random ports in a temp dir.

- The admin talks with a static token (group system:masters); driverd's daemons talk with tokens of
  deploy/'s ServiceAccount obtained through the TokenRequest API, bound to their Node object, so the
  real RBAC authorizer and deploy/'s ValidatingAdmissionPolicy see exactly what a cluster sees.
- `--authorization-mode=Node,RBAC` and the admission plugins of a default cluster (no
  `--enable-admission-plugins`: the apiserver's own default set, ServiceAccount and NodeRestriction
  included).
- The controller-manager runs the disruption controller (PodDisruptionBudget status: without it every
  eviction is refused), the garbage collector, the namespace and ServiceAccount controllers and the
  legacy ServiceAccount token controller (deploy/overlays/host-mode's token Secret).
- No kubelet runs with this control plane (tests/realnode.py runs a real one against a control plane of
  its own): `Kubelet` below plays one (pods Running and Ready, a deleted pod's graceful deletion
  confirmed), and node Ready conditions are written by the tests.
"""
from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import REPO, free_port, missing_component, stop_process
from tests.kubetools import condition_true, conditions

ADMIN_TOKEN = "driverd-test-admin-token"
# A person running `kubectl driverd`: group gpu-admins, bound to deploy/'s driverd-operator ClusterRole
# the way README says (kubectl create clusterrolebinding driverd-operators ... --group=gpu-admins).
OPERATOR_TOKEN = "driverd-test-operator-token"


def find_binaries() -> tuple[Path, str]:
    """(the directory .ci/build-control-plane builds into, what is missing there: "" when complete)."""
    where = os.environ.get("DRIVERD_K8S_BIN") or subprocess.run(
        ["bash", str(REPO / ".ci/build-control-plane"), "--print"], capture_output=True, text=True).stdout.strip()
    d = Path(where)
    missing = [b for b in ("etcd", "kube-apiserver", "kube-controller-manager") if not os.access(d / b, os.X_OK)]
    if not missing:
        return d, ""
    return d, (f"the real control plane is not built ({', '.join(missing)} missing in {d}); "
               "fix: bash .ci/build-control-plane (CI: .ci/install-components runs it)")


def binaries() -> Path:
    """The directory with kube-apiserver, kube-controller-manager and etcd, or a skip (a failure in CI,
    where .ci/install-components builds them)."""
    d, msg = find_binaries()
    if msg:
        missing_component(msg)
    return d


class ControlPlane:
    def __init__(self, bindir: Path, workdir: Path, *, address: str = "127.0.0.1", port: int = 0,
                 service_range: str = "10.96.0.0/16", controllers: tuple[str, ...] = (),
                 apiserver_args: tuple[str, ...] = (), scheduler: bool = False,
                 node_tokens: tuple[str, ...] = ()) -> None:
        """address/port: where kube-apiserver listens (port 0: a free one on loopback); controllers: more
        kube-controller-manager controllers than the default set; scheduler: also run kube-scheduler;
        node_tokens: node names whose kubelet authenticates with a static token (node_token())."""
        self.bin, self.dir = bindir, workdir
        self.address, self.fixed_port, self.service_range = address, port, service_range
        self.extra_controllers, self.apiserver_extra = controllers, apiserver_args
        self.with_scheduler, self.node_names = scheduler, node_tokens
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}
        # what the stopped lifetimes of a restarted component used: CPU seconds, and the apiserver's
        # own request count (apiserver_request_total starts again from 0 in a new process)
        self.retired_cpu: dict[str, float] = {}
        self.retired_requests: dict[tuple[str, str, str], float] = {}
        self.retired_policy_s: dict[str, float] = {}
        self.restarts = 0
        self.controllers_at = 0        # self.restarts when kube-controller-manager last started
        self.port = 0
        self.url = ""
        self.ca = str(workdir / "certs" / "apiserver.crt")
        self.kubeconfig = str(workdir / "admin.kubeconfig")

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 120) -> ControlPlane:
        d = self.dir
        (d / "certs").mkdir(parents=True, exist_ok=True)
        sa_key, sa_pub = d / "sa.key", d / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub)], check=True,
                       capture_output=True)
        # A node's kubelet is user system:node:NAME in group system:nodes: the Node authorizer and the
        # NodeRestriction admission plugin then hold it to its own Node and pods, as a cluster does.
        nodes = "".join(f'{self.node_token(n)},system:node:{n},node-{n},"system:nodes"\n' for n in self.node_names)
        (d / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n'
                                      f'{OPERATOR_TOKEN},operator,operator-uid,"gpu-admins"\n' + nodes)
        # The audit log records every request of driverd's ServiceAccounts (the node daemons', the
        # coordinator's) and of the operator: what driverd actually calls, as the apiserver saw it (verb,
        # resource, subresource, answer).
        (d / "audit-policy.yaml").write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "users": ["system:serviceaccount:driverd:driverd",
                                                     "system:serviceaccount:driverd:driverd-coordinator", "operator"]},
                      {"level": "None"}]}))
        self.audit_log = d / "audit.log"
        etcd_port, peer_port, self.port = free_port(), free_port(), self.fixed_port or free_port()
        etcd_url = self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [
            "--name", "default", "--data-dir", str(d / "etcd"), "--listen-client-urls", etcd_url,
            "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn"])
        self.url = f"https://{self.address}:{self.port}"
        self._spawn("kube-apiserver", [
            "--etcd-servers", etcd_url, "--bind-address", self.address, "--advertise-address", self.address,
            "--secure-port", str(self.port), "--cert-dir", str(d / "certs"),
            "--token-auth-file", str(d / "tokens.csv"),
            "--authorization-mode", "Node,RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(sa_pub), "--service-account-signing-key-file", str(sa_key),
            "--service-cluster-ip-range", self.service_range, "--allow-privileged",
            "--audit-policy-file", str(d / "audit-policy.yaml"), "--audit-log-path", str(self.audit_log),
            "--audit-log-mode", "blocking", "--audit-log-format", "json",
            # requests/watch counts stay per verb and resource in the apiserver's own metrics
            "--watch-cache=true", "-v", "1", *self.apiserver_extra])
        self._wait_ready(timeout)
        self.write_kubeconfig(self.kubeconfig, token=ADMIN_TOKEN)
        self._spawn("kube-controller-manager", [
            "--kubeconfig", self.kubeconfig, "--bind-address", "127.0.0.1", "--secure-port", "0",
            "--controllers", ",".join(("disruption", "garbagecollector", "namespace", "serviceaccount",
                                       "serviceaccount-token", *self.extra_controllers)),
            "--service-account-private-key-file", str(sa_key), "--root-ca-file", self.ca,
            "--use-service-account-credentials=false", "--leader-elect=false", "-v", "1"])
        if self.with_scheduler:
            self._spawn("kube-scheduler", ["--kubeconfig", self.kubeconfig, "--bind-address", "127.0.0.1",
                                           "--secure-port", "0", "--leader-elect=false", "-v", "1"])
        return self

    @staticmethod
    def node_token(node: str) -> str:
        return f"driverd-test-node-{node}"

    def compact_etcd(self) -> int:
        """Compact etcd's history up to now (what kube-apiserver does every 5 minutes): a watch from an
        older resourceVersion can no longer be served. Through etcd's own JSON gateway."""
        url = self.etcd_url + "/v3/kv/range"
        head = json.loads(urllib.request.urlopen(urllib.request.Request(url, data=b'{"key": "AA=="}'), timeout=10).read())
        rev = int(head["header"]["revision"])
        urllib.request.urlopen(urllib.request.Request(self.etcd_url + "/v3/kv/compaction",
                                                      data=json.dumps({"revision": str(rev), "physical": True}).encode()),
                               timeout=30).read()
        return rev

    def restart_apiserver(self, down_s: float = 1.0) -> None:
        """kube-apiserver stops and starts again on the same port (etcd keeps the state): every watch
        breaks, every client sees connection errors meanwhile."""
        p = self.procs["kube-apiserver"]
        self._retire("kube-apiserver")
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:     # still draining its watches: as after a crash, then
            p.kill()
            p.wait(10)
        time.sleep(down_s)
        self._spawn("kube-apiserver", self.args["kube-apiserver"])
        self.restarts += 1
        self._wait_ready(120)

    def restart_controller_manager(self) -> None:
        """kube-controller-manager stops and starts again: its informers list the API server afresh."""
        self._retire("kube-controller-manager")
        stop_process(self.procs["kube-controller-manager"])
        self._spawn("kube-controller-manager", self.args["kube-controller-manager"])
        self.controllers_at = self.restarts

    def _retire(self, name: str) -> None:
        """Keep what a component's process counted before it stops: its CPU from /proc, and for the
        apiserver its request counter (requests in the last moments before the stop are not in it)."""
        self.retired_cpu[name] = self.cpu_seconds(name)
        if name == "kube-apiserver":
            try:
                now, policies = self._scrape()
            except (OSError, urllib.error.URLError):
                return
            for k, v in now.items():
                self.retired_requests[k] = self.retired_requests.get(k, 0.0) + v
            for k, v in policies.items():
                self.retired_policy_s[k] = self.retired_policy_s.get(k, 0.0) + v

    def pid(self, name: str) -> int | None:
        p = self.procs.get(name)
        return p.pid if p is not None and p.poll() is None else None

    def cpu_seconds(self, name: str) -> float:
        """CPU seconds (user + system) of component `name` over all its lifetimes, from /proc."""
        return self.retired_cpu.get(name, 0.0) + proc_cpu_seconds(self.pid(name))

    def _spawn(self, name: str, args: list[str]) -> None:
        self.args[name] = args
        log = open(self.dir / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen([str(self.bin / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        last = ""
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}: {self.log_tail(name)}")
            try:
                if os.path.exists(self.ca) and self.raw("GET", "/readyz") == b"ok":
                    return
            except (OSError, urllib.error.URLError) as e:
                last = str(e)
            time.sleep(0.5)
        raise RuntimeError(f"kube-apiserver not ready after {timeout}s ({last}): {self.log_tail('kube-apiserver')}")

    def log_tail(self, name: str, n: int = 3000) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def stop(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            p = self.procs.get(name)
            if p and p.poll() is None:
                stop_process(p)

    # -- access --------------------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)

    def raw(self, method: str, path: str, body: dict | None = None, token: str = ADMIN_TOKEN,
            content_type: str = "application/json") -> bytes:
        """One request; a 429 with Retry-After (the apiserver still setting up a new CRD's handler, or
        its priority-and-fairness queues full) is waited out, as clients do."""
        for attempt in range(50):
            req = urllib.request.Request(self.url + path, method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
            try:
                with urllib.request.urlopen(req, context=self.ssl_context(), timeout=30) as r:
                    return r.read()
            except urllib.error.HTTPError as e:
                if e.code != 429 or not e.headers.get("Retry-After") or attempt == 49 or "eviction" in path:
                    raise
                time.sleep(min(float(e.headers.get("Retry-After") or 1), 1.0))
        raise AssertionError("unreachable")

    def api(self, method: str, path: str, body: dict | None = None, token: str = ADMIN_TOKEN,
            content_type: str = "application/json") -> dict:
        return json.loads(self.raw(method, path, body, token, content_type) or b"{}")

    def ensure(self, path: str, obj: dict) -> dict:
        """Create obj under the collection path unless it exists (409)."""
        try:
            return self.api("POST", path, obj)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise AssertionError(f"POST {path}: {e.code} {e.read()[:500]!r}") from None
            return self.api("GET", f"{path}/{obj['metadata']['name']}")

    def operator_kubeconfig(self, path: str | os.PathLike) -> str:
        return self.write_kubeconfig(path, token=OPERATOR_TOKEN, user="operator")

    def node_kubeconfig(self, node: str, path: str | os.PathLike) -> str:
        """What a host daemon of `node` uses: a token of deploy/'s ServiceAccount bound to its Node."""
        return self.write_kubeconfig(path, token=self.token("driverd", "driverd", node=node), user=f"driverd-{node}")

    def coordinator_kubeconfig(self, name: str, path: str | os.PathLike) -> str:
        """What deploy/'s coordinator Deployment runs with: a token of the ServiceAccount driverd-coordinator
        bound to its pod `name` (a pod object of that account, never scheduled: no scheduler of that name)."""
        ns = "driverd"
        try:
            self.api("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", {"gracePeriodSeconds": 0})
        except urllib.error.HTTPError:
            pass
        pod = self.api("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"serviceAccountName": "driverd-coordinator", "schedulerName": "nobody", "containers": [
                {"name": "coordinator", "image": "driverd:0.1.0", "command": ["driverd", "cluster", "coordinator"]}]}})
        return self.write_kubeconfig(path, token=self.token(ns, "driverd-coordinator", pod=pod), user=name)

    def write_kubeconfig(self, path: str | os.PathLike, *, token: str = ADMIN_TOKEN, user: str = "admin") -> str:
        ca = Path(self.ca).read_bytes()
        import base64
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
               "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                         "certificate-authority-data": base64.b64encode(ca).decode()}}],
               "users": [{"name": user, "user": {"token": token}}],
               "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}]}
        Path(path).write_text(json.dumps(doc))
        return str(path)

    def token(self, namespace: str, sa: str, *, node: str | None = None, pod: dict | None = None,
              seconds: int = 7200) -> str:
        """A ServiceAccount token from the TokenRequest API, bound to a Node (host mode: the host's
        identity) or to a Pod (container mode: the DaemonSet pod; the token then names the pod's node)."""
        spec: dict = {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds}
        if node:
            uid = self.api("GET", f"/api/v1/nodes/{node}")["metadata"]["uid"]
            spec["boundObjectRef"] = {"kind": "Node", "apiVersion": "v1", "name": node, "uid": uid}
        elif pod:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        r = self.api("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                     {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return r["status"]["token"]

    def audited(self, user: str) -> list[dict]:
        """The audit events of `user` so far, one per request: at ResponseComplete, or for a watch still
        open at ResponseStarted."""
        if not self.audit_log.exists():
            return []
        out: dict[str, dict] = {}
        for line in self.audit_log.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("user", {}).get("username") == user and ev.get("stage") in ("ResponseStarted", "ResponseComplete"):
                out[ev["auditID"]] = ev
        return list(out.values())

    def metrics(self) -> dict[tuple[str, str, str], float]:
        """apiserver_request_total by (verb, resource, subresource): the apiserver's own count, summed
        over its lifetimes (a restarted apiserver counts from 0 again)."""
        out = dict(self.retired_requests)
        for k, v in self._scrape()[0].items():
            out[k] = out.get(k, 0.0) + v
        return out

    def policy_seconds(self) -> dict[str, float]:
        """Seconds the apiserver spent in its ValidatingAdmissionPolicy admission plugin (every policy
        of deploy/), by operation (CREATE: evictions, Events, the Lease; UPDATE: Nodes, the Lease,
        rollouts), from apiserver_admission_controller_admission_duration_seconds, over its lifetimes."""
        out = dict(self.retired_policy_s)
        for k, v in self._scrape()[1].items():
            out[k] = out.get(k, 0.0) + v
        return out

    def audit_mark(self) -> int:
        """Where the audit log stands now (bytes)."""
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def audit_requests(self, user: str, since: int = 0, until: int | None = None) -> dict[tuple[str, str, str], int]:
        """Requests of `user` the apiserver started between two audit_mark()s, by (verb, resource,
        subresource), from its audit log (which survives a restart of the apiserver). A request is
        counted where its first event is (a watch opened before `since` and closed after is not)."""
        seen: set[str] = set()
        out: dict[tuple[str, str, str], int] = {}
        if not self.audit_log.exists():
            return out
        pos = 0
        with open(self.audit_log, "rb") as fh:
            for line in fh:
                at, pos = pos, pos + len(line)
                if until is not None and at >= until:
                    break
                if user.encode() not in line:
                    continue
                ev = json.loads(line)
                if ev.get("user", {}).get("username") != user or ev["auditID"] in seen:
                    continue
                seen.add(ev["auditID"])
                if at >= since:
                    o = ev.get("objectRef") or {}
                    k = (ev.get("verb", ""), o.get("resource", ""), o.get("subresource", ""))
                    out[k] = out.get(k, 0) + 1
        return out

    def _scrape(self) -> tuple[dict[tuple[str, str, str], float], dict[str, float]]:
        """This apiserver process's apiserver_request_total by (verb, resource, subresource), and its
        seconds in the ValidatingAdmissionPolicy plugin by operation."""
        out: dict[tuple[str, str, str], float] = {}
        policies: dict[str, float] = {}
        check = "apiserver_admission_controller_admission_duration_seconds_sum{"
        for line in self.raw("GET", "/metrics").decode().splitlines():
            if line.startswith("apiserver_request_total{"):
                labels, value = line[len("apiserver_request_total{"):].rsplit("} ", 1)
                kv = dict(part.split("=", 1) for part in _split_labels(labels))
                key = (kv.get("verb", ""), kv.get("resource", ""), kv.get("subresource", ""))
                out[key] = out.get(key, 0.0) + float(value)
            elif line.startswith(check):
                labels, value = line[len(check):].rsplit("} ", 1)
                kv = dict(part.split("=", 1) for part in _split_labels(labels))
                if kv.get("name") == "ValidatingAdmissionPolicy":
                    op = kv.get("operation", "")
                    policies[op] = policies.get(op, 0.0) + float(value)
        return out, policies

    def apply(self, env: dict, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["kubectl", *args], capture_output=True, text=True, env=env, timeout=120)

    def kubectl_env(self, home: Path, kubeconfig: str | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env["KUBECONFIG"] = kubeconfig or self.kubeconfig
        env["HOME"] = str(home)              # kubectl's discovery cache stays in the test's directory
        return env


def proc_cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system, its threads included) process `pid` has used, from /proc/PID/stat;
    0 for no process."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()        # after "(comm)": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _split_labels(s: str) -> list[str]:
    """k="v",k2="v2" (values never hold '",' in these metrics) -> ['k=v', 'k2=v2']"""
    return [p.replace('"', "") for p in s.split('",') if p]


class Kubelet:
    """Plays the kubelet of every node for pods: a pod bound to a node becomes Running and Ready, and
    a pod whose graceful deletion started is confirmed gone (what the kubelet does after the
    containers stop), unless its node is in `stuck` (a node that never confirms: pods stay Terminating)."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.stuck: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kubelet", daemon=True)

    def start(self) -> Kubelet:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sync()
            except Exception:           # the apiserver restarting: try again on the next tick
                pass
            self.stop.wait(0.2)

    def sync(self) -> None:
        pods = self.cp.api("GET", "/api/v1/pods?fieldSelector=spec.nodeName!%3D")["items"]
        for p in pods:
            md, st = p["metadata"], p.get("status") or {}
            path = f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}"
            if md.get("deletionTimestamp"):
                if p["spec"]["nodeName"] not in self.stuck:
                    try:
                        self.cp.api("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1",
                                                     "gracePeriodSeconds": 0,
                                                     "preconditions": {"uid": md["uid"]}})
                    except urllib.error.HTTPError:
                        pass
                continue
            if st.get("phase") == "Pending" and p["spec"].get("nodeName"):
                mark_running(self.cp, p)


def mark_running(cp: ControlPlane, pod: dict) -> None:
    md = pod["metadata"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cp.api("PATCH", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/status",
           {"status": {"phase": "Running", "startTime": now,
                       "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                                      {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]}},
           content_type="application/strategic-merge-patch+json")


def start_session_control_plane() -> ControlPlane:
    bindir = binaries()
    work = Path(tempfile.mkdtemp(prefix="driverd-k8s-"))
    return started(ControlPlane(bindir, work))


def started(thing):
    """thing.start(), or thing.stop() when that fails part way (a control plane, a real node)."""
    try:
        thing.start()
    except BaseException:
        thing.stop()
        raise
    return thing


def finish(thing) -> None:
    """Stop a control plane or a real node and remove its directory (kept with DRIVERD_KEEP_CONTROL_PLANE)."""
    thing.stop()
    if not os.environ.get("DRIVERD_KEEP_CONTROL_PLANE"):
        shutil.rmtree(thing.dir, ignore_errors=True)


def apply_deploy(cp: ControlPlane, home: Path, overlay: str = "container-mode") -> subprocess.CompletedProcess:
    """`kubectl apply -k deploy/overlays/<overlay>` as the admin: the CRD, RBAC and admission policy
    driverd's daemons run under."""
    r = cp.apply(cp.kubectl_env(home), "apply", "-k", str(REPO / "deploy" / "overlays" / overlay))
    if r.returncode != 0:
        raise AssertionError(f"kubectl apply -k deploy/overlays/{overlay}: {r.stdout}\n{r.stderr}")
    cp.ensure("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "driverd-operators"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "driverd-operator"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "gpu-admins"}]})
    # the CRD serves once Established; the policy holds once its binding is loaded (checked by the tests)
    for plural in ("driverrollouts", "driverpools"):
        wait_established(cp, f"{plural}.driverd.io")
    wait_policies_configured(cp)
    return r


def wait_established(cp: ControlPlane, crd: str, timeout_s: float = 30.0) -> dict:
    """The CustomResourceDefinition `crd` (plural.group) once it serves (Established)."""
    end = time.monotonic() + timeout_s
    while True:
        obj = cp.api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
        if condition_true(obj, "Established"):
            return obj
        assert time.monotonic() < end, f"the CRD {crd} was never Established: {conditions(obj)}"
        time.sleep(0.2)


def wait_policies_configured(cp: ControlPlane, timeout_s: float = 75.0) -> None:
    """A ValidatingAdmissionPolicy with a CRD as paramKind refuses every matching request until the
    apiserver's admission discovers that CRD (its discovery mapper resets every 30 s): wait until a
    server-side dry run of a DriverRollout creation gets past it, as the tests' raw requests do not retry."""
    probe = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "policy-probe"},
             "spec": {"driver": "550.127.05", "paused": True}}
    end = time.monotonic() + timeout_s
    while True:
        try:
            cp.api("POST", "/apis/driverd.io/v1alpha1/driverrollouts?dryRun=All", probe)
            return
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            if "failed to configure policy" not in body or time.monotonic() > end:
                raise AssertionError(f"dry-run DriverRollout after apply: {e.code} {body[:500]}") from None
        time.sleep(0.5)


def reset(cp: ControlPlane) -> None:
    """Between tests on the session's control plane: no pools, rollouts, nodes, GPU pods and their
    ReplicaSets, PDBs, device-plugin DaemonSet, Lease or Events of an earlier test (the deploy/
    objects stay). Finalizers nobody will remove any more (a rollout's, once its daemons are gone; a
    test's pod held Terminating) are dropped first."""
    if cp.restarts != cp.controllers_at:
        # kube-apiserver was restarted since kube-controller-manager started (an earlier test's outage):
        # its informers back off while the API server is away (client-go's reflector: 0.8 s doubling to
        # 30 s, jittered up to twice that, reset only after 2 min without a failure) and stay blind for
        # up to a minute after it is back. The disruption controller then counted the next test's GPU pod
        # 51 s after its fleet was built, next to the 60 s its budgets wait allows. A test starts from
        # controllers that watch the API server, as from an emptied one. And from an admission that has its
        # policies: a restarted kube-apiserver refuses what deploy/'s policy matches until its discovery
        # finds the policy's paramKind (up to 30 s): a test's first DriverRollout creation was retried for
        # 24 s in that window.
        cp.restart_controller_manager()
        wait_policies_configured(cp)
    gone = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
    unfinal = {"metadata": {"finalizers": None}}
    for coll in ("/apis/driverd.io/v1alpha1/driverrollouts", "/api/v1/namespaces/gpu-jobs/pods"):
        for o in _items(cp, coll):
            if o["metadata"].get("finalizers"):
                try:
                    cp.api("PATCH", f"{coll}/{o['metadata']['name']}", unfinal,
                           content_type="application/merge-patch+json")
                except urllib.error.HTTPError as e:
                    if e.code != 404:
                        raise
    for path in ("/apis/driverd.io/v1alpha1/driverpools", "/apis/driverd.io/v1alpha1/driverrollouts", "/api/v1/nodes",
                 "/apis/apps/v1/namespaces/gpu-jobs/replicasets", "/api/v1/namespaces/gpu-jobs/pods",
                 "/apis/policy/v1/namespaces/gpu-jobs/poddisruptionbudgets",
                 "/apis/apps/v1/namespaces/gpu-operator/daemonsets", "/api/v1/namespaces/gpu-operator/pods",
                 "/apis/coordination.k8s.io/v1/namespaces/driverd/leases", "/api/v1/namespaces/default/events",
                 "/api/v1/namespaces/driverd/events"):
        try:
            cp.api("DELETE", path, gone)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if not _items(cp, "/api/v1/nodes") and not _items(cp, "/apis/driverd.io/v1alpha1/driverrollouts") \
                and not _items(cp, "/api/v1/namespaces/gpu-jobs/pods") \
                and not _items(cp, "/apis/driverd.io/v1alpha1/driverpools"):
            return
        time.sleep(0.2)
    raise AssertionError("the control plane did not empty between tests")


def _items(cp: ControlPlane, path: str) -> list[dict]:
    try:
        return cp.api("GET", path)["items"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise
