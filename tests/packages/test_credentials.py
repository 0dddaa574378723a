"""Repository credentials (issue 21): userinfo in a URL is never repeated — in errors, stderr (the
systemd journal), /readyz, sd_notify STATUS, /run/driverd/daemon.json, or anything sent to the
Kubernetes API — and credentials can come from a netrc file or a header file instead, sent to the
repositories' own hosts only (not to a host a redirect leads to)."""
from __future__ import annotations

import base64
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from driverd.errors import PackageError
from driverd.repo.fetch import Want, fetch
from driverd.repo.http import Credentials, read_header_file
from driverd.redact import redact, redact_obj
from driverd.root import Root

SECRET = "s3cret-Pa55"


@pytest.mark.parametrize("text,want", [
    ("GET https://user:pw@mirror.example/repo/index.json: HTTP 401",
     "GET https://mirror.example/repo/index.json: HTTP 401"),
    ("http://tok3n@h:8080/x and https://a:b@c/d", "http://h:8080/x and https://c/d"),
    ("https://u:p@ss:w@rd@host/path?q=a@b", "https://host/path?q=a@b"),          # raw '@' in the password
    ("['https://u:p@h/r', 'file:///srv/repo']", "['https://h/r', 'file:///srv/repo']"),
    ("oci://robot$x:t@registry:5000/img", "oci://registry:5000/img"),
    ("mail root@localhost about /var/lib/x@y", "mail root@localhost about /var/lib/x@y"),    # not URLs
    ("HTTPS://U:P@Host/", "HTTPS://Host/"),
])
def test_redact_strips_userinfo_of_every_url(text, want):
    assert redact(text) == want


def test_redact_obj_reaches_keys_values_and_lists():
    doc = {"metadata": {"annotations": {"driverd.io/reason": f"GET https://u:{SECRET}@h/i: 401"}},
           "list": [f"http://{SECRET}@h", 3, None], "https://k:v@h": True}
    out = json.dumps(redact_obj(doc))
    assert SECRET not in out and "https://h/i" in out and '"https://h": true' in out


def test_errors_never_carry_userinfo():
    e = PackageError(f"GET https://u:{SECRET}@h/r/index.json: HTTP 401", cause=f"see http://x:{SECRET}@h",
                     fix=f"check https://u:{SECRET}@h")
    assert SECRET not in e.one_line() and SECRET not in json.dumps(e.to_json()) and SECRET not in str(e)


# -- a repository that wants credentials -----------------------------------------------------------

