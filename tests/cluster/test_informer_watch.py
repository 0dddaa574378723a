"""Each watch of an Informer asks the apiserver for its own timeout, between 5 and 10 minutes (as
client-go's reflector does): a fleet's daemons started together do not all come back at the same
second, every 290 s, as they did with one fixed timeout (issue 34)."""
from __future__ import annotations

import threading

from driverd.cluster.informer import Informer


class Recording:
    """The API as far as an Informer uses it: an empty list, then watches that end at once."""

    def __init__(self, stop_after: int) -> None:
        self.timeouts: list[int] = []
        self.stop_after = stop_after
        self.done = threading.Event()

    def list(self, path, labels=None, fields=None):
        return {"items": [], "metadata": {"resourceVersion": "7"}}

    def watch(self, path, *, resource_version, labels, fields, timeout_s, stop):
        assert resource_version == "7"
        self.timeouts.append(timeout_s)
        if len(self.timeouts) >= self.stop_after:
            stop.set()
            self.done.set()
        return iter(())


def test_every_watch_draws_its_timeout_between_five_and_ten_minutes():
    kube = Recording(stop_after=40)
    inf = Informer(kube, "/api/v1/nodes", name="t").start()
    assert kube.done.wait(10)
    inf.close()
    assert all(300 <= t < 600 for t in kube.timeouts), kube.timeouts
    assert len(set(kube.timeouts)) > 10, kube.timeouts          # drawn, not one value for all
