"""What the configured handler needs on a host, and whether it has it (driverd.runtime.needs): the
binary it runs (present, missing, not executable; the handler's own or runtime.binary), CDI per
runtime and version (containerd 1.6 none, 1.7 off by default, 2.x on by default; CRI-O from 1.24
without a switch; Docker 25 opt-in, on by default from 28.2) and the NVIDIA spec in the directories
the runtime reads — in host trees, through detect and plan (text and --json)."""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from driverd.root import Root
from driverd.runtime import registry
from driverd.runtime.needs import find_specs, resolve_binary
from tests.runtime.conftest import PEER, RT, gpu_host, install_binary, make_host

BIN = "/usr/bin/nvidia-container-runtime"
CFG = "/etc/containerd/config.toml"
NEEDS = RT / "needs"
TOOLKIT_BIN = "/usr/local/nvidia/toolkit/nvidia-container-runtime"


def _text(path: Path) -> str:
    return path.read_text().replace("{TMP}", "/var/lib/containerd-test")


def _needs(host: Path, runtime: str, handler: str = "nvidia", binary: str = BIN):
    facts = {f.name: f for f in registry.detect_all(Root(host), handler, binary)}
    return facts[runtime].needs


def _containerd(tmp_path, version: str, files: dict[str, Path | str]) -> Path:
    return make_host(tmp_path / "host", {hp: _text(src) if isinstance(src, Path) else src for hp, src in files.items()},
                     {"/usr/bin/containerd": version})


# -- the binary ------------------------------------------------------------------------------------------
def test_configured_handler_with_its_binary_missing_names_it_what_fails_and_the_fix(tmp_path):
    host = _containerd(tmp_path, "1.6.20~ds1", {CFG: PEER / "containerd/ctk-v2-inplace.toml"})
    n = _needs(host, "containerd")
    assert (n.configured, n.binary, n.binary_from, n.binary_state, n.status) == \
        (True, BIN, "config", "missing", "binary-missing")
    assert n.verdict == (
        "containerd 1.6.20~ds1: handler 'nvidia' configured, /usr/bin/nvidia-container-runtime missing: pods with "
        "runtimeClassName nvidia will fail to start (fix: install nvidia-container-toolkit, or set runtime.binary "
        "and run `driverd runtime configure` to point 'nvidia' at an installed runtime)")
    assert not any("CDI" in f for f in n.fixes)          # containerd 1.6 cannot do CDI: not offered


def test_the_same_handler_with_its_binary_installed_is_ready(tmp_path):
    host = _containerd(tmp_path, "1.6.20~ds1", {CFG: PEER / "containerd/ctk-v2-inplace.toml"})
    install_binary(host)
    n = _needs(host, "containerd")
    assert (n.status, n.binary_state, n.binary_path, n.fixes) == ("ok", "present", BIN, ())
    assert n.verdict == "containerd 1.6.20~ds1: handler 'nvidia' configured, runs /usr/bin/nvidia-container-runtime: ready"


def test_a_binary_without_execute_bits_is_not_taken_for_present(tmp_path):
    host = _containerd(tmp_path, "1.6.20", {CFG: PEER / "containerd/ctk-v2-inplace.toml"})
    install_binary(host, mode=0o644)
    n = _needs(host, "containerd")
    assert (n.status, n.binary_state) == ("binary-missing", "not-executable")
    assert "is not an executable file" in n.verdict and f"make {BIN} executable" in n.fixes[0]


def test_the_handler_runs_what_its_configuration_names_not_runtime_binary(tmp_path):
    # the GPU Operator's toolkit handler in CRI-O: runtime.binary exists, the toolkit's binary does not
    host = make_host(tmp_path / "host", {"/etc/crio/crio.conf.d/99-nvidia.toml": (PEER / "crio/99-nvidia.toml").read_text()},
                     {"/usr/bin/crio": "1.30.4"})
    install_binary(host)
    n = _needs(host, "crio")
    assert (n.binary, n.binary_from, n.status) == (TOOLKIT_BIN, "config", "binary-missing")
    assert "CRI-O refuses to start while a runtime's binary is missing" in n.verdict
    install_binary(host, TOOLKIT_BIN)
    assert _needs(host, "crio").status == "ok"


