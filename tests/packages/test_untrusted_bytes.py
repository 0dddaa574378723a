"""Bytes are bounded or verified before they are processed (issue 21): crafted packages — a
128 KB zstd frame that expands to 4 GiB, a 700 MiB manifest or PAX header in a few KB, 5,000
members — and hostile repositories — a 900 MiB index, an oversized signature, a server that
trickles — are refused early, each with one line, in a child process whose peak RSS and run time
are measured. The frames are written by hand (RLE blocks: 4 bytes per 128 KiB of output), so making
a 4 GiB bomb costs nothing."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from driverd.repo.index import INDEX_NAME, SIG_NAME
from tests.conftest import REPO

GiB, MiB = 1 << 30, 1 << 20
_BLOCK = 128 << 10


def zstd_frame(parts: list[tuple]) -> bytes:
    """One zstd frame from ("raw", bytes) and ("rle", byte, count) parts (RFC 8878: window 128 KiB,
    no content size, no checksum)."""
    blocks: list[tuple[int, int, bytes]] = []            # (type, size, content)
    for p in parts:
        if p[0] == "raw":
            data = p[1]
            for i in range(0, len(data), _BLOCK):
                chunk = data[i:i + _BLOCK]
                blocks.append((0, len(chunk), chunk))
        else:
            _, byte, count = p
            while count:
                n = min(count, _BLOCK)
                blocks.append((1, n, bytes([byte])))
                count -= n
    out = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 7 << 3]))
    for i, (typ, size, content) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        out += ((size << 3) | (typ << 1) | last).to_bytes(3, "little") + content
    return bytes(out)


def _header(name: str, size: int, typ: bytes = tarfile.REGTYPE) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.type, ti.mode = size, typ, 0o644
    return ti.tobuf(tarfile.USTAR_FORMAT if typ != tarfile.XHDTYPE else tarfile.GNU_FORMAT)


def _members(*members: tuple[str, int, int, bytes]) -> list[tuple]:
    """(name, size, fill byte, type) members, each padded, then the end-of-archive blocks."""
    parts: list[tuple] = []
    for name, size, fill, typ in members:
        parts.append(("raw", _header(name, size, typ)))
        if size:
            parts.append(("rle", fill, size + (-size % 512)))
    parts.append(("rle", 0, 1024))
    return parts


def bomb(path: Path, size: int = 4 * GiB) -> Path:
    """A package-shaped stream: a small manifest, then one module of `size` zero bytes."""
    manifest = b'{"format": 1}'
    parts = [("raw", _header("manifest.json", len(manifest)) + manifest + b"\0" * (-len(manifest) % 512))]
    parts += _members(("modules/nvidia.ko", size, 0, tarfile.REGTYPE))
    path.write_bytes(zstd_frame(parts))
    return path


def run_child(code: str, timeout: float = 60) -> tuple[str, int, float]:
    """Run `code` in a fresh interpreter; (its one-line error or 'OK', peak RSS in MiB, seconds).
    The peak is the child's own: Linux carries ru_maxrss (and VmHWM) across fork and exec, so a child
    of a pytest process grown to 90 MB would report 90 MB; writing 5 to clear_refs resets VmHWM."""
    prog = textwrap.dedent("""
        import sys, time
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.monotonic()
        from driverd.errors import DriverdError
        try:
        {body}
            out = "OK"
        except DriverdError as e:
            out = e.one_line()
        print(out)
        hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
        print(hwm // 1024, time.monotonic() - t0)
    """).format(body=textwrap.indent(textwrap.dedent(code), "    "))
    r = subprocess.run([sys.executable, "-c", prog], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2, r.stdout                    # one line for the error, one for the numbers
    rss, secs = lines[1].split()
    return lines[0], int(rss), float(secs)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_crafted_frame_really_is_a_4_gib_bomb(tmp_path):
    """The test's premise: the 128 KB file decompresses (zstandard agrees) to a 4 GiB member."""
    import zstandard
    p = bomb(tmp_path / "b.tar.zst")
    assert p.stat().st_size < 140 << 10
    with zstandard.ZstdDecompressor().stream_reader(open(p, "rb")) as r, \
            tarfile.open(fileobj=r, mode="r|") as tar:
        names = [(ti.name, ti.size) for ti in [tar.next(), tar.next()]]
        first = tar.extractfile(tar.members[-1]).read(MiB)
    assert names == [("manifest.json", 13), ("modules/nvidia.ko", 4 * GiB)] and first == b"\0" * MiB


def test_a_bomb_under_the_wrong_hash_is_refused_before_decompression(tmp_path):
    p = bomb(tmp_path / "b.tar.zst", size=900 * MiB)      # under the member cap: only the hash stops it
    honest = "ab" * 32
    # zstandard made unimportable in the child: any attempt to decompress would fail with an
    # ImportError (not a one-line driverd error) — the refusal provably comes before decompression.
    err, rss, secs = run_child(f"""
        import sys
        sys.modules["zstandard"] = None
        from driverd.package.archive import verify_package
        verify_package({str(p)!r}, {honest!r}, {p.stat().st_size})
    """)
    assert err.startswith("package b.tar.zst has sha256 ") and f"expected {honest}" in err, err
    assert secs < 10 and rss < 80, (secs, rss)
    # size first: a different size is refused without reading the file at all
    err, _, _ = run_child(f"""
        import sys
        sys.modules["zstandard"] = None
        from driverd.package.archive import unpack
        unpack({str(p)!r}, {str(tmp_path / 'dest')!r}, {honest!r}, 1234)
    """)
    assert err.startswith(f"package b.tar.zst is {p.stat().st_size} bytes, expected 1234"), err
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("case", ["member", "total", "members", "manifest", "pax", "gnu-longname"])
def test_caps_refuse_from_the_header_with_bounded_rss_and_time(tmp_path, case):
    p = tmp_path / "p.tar.zst"
    cap = ""
    if case == "member":
        bomb(p, 4 * GiB)
        want = "member 'modules/nvidia.ko' is implausibly large (4294967296 bytes)"
    elif case == "total":                      # two members within the member cap, together over it
        p.write_bytes(zstd_frame(_members(("manifest.json", 2, 32, tarfile.REGTYPE),
                                          ("modules/a.ko", 40 * MiB, 0, tarfile.REGTYPE),
                                          ("modules/b.ko", 40 * MiB, 0, tarfile.REGTYPE))))
        cap = "archive.MAX_UNPACKED_BYTES = 64 << 20"
        want = "it unpacks to more than 67108864 bytes (at 'modules/b.ko')"
    elif case == "members":
        p.write_bytes(zstd_frame(_members(*[(f"modules/m{i}.ko", 0, 0, tarfile.REGTYPE) for i in range(5000)])))
        want = "it has more than 1024 members"
    elif case == "manifest":
        p.write_bytes(zstd_frame(_members(("manifest.json", 700 * MiB, 32, tarfile.REGTYPE))))
        want = "manifest.json is 734003200 bytes (at most 1048576)"
    elif case == "pax":
        p.write_bytes(zstd_frame(_members(("././@PaxHeader", 700 * MiB, ord("a"), tarfile.XHDTYPE),
                                          ("manifest.json", 2, 32, tarfile.REGTYPE))))
        want = "a tar extension header of 734003200 bytes (at most 65536)"
    else:
        p.write_bytes(zstd_frame(_members(("././@LongLink", 700 * MiB, ord("a"), tarfile.GNUTYPE_LONGNAME),
                                          ("manifest.json", 2, 32, tarfile.REGTYPE))))
        want = "a tar extension header of 734003200 bytes (at most 65536)"
    assert p.stat().st_size < (3 << 20 if case == "members" else 200 << 10)
    for call in ("verify_package", "read_manifest"):
        if call == "read_manifest" and case in ("total", "members", "member"):
            continue                                  # read_manifest reads the first member only
        err, rss, secs = run_child(f"""
            from driverd.package import archive
            {cap}
            archive.{call}({str(p)!r})
        """)
        assert err.startswith("refusing package p.tar.zst: ") and want in err, (call, err)
        assert "\n" not in err and rss < 100 and secs < 8, (call, rss, secs)


# -- hostile repositories ------------------------------------------------------------------------

class _Hostile(ThreadingHTTPServer):
    daemon_threads = True


def _server(behaviour: dict) -> tuple[_Hostile, str]:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):                            # noqa: N802
            name = self.path.rsplit("/", 1)[-1]
            b = behaviour.get(name)
            try:
                if b is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif b[0] == "huge":                 # `size` bytes, declared or chunked
                    _, size, declare = b
                    self.send_response(200)
                    if declare:
                        self.send_header("Content-Length", str(size))
                        self.end_headers()
                        block, sent = b" " * MiB, 0
                        while sent < size:
                            self.wfile.write(block)
                            sent += len(block)
                    else:
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        block, sent = b" " * MiB, 0
                        while sent < size:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                            sent += len(block)
                        self.wfile.write(b"0\r\n\r\n")
                elif b[0] == "trickle":              # a byte every `gap` seconds, for `n` bytes
                    _, data, gap = b
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        time.sleep(gap)
                else:
                    data = b[1]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
            except OSError:
                pass                                  # the client refused and went away: expected
    srv = _Hostile(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/repo"


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "chunked"])
def test_a_900_mib_index_is_refused_at_the_cap(declare):
    srv, url = _server({INDEX_NAME: ("huge", 900 * MiB, declare)})
    try:
        err, rss, secs = run_child(f"""
            from driverd.repo.fetch import read_index
            read_index({url!r}, insecure=True)
        """)
    finally:
        srv.shutdown()
    assert err.startswith(f"refusing index {url}/index.json: ") and "at most 33554432 are accepted" in err, err
    assert ("943718400 bytes declared" in err) == declare
    assert rss < 150 and secs < 10, (rss, secs)


