"""Hosts NVIDIA's tooling configured first, and the legacy containerd shapes — every result loaded by
the real containerd 1.6 and 2.1 (`config dump`, `ctr plugins ls`: cri ok). For 1.6 the test also asks
the CRI plugin what it really runs with: its startup line "Start cri plugin with config {...}" is
logged after the plugin's own validation (where the deprecated default_runtime table becomes runtime
"default" and the default), which `config dump` does not show (tests/runtime/conftest.cri_effective).
"""
from __future__ import annotations

import tomllib

import pytest

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import Options, cdi, configure, revert
from driverd.runtime.containerd import dropin_path
from tests.runtime.conftest import (
    cri_effective,
    fixture_text,
    make_host,
    peer_text,
    runtimes_of,
    snapshot,
)
from tests.runtime.test_runtime_files import gpu_tree

pytestmark = [pytest.mark.real, pytest.mark.slow]
BIN = "/usr/bin/nvidia-container-runtime"
TOOLKIT = "/usr/local/nvidia/toolkit/nvidia-container-runtime"
CFG = "/etc/containerd/config.toml"
V2 = "io.containerd.grpc.v1.cri"
BINV = {"1.6": "1.6.20~ds1", "2.1": "2.1.9"}


def _opts(**kw) -> Options:
    return Options(**{"restart": "none", **kw})


def _host(containerd_env, version, files, extra_bins=()):
    ctd, host, tmp = containerd_env(version)
    bins = {"/usr/bin/containerd": BINV[version], BIN: "", **{b: "" for b in extra_bins}}
    make_host(host, {hp: peer_text(f"containerd/{name}", tmp) for hp, name in files.items()}, bins)
    return ctd, host


def _effective(ctd) -> dict:
    """Start the private containerd: the CRI plugin must be ok; return what it runs with (1.6)."""
    status, log = ctd.plugins()
    assert status and all(s == "ok" for s in status.values()), f"CRI plugin not ok: {status}\n{log[-3000:]}"
    return cri_effective(log) if "Start cri plugin with config" in log else {}


def _handler(dump: dict, name: str = "nvidia") -> dict:
    return runtimes_of(dump, dump["version"])[name]


def _ctd(dump: dict) -> dict:
    plugin = {1: "cri", 2: V2, 3: "io.containerd.cri.v1.runtime"}[dump["version"]]
    return dump["plugins"][plugin]


# -- adoption: nvidia-ctk / GPU Operator handlers ---------------------------------------------------
@pytest.mark.parametrize("version", ["1.6", "2.1"])
def test_nvidia_ctk_handler_flags_apply_to_the_existing_handler(containerd_env, tmp_path, version):
    ctd, host = _host(containerd_env, version, {CFG: "ctk-v2-inplace.toml"})
    gpu_tree(host, 1)
    before = snapshot(host)
    plain = configure(Root(host), "containerd", _opts())
    assert plain.files_changed == [] and plain.skipped and "left as it is" in " ".join(plain.notes)
    rep = configure(Root(host), "containerd", _opts(set_as_default=True, cdi=True))
    assert CFG in rep.files_changed and "/var/run/cdi/nvidia.yaml" in rep.files_changed
    text = (host / CFG.lstrip("/")).read_text()
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in text and 'sandbox_image = "example.com/pause:ctk-inplace"' in text
    dump = ctd.dump()
    assert _ctd(dump)["containerd"]["default_runtime_name"] == "nvidia"
    assert _handler(dump)["options"] == {"BinaryName": BIN, "SystemdCgroup": True}
    if version == "2.1":
        assert _ctd(dump)["enable_cdi"] is True
    else:   # Debian's 1.6 has no CDI: not set, and said so
        assert "enable_cdi" not in text and any("no CDI support" in n for n in rep.notes)
    eff = _effective(ctd)
    if version == "1.6":
        assert eff["default"] == "nvidia"
    again = configure(Root(host), "containerd", _opts(set_as_default=True, cdi=True))
    assert again.files_changed == [] and again.skipped
    revert(Root(host), "containerd", _opts())
    revert(Root(host), "cdi", _opts())
    assert snapshot(host) == before


