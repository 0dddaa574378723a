"""Files that decide what root does (issue 30): the config file, the node's keys, certificates and
repository credentials, and the daemon's kubeconfig with the files it names are read only when nobody
but root (or the user running a one-shot command on their own files) can change them — the file, and
every directory on the way, links judged by their final target — and the daemon's kubeconfig may not
run an exec plugin or send a tokenFile unless cluster.allow_exec_credentials says so. Each refusal is
one line with the cause and the fix, exit 2."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from driverd import config, fsutil
from driverd.errors import ConfigError
from driverd.root import Root
from tests.conftest import run_cli

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def _file(p: Path, text: str = "x\n", mode: int = 0o644) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    os.chmod(p, mode)
    return p


def _refused(e: pytest.ExceptionInfo, *words: str) -> str:
    line = e.value.one_line()
    assert "\n" not in line and e.value.exit_code == 2, line
    for w in words:
        assert w in line, line
    return line


# -- the check itself -----------------------------------------------------------------------------

def test_a_root_owned_file_in_root_owned_directories_is_trusted(tmp_path):
    f = _file(tmp_path / "etc/driverd/config.toml")
    assert fsutil.trusted_file(f, "config file") == f


@pytest.mark.parametrize("mode,words", [(0o666, "writable by its group and everyone (mode 0666)"),
                                        (0o646, "writable by everyone (mode 0646)"),
                                        (0o664, "writable by its group (mode 0664)")])
def test_a_group_or_world_writable_file_is_refused(tmp_path, mode, words):
    f = _file(tmp_path / "netrc", mode=mode)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(f, "packages.netrc")
    _refused(e, f"refusing packages.netrc {f}", words, f"fix: chmod go-w {f}")


@as_root
def test_a_file_owned_by_another_user_is_refused(tmp_path):
    f = _file(tmp_path / "kubeconfig")
    os.chown(f, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(f, "kubeconfig")
    _refused(e, f"it is owned by uid {NOBODY}", "not root", f"fix: chown root:root {f} && chmod go-w {f}",
             "driverd runs as root")


def test_a_writable_directory_on_the_way_is_refused(tmp_path):
    f = _file(tmp_path / "shared/keys/index.pub")
    os.chmod(tmp_path / "shared", 0o777)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(f, "packages.index_public_key")
    _refused(e, f"the directory {tmp_path / 'shared'} is writable by its group and everyone", "no sticky bit",
             f"fix: chmod go-w {tmp_path / 'shared'}")


@as_root
def test_a_directory_on_the_way_owned_by_another_user_is_refused(tmp_path):
    f = _file(tmp_path / "home/alice/config.toml")
    os.chown(tmp_path / "home/alice", NOBODY, NOBODY)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(f, "config file")
    _refused(e, f"the directory {tmp_path / 'home/alice'} is owned by uid {NOBODY}")


def test_a_sticky_directory_is_fine_for_roots_own_entries(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    f = _file(tmp / "config.toml")
    assert fsutil.trusted_file(f, "config file") == f


@as_root
def test_another_users_symlink_in_a_sticky_directory_is_never_followed(tmp_path):
    """The classic: /tmp/driverd.toml -> a file of root's, planted by another user, who can re-point it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    good = _file(tmp_path / "etc/good.toml")
    link = tmp / "driverd.toml"
    link.symlink_to(good)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(link, "config file")
    _refused(e, f"the symbolic link {link} in the shared directory {tmp} belongs to uid {NOBODY}")


def test_a_link_is_judged_by_its_final_target(tmp_path):
    target = _file(tmp_path / "real/config.toml")
    link = tmp_path / "etc/config.toml"
    link.parent.mkdir()
    link.symlink_to("../real/config.toml")
    assert fsutil.trusted_file(link, "config file") == target
    os.chmod(target, 0o666)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(link, "config file")
    _refused(e, "writable by its group and everyone", f"it leads to {target}", f"chmod go-w {target}")
    os.chmod(target, 0o644)
    os.chmod(tmp_path / "real", 0o777)          # the target's own directory
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(link, "config file")
    _refused(e, f"the directory {tmp_path / 'real'} is writable")