def test_a_default_handler_without_its_binary_breaks_every_container(tmp_path):
    # what the GPU Operator's toolkit leaves behind once its container (and binary) is gone
    host = _containerd(tmp_path, "1.7.27", {CFG: PEER / "containerd/operator-v2.toml"})
    n = _needs(host, "containerd")
    assert (n.default, n.binary, n.status) == (True, TOOLKIT_BIN, "binary-missing")
    assert n.verdict.startswith(
        f"containerd 1.7.27: handler 'nvidia' configured as the default runtime, {TOOLKIT_BIN} missing: pods with "
        "runtimeClassName nvidia will fail to start; as the default it also breaks every container that names no runtime")
    host = make_host(tmp_path / "docker", {"/etc/docker/daemon.json": (PEER / "docker/daemon-operator.json").read_text()},
                     {"/usr/bin/dockerd": "28.3.3"})
    n = _needs(host, "docker")
    assert n.default and "as the default it also breaks every container that names no runtime" in n.verdict
    install_binary(host, TOOLKIT_BIN)
    assert _needs(host, "docker").verdict == ("Docker 28.3.3: handler 'nvidia' configured as the default, runs "
                                              f"{TOOLKIT_BIN}: ready")
    host = _containerd(tmp_path / "runc", "1.7.27", {CFG: PEER / "containerd/ctk-v2-inplace.toml"})
    assert not _needs(host, "containerd").default          # default_runtime_name = "runc"


def test_an_unconfigured_handler_is_judged_by_runtime_binary(tmp_path):
    host = _containerd(tmp_path, "2.1.9", {CFG: RT / "containerd/v3.toml"})
    n = _needs(host, "containerd", binary="/opt/nvidia/bin/nvidia-container-runtime")
    assert (n.configured, n.binary, n.binary_from, n.status) == \
        (False, "/opt/nvidia/bin/nvidia-container-runtime", "runtime.binary", "binary-missing")
    assert "not configured, /opt/nvidia/bin/nvidia-container-runtime (runtime.binary) missing: once configured, pods " \
           "with runtimeClassName nvidia will fail to start" in n.verdict
    assert "set runtime.binary to the NVIDIA runtime's path" in n.fixes
    install_binary(host, "/opt/nvidia/bin/nvidia-container-runtime")
    n = _needs(host, "containerd", binary="/opt/nvidia/bin/nvidia-container-runtime")
    assert n.status == "not-configured" and "`driverd apply` or `driverd runtime configure` adds it" in n.verdict


def test_a_bare_name_resolves_on_the_hosts_path_like_dockerd(tmp_path):
    host = make_host(tmp_path / "host", {"/etc/docker/daemon.json": (PEER / "docker/daemon-ctk.json").read_text()},
                     {"/usr/bin/dockerd": "27.5.1"})
    n = _needs(host, "docker")
    assert (n.binary, n.binary_path, n.status) == ("nvidia-container-runtime", None, "binary-missing")
    assert "containers run with --runtime nvidia will fail to start" in n.verdict
    install_binary(host, "/usr/local/bin/nvidia-container-runtime")
    n = _needs(host, "docker")
    assert (n.binary_path, n.status) == ("/usr/local/bin/nvidia-container-runtime", "ok")
    assert "runs nvidia-container-runtime (/usr/local/bin/nvidia-container-runtime): ready" in n.verdict
    assert resolve_binary(Root(host), "nvidia-container-runtime") == ("/usr/local/bin/nvidia-container-runtime", "present")


# -- CDI -------------------------------------------------------------------------------------------------
def test_containerd_16_has_no_cdi_whatever_the_config_says(tmp_path):
    host = _containerd(tmp_path, "1.6.20~ds1", {CFG: NEEDS / "containerd-v2-cdi-on.toml"})
    c = _needs(host, "containerd").cdi
    assert (c.supported, c.enabled, c.usable) == (False, False, False)
    assert c.evidence == "containerd 1.6 has no CDI support; it came with containerd 1.7"


def test_containerd_17_needs_enable_cdi_and_a_later_cri_table_replaces_it_whole(tmp_path):
    host = _containerd(tmp_path, "1.7.27", {CFG: RT / "containerd/v2.toml"})
    c = _needs(host, "containerd").cdi
    assert (c.supported, c.enabled) == (True, False)
    assert c.evidence == "enable_cdi is not set: containerd 1.7 defaults to false"
    host = _containerd(tmp_path / "b", "1.7.27", {CFG: NEEDS / "containerd-v2-cdi-on.toml"})
    c = _needs(host, "containerd").cdi
    assert (c.supported, c.enabled, c.evidence) == (True, True, f"enable_cdi = true in {CFG}")
    # an import that defines the CRI table again replaces it whole under 1.x: enable_cdi is gone
    host = _containerd(tmp_path / "c", "1.7.27", {CFG: NEEDS / "containerd-v2-cdi-on.toml",
                                                  "/etc/containerd/conf.d/20-cri.toml": NEEDS / "containerd-v2-cdi-owner.toml"})
    c = _needs(host, "containerd").cdi
    assert (c.enabled, c.evidence) == (False, "enable_cdi is not set: containerd 1.7 defaults to false")


