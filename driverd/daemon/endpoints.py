"""HTTP on --listen / daemon.listen: /metrics (Prometheus text format), /healthz (200 while the
process serves), /readyz (200 only when the host is converged and the driver validated, or degraded -
a validated driver runs, not the wanted one - else 503; a one-line reason either way).

driverd runs as root on every node and this port is reachable from the pod network, so the
listener is built not to be exhausted by its clients (issue 21):

- **One thread, no thread per connection.** A selector loop accepts, reads request heads and
  writes answers without blocking. The work a request asks for is an in-memory read (health
  state, a /proc file, the metrics registry), done inline: there is no pool a slow client can fill.
- **A connection cap** (`MAX_CONNECTIONS`, and never more than a quarter of the process's file
  descriptor limit, so a SIGHUP reload still opens its files). At the cap a new connection evicts
  the connection that has been *reading its head* longest — idle and slowloris sockets make room
  for a probe; they never block it.
- **Deadlines, not only read timeouts**: the whole request head within `HEAD_TIMEOUT_S`, the whole
  answer within `WRITE_TIMEOUT_S`; a trickle of one byte a second does not extend either.
- **Small heads**: at most `MAX_HEAD_BYTES` and `MAX_HEADER_LINES`; past either a 431 and close.
  Nothing larger than a head is ever buffered; request bodies are not read.
- **Quiet client errors**: resets, broken pipes and garbage are counted and closed, never a
  traceback.
"""
from __future__ import annotations

import errno
import os
import resource
import selectors
import socket
import threading
import time
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.errors import UsageError

MAX_CONNECTIONS = 128
MAX_HEAD_BYTES = 8192
MAX_HEADER_LINES = 32
HEAD_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 5.0
_BACKLOG = 1024         # a burst of connects waits in the kernel, not as SYN retransmits (1 s each)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def parse_listen(text: str) -> tuple[str, int]:
    """'ADDR:PORT', '[v6]:PORT' or ':PORT' (all addresses) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r} is not ADDR:PORT", fix="e.g. 127.0.0.1:9477, 0.0.0.0:9477 or [::1]:9477")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port)


def connection_cap(limit: int = MAX_CONNECTIONS) -> int:
    """`limit`, but at most a quarter of RLIMIT_NOFILE: the daemon's other work (config reloads,
    journal writes, commands it runs) keeps its descriptors however many clients connect."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(4, min(limit, soft // 4))


@dataclass
class _Conn:
    """One open client connection of the HTTP listener, from accept until it is closed."""
    sock: socket.socket
    opened: float
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytes = b""
    deadline: float = 0.0
    writing: bool = False


@dataclass
class Counters:
    """What the listener did, for tests and the bench (not exported: a scrape must stay cheap)."""
    accepted: int = 0
    served: int = 0
    evicted: int = 0
    timed_out: int = 0
    refused_head: int = 0
    client_errors: int = 0


