"""The repository client's transport: one requests session per repository (its credentials, proxies from
the environment), retries with backoff on what a retry can fix, a deadline for a whole request and a
size limit on what is read before it is verified; file:// and plain directories read the same way."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlsplit

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.redact import redact

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
ATTEMPTS = 5
_CHUNK = 64 << 10


class _Retryable(Exception):
    """A transient failure: the download is retried (resuming) with backoff."""


class _Fatal(Exception):
    """A failure retrying cannot fix (404, sha mismatch after a full download...)."""


class Unreachable(PackageError):
    """The repository did not answer (connection refused, a name that does not resolve, TLS, timeouts,
    5xx until the attempts ran out): unlike "reachable, but no package for this kernel", whether it
    holds the package is unknown, and the fix is the URL, the network or the proxy, not a build."""


def in_words(e: BaseException) -> str:
    """What went wrong on the wire, in words: the OS, resolver or TLS error under requests' and
    urllib3's wrappers (ConnectionError > MaxRetryError > NewConnectionError > ConnectionRefusedError),
    not their reprs."""
    import socket
    import ssl

    import requests
    if isinstance(e, requests.exceptions.ConnectTimeout):
        return f"no connection within {CONNECT_TIMEOUT:.0f} s (connect timeout)"
    if isinstance(e, requests.exceptions.ReadTimeout):
        return f"the server sent nothing for {READ_TIMEOUT:.0f} s (read timeout)"
    proxy = "the proxy failed: " if isinstance(e, requests.exceptions.ProxyError) else ""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, socket.gaierror):
            return f"{proxy}the host name does not resolve ({x.strerror or x})"
        if isinstance(x, ssl.SSLCertVerificationError):
            return f"{proxy}TLS: the server's certificate is not trusted ({x.verify_message or x.reason})"
        if isinstance(x, ssl.SSLError):
            return f"{proxy}TLS failed ({x.reason or x})"
        if isinstance(x, OSError) and x.errno is not None and x.strerror:
            return proxy + x.strerror[0].lower() + x.strerror[1:]
        todo += [a for a in x.args if isinstance(a, BaseException)]
        todo += [v for v in (getattr(x, "reason", None), x.__cause__, x.__context__) if isinstance(v, BaseException)]
    return proxy + " ".join(str(e).split())


def _is_file_repo(url: str) -> bool:
    return url.startswith("file://") or "://" not in url


def _file_path(url: str) -> Path:
    return Path(unquote(urlsplit(url).path)) if url.startswith("file://") else Path(url)


def _join(url: str, rel: str) -> str:
    return url.rstrip("/") + "/" + rel


_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: str) -> tuple[str, str, int] | None:
    """The URL's origin (RFC 6454): scheme, host (lower case), port (the scheme's default when the URL
    names none). None for a URL without a host or with an unreadable port."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return None
    scheme, host = u.scheme.lower(), (u.hostname or "").lower()
    if not host or not scheme:
        return None
    port = port if port is not None else _DEFAULT_PORTS.get(scheme)
    return (scheme, host, port) if port is not None else None


@dataclass(frozen=True)
class Credentials:
    """Repository credentials kept out of URLs (issue 21): a netrc file (`machine HOST login L
    password P`, sent as HTTP basic auth) and/or headers (`Authorization: Bearer …`), sent only to the
    exact origins (scheme, host, port) of the configured repositories (issue 30) — never to another
    port or scheme of the same host, nor to anywhere a redirect leads to."""
    netrc: str | None = None
    header_file: str | None = None

    def load(self, origins: set[tuple[str, str, int]]) -> "_RepoAuth | None":
        if not (self.netrc or self.header_file):
            return None
        creds = None
        if self.netrc:
            import netrc as netrc_mod
            try:
                creds = netrc_mod.netrc(self.netrc)
            except FileNotFoundError:
                raise PackageError(f"packages.netrc {self.netrc} does not exist",
                                   fix="create it (machine HOST login USER password SECRET) or unset packages.netrc"
                                   ) from None
            except netrc_mod.NetrcParseError as e:
                raise PackageError(f"packages.netrc {self.netrc} cannot be parsed (line {e.lineno})",
                                   fix="write lines like: machine HOST login USER password SECRET") from None
            except OSError as e:
                raise PackageError(f"cannot read packages.netrc {self.netrc}: {e.strerror}",
                                   fix="check the file and its permissions") from None
        headers: dict[str, str] = {}
        if self.header_file:
            headers = read_header_file(self.header_file)
        return _RepoAuth(origins, creds, headers)


