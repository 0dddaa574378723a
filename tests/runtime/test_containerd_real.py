"""driverd's containerd configuration, loaded by the real containerd 1.6 (bookworm) and 2.1.

Each case: the user's config (fixture) -> `driverd.runtime.configure` -> `containerd config dump`
must show the nvidia handler with inherited options *and* every runtime/setting the user had;
a private containerd must load the CRI plugin (`ctr plugins ls`: ok); revert restores the bytes.
"""
from __future__ import annotations

import pytest

from driverd.root import Root
from driverd.runtime import Options, configure, revert
from driverd.runtime.containerd import dropin_path
from tests.runtime.conftest import fixture_text, make_host, runtimes_of, snapshot

pytestmark = [pytest.mark.real, pytest.mark.slow]
BIN = "/usr/bin/nvidia-container-runtime"
CFG = "/etc/containerd/config.toml"


def _opts(**kw) -> Options:
    return Options(**{"restart": "none", **kw})


def _assert_cri_ok(ctd) -> None:
    status, log = ctd.plugins()
    assert status, f"no CRI plugin listed; log:\n{log[-3000:]}"
    assert all(s == "ok" for s in status.values()), f"CRI plugin not ok: {status}\n{log[-3000:]}"


def _handler(dump: dict, name: str = "nvidia") -> dict:
    return runtimes_of(dump, dump["version"])[name]


def _setup(containerd_env, version, files, binv):
    ctd, host, tmp = containerd_env(version)
    files = {hp: fixture_text(name, tmp) for hp, name in files.items()}
    make_host(host, files, {"/usr/bin/containerd": binv, BIN: ""})
    return ctd, host, tmp


