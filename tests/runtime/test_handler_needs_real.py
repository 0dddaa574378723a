"""What driverd says of containerd's CDI, checked against the real containerd 1.6 (bookworm) and 2.1:
the value of enable_cdi and cdi_spec_dirs that `containerd config dump` shows for a configuration must
be what detect reports for the same files and version (2.1), and 1.6 must have no CDI at all."""
from __future__ import annotations

import subprocess

import pytest

from driverd.root import Root
from driverd.runtime import registry
from tests.runtime.conftest import RT, fixture_text, make_host

pytestmark = [pytest.mark.real, pytest.mark.slow]
CFG = "/etc/containerd/config.toml"
NEEDS = RT / "needs"
V2_OFF = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = false\n  cdi_spec_dirs = ["/etc/cdi"]\n'


def _source(src: str, tmp: str) -> str:
    """Inline TOML, a file of tests/fixtures/runtime/needs ("needs/NAME"), or a containerd fixture."""
    if "\n" in src:
        return src
    if src.startswith("needs/"):
        return (NEEDS / src.removeprefix("needs/")).read_text()
    return fixture_text(src, tmp)


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    return out.split()[2]                       # "containerd <module> 2.1.9+unknown <rev>"


def _cdi(host, binary: str):
    make_host(host, {}, {"/usr/bin/containerd": _version(binary)})
    (rt,) = [f for f in registry.detect_all(Root(host)) if f.name == "containerd"]
    return rt.needs.cdi


def test_containerd_16_has_no_cdi_setting_and_driverd_says_so(containerd_env):
    ctd, host, _ = containerd_env("1.6")
    default = subprocess.run([ctd.binary, "config", "default"], capture_output=True, text=True, timeout=60)
    assert default.returncode == 0 and "cdi" not in default.stdout     # no enable_cdi, no cdi_spec_dirs
    (host / "etc/containerd/config.toml").write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n')
    dump = ctd.dump()
    assert "enable_cdi" not in dump["plugins"]["io.containerd.grpc.v1.cri"]    # the key is dropped unread
    c = _cdi(host, ctd.binary)
    assert (c.supported, c.enabled) == (False, False)
    assert c.evidence == "containerd 1.6 has no CDI support; it came with containerd 1.7"


@pytest.mark.parametrize("files", [
    {CFG: "v3.toml"},                                                          # not set: 2.x's default
    {CFG: "v3.toml", "/etc/containerd/site/50-cdi.toml": "needs/containerd-v3-cdi-off-site.toml"},   # an import
    {CFG: V2_OFF},                                                             # a version 2 file, migrated
    {CFG: "v2.toml"},
], ids=["v3-default", "v3-import-off", "v2-off", "v2-default"])
def test_containerd_21_enable_cdi_as_config_dump_shows_it(containerd_env, files):
    ctd, host, tmp = containerd_env("2.1")
    for hp, src in files.items():
        p = host / hp.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(_source(src, tmp))
    cri = ctd.dump()["plugins"]["io.containerd.cri.v1.runtime"]
    c = _cdi(host, ctd.binary)
    assert c.supported is True
    assert (c.enabled, list(c.spec_dirs)) == (cri["enable_cdi"], cri["cdi_spec_dirs"])
    if files == {CFG: "v3.toml"}:
        assert cri["enable_cdi"] is True and c.evidence == "enable_cdi is not set: on by default since containerd 2.0"
