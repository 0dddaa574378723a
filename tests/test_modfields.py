"""A module's modinfo read from the file itself (driverd.package.modfields) gives kmod's `modinfo`
fields: compared with the real kmod 30 on real ELF modules — unsigned, signed by the kernel's own
sign-file (issuer+serial and SKID), compressed with xz and zstd, and with the parameter layouts
kmod rewrites."""
from __future__ import annotations

import lzma
import shutil
import subprocess
from pathlib import Path

import pytest

from driverd.errors import PackageError
from driverd.package.modfields import first, module_fields, modinfo
from driverd.sim import fakemod
from tests.conftest import CI_PREFIX, require_binary
from tests.kmodtools import kmod_modinfo, kmod_sig_key

pytestmark = pytest.mark.real


def _sign_file() -> str:
    require_binary("openssl")
    return fakemod.find_sign_file() or require_binary("sign-file")


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    s = fakemod.test_signer(tmp_path_factory.mktemp("key"))
    if s is None:
        _sign_file()
    return s


def _org_signer(d: Path, serial: str = "0x8a5b2c3d4e5f60718293a4b5c6d7e8f9") -> tuple[Path, Path]:
    """A certificate whose O differs from its CN (the kernel calls it 'O: CN'; kmod shows the CN) and
    whose serial has its top bit set (DER adds a 00 byte; kmod prints the number's own bytes)."""
    key, cert = d / "k.pem", d / "c.pem"
    subprocess.run(["openssl", "req", "-new", "-nodes", "-utf8", "-sha256", "-days", "3650", "-batch", "-x509",
                    "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert), "-set_serial",
                    serial, "-subj", "/O=Example Builders/CN=fleet module key"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def _compare(paths, ignore_sig: bool = False):
    tool = kmod_modinfo(paths)
    ours = modinfo(paths)
    assert set(ours) == set(tool)
    for p, t in tool.items():
        t = {k: v for k, v in t.items() if k != "signature"}      # the hex dump: not reproduced
        o = ours[p]
        if ignore_sig:
            o = {k: v for k, v in o.items() if not k.startswith("sig")}
        assert o == t, p
        assert list(o) == list(t), p                              # kmod's field order too
    return ours, tool


def test_unsigned_build_matches_kmod(tmp_path):
    b = fakemod.write_nvidia_build(tmp_path / "b")
    ours, _ = _compare(b.modules)
    nv = ours[str(b.modules[0].resolve())]
    assert first(nv, "name") == "nvidia" and first(nv, "vermagic").endswith("modversions")
    assert nv["firmware"] == ["nvidia/535.261.03/gsp_ga10x.bin", "nvidia/535.261.03/gsp_tu10x.bin"]
    assert "sig_id" not in nv and nv["depends"] == [""]
    uvm = ours[str(b.modules[1].resolve())]
    assert uvm["depends"] == ["nvidia"] and uvm["parm"] == ["uvm_perf_prefetch_enable:Enable prefetching (uint)"]


def test_parameter_layouts_and_repeated_fields_match_kmod(tmp_path):
    m = fakemod.FakeModule("zz", version="1", vermagic="6.1.0 SMP ",
                           params=(("b_p", "int", "B desc"), ("a_p", "charp", "A: has a colon"), ("e_p", "bool", "")),
                           extra_modinfo=(("parmtype", "only_type:uint"), ("parm", "only_desc:D only"),
                                          ("parm", "b_p:a later description"), ("alias", "pci:v000010DEd*"),
                                          ("alias", "x"), ("license", "GPL"), ("import_ns", "DMA_BUF")))
    p = fakemod.write_module(m, tmp_path)
    ours, _ = _compare([p])
    f = ours[str(p.resolve())]
    assert f["alias"] == ["pci:v000010DEd*", "x"] and f["license"] == ["Dual MIT/GPL", "GPL"]
    assert f["parm"][0] == "only_desc:D only" and f["parm"][-1] == "b_p:a later description (int)"


def test_signed_modules_match_kmod(tmp_path, signer):
    b = fakemod.write_nvidia_build(tmp_path / "b", sign=signer)
    ours, _ = _compare(b.modules)
    for f in ours.values():
        assert f["sig_id"] == ["PKCS#7"] and f["signer"] == ["driverd test signing key"]
        assert f["sig_hashalgo"] == ["sha256"] and f["sig_key"] == [kmod_sig_key(signer.cert)]


def test_signer_is_the_issuer_cn_and_sig_key_the_serial_number(tmp_path):
    sf = _sign_file()
    key, cert = _org_signer(tmp_path)
    b = fakemod.write_nvidia_build(tmp_path / "b")
    for p in b.modules[:2]:
        subprocess.run([sf, "sha512", str(key), str(cert), str(p)], check=True, capture_output=True)
    ours, _ = _compare(b.modules[:2])
    f = ours[str(b.modules[0].resolve())]
    assert f["signer"] == ["fleet module key"] and f["sig_hashalgo"] == ["sha512"]
    assert f["sig_key"] == ["8A:5B:2C:3D:4E:5F:60:71:82:93:A4:B5:C6:D7:E8:F9"]


def test_a_serial_whose_first_random_byte_is_zero_prints_19_bytes_as_kmod_does(tmp_path):
    """openssl draws 20 random bytes for a serial; one key in 256 starts with 00, which the DER integer
    (and so kmod) drops: the key id then has 19 bytes. The reader must print what kmod prints."""
    sf = _sign_file()
    key, cert = _org_signer(tmp_path, serial="0x00" + "5b" * 19)
    b = fakemod.write_nvidia_build(tmp_path / "b")
    subprocess.run([sf, "sha256", str(key), str(cert), str(b.modules[0])], check=True, capture_output=True)
    ours, _ = _compare(b.modules[:1])
    assert ours[str(b.modules[0].resolve())]["sig_key"] == [":".join(["5B"] * 19)] == [kmod_sig_key(cert)]


def test_compressed_modules_match_kmod(tmp_path, signer):
    zstd = pytest.importorskip("zstandard")
    b = fakemod.write_nvidia_build(tmp_path / "b", sign=signer)
    out = []
    for p in b.modules[:3]:
        xz = p.with_name(p.name + ".xz")
        # kmod reads xz with CRC32 checks (as the kernel's build compresses them)
        xz.write_bytes(lzma.compress(p.read_bytes(), check=lzma.CHECK_CRC32))
        zs = p.with_name(p.name.removesuffix(".ko") + "-z.ko.zst")
        zs.write_bytes(zstd.ZstdCompressor().compress(p.read_bytes()))
        out += [xz, zs]
    ours, _ = _compare(out)
    assert all(f["signer"] == ["driverd test signing key"] for f in ours.values())


def test_skid_signature_is_shown_where_kmod_shows_none(tmp_path):
    """sign-file -k names the key by its subjectKeyIdentifier: kmod then prints no signature fields;
    the file reader names the key (the one deliberate difference, see modfields' docstring)."""
    sf = _sign_file()
    key, cert = _org_signer(tmp_path)
    b = fakemod.write_nvidia_build(tmp_path / "b")
    p = b.modules[0]
    subprocess.run([sf, "-k", "sha256", str(key), str(cert), str(p)], check=True, capture_output=True)
    ours, tool = _compare([p], ignore_sig=True)
    t, o = tool[str(p.resolve())], ours[str(p.resolve())]
    assert not any(k.startswith("sig") for k in t)
    from driverd.package.modsig import read_certificates
    [c] = read_certificates(cert)
    assert o["sig_id"] == ["PKCS#7"] and "signer" not in o
    assert o["sig_key"][0].replace(":", "").lower() == c.skid


def test_damaged_files_are_one_clear_error(tmp_path):
    b = fakemod.write_nvidia_build(tmp_path / "b")
    bad = tmp_path / "bad.ko"
    bad.write_bytes(b.modules[0].read_bytes()[:40])
    with pytest.raises(PackageError, match="bad.ko is not a readable kernel module"):
        module_fields(bad)
    xz = tmp_path / "x.ko.xz"
    xz.write_bytes(b"not xz")
    with pytest.raises(PackageError, match="cannot decompress"):
        module_fields(xz)
    with pytest.raises(PackageError, match="cannot read module"):
        module_fields(tmp_path / "missing.ko")
    shutil.copy(b.modules[0], tmp_path / "ok.ko")
    assert first(module_fields(tmp_path / "ok.ko"), "version") == "535.261.03"


def _debian_modules() -> list[Path]:
    """Debian's own signed modules, where this machine has a Debian kernel image unpacked (the VM
    kernel under /opt/driverd-ci, or an installed linux-image under /lib/modules)."""
    import glob
    found = sorted(glob.glob(f"{CI_PREFIX}/kernel-*/lib/modules/*/kernel/**/*.ko", recursive=True)
                   + glob.glob("/lib/modules/*/kernel/**/*.ko", recursive=True))
    return [Path(p) for p in found]


def test_debian_signed_modules_match_kmod(tmp_path):
    """Every 25th module of a Debian kernel (about 160 of 4000: in-tree, signed by the build's key,
    aliases, multi-line parameter descriptions), and some of them compressed."""
    mods = _debian_modules()
    if not mods:
        pytest.skip("no Debian kernel modules on this machine (none under /lib/modules/*/kernel or "
                    "/opt/driverd-ci/kernel-*)")
    sample = mods[::25]
    ours, _ = _compare(sample)
    assert all(f.get("sig_id") == ["PKCS#7"] and f["signer"][0] for f in ours.values())
    assert any("\n" in p for f in ours.values() for p in f.get("parm", ())) or len(sample) < 100
    zstd = pytest.importorskip("zstandard")
    packed = []
    for i, p in enumerate(sample[:10]):
        c = tmp_path / f"{i}-{p.name}"
        if i % 2:
            c = c.with_name(c.name + ".xz")
            c.write_bytes(lzma.compress(p.read_bytes(), check=lzma.CHECK_CRC32))
        else:
            c = c.with_name(c.name + ".zst")
            c.write_bytes(zstd.ZstdCompressor().compress(p.read_bytes()))
        packed.append(c)
    _compare(packed)