_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def read_header_file(path: str) -> dict[str, str]:
    """`Name: value` lines (blank lines and # comments ignored). Errors name the line, never its value."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(64 << 10)
    except FileNotFoundError:
        raise PackageError(f"packages.auth_header_file {path} does not exist",
                           fix="create it (lines like `Authorization: Bearer TOKEN`) or unset the key") from None
    except (OSError, UnicodeError) as e:
        raise PackageError(f"cannot read packages.auth_header_file {path}: {getattr(e, 'strerror', None) or e}",
                           fix="check the file and its permissions") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _TOKEN.match(name) or not value or any(c in value for c in "\r\n\0"):
            raise PackageError(f"packages.auth_header_file {path}: line {n} is not `Name: value`",
                               fix="one header a line, e.g. `Authorization: Bearer TOKEN`")
        out[name] = value
    return out


class _RepoAuth:
    """A requests auth callable: the netrc entry or the headers, for the repositories' exact origins
    only (a request to any other origin gets nothing of them)."""

    def __init__(self, origins: set[tuple[str, str, int]], creds, headers: dict[str, str]) -> None:
        self.origins, self.creds, self.headers = set(origins), creds, headers

    def __call__(self, r):
        o = origin(r.url)
        if o is None or o not in self.origins:
            return r
        r.headers.update(self.headers)
        if self.creds is not None and "Authorization" not in self.headers:
            found = self.creds.authenticators(o[1])
            if found:
                from requests.auth import _basic_auth_str
                r.headers["Authorization"] = _basic_auth_str(found[0], found[2] or "")
        return r

    def strip(self, r) -> None:
        for name in self.headers:
            r.headers.pop(name, None)
        r.headers.pop("Authorization", None)


def _session(auth: "_RepoAuth | None" = None):
    import requests

    class Session(requests.Session):
        def rebuild_auth(self, prepared_request, response):
            # A redirect. requests' own rule drops Authorization only when the host name changes (or
            # the port or scheme, except http->https on default ports) and then adds ~/.netrc's entry
            # for the new host; it would carry our custom headers along. With credentials configured,
            # everything of ours is dropped and given again only when the new URL is one of the
            # repositories' exact origins.
            if auth is None:
                super().rebuild_auth(prepared_request, response)
                return
            auth.strip(prepared_request)
            auth(prepared_request)
    s = Session()
    s.trust_env = True              # HTTP_PROXY / HTTPS_PROXY / NO_PROXY
    s.headers["User-Agent"] = "driverd"
    if auth is not None:
        s.auth = auth
    return s


def _retrying(fn: Callable[[], object], what: str, attempts: int = ATTEMPTS):
    import requests
    from tenacity import (RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter,
                          Retrying)
    from driverd.log import log
    transient = (_Retryable, requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)

    def say(state) -> None:
        # The backoff takes seconds: say what failed instead of staying silent until the last attempt.
        words = in_words(state.outcome.exception())
        log(f"driverd: warning: {redact(what)}: {words}; retrying in {state.next_action.sleep:.1f} s "
            f"(attempt {state.attempt_number + 1} of {attempts})", "warning", reason=words)
    try:
        for attempt in Retrying(stop=stop_after_attempt(attempts), reraise=False,
                                wait=wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2),
                                retry=retry_if_exception_type(transient), before_sleep=say):
            with attempt:
                return fn()
    except RetryError as e:
        words = in_words(e.last_attempt.exception())
        raise Unreachable(f"{what} failed after {attempts} attempt{'' if attempts == 1 else 's'}: {words}",
                          cause="the repository did not answer, or kept failing",
                          fix="check the repository URL, that its server is up, the network and the proxy settings "
                              "(HTTPS_PROXY, NO_PROXY)") from None
    except requests.RequestException as e:      # not retried: a URL requests cannot fetch at all
        raise PackageError(f"{what} failed: {in_words(e)}", cause="the repository URL cannot be fetched",
                           fix="use an https://, http:// or file:// repository URL") from None


class _Deadline:
    """Closes a streamed response's socket when `at` (monotonic) passes: a server that trickles a
    byte per read timeout can hold a download forever otherwise. shutdown() wakes the blocked read."""

    def __init__(self, response, at: float) -> None:
        import threading
        self.fired = False
        self._r = response
        self._t = threading.Timer(max(0.0, at - time.monotonic()), self._fire)
        self._t.daemon = True
        self._t.start()

    def _fire(self) -> None:
        self.fired = True
        import socket
        sock = getattr(getattr(self._r.raw, "_connection", None) or getattr(self._r.raw, "connection", None),
                       "sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
            self._r.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._t.cancel()


def _bounded_get(session, src: str, limit: int, deadline_s: float, what: str, required: bool = True) -> bytes | None:
    """GET `src` as a stream, at most `limit` bytes, all of it within `deadline_s`; None for a 404
    when not `required`. Transient failures raise _Retryable; anything too large a PackageError."""
    import requests
    with session.get(src, stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)) as r:
        if r.status_code == 404 and not required:
            return None
        if r.status_code >= 500 or r.status_code == 429:
            raise _Retryable(f"HTTP {r.status_code}")
        if r.status_code != 200:
            raise PackageError(f"GET {src}: HTTP {r.status_code}",
                               fix="check the repository URL (it must contain index.json)")
        declared = r.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(what, src, f"{declared} bytes declared", limit)
        buf = bytearray()
        with _Deadline(r, time.monotonic() + deadline_s) as dl:
            try:
                for chunk in r.iter_content(_CHUNK):
                    buf += chunk
                    if len(buf) > limit:
                        raise _too_large(what, src, f"more than {limit} bytes sent", limit)
            except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError,
                    requests.exceptions.StreamConsumedError, AttributeError, ValueError) as e:
                if dl.fired:
                    raise PackageError(f"GET {src} did not finish within {deadline_s:.0f} s",
                                       cause="the repository is too slow or holds the connection open",
                                       fix="check the repository and the network; retry later") from None
                raise _Retryable(f"GET {src} interrupted ({e})") from None
        if dl.fired:
            raise PackageError(f"GET {src} did not finish within {deadline_s:.0f} s",
                               cause="the repository is too slow or holds the connection open",
                               fix="check the repository and the network; retry later")
        return bytes(buf)


def _too_large(what: str, src: str, how: str, limit: int) -> PackageError:
    return PackageError(f"refusing {what} {src}: {how}, at most {limit} are accepted",
                        cause="the repository serves something that is not a driverd " + what,
                        fix="check the repository URL and what the server behind it returns")


def _read_small_file(path: Path, limit: int, what: str) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise _too_large(what, str(path), f"{size} bytes", limit)
        data = f.read(limit + 1)            # a file that grew since fstat is still read only this far
        if len(data) > limit:
            raise _too_large(what, str(path), f"more than {limit} bytes", limit)
        return data
