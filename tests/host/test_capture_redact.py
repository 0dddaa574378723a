"""`debug capture-host` never carries secrets off the host: registry auth, tokens and passwords in
the runtime configs it copies are replaced with REDACTED, and it says which files and keys."""
from __future__ import annotations

import json
import os
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
    r = run_cli("debug", "capture-host", "--root", str(host), "--archive", str(tmp_path / "c.tar.gz"))
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


# -- issue 21: parsed formats, not line patterns; the bundle 0600 ---------------------------------------

TRICKY_TOML = '''version = 2
[plugins."io.containerd.grpc.v1.cri".registry.configs."r.internal".auth2]
  auth = { username = "u", password = "inline-pw-1" }
[plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]
  endpoint = ["https://mirror-user:mirror-pw-2@mirror.internal", "https://public.example"]
[plugins."io.containerd.grpc.v1.cri".registry.headers]
  x-secret-token = ["hdr-tok-3"]
  X-Trace = ["keep-me"]
[extra]
  note = """
a multi-line string
password = "not-a-key-4"
"""
  private_key = \'\'\'
multi-line-literal-5
\'\'\'
'''


def test_toml_inline_tables_multiline_strings_urls_and_header_keys():
    data, keys = redact("/etc/containerd/config.toml", TRICKY_TOML.encode())
    text = data.decode()
    for secret in ("inline-pw-1", "mirror-pw-2", "mirror-user", "hdr-tok-3", "multi-line-literal-5"):
        assert secret not in text, secret
    import tomllib
    doc = tomllib.loads(text)                       # still TOML, same shape
    reg = doc["plugins"]["io.containerd.grpc.v1.cri"]["registry"]
    assert reg["configs"]["r.internal"]["auth2"]["auth"] == {"username": "u", "password": REDACTED}
    assert reg["mirrors"]["docker.io"]["endpoint"] == ["https://mirror.internal", "https://public.example"]
    assert reg["headers"] == {"x-secret-token": [REDACTED], "X-Trace": ["keep-me"]}
    # text inside a multi-line string is a value, not a key: left alone (it is no secret's value)
    assert 'password = "not-a-key-4"' in doc["extra"]["note"] and doc["extra"]["private_key"] == REDACTED
    assert set(keys) == {"password", "endpoint (URL userinfo)", "x-secret-token", "private_key"}


def test_yaml_json_and_unknown_formats():
    y = b"registries:\n  - url: https://bot:yaml-pw-6@reg.example/v2\n    bearerToken: tok-7\n    name: r1\n"
    data, keys = redact("/etc/rancher/registries.yaml", y)
    import yaml
    assert yaml.safe_load(data) == {"registries": [{"url": "https://reg.example/v2", "bearerToken": REDACTED,
                                                    "name": "r1"}]}
    assert keys == ["registries.url (URL userinfo)", "registries.bearerToken"]
    j = json.dumps({"auths": {"r": {"auth": "x", "identitytoken": "tok-8"}},
                    "proxies": {"default": {"httpsProxy": "http://p:proxy-pw-9@proxy:3128"}}}).encode()
    data, keys = redact("/root/.docker/config.json", j)
    assert b"tok-8" not in data and b"proxy-pw-9" not in data and json.loads(data)["auths"]["r"]["auth"] == REDACTED
    data, keys = redact("/etc/default/driverd", b"HTTPS_PROXY=http://u:env-pw-10@proxy\nAPI_TOKEN=tok-11\nX=1\n")
    assert b"env-pw-10" not in data and b"tok-11" not in data and b"X=1\n" in data
    # a config that claims a format and does not parse is not copied at all
    data, keys = redact("/etc/containerd/config.toml", b'[broken\npassword = "pw-12"\n')
    assert b"pw-12" not in data and keys == ["whole file (toml that does not parse)"]


def test_the_bundle_is_written_0600(tmp_path):
    host = _host(tmp_path)
    out = tmp_path / "cap.tar.gz"
    out.write_bytes(b"old")
    os.chmod(out, 0o644)                               # an existing file is narrowed too
    capture(Root(str(host)), str(out))
    assert os.stat(out).st_mode & 0o777 == 0o600
    out2 = tmp_path / "new.tar.gz"
    old = os.umask(0)
    try:
        capture(Root(str(host)), str(out2))
    finally:
        os.umask(old)
    assert os.stat(out2).st_mode & 0o777 == 0o600


# -- issue 30: secrets in command lines ------------------------------------------------------------

def test_command_line_secrets_in_every_form():
    argv = ["python", "train.py", "--api_key=sk-live-1", "--hf_token=hf_2", "--wandb_api_key", "wb-3",
            "--epochs=3", "-v", "HF_TOKEN=env-4", "-e", "WANDB_API_KEY=env-5", "--env=GITHUB_TOKEN=ghp-6",
            "--db-password", "pw-7", "-password=pw-8", "--token", "--next", "--auth-file=/etc/x",
            "--model", "s3://ak:sk-9@bucket/m", "--kernel", "6.1.0", "PATH=/usr/bin"]
    data, keys = redact("/proc/7/cmdline", "\0".join(argv).encode() + b"\0")
    out = data.decode().split("\0")
    for leaked in ("sk-live-1", "hf_2", "wb-3", "env-4", "env-5", "ghp-6", "pw-7", "pw-8", "/etc/x", "sk-9"):
        assert leaked not in data.decode(), (leaked, out)
    assert out[:7] == ["python", "train.py", "--api_key=REDACTED", "--hf_token=REDACTED", "--wandb_api_key",
                       "REDACTED", "--epochs=3"]
    assert "--env=GITHUB_TOKEN=REDACTED" in out and "WANDB_API_KEY=REDACTED" in out and "HF_TOKEN=REDACTED" in out
    assert out[out.index("--token") + 1] == "--next"             # a flag is no value
    assert "s3://bucket/m" in out and "6.1.0" in out and "PATH=/usr/bin" in out and out[-1] == ""
    assert {"api_key", "hf_token", "wandb_api_key", "HF_TOKEN", "WANDB_API_KEY", "GITHUB_TOKEN", "db-password",
            "password", "token", "auth-file", "URL userinfo"} <= set(keys)
