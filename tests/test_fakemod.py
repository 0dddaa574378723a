"""The simulated .ko files must be accepted by the real kmod tools exactly like compiled modules."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from driverd.package.archive import read_manifest, unpack
from driverd.package.modfields import modinfo
from driverd.sim import fakemod
from driverd.sim.fakepkg import make_fake_package
from tests.conftest import require_binary
from tests.kmodtools import kmod_modinfo, kmod_sig_key, parse_modinfo

REL = "6.1.0-47-cloud-amd64"
pytestmark = pytest.mark.real


def _tools():
    return (require_binary("modinfo", "/usr/sbin/modinfo", "/sbin/modinfo"),
            require_binary("depmod", "/usr/sbin/depmod", "/sbin/depmod"),
            require_binary("modprobe", "/usr/sbin/modprobe", "/sbin/modprobe"))


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    if not shutil.which("openssl") or not fakemod.find_sign_file():
        require_binary("sign-file", *fakemod.SIGN_FILE_CANDIDATES)
    s = fakemod.test_signer(tmp_path_factory.mktemp("key"))
    assert s is not None
    return s


def _install_tree(tmp_path, build):
    d = tmp_path / "root" / "lib" / "modules" / REL / "updates" / "driverd"
    d.mkdir(parents=True)
    for m in build.modules:
        shutil.copy(m, d)
    return tmp_path / "root"


def test_modinfo_reads_every_field(tmp_path):
    mi, _, _ = _tools()
    mod = fakemod.FakeModule("nvidia_uvm", version="550.127.05", vermagic="6.12.9 SMP mod_unload ",
                             depends=("nvidia",), params=(("uvm_x", "int", "An int"),),
                             firmware=("nvidia/550.127.05/gsp_ga10x.bin",), srcversion="ABCDEF0123456789ABCDEF0")
    p = fakemod.write_module(mod, tmp_path)
    assert p.name == "nvidia-uvm.ko"
    out = subprocess.run([mi, "-0", str(p)], capture_output=True, text=True, check=True).stdout
    f = parse_modinfo(out)[0]
    assert f["name"] == ["nvidia_uvm"] and f["version"] == ["550.127.05"]
    assert f["vermagic"] == ["6.12.9 SMP mod_unload"]
    assert f["srcversion"] == ["ABCDEF0123456789ABCDEF0"] and f["depends"] == ["nvidia"]
    assert f["firmware"] == ["nvidia/550.127.05/gsp_ga10x.bin"]
    assert f["parm"] == ["uvm_x:An int (int)"]
    # modinfo -F prints single fields: the same interface scripts use
    assert subprocess.run([mi, "-F", "vermagic", str(p)], capture_output=True, text=True).stdout.strip() \
        == "6.12.9 SMP mod_unload"


def test_depmod_computes_dependencies_from_symbols(tmp_path):
    _, dm, mp = _tools()
    build = fakemod.write_nvidia_build(tmp_path / "b")
    root = _install_tree(tmp_path, build)
    subprocess.run([dm, "-b", str(root), REL], check=True, capture_output=True)
    dep = (root / "lib/modules" / REL / "modules.dep").read_text()
    assert "updates/driverd/nvidia-uvm.ko: updates/driverd/nvidia.ko" in dep
    assert "updates/driverd/nvidia-drm.ko: updates/driverd/nvidia-modeset.ko updates/driverd/nvidia.ko" in dep
    out = subprocess.run([mp, "-d", str(root), "-S", REL, "--show-depends", "nvidia_uvm"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [ln.rsplit("/", 1)[-1].strip() for ln in out] == ["nvidia.ko", "nvidia-uvm.ko"]
    out = subprocess.run([mp, "-d", str(root), "-S", REL, "--show-depends", "nvidia-drm"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert [ln.rsplit("/", 1)[-1].strip() for ln in out] == ["nvidia.ko", "nvidia-modeset.ko", "nvidia-drm.ko"]
    # the exported symbols are in modules.symbols, as for a compiled module
    syms = (root / "lib/modules" / REL / "modules.symbols").read_text()
    assert "alias symbol:nvidia_p2p_get_pages nvidia" in syms


def test_module_without_its_exporter_has_no_dependency(tmp_path):
    """Negative control: drop nvidia.ko and nvidia_uvm's link to it disappears."""
    _, dm, _ = _tools()
    build = fakemod.write_nvidia_build(tmp_path / "b")
    build.modules = [m for m in build.modules if m.name != "nvidia.ko"]
    root = _install_tree(tmp_path, build)
    subprocess.run([dm, "-b", str(root), REL], check=True, capture_output=True)
    dep = (root / "lib/modules" / REL / "modules.dep").read_text()
    assert "updates/driverd/nvidia-uvm.ko:\n" in dep


def test_signed_modules_show_signer(tmp_path, signer):
    build = fakemod.write_nvidia_build(tmp_path / "b", sign=signer)
    info = kmod_modinfo(build.modules)
    assert modinfo(build.modules).keys() == info.keys()
    for fields in info.values():
        assert fields["signer"] == ["driverd test signing key"]
        assert fields["sig_hashalgo"] == ["sha256"]
        assert fields["sig_key"] == [kmod_sig_key(signer.cert)]
    raw = build.modules[0].read_bytes()
    assert raw.endswith(b"~Module signature appended~\n")


def test_fake_package_roundtrip(tmp_path, signer):
    _tools()
    ref = make_fake_package(tmp_path / "out", signer=signer)
    assert ref.path.name.endswith(f".{ref.sha256}.tar.zst")
    m = read_manifest(ref.path)
    assert m.driver_version == "535.261.03" and m.kernel_release == REL and m.signed
    assert {x.name for x in m.modules} == {"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem"}
    uvm = next(x for x in m.modules if x.name == "nvidia_uvm")
    assert uvm.depends == ("nvidia",) and uvm.vermagic.startswith(REL + " ")
    assert len(m.firmware_files) == 2
    nv = next(x for x in m.modules if x.name == "nvidia")
    assert nv.firmware == ("nvidia/535.261.03/gsp_ga10x.bin", "nvidia/535.261.03/gsp_tu10x.bin")
    m2 = unpack(ref.path, tmp_path / "u")
    assert m2 == m
    assert (tmp_path / "u/modules/nvidia.ko").stat().st_size == m.file("modules/nvidia.ko").size
    # deterministic: the same unsigned inputs give the same package identity
    a = make_fake_package(tmp_path / "d1")
    b = make_fake_package(tmp_path / "d2")
    assert a.sha256 == b.sha256
