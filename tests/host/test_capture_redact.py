"""`debug capture-host` never carries secrets off the host: registry auth, tokens and passwords in
the runtime configs it copies are replaced with REDACTED, and it says which files and keys."""
from __future__ import annotations

import json
import tarfile

from driverd.host.capture import REDACTED, capture, redact
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, h100, write_host
from tests.conftest import run_cli

CONTAINERD = '''version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".registry.configs."registry.internal:5000".auth]
  username = "puller"
  password = "hunter2-containerd"
  auth = "cHVsbGVyOmh1bnRlcjI="
  identitytoken = ""
'''
DOCKER = {"runtimes": {"runc": {"path": "runc"}}, "registry-mirrors": ["https://mirror.internal"],
          "auths": {"registry.internal": {"auth": "c2VjcmV0LWRvY2tlcg=="}}}


def _host(tmp_path):
    return write_host(tmp_path / "host", HostSpec(pci=[h100("0000:1b:00.0")], files={
        "/etc/containerd/config.toml": CONTAINERD, "/usr/bin/containerd": "",
        "/etc/docker/daemon.json": json.dumps(DOCKER), "/usr/bin/dockerd": ""}))


def test_capture_redacts_runtime_secrets_and_says_so(tmp_path):
    host = _host(tmp_path)
    out = tmp_path / "cap.tar.gz"
    res = capture(Root(str(host)), str(out))
    by_path = {r["path"]: r["keys"] for r in res["redacted"]}
    assert set(by_path["/etc/containerd/config.toml"]) == {"password", "auth"}
    with tarfile.open(out) as tar:
        names = tar.getnames()
        text = tar.extractfile("etc/containerd/config.toml").read().decode()
        blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
    assert "hunter2" not in text and f'password = "{REDACTED}"' in text and 'username = "puller"' in text
    assert 'identitytoken = ""' in text                            # empty: nothing to hide, left as it is
    assert b"hunter2" not in blob and b"cHVsbGVyOmh1bnRlcjI=" not in blob
    if "etc/docker/daemon.json" in names:
        assert b"c2VjcmV0LWRvY2tlcg==" not in blob and "auths.registry.internal.auth" in \
            by_path["/etc/docker/daemon.json"]


def test_cli_says_what_it_redacted(tmp_path):
    host = _host(tmp_path)
    r = run_cli("debug", "capture-host", "--root", str(host), "--out", str(tmp_path / "c.tar.gz"))
    assert r.returncode == 0, r.stderr
    assert "redacted" in r.stdout and "/etc/containerd/config.toml (password, auth)" in r.stdout


def test_redact_formats():
    data, keys = redact("/etc/containers/auth.json", b'{"auths": {"quay.io": {"auth": "eHl6", "email": "a@b"}}}')
    assert json.loads(data)["auths"]["quay.io"] == {"auth": REDACTED, "email": "a@b"} and keys == ["auths.quay.io.auth"]
    data, keys = redact("/proc/42/cmdline", b"kubelet\0--token\0abc\0--bootstrap-token=xyz\0--v=2\0")
    assert data == b"kubelet\0--token\0REDACTED\0--bootstrap-token=REDACTED\0--v=2\0"
    data, keys = redact("/etc/driverd/mok.key", b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    assert b"MIIE" not in data and keys == ["private key"]
    data, keys = redact("/etc/os-release", b'NAME="Debian"\n')
    assert keys == [] and data == b'NAME="Debian"\n'
