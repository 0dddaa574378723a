"""The daemon's HTTP listener cannot be exhausted by its clients (issue 21): a child process
serving driverd's Endpoints with `ulimit -n 1024` stays answering /healthz while 1,500 idle
sockets, slowloris trickles, 64 KB header floods and reset-before-read clients hit it; its RSS,
thread count and descriptors stay bounded and it prints nothing (no BrokenPipe tracebacks).
Loopback only, bounded counts, ~15 s."""
from __future__ import annotations

import resource
import socket
import time

import pytest

from driverd.daemon.endpoints import MAX_CONNECTIONS, MAX_HEAD_BYTES
from tests.daemon import listener_load as load


@pytest.fixture
def child():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard or soft < hard < 4096:                # the test's own 1,500+ sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    c = load.start("driverd", head_timeout_s=2.0)
    yield c
    c.stop()


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_small_heads_bad_requests_and_methods_get_one_answer_each(child):
    assert _raw(child.port, b"GET /healthz HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\nok\n")
    assert b" 404 " in _raw(child.port, b"GET /nope HTTP/1.1\r\n\r\n").split(b"\r\n")[0]
    many = b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(40)) + b"\r\n"
    assert _raw(child.port, many).startswith(b"HTTP/1.1 431 ")
    huge = b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES * 4) + b"\r\n\r\n"
    assert _raw(child.port, huge).startswith(b"HTTP/1.1 431 ")
    assert _raw(child.port, b"\x16\x03\x01 garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(child.port, b"POST /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    head = _raw(child.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")       # no body
    assert b"driverd_" in load.get(child.port, "/metrics")[1]


def test_a_slow_head_is_closed_at_its_deadline_however_it_trickles(child):
    s = socket.create_connection(("127.0.0.1", child.port), timeout=10)
    s.sendall(b"GET /healthz HTTP/1.1\r\n")
    t0 = time.monotonic()
    closed = None
    while time.monotonic() - t0 < 8:
        try:
            s.sendall(b"X: y\r\n")          # one line every 0.2 s: a read timeout alone would never fire
            s.settimeout(0.2)
            if s.recv(1) == b"":
                closed = time.monotonic() - t0
                break
        except socket.timeout:
            continue
        except OSError:
            closed = time.monotonic() - t0
            break
    s.close()
    assert closed is not None and 1.5 <= closed <= 4.0, closed         # head deadline 2 s in the child


def test_healthz_is_served_and_rss_stays_flat_under_a_socket_storm(child):
    for _ in range(20):                         # warm-up: the first requests allocate what they keep
        assert load.get(child.port)[0] == 200
    quiet = load.probe(child.port, 100, pause_s=0.0)
    before = child.status()
    storm = load.Storm(child.port, idle=1500, slowloris=100, big=40, resets=500).start()
    try:
        during = load.probe(child.port, 200, pause_s=0.02)
        peak = child.status()
    finally:
        storm.stop()
    time.sleep(0.5)
    after = child.status()
    codes = [c for c, _ in during]
    # Every probe answered while 1,500 idle + 100 slowloris + 40 header floods were open.
    assert codes.count(200) == len(codes), codes
    quiet_p99, storm_p99 = load.p99([t for _, t in quiet]), load.p99([t for _, t in during])
    assert storm_p99 < 1.0, (quiet_p99, storm_p99)          # 2 shared cores; a dropped SYN alone costs 1 s
    # One serving thread, whatever the number of clients; descriptors capped far below ulimit -n 1024.
    assert peak["Threads"] == before["Threads"] <= 3, (before, peak)
    assert peak["fds"] <= min(MAX_CONNECTIONS, 1024 // 4) + 16, peak
    # 40 clients offering 99 x 64 KB headers cost at most one 8 KB head each: RSS stays flat.
    assert peak["VmRSS"] - before["VmRSS"] < 12 * 1024, (before, peak)
    assert after["VmRSS"] - before["VmRSS"] < 12 * 1024, (before, after)
    assert load.get(child.port)[0] == 200
    err = child.stop()
    assert err == "", err                                  # no BrokenPipe or reset tracebacks
