"""`driverd cluster coordinator` off a cluster it can reach: one line naming the cause and its fix, exit 1
at once (not the informers' silent retries); nothing needs a control plane here."""
from __future__ import annotations

import json
import socket

from tests.conftest import run_cli


def test_an_unreachable_api_server_is_said_in_one_line_at_once(tmp_path):
    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kc = tmp_path / "kubeconfig"
    kc.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "t",
                              "clusters": [{"name": "t", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
                              "users": [{"name": "u", "user": {"token": "s3cr3t-token"}}],
                              "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}]}))
    kc.chmod(0o600)
    r = run_cli("cluster", "coordinator", "--root", str(tmp_path), "--kubeconfig", str(kc), timeout=60)
    assert r.returncode == 1
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "cannot read the Lease driverd/driverd-rollout" in line and f"127.0.0.1:{port}" in line \
        and "connection refused" in line and "fix:" in line, line
    assert "s3cr3t-token" not in r.stderr + r.stdout