def test_operator_handler_is_kept_and_a_named_binary_changes_only_its_path(containerd_env):
    ctd, host = _host(containerd_env, "1.6", {CFG: "operator-v2.toml"},
                      [TOOLKIT, TOOLKIT + ".cdi", TOOLKIT + ".legacy"])
    before = snapshot(host)
    kept = configure(Root(host), "containerd", _opts())       # runs the toolkit's binary, which exists
    assert kept.files_changed == [] and "left as it is" in " ".join(kept.notes)
    rep = configure(Root(host), "containerd", _opts(binary=BIN, binary_explicit=True))
    assert rep.files_changed == [CFG]
    assert rep.adopted == [{"handler": "nvidia", "file": CFG, "before": TOOLKIT, "binary": BIN,
                            "how": "the configured binary", "foreign": False}]
    diff = [ln for ln in rep.diffs[CFG].splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert diff == [f'-            BinaryName = "{TOOLKIT}"', f'+            BinaryName = "{BIN}"']
    dump = ctd.dump()
    rts = runtimes_of(dump, 2)
    assert rts["nvidia"]["options"]["BinaryName"] == BIN and rts["nvidia"]["container_annotations"] == ["cdi.k8s.io/*"]
    assert rts["nvidia-cdi"]["options"]["BinaryName"] == TOOLKIT + ".cdi"
    assert _effective(ctd)["default"] == "nvidia"
    rev = revert(Root(host), "containerd", _opts())
    assert any("goes back to what the other tool wrote" in n for n in rev.notes)
    assert snapshot(host) == before


def test_handler_at_a_missing_path_is_adopted_and_revert_gives_the_old_one_back(containerd_env):
    ctd, host = _host(containerd_env, "2.1", {CFG: "old-path-v2.toml"})
    before = snapshot(host)
    rep = configure(Root(host), "containerd", _opts())
    assert rep.adopted[0]["before"] == "/opt/old-toolkit/bin/nvidia-container-runtime"
    assert rep.adopted[0]["binary"] == BIN and "does not exist" in rep.adopted[0]["how"]
    assert _handler(ctd.dump())["options"]["BinaryName"] == BIN
    _effective(ctd)
    again = configure(Root(host), "containerd", _opts())
    assert again.files_changed == [] and not again.adopted and "adopted by driverd earlier" in " ".join(again.notes)
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before
    # adopted again, then someone edits the file: revert keeps their edit and gives the old path back
    configure(Root(host), "containerd", _opts())
    p = host / CFG.lstrip("/")
    p.write_text(p.read_text().replace('sandbox_image = "example.com/pause:old-path"',
                                       'sandbox_image = "example.com/pause:edited"'))
    revert(Root(host), "containerd", _opts())
    doc = tomllib.loads(p.read_text())
    assert doc["plugins"][V2]["sandbox_image"] == "example.com/pause:edited"
    assert doc["plugins"][V2]["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == \
        "/opt/old-toolkit/bin/nvidia-container-runtime"


def test_foreign_handler_is_refused_in_one_line_and_taken_over_on_request(containerd_env):
    ctd, host = _host(containerd_env, "1.6", {CFG: "foreign-v2.toml"})
    before, everything = snapshot(host), snapshot(host, "")
    with pytest.raises(RuntimeConfigError) as e:
        configure(Root(host), "containerd", _opts())
    line = e.value.one_line()
    assert e.value.exit_code == 3 and "\n" not in line
    assert "'/opt/acme/bin/acme-gpu-runc'" in line and "--adopt-foreign" in line and "not driverd's" in line
    assert snapshot(host, "") == everything                                   # nothing written anywhere
    rep = configure(Root(host), "containerd", _opts(adopt_foreign=True))
    assert rep.adopted[0]["foreign"] and rep.adopted[0]["binary"] == BIN
    assert _handler(ctd.dump())["options"]["BinaryName"] == BIN
    _effective(ctd)
    assert configure(Root(host), "containerd", _opts()).files_changed == []   # now it runs NVIDIA's runtime
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


def test_v3_handler_in_the_main_config_is_fixed_from_the_dropin(containerd_env):
    """containerd 2.x merges imports key by key: driverd's drop-in carries only the binary."""
    ctd, host = _host(containerd_env, "2.1", {CFG: "old-path-v3.toml"})
    before = snapshot(host)
    rep = configure(Root(host), "containerd", _opts(set_as_default=True))
    ours = dropin_path(CFG, "nvidia")
    assert rep.files_changed == [CFG, ours] and rep.adopted[0]["file"] == ours
    drop = tomllib.loads((host / ours.lstrip("/")).read_text())
    assert drop["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"] == {
        "nvidia": {"options": {"BinaryName": BIN}}}
    nv = _handler(ctd.dump())
    assert nv["options"] == {"BinaryName": BIN, "SystemdCgroup": True} and nv["privileged_without_host_devices"]
    assert _ctd(ctd.dump())["containerd"]["default_runtime_name"] == "nvidia"
    _effective(ctd)
    again = configure(Root(host), "containerd", _opts(set_as_default=True))
    assert again.files_changed == [] and not again.adopted
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


# -- legacy shapes ----------------------------------------------------------------------------------
def test_v1_shim_handler_runs_the_nvidia_runtime(containerd_env):
    ctd, host = _host(containerd_env, "1.6", {CFG: "v1-shim.toml"})
    before = snapshot(host)
    rep = configure(Root(host), "containerd", _opts())
    assert any("options.Runtime" in n for n in rep.notes)
    nv = ctd.dump()["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
    assert nv["runtime_type"] == "io.containerd.runtime.v1.linux"
    assert nv["options"]["Runtime"] == BIN and nv["options"]["BinaryName"] == BIN
    assert nv["options"]["SystemdCgroup"] is True and nv["options"]["Root"].endswith("/runc-root")
    eff = _effective(ctd)
    assert "Runtime:/usr/bin/nvidia-container-runtime" in eff["runtimes"]["nvidia"]
    assert "Runtime:/usr/bin/runc" in eff["runtimes"]["runc"]
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


def test_v1_shim_handler_that_still_runs_runc_is_fixed(containerd_env):
    """Another tool copied runc's options and set only BinaryName: the v1 shim runs Runtime = runc."""
    ctd, host = _host(containerd_env, "1.6", {CFG: "v1-shim-copied-runc.toml"})
    before = snapshot(host)
    assert "Runtime:/usr/bin/runc" in _effective(ctd)["runtimes"]["nvidia"]     # pods asking for nvidia: runc
    rep = configure(Root(host), "containerd", _opts())
    assert rep.adopted and rep.adopted[0]["binary"] == BIN
    diff = [ln for ln in rep.diffs[CFG].splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert diff == ['-            Runtime = "/usr/bin/runc"', f'+            Runtime = "{BIN}"']
    assert "Runtime:/usr/bin/nvidia-container-runtime" in _effective(ctd)["runtimes"]["nvidia"]
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


@pytest.mark.parametrize("version", ["1.6", "2.1"])
def test_empty_runtime_type_is_treated_as_runc_v2(containerd_env, version):
    ctd, host = _host(containerd_env, version, {CFG: "v2-empty-type.toml"})
    rep = configure(Root(host), "containerd", _opts())
    assert any("empty runtime_type" in n for n in rep.notes)
    nv = _handler(ctd.dump())
    assert nv["runtime_type"] == "io.containerd.runc.v2"
    assert nv["options"]["BinaryName"] == BIN and nv["options"]["SystemdCgroup"] is True
    eff = _effective(ctd)
    if version == "1.6":
        assert eff["runtimes"]["nvidia"].startswith("{Type:io.containerd.runc.v2 ")
        assert "BinaryName:/usr/bin/nvidia-container-runtime" in eff["runtimes"]["nvidia"]


def test_deprecated_default_runtime_table_what_containerd_16_really_uses(containerd_env):
    ctd, host = _host(containerd_env, "1.6", {CFG: "v1-legacy-default.toml"})
    before = snapshot(host)
    # As found: the dump says runc, the CRI plugin uses the deprecated table as runtime "default".
    assert _ctd(ctd.dump())["containerd"]["default_runtime_name"] == "runc"
    assert _effective(ctd)["default"] == "default"
    # Without --set-as-default the table stays (and the handler derives from it: the v1 shim).
    rep = configure(Root(host), "containerd", _opts())
    assert any("deprecated default_runtime" in n and "--set-as-default" in n for n in rep.notes)
    eff = _effective(ctd)
    assert eff["default"] == "default" and "Runtime:/usr/bin/nvidia-container-runtime" in eff["runtimes"]["nvidia"]
    # --set-as-default: the table becomes runtimes.default and the default really changes.
    rep = configure(Root(host), "containerd", _opts(set_as_default=True))
    assert any("migrated the deprecated default_runtime table" in n for n in rep.notes)
    c = _ctd(ctd.dump())["containerd"]
    assert c["default_runtime_name"] == "nvidia" and c["default_runtime"]["runtime_type"] == ""
    assert c["runtimes"]["default"]["runtime_type"] == "io.containerd.runtime.v1.linux"
    assert c["runtimes"]["default"]["runtime_engine"] == "/usr/bin/runc"
    eff = _effective(ctd)
    assert eff["default"] == "nvidia" and "Engine:/usr/bin/runc" in eff["runtimes"]["default"]
    assert configure(Root(host), "containerd", _opts(set_as_default=True)).files_changed == []
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before
    assert _effective(ctd)["default"] == "default"


@pytest.mark.parametrize("version", ["1.6", "2.1"])
def test_deprecated_default_runtime_table_in_a_v2_config(containerd_env, version):
    ctd, host = _host(containerd_env, version, {CFG: "v2-legacy-default.toml"})
    before = snapshot(host)
    rep = configure(Root(host), "containerd", _opts(set_as_default=True))
    text = (host / CFG.lstrip("/")).read_text()
    dump = ctd.dump()
    assert _ctd(dump)["containerd"]["default_runtime_name"] == "nvidia"
    if version == "1.6":     # migrated; the handler inherits the table's SystemdCgroup
        assert "containerd.default_runtime]" not in text
        assert _handler(dump)["options"] == {"SystemdCgroup": True, "BinaryName": BIN}
        assert _effective(ctd)["default"] == "nvidia"
    else:                    # 2.x ignores the table: left alone, and said so
        assert "containerd.default_runtime]" in text
        assert any("ignores the deprecated default_runtime" in n for n in rep.notes)
        _effective(ctd)
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


# -- nvidia-ctk's drop-in layout ---------------------------------------------------------------------
def test_nvidia_ctk_dropin_v2_on_containerd_16(containerd_env):
    drop = "/etc/containerd/conf.d/99-nvidia.toml"
    ctd, host = _host(containerd_env, "1.6", {CFG: "ctk-dropin-v2.toml", drop: "ctk-dropin-v2-conf.d-99-nvidia.toml"})
    before = snapshot(host)
    assert _effective(ctd)["default"] == "runc"
    rep = configure(Root(host), "containerd", _opts(set_as_default=True))
    assert rep.files_changed == [drop]     # the CRI table containerd 1.6 uses is nvidia-ctk's drop-in
    assert _effective(ctd)["default"] == "nvidia"
    assert set(runtimes_of(ctd.dump(), 2)) == {"runc", "nvidia", "nvidia-cdi", "nvidia-legacy"}
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


def test_nvidia_ctk_dropin_v3_on_containerd_21(containerd_env):
    drop = "/etc/containerd/conf.d/99-nvidia.toml"
    ctd, host = _host(containerd_env, "2.1", {CFG: "ctk-dropin-v3.toml", drop: "ctk-dropin-v3-conf.d-99-nvidia.toml"})
    before = snapshot(host)
    rep = configure(Root(host), "containerd", _opts(set_as_default=True, cdi=True))
    ours = dropin_path(CFG, "nvidia")
    # nvidia-ctk's 99-nvidia.toml sorts after driverd's drop-in and sets default_runtime_name = "runc":
    # changed there; enable_cdi goes into driverd's drop-in.
    assert rep.files_changed == [ours, drop]
    assert any(cdi.PENDING.split(":")[0] in n for n in rep.notes)
    assert 'default_runtime_name = "nvidia"' in (host / drop.lstrip("/")).read_text()
    dump = ctd.dump()
    rt = dump["plugins"]["io.containerd.cri.v1.runtime"]
    assert rt["containerd"]["default_runtime_name"] == "nvidia" and rt["enable_cdi"] is True
    assert rt["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"] == BIN
    _effective(ctd)
    assert configure(Root(host), "containerd", _opts(set_as_default=True, cdi=True)).files_changed == []
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


# -- CDI in two parts ---------------------------------------------------------------------------------
def test_cdi_runtime_side_first_spec_when_gpus_appear(containerd_env):
    ctd, host, tmp = containerd_env("2.1")
    make_host(host, {CFG: fixture_text("v3.toml", tmp)}, {"/usr/bin/containerd": "2.1.9", BIN: ""})
    spec = host / "var/run/cdi/nvidia.yaml"
    rep = configure(Root(host), "containerd", _opts(cdi=True))       # no GPU visible: driver not loaded
    assert "/var/run/cdi/nvidia.yaml" not in rep.files_changed and not spec.exists()
    assert any("written when the GPUs appear" in n for n in rep.notes)
    assert ctd.dump()["plugins"]["io.containerd.cri.v1.runtime"]["enable_cdi"] is True
    _effective(ctd)
    waiting = cdi.refresh(Root(host), _opts(cdi=True))
    assert waiting.files_changed == [] and "written when the GPUs appear" in waiting.skipped
    assert cdi.refresh(Root(host), _opts()).skipped.startswith("CDI is not enabled")
    gpu_tree(host, 1)                                                 # the driver is loaded
    first = cdi.refresh(Root(host), _opts(cdi=True))
    assert first.files_changed == ["/var/run/cdi/nvidia.yaml"] and spec.exists()
    assert cdi.refresh(Root(host), _opts(cdi=True)).files_changed == []
    gpu_tree(host, 2)                                                 # another GPU: rewritten
    assert cdi.refresh(Root(host), _opts(cdi=True)).files_changed == ["/var/run/cdi/nvidia.yaml"]
    assert "/dev/nvidia1" in spec.read_text()
    assert configure(Root(host), "containerd", _opts(cdi=True)).files_changed == []
    revert(Root(host), "cdi", _opts())
    assert not spec.exists()