class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _auth_server(host: str, want_auth: str | None, seen: list, redirect_to: str | None = None) -> tuple:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):                            # noqa: N802
            seen.append((self.server.server_address[0], self.path, dict(self.headers)))
            if redirect_to and self.path.endswith("index.json"):
                self.send_response(302)
                self.send_header("Location", redirect_to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            ok = want_auth is None or self.headers.get("Authorization") == want_auth
            body = b'{"schema": 1, "packages": []}' if ok else b"unauthorized"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    srv = _Server((host, 0), H)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return srv, f"http://{host}:{srv.server_address[1]}/repo"


WANT = Want("535.261.03", "open", "6.1.0-47-cloud-amd64", "x86_64")


def _fetch(tmp_path, url, creds=None):
    return fetch(Root(tmp_path / "root"), WANT, [url], insecure=True, credentials=creds, attempts=1)


def test_userinfo_in_the_url_still_authenticates_but_is_never_printed(tmp_path, capfd):
    seen: list = []
    basic = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
    srv, url = _auth_server("127.0.0.1", basic, seen)
    try:
        with pytest.raises(PackageError) as e:
            _fetch(tmp_path, url.replace("http://", f"http://user:{SECRET}@"))
    finally:
        srv.shutdown()
    assert seen and seen[0][2].get("Authorization") == basic          # the server got the credentials ...
    line = e.value.one_line()
    assert "index lists 0 packages" in line and url in line and SECRET not in line   # ... nobody else
    out, err = capfd.readouterr()
    assert SECRET not in out + err and "UNSIGNED repository index http://127.0.0.1" in err


def test_netrc_credentials(tmp_path):
    seen: list = []
    basic = "Basic " + base64.b64encode(f"robot:{SECRET}".encode()).decode()
    srv, url = _auth_server("127.0.0.1", basic, seen)
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login robot password {SECRET}\n")
    try:
        with pytest.raises(PackageError, match="HTTP 401") as e:
            _fetch(tmp_path, url)                                          # no credentials: refused
        assert SECRET not in e.value.one_line()
        with pytest.raises(PackageError, match="index lists 0 packages"):
            _fetch(tmp_path, url, Credentials(netrc=str(netrc)))          # authenticated: index read
    finally:
        srv.shutdown()
    assert seen[-1][2].get("Authorization") == basic
    netrc.write_text("machine\n")
    with pytest.raises(PackageError) as e:
        _fetch(tmp_path, url, Credentials(netrc=str(netrc)))
    assert e.value.one_line().startswith(f"packages.netrc {netrc} cannot be parsed")


def test_header_file_goes_to_the_repository_host_and_not_across_a_redirect(tmp_path):
    seen: list = []
    other, other_url = _auth_server("127.0.0.2", None, seen)                # another host
    srv, url = _auth_server("127.0.0.1", f"Bearer {SECRET}", seen, redirect_to=other_url.rsplit("/repo", 1)[0])
    hf = tmp_path / "headers"
    hf.write_text(f"# the repository's token\nAuthorization: Bearer {SECRET}\nX-Secret-Token: {SECRET}\n")
    try:
        with pytest.raises(PackageError, match="index lists 0 packages"):
            _fetch(tmp_path, url, Credentials(header_file=str(hf)))
    finally:
        srv.shutdown()
        other.shutdown()
    (h1, _, first), (h2, _, second) = seen[:2]
    assert h1 == "127.0.0.1" and first["Authorization"] == f"Bearer {SECRET}" and first["X-Secret-Token"] == SECRET
    assert h2 == "127.0.0.2" and "Authorization" not in second and "X-Secret-Token" not in second


@pytest.mark.parametrize("kind", ["header", "netrc"])
def test_credentials_go_to_the_exact_origin_not_another_port_of_the_same_host(tmp_path, kind):
    """Issue 30: a redirect from 127.0.0.1:A to 127.0.0.1:B (the same host name, another port: another
    origin, another service) carries neither the header file's headers nor the netrc login."""
    seen: list = []
    other, other_url = _auth_server("127.0.0.1", None, seen)                # same host, another port
    srv, url = _auth_server("127.0.0.1", None, seen, redirect_to=other_url.rsplit("/repo", 1)[0])
    if kind == "header":
        f = tmp_path / "headers"
        f.write_text(f"Authorization: Bearer {SECRET}\nX-Secret-Token: {SECRET}\n")
        creds = Credentials(header_file=str(f))
    else:
        f = tmp_path / "netrc"
        f.write_text(f"machine 127.0.0.1 login robot password {SECRET}\n")
        creds = Credentials(netrc=str(f))
    try:
        with pytest.raises(PackageError, match="index lists 0 packages"):
            _fetch(tmp_path, url, creds)
    finally:
        srv.shutdown()
        other.shutdown()
    (_, _, first), (_, _, second) = seen[:2]
    assert first["Authorization"].startswith("Bearer " if kind == "header" else "Basic ")
    assert "Authorization" not in second and "X-Secret-Token" not in second, second


def test_origin_is_scheme_host_and_port():
    from driverd.repo.http import _RepoAuth, origin
    assert origin("https://Mirror.Example/repo") == ("https", "mirror.example", 443)
    assert origin("http://h:8080/x") == ("http", "h", 8080) != origin("http://h:8081/x")
    assert origin("http://h/x") == origin("http://h:80/y") != origin("https://h/x")
    assert origin("http://[::1]:9/x") == ("http", "::1", 9)
    assert origin("http://h:99999/x") is None and origin("file:///srv") is None

    class R:
        def __init__(self, url):
            self.url, self.headers = url, {}
    auth = _RepoAuth({origin("https://h/repo")}, None, {"Authorization": "Bearer t"})
    assert auth(R("https://h:443/other")).headers == {"Authorization": "Bearer t"}
    for url in ("http://h/repo", "https://h:8443/repo", "https://h.evil/repo", "https://x@h2/repo"):
        assert auth(R(url)).headers == {}, url


def test_a_bad_header_file_names_the_line_not_the_value(tmp_path):
    hf = tmp_path / "headers"
    hf.write_text(f"Authorization: Bearer x\nBearer {SECRET}\n")
    with pytest.raises(PackageError) as e:
        read_header_file(str(hf))
    assert e.value.one_line().startswith(f"packages.auth_header_file {hf}: line 2 is not `Name: value`")
    assert SECRET not in e.value.one_line()


# -- the daemon: /readyz, stderr, STATUS=, daemon.json ----------------------------------------------

@pytest.mark.real
@pytest.mark.parametrize("secret", [SECRET, "s3'cr(e)t!"])      # issue 30: a ' in the password
def test_the_daemon_never_repeats_url_credentials(host, daemons, secret):
    from tests.daemon.conftest import NEW
    seen: list = []
    srv, url = _auth_server("127.0.0.1", "Basic nothing-matches", seen)
    secret_url = url.replace("http://", f"http://robot:{secret}@")
    p = Path(host) / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f'[driver]\nversion = "{NEW}"\nflavor = "open"\n[packages]\nrepositories = ["{secret_url}"]\n'
                 f'insecure = true\nbuild_fallback = false\n[runtime]\nrestart = "none"\n[daemon]\n'
                 f'retry_min_s = 1\nretry_max_s = 2\n')
    try:
        d = daemons(host)
        d.wait_log(r"HTTP 401.*retrying in", 60)             # a pass ended: daemon.json is written
        code, body = d.get("/readyz")
        d.wait_notify("STATUS=", 10)
        sf = Path(host) / "run/driverd/daemon.json"
        for _ in range(50):
            if sf.exists():
                break
            time.sleep(0.1)
        state = sf.read_text()
        d.stop()
    finally:
        srv.shutdown()
    assert seen and seen[0][2]["Authorization"].startswith("Basic ")      # the credentials were used
    assert code == 503 and url in body and secret not in body, body
    assert secret not in d.log and url in d.log
    assert not any(secret in m for m in d.all_messages)
    assert secret not in state and url in state
    assert oct(os.stat(Path(host) / "run/driverd/daemon.json").st_mode & 0o777) == "0o600"


