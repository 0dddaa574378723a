"""HTTP on --listen / daemon.listen: /metrics (Prometheus text format), /healthz (200 while the
process serves), /readyz (200 only when the host is converged and the driver validated, else 503
with a one-line reason). The standard library's ThreadingHTTPServer in a daemon thread; the thread
sleeps in select() until a request comes."""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from driverd.errors import UsageError


def parse_listen(text: str) -> tuple[str, int]:
    """'ADDR:PORT', '[v6]:PORT' or ':PORT' (all addresses) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r} is not ADDR:PORT", fix="e.g. 127.0.0.1:9477, 0.0.0.0:9477 or [::1]:9477")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler(health, metrics):
    class Handler(BaseHTTPRequestHandler):
        server_version = "driverd"

        def do_GET(self):                      # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                ready, _ = health.readiness()
                metrics.set_ready(ready)
                self._send(200, metrics.render(), metrics.content_type)
            elif path == "/healthz":
                self._send(200, b"ok\n")
            elif path == "/readyz":
                ready, why = health.readiness()
                metrics.set_ready(ready)
                self._send(200 if ready else 503, (("ready: " if ready else "not ready: ") + why + "\n").encode())
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # probes every few seconds must not fill the log
            pass
    return Handler


class Endpoints:
    def __init__(self, listen: str, health, metrics) -> None:
        self.host, self.port = parse_listen(listen)
        self.health, self.metrics = health, metrics
        self.server: _Server | None = None

    def start(self) -> tuple[str, int]:
        """Bind (a busy or forbidden address is a one-line error) and serve in a daemon thread."""
        cls = _Server
        if ":" in self.host:
            cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        try:
            self.server = cls((self.host, self.port), _handler(self.health, self.metrics))
        except OSError as e:
            raise UsageError(f"cannot listen on {self.host}:{self.port}: {e.strerror}",
                             fix="pass another --listen ADDR:PORT (or set daemon.listen); port 0 picks a free "
                                 "one") from None
        # serve_forever wakes every poll_interval to look for shutdown(); the daemon never calls it
        # (the thread ends with the process), so it sleeps in select() until a request comes.
        t = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 3600},
                             name="driverd-http", daemon=True)
        t.start()
        host, port = self.server.server_address[:2]
        return host, port

    def close(self) -> None:
        if self.server is not None:
            self.server.server_close()