def test_a_read_only_mount_passes_whatever_the_mode(tmp_path, monkeypatch):
    """A ConfigMap mounted readOnly (its directory is 0777 on some kubelets): nobody can change it here."""
    f = _file(tmp_path / "cm/config.toml", mode=0o666)
    os.chmod(tmp_path / "cm", 0o777)
    monkeypatch.setattr(fsutil, "_read_only", lambda p: str(p).startswith(str(tmp_path / "cm")))
    assert fsutil.trusted_file(f, "config file") == f


def test_a_user_may_own_the_files_of_a_one_shot_command(tmp_path, monkeypatch):
    """Not root: the user's own files are fine (still not group/world-writable); another user's are not."""
    me = 4242
    f = _file(tmp_path / "mine.toml")
    st = os.stat(f)
    monkeypatch.setattr(os, "geteuid", lambda: me)
    real_lstat = os.lstat

    def lstat(p, *a, **k):
        r = real_lstat(p, *a, **k)
        if os.fspath(p) == str(f):
            return os.stat_result((r.st_mode, r.st_ino, r.st_dev, r.st_nlink, me, r.st_gid, r.st_size,
                                   r.st_atime, r.st_mtime, r.st_ctime))
        return r
    monkeypatch.setattr(os, "lstat", lstat)
    assert fsutil.trusted_file(f, "config file") == f
    assert st.st_uid == os.stat(f).st_uid            # nothing changed on disk
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(ConfigError) as e:
        fsutil.trusted_file(f, "config file")
    _refused(e, f"owned by uid {me}", f"not root or you (uid {me + 1}", "what driverd does as you")


# -- the config file ------------------------------------------------------------------------------

def test_a_world_writable_config_toml_is_refused_not_used(tmp_path):
    cfgp = _file(tmp_path / "etc/driverd/config.toml", '[driver]\nversion = "550.127.05"\n', mode=0o666)
    with pytest.raises(ConfigError) as e:
        config.load(Root(tmp_path), environ={})
    _refused(e, f"refusing config file {tmp_path}/etc/driverd/config.toml", "mode 0666", f"chmod go-w {cfgp}")
    os.chmod(cfgp, 0o644)
    assert config.load(Root(tmp_path), environ={})["driver.version"] == "550.127.05"


@as_root
def test_a_config_owned_by_nobody_is_refused_by_every_command(tmp_path):
    cfgp = _file(tmp_path / "etc/driverd/config.toml", '[driver]\nversion = "550.127.05"\n')
    _file(tmp_path / "etc/os-release", "ID=debian\n")           # a host root (plan reads the host)
    os.chown(cfgp, NOBODY, NOBODY)
    for argv in (["config", "--root", str(tmp_path)], ["plan", "--root", str(tmp_path)],
                 ["config", "--config", str(cfgp)]):
        r = run_cli(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("driverd: error:")]
        assert "refusing config file" in line and f"owned by uid {NOBODY}" in line and "fix: chown root:root" in line


# -- the node's keys, certificates and repository credentials -------------------------------------

def test_node_key_paths_are_checked_under_the_root(tmp_path):
    from driverd.root.nodefiles import node_path
    root = Root(tmp_path)
    key = _file(tmp_path / "etc/driverd/keys/repo-index.pub", mode=0o666)
    with pytest.raises(ConfigError) as e:
        node_path(root, "/etc/driverd/keys/repo-index.pub", "packages.index_public_key")
    _refused(e, "refusing packages.index_public_key /etc/driverd/keys/repo-index.pub", f"chmod go-w {key}")
    os.chmod(key, 0o644)
    assert node_path(root, "/etc/driverd/keys/repo-index.pub") == str(key)
    assert node_path(root, "/etc/driverd/keys/missing.pub") == str(tmp_path / "etc/driverd/keys/missing.pub")


