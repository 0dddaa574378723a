from driverd.host import collect
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, write_host

CONTAINERD_V2 = '''# user's config
version = 2
imports = ["/etc/containerd/conf.d/*.toml"]
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
'''
DROPIN = '''version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
'''
CONTAINERD_V3 = '''version = 3
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
'''


def runtimes(tmp_path, files):
    write_host(tmp_path, HostSpec(files=files))
    return {r.name: r for r in collect(Root(tmp_path), nvml=False).runtimes}


def test_containerd_v2_with_dropin(tmp_path):
    r = runtimes(tmp_path, {"/usr/bin/containerd": "", "/etc/containerd/config.toml": CONTAINERD_V2,
                            "/etc/containerd/conf.d/99-nvidia.toml": DROPIN})["containerd"]
    assert r.handlers == ("runc", "nvidia") and r.nvidia_handler and r.config_exists
    assert r.binary == "/usr/bin/containerd" and not r.socket_exists


def test_containerd_v3_without_nvidia(tmp_path):
    r = runtimes(tmp_path, {"/usr/bin/containerd": "", "/etc/containerd/config.toml": CONTAINERD_V3})["containerd"]
    assert r.handlers == ("runc",) and not r.nvidia_handler


def test_k3s_template(tmp_path):
    tmpl = '{{ template "base" . }}\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n  runtime_type = "io.containerd.runc.v2"\n'
    r = runtimes(tmp_path, {"/usr/local/bin/k3s": "",
                            "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl": tmpl})["containerd"]
    assert r.config_path.endswith("config.toml.tmpl") and r.nvidia_handler


def test_crio_and_docker(tmp_path):
    rs = runtimes(tmp_path, {
        "/usr/bin/crio": "", "/etc/crio/crio.conf": '[crio.runtime]\ndefault_runtime = "crun"\n[crio.runtime.runtimes.crun]\n',
        "/etc/crio/crio.conf.d/99-nvidia.conf": '[crio.runtime.runtimes.nvidia]\nruntime_path = "/usr/bin/nvidia-container-runtime"\n',
        "/usr/bin/dockerd": "", "/etc/docker/daemon.json": '{"features": {"cdi": true}, "runtimes": {"kata": {"path": "/x"}}}'})
    assert rs["crio"].handlers == ("crun", "nvidia")
    assert rs["docker"].handlers == ("kata",) and not rs["docker"].nvidia_handler


def test_garbled_configs_are_noted_not_fatal(tmp_path):
    rs = runtimes(tmp_path, {"/usr/bin/containerd": "", "/etc/containerd/config.toml": "version = [\n",
                             "/usr/bin/dockerd": "", "/etc/docker/daemon.json": "{not json"})
    assert rs["containerd"].handlers == () and "not valid TOML" in rs["containerd"].note
    assert "not valid JSON" in rs["docker"].note


def test_no_runtime(tmp_path):
    assert runtimes(tmp_path, {}) == {}


def test_live_versions_run_while_the_rest_is_read_and_an_uncollected_one_is_stopped(tmp_path):
    """Issue 47: a live collect starts each runtime binary's `--version` first and reads its answer
    last; a run nobody collects does not outlive the read."""
    import os
    import time

    from driverd.runtime.base import Versions
    started = tmp_path / "started"
    fast, slow = tmp_path / "containerd", tmp_path / "crio"
    fast.write_text(f"#!/bin/sh\necho $$ > {started}\necho 'containerd github.com/containerd/containerd 1.6.20~ds1 abc'\n")
    slow.write_text(f"#!/bin/sh\necho $$ > {started}.slow\nexec sleep 60\n")
    for f in (fast, slow):
        f.chmod(0o755)
    v = Versions.start(Root("/"), [str(fast), str(slow)])
    deadline = time.monotonic() + 10
    written = lambda f: f.exists() and f.read_text().strip().isdigit()     # created and written by the shell
    while not (written(started) and written(tmp_path / "started.slow")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert written(started), "the --version run did not start before its answer was asked for"
    assert v.get(str(fast)) == "1.6.20~ds1"
    assert v.get(str(fast)) == "1.6.20~ds1"           # asked again: run again, same answer
    pid = int((tmp_path / "started.slow").read_text())
    del v
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the uncollected --version run still runs")