def test_an_oversized_signature_is_refused(tmp_path):
    srv, url = _server({INDEX_NAME: ("ok", b'{"format": 1, "packages": []}'), SIG_NAME: ("huge", 5 * MiB, True)})
    try:
        err, _, _ = run_child(f"""
            from driverd.repo.fetch import read_index
            read_index({url!r}, public_key={str(tmp_path / 'k.pem')!r})
        """)
    finally:
        srv.shutdown()
    assert err.startswith(f"refusing signature {url}/index.json.sig: 5242880 bytes declared"), err
    # the same caps on a file:// repository
    (tmp_path / INDEX_NAME).write_bytes(b" " * (33 * MiB))
    err, _, _ = run_child(f"""
        from driverd.repo.fetch import read_index
        read_index("file://{tmp_path}")
    """)
    assert err.startswith(f"refusing index {tmp_path}/index.json: 34603008 bytes"), err


def test_a_trickling_index_and_package_meet_their_whole_deadline(tmp_path):
    body = json.dumps({"format": 1, "packages": []}).encode()
    srv, url = _server({INDEX_NAME: ("trickle", body, 0.3), "p.tar.zst": ("trickle", b"x" * 100, 0.3)})
    try:
        err, _, secs = run_child(f"""
            from driverd.repo import fetch
            fetch.INDEX_DEADLINE_S = 1.5
            fetch.read_index({url!r}, insecure=True)
        """)
        assert err == f"GET {url}/index.json did not finish within 2 s; cause: the repository is too slow or " \
                      "holds the connection open; fix: check the repository and the network; retry later", err
        assert 1.2 < secs < 8, secs              # each byte came within the 60 s read timeout
        err, _, secs = run_child(f"""
            from pathlib import Path
            from driverd.repo import fetch
            from driverd.repo.index import IndexEntry
            e = IndexEntry("1.0", "open", "k", "x86_64", "00" * 32, 100, "p.tar.zst")
            fetch.download({url!r}, e, {str(tmp_path / 'p.tar.zst')!r}, deadline_s=1.5)
        """)
        assert err.startswith(f"download of {url}/p.tar.zst did not finish within 2 s"), err
        assert 1.2 < secs < 8, secs
        assert not list(tmp_path.iterdir())      # no partial file left behind
    finally:
        srv.shutdown()