def test_a_trusted_cert_others_can_write_blocks_the_signer_preflight(tmp_path):
    from driverd.build.signers import declared_certs
    from driverd.sim.fakemod import make_signing_key
    _, cert = make_signing_key(tmp_path / "etc/driverd/keys")
    os.chmod(cert, 0o666)
    with pytest.raises(ConfigError) as e:
        declared_certs(Root(tmp_path), ["/etc/driverd/keys/" + cert.name])
    _refused(e, "refusing signing.trusted_certs", "mode 0666")


def test_fetch_refuses_a_netrc_others_can_write(tmp_path):
    """`driverd fetch` (the same fetch_configured the apply step and the rollout preflight use) never
    reads a netrc whose passwords and hosts another user chose."""
    from driverd.sim.scenario import dgx_spec, make_host, make_packages
    host = make_host(tmp_path / "host", dgx_spec(gpus=1, nvswitches=0, nouveau=False))
    make_packages(tmp_path / "repo")
    netrc = _file(host / "etc/driverd/netrc", "machine 127.0.0.1 login robot password pw\n", mode=0o666)
    _file(host / "etc/driverd/config.toml", f'[packages]\nrepositories = ["file://{tmp_path / "repo"}"]\n'
          'netrc = "/etc/driverd/netrc"\n')
    r = run_cli("fetch", "--root", str(host), "--driver", "535.261.03", "--flavor", "open")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing key or credential file /etc/driverd/netrc" in r.stderr and f"chmod go-w {netrc}" in r.stderr
    os.chmod(netrc, 0o600)
    r = run_cli("fetch", "--root", str(host), "--driver", "535.261.03", "--flavor", "open")
    assert r.returncode == 0, r.stdout + r.stderr


# -- the kubeconfig ---------------------------------------------------------------------------------

def _exec_plugin(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "plugin-ran"
    plugin = tmp_path / "bin/credential-plugin"
    _file(plugin, "#!/bin/sh\n"
                  f"touch {marker}\n"
                  'echo \'{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", '
                  '"status": {"token": "from-the-plugin"}}\'\n', mode=0o755)
    return plugin, marker


def _kubeconfig(path: Path, user: dict, mode: int = 0o600) -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
           "users": [{"name": "u", "user": user}]}
    return _file(path, json.dumps(doc), mode=mode)


def test_the_daemons_kubeconfig_never_runs_an_exec_plugin_unless_allowed(tmp_path):
    from driverd.cluster.kube import Kube, Target
    plugin, marker = _exec_plugin(tmp_path)
    kc = _kubeconfig(tmp_path / "etc/driverd/kubeconfig",
                     {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
                               "interactiveMode": "Never"}})
    with pytest.raises(ConfigError) as e:
        Kube(Target(kubeconfig=str(kc), allow_exec=False))
    _refused(e, f"refusing kubeconfig {kc}: user 'u' of context 'c' authenticates with an exec plugin ({plugin})",
             "run as root", "cluster.allow_exec_credentials")
    assert not marker.exists()
    # allowed (an operator's kubectl driverd, or cluster.allow_exec_credentials = true): the client runs it
    k = Kube(Target(kubeconfig=str(kc), allow_exec=True))
    assert marker.exists() and "from-the-plugin" in str(k.configuration.api_key)


def test_the_daemons_kubeconfig_never_sends_a_token_file_unless_allowed(tmp_path):
    from driverd.cluster.kube import Kube, Target
    token = _file(tmp_path / "etc/driverd/token", "secret-token\n", mode=0o600)
    kc = _kubeconfig(tmp_path / "etc/driverd/kubeconfig", {"tokenFile": str(token)})
    with pytest.raises(ConfigError) as e:
        Kube(Target(kubeconfig=str(kc), allow_exec=False))
    _refused(e, f"authenticates with a tokenFile ({token}), whose content the daemon would send")
    assert "secret-token" in str(Kube(Target(kubeconfig=str(kc), allow_exec=True)).configuration.api_key)
    os.chmod(token, 0o666)                       # allowed, but another user could choose what is sent
    with pytest.raises(ConfigError) as e:
        Kube(Target(kubeconfig=str(kc), allow_exec=True))
    _refused(e, f"refusing kubeconfig {kc}'s tokenFile", "mode 0666")