@pytest.fixture
def host(tmp_path):
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "root"
    make_host(root, dgx_spec(gpus=1, nvswitches=0, nouveau=False))
    return root


from tests.daemon.conftest import daemons  # noqa: E402,F401  (the daemon-process fixture)


@pytest.mark.real
def test_nothing_sent_to_the_kubernetes_api_carries_url_credentials(tmp_path):
    """Node annotations, conditions, Events and rollout status all go through cluster.kube: a
    reason quoting a repository URL reaches the API server without its userinfo."""
    from driverd.cluster.kube import Kube, Target, node_path
    from tests.apiserver import ApiServer
    srv = ApiServer(host="127.0.0.1", port=0).start()
    try:
        kc = tmp_path / "kubeconfig"
        srv.write_kubeconfig(str(kc))
        kube = Kube(Target(kubeconfig=str(kc)))
        reason = f"fetch failed: GET https://robot:{SECRET}@mirror.example/repo/index.json: HTTP 401"
        kube.create(node_path(), {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        kube.patch(node_path("n1"), {"metadata": {"annotations": {"driverd.io/reason": reason}}})
        kube.create("/api/v1/namespaces/default/events",
                    {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e1", "namespace": "default"},
                     "involvedObject": {"kind": "Node", "name": "n1"}, "reason": "Failed", "message": reason})
        node = json.dumps(kube.get(node_path("n1")))
        event = json.dumps(kube.get("/api/v1/namespaces/default/events/e1"))
    finally:
        srv.stop()
    for doc in (node, event):
        assert SECRET not in doc and "GET https://mirror.example/repo/index.json: HTTP 401" in doc


def test_the_user_space_fetch_sends_netrc_credentials_to_the_repository(tmp_path):
    """userspace.fetch reads the same repositories with the same credentials (packages.netrc): the index is
    read authenticated, and the answer is about the user-space package, not a 401."""
    from driverd.config import load
    from driverd.repo import userspace as userspace_source
    seen: list = []
    basic = "Basic " + base64.b64encode(f"robot:{SECRET}".encode()).decode()
    srv, url = _auth_server("127.0.0.1", basic, seen)
    root = tmp_path / "root"
    (root / "etc/driverd").mkdir(parents=True)
    (root / "etc/driverd/netrc").write_text(f"machine 127.0.0.1 login robot password {SECRET}\n")
    os.chmod(root / "etc/driverd/netrc", 0o600)
    (root / "etc/driverd/config.toml").write_text(
        f'[packages]\nrepositories = ["{url}"]\ninsecure = true\nnetrc = "/etc/driverd/netrc"\n[userspace]\nfetch = true\n')
    try:
        cfg = load(Root(str(root)), None, environ={})
        with pytest.raises(PackageError) as e:
            userspace_source.fetch(Root(str(root)), cfg, "550.163.01", "x86_64")
    finally:
        srv.shutdown()
    assert seen and seen[-1][2].get("Authorization") == basic, seen
    line = e.value.one_line()
    assert "its index lists 0 user-space packages" in line and SECRET not in line, line