@pytest.mark.parametrize("fixture,version", [("v1.toml", 1), ("v2.toml", 2)])
def test_containerd_16_in_place_keeps_everything(containerd_env, fixture, version):
    files = {CFG: fixture}
    if version == 2:
        files["/etc/containerd/conf.d/10-site.toml"] = "v2-conf.d-10-site.toml"
    ctd, host, _ = _setup(containerd_env, "1.6", files, "1.6.20~ds1")
    before = snapshot(host)
    before_dump = ctd.dump()
    rep = configure(Root(host), "containerd", _opts(set_as_default=True))
    assert rep.files_changed == [CFG], rep          # in place: no drop-in under 1.6 rules
    assert not (host / "etc/containerd/conf.d/99-driverd-nvidia.toml").exists()
    text = (host / "etc/containerd/config.toml").read_text()
    assert "# the user's pause image" in text or "# runc with the systemd cgroup driver" in text
    dump = ctd.dump()
    nv = _handler(dump)
    assert nv["options"]["BinaryName"] == BIN and nv["options"]["SystemdCgroup"] is True
    assert nv["runtime_type"] == "io.containerd.runc.v2"
    cri = dump["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    assert cri["sandbox_image"] == before_dump["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"]
    assert set(runtimes_of(before_dump, 2)) | {"nvidia"} == set(runtimes_of(dump, 2))
    assert runtimes_of(dump, 2)["runc"]["options"]["SystemdCgroup"] is True
    _assert_cri_ok(ctd)
    # idempotent: a second run changes nothing and restarts nothing
    again = configure(Root(host), "containerd", _opts(set_as_default=True, restart="systemd"))
    assert again.files_changed == [] and not again.restarted and again.skipped
    rev = revert(Root(host), "containerd", _opts())
    assert rev.files_changed == [CFG]
    assert snapshot(host) == before                  # byte-identical


def test_containerd_16_edits_the_import_that_owns_the_cri_table(containerd_env):
    ctd, host, _ = _setup(containerd_env, "1.6", {
        CFG: "v2-import-owner.toml", "/etc/containerd/conf.d/20-cri.toml": "v2-import-owner-conf.d-20-cri.toml"},
        "1.6.20")
    before = snapshot(host)
    rep = configure(Root(host), "containerd", _opts())
    assert rep.files_changed == ["/etc/containerd/conf.d/20-cri.toml"]
    dump = ctd.dump()
    rts = runtimes_of(dump, 2)
    assert {"crun", "gvisor", "nvidia"} <= set(rts)
    # derived from the default runtime (crun): its options are inherited, BinaryName replaced
    assert rts["nvidia"]["options"]["SystemdCgroup"] is True and rts["nvidia"]["options"]["BinaryName"] == BIN
    assert dump["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"] == "example.com/pause:from-import"
    _assert_cri_ok(ctd)
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


def test_containerd_16_user_without_runc_keeps_a_loadable_cri(containerd_env):
    ctd, host, _ = _setup(containerd_env, "1.6", {CFG: "v2-norunc.toml"}, "1.6.20")
    configure(Root(host), "containerd", _opts())
    dump = ctd.dump()
    rts = runtimes_of(dump, 2)
    assert {"runc", "nvidia"} <= set(rts)
    assert dump["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["snapshotter"] == "overlayfs"
    _assert_cri_ok(ctd)


def test_containerd_16_naive_dropin_breaks_what_driverd_avoids(containerd_env):
    """The fact behind the in-place choice: 1.6 replaces the CRI table from an import."""
    ctd, host, tmp = _setup(containerd_env, "1.6", {CFG: "v2.toml"}, "1.6.20")
    (host / "etc/containerd/conf.d").mkdir(parents=True, exist_ok=True)
    (host / "etc/containerd/conf.d/nvidia.toml").write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        '  runtime_type = "io.containerd.runc.v2"\n')
    rts = runtimes_of(ctd.dump(), 2)
    assert "nvidia" in rts and "kata" not in rts and "runc" not in rts
    status, _ = ctd.plugins()
    assert status.get("io.containerd.grpc.v1 cri") == "error"


@pytest.mark.parametrize("fixture", ["v3.toml", "v3-norunc.toml"])
def test_containerd_21_v3_dropin(containerd_env, fixture):
    files = {CFG: fixture}
    if fixture == "v3.toml":
        files["/etc/containerd/site/10-gc.toml"] = "v3-site-10-gc.toml"
    ctd, host, _ = _setup(containerd_env, "2.1", files, "2.1.9")
    before = snapshot(host)
    before_dump = ctd.dump()
    rep = configure(Root(host), "containerd", _opts(cdi=False, set_as_default=True))
    drop = dropin_path(CFG, "nvidia")
    if fixture == "v3.toml":
        assert rep.files_changed == [CFG, drop]           # imports entry appended, drop-in written
        text = (host / "etc/containerd/config.toml").read_text()
        assert '"/etc/containerd/site/*.toml"' in text and "# containerd 2.x config (version 3)" in text
    else:
        assert rep.files_changed == [drop]                # conf.d/*.toml already imported
    dump = ctd.dump()
    rts = runtimes_of(dump, 3)
    assert set(runtimes_of(before_dump, 3)) | {"nvidia"} == set(rts)
    assert rts["nvidia"]["options"]["BinaryName"] == BIN
    if fixture == "v3.toml":
        assert rts["nvidia"]["options"]["SystemdCgroup"] is True
        assert dump["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == "example.com/pause:v3-fixture"
        assert dump["plugins"]["io.containerd.gc.v1.scheduler"]["pause_threshold"] == 0.03
    assert dump["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["default_runtime_name"] == "nvidia"
    _assert_cri_ok(ctd)
    assert configure(Root(host), "containerd", _opts(set_as_default=True)).files_changed == []
    revert(Root(host), "containerd", _opts())
    assert snapshot(host) == before


def test_containerd_21_reads_v2_edited_in_place(containerd_env):
    ctd, host, _ = _setup(containerd_env, "2.1", {
        CFG: "v2.toml", "/proc/driver/nvidia/gpus/0000:17:00.0/information": "gpu-information.txt"}, "2.1.9")
    (host / "dev").mkdir()
    (host / "dev/nvidia0").touch()
    (host / "dev/nvidiactl").touch()
    rep = configure(Root(host), "containerd", _opts(cdi=True))
    assert "/var/run/cdi/nvidia.yaml" in rep.files_changed
    dump = ctd.dump()
    rts = runtimes_of(dump, 3)
    assert {"runc", "kata", "nvidia"} <= set(rts) and rts["nvidia"]["options"]["SystemdCgroup"] is True
    assert dump["plugins"]["io.containerd.cri.v1.runtime"]["enable_cdi"] is True
    _assert_cri_ok(ctd)


@pytest.mark.parametrize("version", ["1.6", "2.1"])
def test_k3s_template_renders_to_a_loadable_config(containerd_env, version):
    tmpl = "/var/lib/rancher/k3s/agent/etc/containerd/config.toml.tmpl"
    # k3s renders config.toml next to the template at every start; driverd reads runc's options there.
    ctd, host, tmp = _setup(containerd_env, version, {tmpl: "k3s-config.toml.tmpl",
                                                      tmpl[:-5]: "k3s-base-v2.toml"}, "1.7.11-k3s1")
    original = (host / tmpl.lstrip("/")).read_text()
    rep = configure(Root(host), "containerd", _opts(config_path=tmpl))
    text = (host / tmpl.lstrip("/")).read_text()
    assert rep.files_changed == [tmpl] and text.startswith(original)   # template syntax untouched
    # What k3s would render: its base config in place of {{ template "base" . }}, directives dropped.
    base = fixture_text("containerd/k3s-base-v2.toml", tmp)
    rendered = "\n".join(base if "template \"base\"" in ln else ln for ln in text.splitlines() if
                         "{{" not in ln or "template \"base\"" in ln)
    (host / "etc/containerd/config.toml").write_text(rendered)
    dump = ctd.dump()
    rts = runtimes_of(dump, dump["version"])
    assert {"runc", "wasm", "nvidia"} <= set(rts)
    assert rts["nvidia"]["options"] == {**rts["nvidia"]["options"], "BinaryName": BIN, "SystemdCgroup": True}
    _assert_cri_ok(ctd)
    revert(Root(host), "containerd", _opts(config_path=tmpl))
    assert (host / tmpl.lstrip("/")).read_text() == original