def test_containerd_2_has_cdi_on_unless_a_file_turns_it_off(tmp_path):
    host = _containerd(tmp_path, "2.1.9", {CFG: RT / "containerd/v3.toml"})
    c = _needs(host, "containerd").cdi
    assert (c.supported, c.enabled, c.spec_dirs) == (True, True, ("/etc/cdi", "/var/run/cdi"))
    assert c.evidence == "enable_cdi is not set: on by default since containerd 2.0"
    host = _containerd(tmp_path / "b", "2.1.9", {CFG: RT / "containerd/v3.toml",
                                                 "/etc/containerd/site/50-cdi.toml": NEEDS / "containerd-v3-cdi-off-site.toml"})
    c = _needs(host, "containerd").cdi
    assert (c.enabled, c.evidence) == (False, "enable_cdi = false in /etc/containerd/site/50-cdi.toml")
    assert _needs(host, "containerd").cdi_line.startswith("CDI: off (enable_cdi = false in /etc/containerd/site/50-cdi.toml)")


def test_cdi_usable_with_nvidias_spec_becomes_a_fix_for_a_missing_binary(tmp_path):
    host = _containerd(tmp_path, "2.1.9", {CFG: RT / "containerd/v3.toml",
                                           "/var/run/cdi/nvidia.yaml": NEEDS / "nvidia.yaml",
                                           "/etc/cdi/other.yaml": NEEDS / "other.yaml"})
    n = _needs(host, "containerd")
    assert n.cdi.specs == ("/var/run/cdi/nvidia.yaml",) and n.cdi.usable
    assert n.fixes[-1] == "use CDI instead (containerd reads /var/run/cdi/nvidia.yaml)"
    assert n.cdi_line == ("CDI: on (enable_cdi is not set: on by default since containerd 2.0); spec for "
                          "nvidia.com/gpu: /var/run/cdi/nvidia.yaml")


def test_specs_are_found_by_kind_in_json_and_yaml_once_per_directory(tmp_path):
    host = make_host(tmp_path / "host", {"/run/cdi/nvidia.json": (NEEDS / "nvidia.json").read_text(),
                                         "/etc/cdi/other.yaml": (NEEDS / "other.yaml").read_text(),
                                         "/etc/cdi/nvidia.yml": (NEEDS / "nvidia.yaml").read_text(),   # not a CDI name
                                         "/etc/cdi/broken.json": "{not json"})
    (host / "var").mkdir()
    os.symlink("/run", host / "var/run")
    root = Root(host)
    assert find_specs(root, ("/etc/cdi", "/var/run/cdi", "/run/cdi")) == ("/var/run/cdi/nvidia.json",)
    assert find_specs(root, ("/etc/cdi",), kind="vendor.example/fpga") == ("/etc/cdi/other.yaml",)


@pytest.mark.parametrize("version,daemon_json,supported,enabled,evidence", [
    ("24.0.9", None, False, False, "Docker 24.0 has no CDI support; it came with Docker 25"),
    ("26.1.5", None, True, False, "features.cdi is not set: Docker 26.1 needs it (opt-in before 28.2)"),
    ("26.1.5", "daemon-cdi-on.json", True, True, "features.cdi = true in /etc/docker/daemon.json"),
    ("28.2.2", None, True, True, "features.cdi is not set: on by default since Docker 28.2"),
    ("28.2.2", "daemon-cdi-off.json", True, False, "features.cdi = false in /etc/docker/daemon.json"),
])
def test_docker_cdi_by_version_and_features_cdi(tmp_path, version, daemon_json, supported, enabled, evidence):
    files = {"/etc/docker/daemon.json": (NEEDS / daemon_json).read_text()} if daemon_json else {}
    host = make_host(tmp_path / "host", files, {"/usr/bin/dockerd": version})
    c = _needs(host, "docker").cdi
    assert (c.supported, c.enabled, c.evidence) == (supported, enabled, evidence)
    if daemon_json == "daemon-cdi-off.json":
        assert c.spec_dirs == ("/opt/cdi",)
        assert "driverd writes its spec to /var/run/cdi/nvidia.yaml, a directory Docker does not read" in \
            _needs(host, "docker").cdi_line


