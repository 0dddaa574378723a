"""Runtime config files that are symlinks (config management, /etc/alternatives-style setups): driverd
writes through the link to its target inside the root, keeps the link, and revert undoes exactly that."""
from __future__ import annotations

import json
import os

from driverd.root import Root
from driverd.runtime import Options, configure, revert
from tests.runtime.conftest import RT, make_host
from tests.runtime.test_runtime_files import BIN


def _opts(**kw) -> Options:
    return Options(**{"restart": "none", **kw})


def test_symlinked_containerd_config_is_written_through_and_restored(tmp_path):
    host = make_host(tmp_path / "host", {"/etc/site/containerd.toml": (RT / "containerd/v2.toml").read_text()},
                     {"/usr/bin/containerd": "1.7.24", BIN: ""})
    (host / "etc/containerd").mkdir(parents=True)
    os.symlink("/etc/site/containerd.toml", host / "etc/containerd/config.toml")   # absolute, inside the root
    orig = (host / "etc/site/containerd.toml").read_bytes()
    rep = configure(Root(host), "containerd", _opts(config_path="/etc/containerd/config.toml"))
    assert rep.files_changed == ["/etc/containerd/config.toml"]
    assert os.readlink(host / "etc/containerd/config.toml") == "/etc/site/containerd.toml"
    assert b"nvidia" in (host / "etc/site/containerd.toml").read_bytes()
    revert(Root(host), "containerd", _opts(config_path="/etc/containerd/config.toml"))
    assert (host / "etc/site/containerd.toml").read_bytes() == orig
    assert os.readlink(host / "etc/containerd/config.toml") == "/etc/site/containerd.toml"


def test_dangling_symlinked_daemon_json_is_created_and_removed_at_its_target(tmp_path):
    host = make_host(tmp_path / "host", {}, {"/usr/bin/dockerd": "27.1.0", BIN: ""})
    (host / "etc/docker").mkdir(parents=True)
    os.symlink("../site/docker.json", host / "etc/docker/daemon.json")             # relative, dangling
    configure(Root(host), "docker", _opts())
    assert json.loads((host / "etc/site/docker.json").read_text())["runtimes"]["nvidia"] == {"path": BIN}
    revert(Root(host), "docker", _opts())
    assert not (host / "etc/site/docker.json").exists()
    assert os.readlink(host / "etc/docker/daemon.json") == "../site/docker.json"