def test_a_kubeconfig_others_can_write_is_refused(tmp_path):
    from driverd.cluster.kube import Kube, Target
    kc = _kubeconfig(tmp_path / "kubeconfig", {"token": "t"}, mode=0o666)
    with pytest.raises(ConfigError) as e:
        Kube(Target(kubeconfig=str(kc)))
    _refused(e, f"refusing kubeconfig {kc}", "mode 0666")
    os.chmod(kc, 0o600)
    assert Kube(Target(kubeconfig=str(kc))).host == "https://127.0.0.1:1"


def test_a_ca_file_others_can_write_is_refused(tmp_path):
    from driverd.cluster.kube import Kube, Target
    ca = _file(tmp_path / "pki/ca.crt", "not a real CA\n", mode=0o666)
    kc = _kubeconfig(tmp_path / "kubeconfig", {"token": "t"})
    doc = json.loads(kc.read_text())
    doc["clusters"][0]["cluster"]["certificate-authority"] = "pki/ca.crt"         # relative to the kubeconfig
    kc.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as e:
        Kube(Target(kubeconfig=str(kc)))
    _refused(e, f"refusing kubeconfig {kc}'s certificate-authority", f"chmod go-w {ca}")


def test_cluster_mode_refuses_the_exec_plugin_before_running_it(tmp_path):
    """The daemon's cluster mode (and `driverd cluster agent`), with cluster.kubeconfig naming a
    kubeconfig whose user runs a program: refused in one line, the program never started; allowed by
    cluster.allow_exec_credentials."""
    from driverd.daemon.cluster_mode import ClusterMode
    plugin, marker = _exec_plugin(tmp_path)
    _kubeconfig(tmp_path / "etc/driverd/kubeconfig",
                {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
                          "interactiveMode": "Never"}})
    _file(tmp_path / "etc/driverd/config.toml", '[cluster]\nkubeconfig = "/etc/driverd/kubeconfig"\n'
          'node_name = "gpu-0"\n')
    cfg = config.load(Root(tmp_path), environ={})
    with pytest.raises(ConfigError) as e:
        ClusterMode(cfg, Root(tmp_path), lambda c: None, lambda m: None)
    _refused(e, "authenticates with an exec plugin", "set cluster.allow_exec_credentials = true")
    assert not marker.exists()
    r = run_cli("cluster", "agent", "--root", str(tmp_path), "--node", "gpu-0")
    assert r.returncode == 2 and "authenticates with an exec plugin" in r.stderr, r.stderr
    assert not marker.exists()
    allowed = cfg.with_overrides({"cluster.allow_exec_credentials": True})
    cm = ClusterMode(allowed, Root(tmp_path), lambda c: None, lambda m: None)
    assert marker.exists()
    cm.agent.close()
    cm.coordinator.close()


def test_the_default_kubeconfig_is_checked_too(tmp_path, monkeypatch):
    """No --kubeconfig: $KUBECONFIG (':'-separated, as the client merges it) is what is checked."""
    from driverd.cluster.kube import Kube, Target
    a = _kubeconfig(tmp_path / "a", {"token": "t"})
    b = _file(tmp_path / "b", "{}", mode=0o666)
    monkeypatch.setenv("KUBECONFIG", f"{a}:{b}")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError) as e:
        Kube(Target())
    _refused(e, f"refusing kubeconfig {b}")
    assert stat.S_IMODE(os.stat(b).st_mode) == 0o666
