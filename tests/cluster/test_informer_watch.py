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


class OneStream:
    """A watch whose next event arrives only after the Informer was closed (a stream blocked in its read
    when close() came): the first event, then the second once the test let it through."""

    def __init__(self) -> None:
        self.first_sent, self.release = threading.Event(), threading.Event()

    def list(self, path, labels=None, fields=None):
        return {"items": [], "metadata": {"resourceVersion": "7"}}

    def watch(self, path, *, resource_version, labels, fields, timeout_s, stop):
        for name in ("a", "b"):
            if name == "b":
                self.first_sent.set()
                self.release.wait(10)
            yield {"type": "ADDED", "object": {"metadata": {"name": name, "resourceVersion": "8"}}}
        stop.wait(10)


def test_a_closed_informer_says_nothing_of_what_its_stream_still_brings():
    """Issue 47: a closed watch stays in its read until its next event; that event was still handed to
    on_change (a node agent woken by a drain watch it had ended). Nothing comes after close()."""
    kube, seen = OneStream(), []
    inf = Informer(kube, "/api/v1/pods", name="t", on_change=lambda kind, obj: seen.append(
        (kind, (obj.get("metadata") or {}).get("name")))).start()
    assert kube.first_sent.wait(10)
    inf.close()
    kube.release.set()
    inf._thread.join(10)
    assert not inf._thread.is_alive()
    assert ("ADDED", "a") in seen and ("ADDED", "b") not in seen, seen
    assert inf.get("b") is None
