"""Issue 48: `cluster agent` and `demo --kubeconfig` sat silent for their whole retry window (60 s) on an API
server they could not reach. The client says the outage at its first failed try, once, and keeps trying."""
from __future__ import annotations

import pytest

from driverd import log
from driverd.cluster.kube import Kube, Target, Unreachable
from tests.conftest import free_port


class _Stream:
    def __init__(self, kube_box: list) -> None:
        self.lines: list[tuple[str, int]] = []
        self.kube_box = kube_box

    def write(self, s: str) -> None:
        if s.strip():
            self.lines.append((s.strip(), self.kube_box[0].requests))

    def flush(self) -> None:
        pass


def test_an_unreachable_api_server_is_said_at_the_first_failed_try_and_once(tmp_path):
    port = free_port()                                   # nothing listens there
    kc = tmp_path / "kubeconfig"
    kc.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    box: list = [None]
    stream = _Stream(box)
    log.configure("text", stream=stream)
    try:
        k = box[0] = Kube(Target(kubeconfig=str(kc)), retry_for_s=2.5)
        with pytest.raises(Unreachable):
            k.get("/api/v1/nodes")
    finally:
        log.reset()
    said = [(line, n) for line, n in stream.lines if "cannot reach the Kubernetes API" in line]
    assert len(said) == 1, stream.lines                  # once for the outage, not once a try
    line, tries = said[0]
    assert tries == 1 and k.requests > 1, (tries, k.requests)     # after the first try; the tries went on
    assert f"127.0.0.1:{port}" in line and "retrying for up to 2s" in line, line