def test_crio_has_cdi_from_124_without_a_switch_reading_its_drop_ins_spec_dirs(tmp_path):
    files = {"/etc/crio/crio.conf": (RT / "crio/crio.conf").read_text(),
             "/etc/crio/crio.conf.d/99-cdi.conf": (NEEDS / "crio-99-cdi-dirs.conf").read_text(),
             "/opt/vendor/cdi/nvidia.json": (NEEDS / "nvidia.json").read_text()}
    host = make_host(tmp_path / "host", files, {"/usr/bin/crio": "1.30.4"})
    c = _needs(host, "crio").cdi
    assert (c.supported, c.enabled, c.spec_dirs, c.specs) == \
        (True, True, ("/etc/cdi", "/opt/vendor/cdi"), ("/opt/vendor/cdi/nvidia.json",))
    host = make_host(tmp_path / "old", files, {"/usr/bin/crio": "1.23.5"})
    c = _needs(host, "crio").cdi
    assert (c.supported, c.evidence) == (False, "CRI-O 1.23 has no CDI support; it came with CRI-O 1.24")


# -- detect and capture ----------------------------------------------------------------------------------
def _cli(capsys, *argv, rc: int = 0, as_json: bool = True):
    from driverd.cli import main
    capsys.readouterr()
    got = main([*argv, *(["--json"] if as_json else [])])
    out = capsys.readouterr().out
    assert got == rc, out
    return json.loads(out) if as_json else out


def test_detect_says_per_runtime_what_the_handler_needs_in_text_and_json(tmp_path, capsys):
    host = gpu_host(tmp_path / "host", {CFG: _text(PEER / "containerd/ctk-v2-inplace.toml"),
                                "/etc/docker/daemon.json": (NEEDS / "daemon-cdi-on.json").read_text()},
                     {"/usr/bin/containerd": "1.6.20~ds1", "/usr/bin/dockerd": "26.1.5"})
    facts = _cli(capsys, "detect", "--root", str(host), "--no-nvml")
    by = {r["name"]: r["needs"] for r in facts["runtimes"]}
    assert by["containerd"]["status"] == by["docker"]["status"] == "binary-missing"
    assert by["docker"]["cdi"] == {"supported": True, "enabled": True, "evidence": "features.cdi = true in "
                                   "/etc/docker/daemon.json", "spec_dirs": ["/etc/cdi", "/var/run/cdi"], "specs": []}
    assert by["docker"]["fixes"][-1] == ("use CDI instead (runtime.cdi = true writes /var/run/cdi/nvidia.yaml once "
                                         "the GPUs are visible)")
    text = _cli(capsys, "detect", "--root", str(host), "--no-nvml", as_json=False)
    assert ("  warning: containerd 1.6.20~ds1: handler 'nvidia' configured, /usr/bin/nvidia-container-runtime missing: "
            "pods with runtimeClassName nvidia will fail to start (fix: install nvidia-container-toolkit") in text
    assert "  warning: Docker 26.1.5: handler 'nvidia' configured, nvidia-container-runtime missing" in text
    assert "  CDI: not supported (containerd 1.6 has no CDI support; it came with containerd 1.7)" in text
    # runtime.binary from the configuration decides what an unconfigured handler needs
    (host / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (host / "etc/driverd/config.toml").write_text('[runtime]\nhandler = "gpu"\nbinary = "/opt/nv/runtime"\n')
    facts = _cli(capsys, "detect", "--root", str(host), "--no-nvml")
    n = facts["runtimes"][0]["needs"]
    assert (n["handler"], n["binary"], n["binary_from"], n["configured"]) == ("gpu", "/opt/nv/runtime", "runtime.binary", False)


def test_a_captured_host_keeps_the_handler_binary_present(tmp_path, capsys):
    host = gpu_host(tmp_path / "host", {CFG: _text(PEER / "containerd/ctk-v2-inplace.toml")}, {"/usr/bin/containerd": "1.6.20"})
    big = host / BIN.lstrip("/")
    big.parent.mkdir(parents=True, exist_ok=True)
    big.write_bytes(b"\0" * (2 << 20))          # larger than what a capture packs
    os.chmod(big, 0o755)
    assert _needs(host, "containerd").status == "ok"
    out = tmp_path / "cap.tar.gz"
    _cli(capsys, "debug", "capture-host", "--root", str(host), "--archive", str(out))
    with tarfile.open(out) as tar:
        member = tar.getmember(BIN.lstrip("/"))
        assert member.isfile() and member.mode & 0o111 and member.size == 0
