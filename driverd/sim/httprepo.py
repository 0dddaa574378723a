"""A loopback HTTP server for a repository directory, with Range support and injectable faults
(truncated bodies, 5xx answers) — for fetch tests and the fetch benchmark."""
from __future__ import annotations

import os
import threading
from dataclasses import field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from driverd.datatypes import dataclass


@dataclass
class Faults:
    """The faults the loopback repository server puts into its next package GETs, and the requests it saw."""
    truncate_next: int = 0          # the next N package GETs send half the body, then close
    fail_next: int = 0              # the next N package GETs answer 503
    requests: list[tuple[str, str | None, int]] = field(default_factory=list)   # (path, Range, status)


class RepoServer:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.faults = Faults()
        faults, base = self.faults, str(self.directory)

        class Handler(SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def __init__(self, *a, **kw):
                super().__init__(*a, directory=base, **kw)

            def log_message(self, *a):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                path = self.translate_path(self.path)
                is_pkg = path.endswith(".tar.zst")
                if is_pkg and faults.fail_next > 0:
                    faults.fail_next -= 1
                    faults.requests.append((self.path, rng, 503))
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if not os.path.isfile(path):
                    faults.requests.append((self.path, rng, 404))
                    self.send_error(404)
                    return
                size = os.path.getsize(path)
                start = 0
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    if start >= size:
                        faults.requests.append((self.path, rng, 416))
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                status = 206 if start else 200
                faults.requests.append((self.path, rng, status))
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                limit = size - start
                if is_pkg and faults.truncate_next > 0:
                    faults.truncate_next -= 1
                    limit = (size - start) // 2
                    self.close_connection = True
                with open(path, "rb") as f:
                    f.seek(start)
                    left = limit
                    while left > 0:
                        chunk = f.read(min(1 << 20, left))
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        left -= len(chunk)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "RepoServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    """python -m driverd.sim.httprepo DIR: serve DIR on a loopback port; prints the URL, runs until killed."""
    import sys
    srv = RepoServer(sys.argv[1])
    print(srv.url, flush=True)
    srv.httpd.serve_forever()


if __name__ == "__main__":
    main()
