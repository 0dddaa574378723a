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
