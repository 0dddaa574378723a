"""driverd.sim.fleet's played kubelet: an evicted pod's graceful deletion is confirmed even when the
API server is away at that moment (it restarts), as a real kubelet keeps trying. A confirmation lost
to a restart left the pod Terminating for good: the fleet bench's apiserver-restart fault then failed
an unrelated node with "stuck Terminating"."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from driverd.cluster.kube import Kube, Target
from driverd.sim.fleet import Kubelet
from tests.conftest import free_port as _free_port


def _kubeconfig(path, port: int) -> str:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    path.chmod(0o600)
    return str(path)


def test_a_deletion_confirmed_while_the_api_server_restarts_arrives_once_it_is_back(tmp_path):
    port = _free_port()
    seen: list = []

    class Api(BaseHTTPRequestHandler):
        def do_DELETE(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            seen.append((self.path, body))
            out = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Success"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    kube = Kube(Target(kubeconfig=_kubeconfig(tmp_path / "kubeconfig", port)), retry_for_s=20)
    kubelet = Kubelet(SimpleNamespace(nodes={}), kube)
    md = {"namespace": "gpu-jobs", "name": "train-0", "uid": "u-1"}
    # nothing listens yet: the API server is restarting when the eviction's event arrives
    confirm = threading.Thread(target=kubelet._confirm, args=(md,), daemon=True)
    confirm.start()
    time.sleep(1.0)
    assert not seen
    server = ThreadingHTTPServer(("127.0.0.1", port), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        confirm.join(20)
        assert seen == [("/api/v1/namespaces/gpu-jobs/pods/train-0",
                         {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                          "preconditions": {"uid": "u-1"}})]
    finally:
        server.shutdown()