def _answer(code: int, body: bytes, ctype: str = "text/plain; charset=utf-8", head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nServer: driverd\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head if head_only else head + body


class _Loop:
    def __init__(self, sock: socket.socket, route, cap: int, head_timeout_s: float, write_timeout_s: float) -> None:
        self.sock, self.route, self.cap = sock, route, cap
        self.head_timeout_s, self.write_timeout_s = head_timeout_s, write_timeout_s
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self.counters = Counters()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = False
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop:
            now = time.monotonic()
            deadlines = [c.deadline for c in self.conns.values()]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            for key, events in self.sel.select(timeout):
                if key.data == "wake":
                    try:
                        os.read(self._wake_r, 512)
                    except OSError:
                        pass
                elif key.data is None:
                    self._accept()
                elif events & selectors.EVENT_WRITE:
                    self._write(key.data)
                else:
                    self._read(key.data)
            self._expire(time.monotonic())
        for c in list(self.conns.values()):
            self._close(c)
        self.sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stop(self) -> None:
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- connections ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        # Drain the backlog (bounded: a burst larger than the backlog waits for the next wake-up).
        for _ in range(64):
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors for now (the process's other work holds them): make room, or
                    # pause briefly rather than spin on a listening socket that stays readable.
                    if not self._evict_oldest_reader():
                        time.sleep(0.05)
                    return
                self.counters.client_errors += 1       # ECONNABORTED and friends: the client left
                continue
            if len(self.conns) >= self.cap and not self._evict_oldest_reader():
                s.close()                               # every slot is writing an answer: try later
                continue
            s.setblocking(False)
            now = time.monotonic()
            c = _Conn(s, now, deadline=now + self.head_timeout_s)
            self.conns[s.fileno()] = c
            self.sel.register(s, selectors.EVENT_READ, c)
            self.counters.accepted += 1

    def _evict_oldest_reader(self) -> bool:
        readers = [c for c in self.conns.values() if not c.writing]
        if not readers:
            return False
        self._close(min(readers, key=lambda c: c.opened))
        self.counters.evicted += 1
        return True

    def _close(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        if fd >= 0 and self.conns.pop(fd, None) is not None:
            try:
                self.sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
        try:
            c.sock.close()
        except OSError:
            pass

    def _expire(self, now: float) -> None:
        for c in [c for c in self.conns.values() if c.deadline <= now]:
            self.counters.timed_out += 1
            self._close(c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(MAX_HEAD_BYTES + 1 - len(c.inbuf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.counters.client_errors += 1
            self._close(c)
            return
        if not data:                                   # the client went away before asking
            self._close(c)
            return
        c.inbuf += data
        end = c.inbuf.find(b"\r\n\r\n")
        if end < 0:
            end = c.inbuf.find(b"\n\n")
        if end < 0:
            if len(c.inbuf) > MAX_HEAD_BYTES or c.inbuf.count(b"\n") > MAX_HEADER_LINES:
                self._respond(c, _answer(431, b"request head too large\n"), refused=True)
            return
        head = bytes(c.inbuf[:end])
        self._respond(c, self._handle(head))

    def _handle(self, head: bytes) -> bytes:
        lines = head.split(b"\n")
        if len(head) > MAX_HEAD_BYTES or len(lines) > MAX_HEADER_LINES + 1:
            self.counters.refused_head += 1
            return _answer(431, b"request head too large\n")
        parts = lines[0].strip().split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self.counters.client_errors += 1
            return _answer(400, b"bad request\n")
        method, target = parts[0], parts[1].decode("latin-1")
        if method not in (b"GET", b"HEAD"):
            return _answer(405, b"only GET and HEAD\n")
        try:
            code, body, ctype = self.route(target.split("?", 1)[0])
        except Exception as e:                          # a probe must answer, never kill the loop
            code, body, ctype = 503, f"cannot answer: {' '.join(str(e).split())[:200]}\n".encode(), \
                "text/plain; charset=utf-8"
        self.counters.served += 1
        return _answer(code, body, ctype, head_only=method == b"HEAD")

    def _respond(self, c: _Conn, data: bytes, refused: bool = False) -> None:
        if refused:
            self.counters.refused_head += 1
        c.inbuf = bytearray()
        c.out, c.writing = data, True
        c.deadline = time.monotonic() + self.write_timeout_s
        try:
            self.sel.modify(c.sock, selectors.EVENT_WRITE, c)
        except (KeyError, ValueError):
            return
        self._write(c)

    def _write(self, c: _Conn) -> None:
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:                                 # reset or broken pipe: the client left
            self.counters.client_errors += 1
            self._close(c)
            return
        c.out = c.out[n:]
        if not c.out:
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._close(c)


def _router(health, metrics):
    def route(path: str) -> tuple[int, bytes, str]:
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            ready, _ = health.readiness()
            metrics.set_ready(ready)
            return 200, metrics.render(), metrics.content_type
        if path == "/healthz":
            return 200, b"ok\n", text
        if path == "/readyz":
            ready, why = health.readiness()
            metrics.set_ready(ready)
            return (200 if ready else 503), (("ready: " if ready else "not ready: ") + why + "\n").encode(), text
        return 404, b"not found: try /metrics, /healthz or /readyz\n", text
    return route


class Endpoints:
    def __init__(self, listen: str, health, metrics, *, max_connections: int = MAX_CONNECTIONS,
                 head_timeout_s: float = HEAD_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.host, self.port = parse_listen(listen)
        self.health, self.metrics = health, metrics
        self.max_connections = max_connections
        self.head_timeout_s, self.write_timeout_s = head_timeout_s, write_timeout_s
        self.loop: _Loop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> tuple[str, int]:
        """Bind (a busy or forbidden address is a one-line error) and serve in a daemon thread."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(_BACKLOG)
        except OSError as e:
            sock.close()
            raise UsageError(f"cannot listen on {self.host}:{self.port}: {e.strerror}",
                             fix="pass another --listen ADDR:PORT (or set daemon.listen); port 0 picks a free "
                                 "one") from None
        self.loop = _Loop(sock, _router(self.health, self.metrics), connection_cap(self.max_connections),
                          self.head_timeout_s, self.write_timeout_s)
        self._thread = threading.Thread(target=self.loop.run, name="driverd-http", daemon=True)
        self._thread.start()
        host, port = sock.getsockname()[:2]
        return host, port

    @property
    def counters(self) -> Counters:
        return self.loop.counters if self.loop else Counters()

    def close(self) -> None:
        if self.loop is not None and self._thread is not None:
            self.loop.stop()
            self._thread.join(timeout=5)
            self.loop.sock.close()
            self.loop = None
