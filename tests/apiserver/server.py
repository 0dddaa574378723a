"""ApiServer: the store served over HTTP on loopback, with start/stop/restart and a kubeconfig writer."""
from __future__ import annotations

import collections
import itertools
import os
import socket
import threading
from http.server import ThreadingHTTPServer

from tests.apiserver.http import Handler
from tests.apiserver.store import Store


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 4096

    def __init__(self, addr, api):
        self.api = api
        super().__init__(addr, Handler)

    def handle_error(self, request, client_address):  # a client that went away is not news
        pass


class ApiServer:
    """An in-memory Kubernetes API server on ``host:port`` (plain HTTP, no authentication).

    ``bookmark_interval``: seconds between BOOKMARK events on watches that allow them (Kubernetes: about a
    minute). ``history``: how many change events are kept for watches resuming from a resourceVersion; older ones
    answer 410 Gone. ``request_log``: how many RequestInfo records ``request_counts_by`` can see."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, bookmark_interval: float = 5.0,
                 history: int = 50000, request_log: int = 200_000, store: Store | None = None):
        self.host, self.port = host, port
        self.bookmark_interval = bookmark_interval
        self.store = store or Store(history=history)
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        self._counter = itertools.count()
        self._count_value = 0
        self._log: collections.deque = collections.deque(maxlen=request_log)
        self._watches = 0
        self._watches_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ApiServer:
        if self._httpd is not None:
            return self
        self._httpd = _HTTPServer((self.host, self.port), self)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"apiserver:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every open connection (watches end at once)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self.store.close_watchers()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread:
            self._thread.join(timeout=5)

    def restart(self) -> ApiServer:
        """Stop, then start on the same port, keeping every object and the resourceVersion counter. Watches are
        cut; as after a real restart the watch cache starts afresh, so resuming from a resourceVersion older than
        the current one answers 410 Gone (resuming from the current one works)."""
        self.stop()
        self.store.forget_history()
        return self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    # ------------------------------------------------------------------ kubeconfig
    def kubeconfig(self, context: str = "driverd-sim", namespace: str = "default") -> dict:
        return {"apiVersion": "v1", "kind": "Config", "preferences": {}, "current-context": context,
                "clusters": [{"name": context, "cluster": {"server": self.url}}],
                "users": [{"name": context, "user": {}}],
                "contexts": [{"name": context, "context": {"cluster": context, "user": context,
                                                            "namespace": namespace}}]}

    def write_kubeconfig(self, path, context: str = "driverd-sim") -> str:
        import yaml
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            yaml.safe_dump(self.kubeconfig(context), f, sort_keys=False)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ accounting
    def _count(self, info) -> None:
        self._count_value = next(self._counter) + 1
        self._log.append(info)

    @property
    def request_count(self) -> int:
        """Total HTTP requests served since construction (restart keeps counting)."""
        return self._count_value

    def request_counts_by(self, key) -> collections.Counter:
        """Counter of ``key(req)`` over the logged requests; ``req`` is a RequestInfo with method, path, query,
        verb (get/list/watch/create/update/patch/delete/deletecollection), group, version, resource, subresource,
        namespace, name, user_agent and code."""
        return collections.Counter(key(r) for r in list(self._log))

    def requests(self) -> list:
        return list(self._log)

    def track(self, conn, opened: bool) -> None:
        with self._conns_lock:
            if opened:
                self._conns.add(conn)
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            else:
                self._conns.discard(conn)

    def _watch_opened(self, w) -> None:
        with self._watches_lock:
            self._watches += 1

    def _watch_closed(self, w) -> None:
        with self._watches_lock:
            self._watches -= 1

    @property
    def open_watches(self) -> int:
        return self._watches

    @property
    def open_connections(self) -> int:
        return len(self._conns)
