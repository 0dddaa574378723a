"""A bounded, loopback-only load generator for the daemon's HTTP listener (issue 21), shared by
tests/daemon/test_listener_load.py and bench/http_listener.py.

The listener runs in a child process (`python -m tests.daemon.listener_load serve IMPL`) with
`ulimit -n 1024`, so its RSS, thread count and stderr are its own. IMPL is `driverd` (the daemon's
Endpoints with a real Metrics registry) or `baseline` (the standard library's ThreadingHTTPServer
with a BaseHTTPRequestHandler, as driverd served before issue 21) — the bench compares the two in
one run."""
from __future__ import annotations

import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class _Health:
    def readiness(self):
        return True, "driver 550.127.05 (open) loaded and validated; last reconcile converged"


def _serve(impl: str, head_timeout_s: float) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    if impl == "driverd":
        from driverd.daemon.endpoints import Endpoints
        from driverd.daemon.metrics import Metrics
        ep = Endpoints("127.0.0.1:0", _Health(), Metrics(), head_timeout_s=head_timeout_s)
        host, port = ep.start()
    else:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class H(BaseHTTPRequestHandler):
            def do_GET(self):                            # noqa: N802
                body = b"ok\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        class S(ThreadingHTTPServer):
            daemon_threads = True
        srv = S(("127.0.0.1", 0), H)
        port = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(port, flush=True)
    sys.stdin.read()                      # until the parent closes our stdin


@dataclass
class Child:
    proc: subprocess.Popen
    port: int

    def status(self) -> dict[str, int]:
        """VmRSS (KiB), Threads and open descriptors of the listener process."""
        out: dict[str, int] = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "Threads"):
                out[k] = int(v.split()[0])
        out["fds"] = len(list(Path(f"/proc/{self.proc.pid}/fd").iterdir()))
        return out

    def stop(self) -> str:
        """Stop the child (closing its stdin); its stderr. Idempotent."""
        if self.proc.returncode is not None:
            return ""
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def start(impl: str, head_timeout_s: float = 5.0) -> Child:
    p = subprocess.Popen([sys.executable, "-m", "tests.daemon.listener_load", "serve", impl, str(head_timeout_s)],
                         cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    line = p.stdout.readline()
    if not line.strip().isdigit():
        p.kill()
        raise RuntimeError(f"listener child did not start: {line!r} {p.stderr.read()}")
    return Child(p, int(line))


def get(port: int, path: str = "/healthz", timeout: float = 2.0) -> tuple[int, bytes, float]:
    """One GET on a fresh connection: (status, body, seconds); status 0 when it failed."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return 0, b"", time.perf_counter() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        code = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        code = 0
    return code, body, time.perf_counter() - t0


def p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)] if xs else float("inf")


@dataclass
class Storm:
    """Hostile clients held open against `port`, all bounded: `idle` connections that never send a
    byte, `slowloris` connections that trickle a header line every `trickle_s`, `big` connections
    that send up to `big_lines` header lines of 64 KB each, and `resets` clients that ask and then
    reset the connection (SO_LINGER 0) before reading the answer."""
    port: int
    idle: int = 0
    slowloris: int = 0
    big: int = 0
    big_lines: int = 99
    resets: int = 0
    trickle_s: float = 0.5
    socks: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list = field(default_factory=list)
    _deadline: float = 0.0

    def _connect(self) -> socket.socket | None:
        # A listener that stopped accepting leaves connects hanging in its backlog: a short timeout
        # and an overall deadline keep the storm bounded in time whatever the listener does.
        if time.monotonic() > self._deadline:
            return None
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        except OSError:
            return None
        self.socks.append(s)
        return s

    def start(self, within_s: float = 15.0) -> "Storm":
        self._deadline = time.monotonic() + within_s
        for _ in range(self.idle):
            # Non-blocking connects: the kernel completes them (retransmitting SYNs a full backlog
            # dropped) while the storm goes on, as many independent clients would.
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            self.socks.append(s)
        slow = [s for s in (self._connect() for _ in range(self.slowloris)) if s]
        for s in slow:
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\n")
            except OSError:
                pass
        self._threads.append(threading.Thread(target=self._trickle, args=(slow,), daemon=True))
        for _ in range(self.big):
            self._threads.append(threading.Thread(target=self._big, daemon=True))
        self._threads.append(threading.Thread(target=self._resets, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def _trickle(self, socks) -> None:
        while not self._stop.wait(self.trickle_s):
            for s in socks:
                try:
                    s.send(b"X-a: b\r\n")
                except OSError:
                    pass

    def _big(self) -> None:
        s = self._connect()
        if s is None:
            return
        line = b"X-Big: " + b"a" * 65536 + b"\r\n"
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\n")
            for _ in range(self.big_lines):
                if self._stop.is_set():
                    return
                s.sendall(line)
        except OSError:
            pass

    def _resets(self) -> None:
        import struct
        for _ in range(self.resets):
            if self._stop.is_set() or time.monotonic() > self._deadline:
                return
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def probe(port: int, n: int, pause_s: float = 0.01) -> list[tuple[int, float]]:
    out = []
    for _ in range(n):
        code, _, dt = get(port)
        out.append((code, dt))
        time.sleep(pause_s)
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        _serve(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 5.0)
    else:
        raise SystemExit("usage: python -m tests.daemon.listener_load serve driverd|baseline [HEAD_TIMEOUT_S]")
