"""Signer preflight with real signatures: modules signed by the kernel's own sign-file with two test
keys, a simulated host whose /proc/keys (the kernel's format) lists one of them. The plan passes for
that package, blocks the other naming its key and the enrol command, and the simulated kernel refuses
the other and the unsigned one the way the real kernel does. The module signature parser agrees with
kmod's modinfo, and reads what modinfo cannot (a signature naming its key by SKID: sign-file -k)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from driverd.errors import ModuleError, PackageError
from driverd.host.keyrings import read_keyrings
from tests.kmodtools import kmod_modinfo
from driverd.install import modules as inst
from driverd.package.modsig import read_certificates, read_signature, signature_of_bytes
from driverd.repo.index import write_index
from driverd.build.signers import package_signatures
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim import fakemod, keys
from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import HostSpec, h100, write_host
from driverd.sim.kernel import SimKernel
from tests.conftest import require_binary, run_cli

REL = "6.1.0-47-cloud-amd64"
pytestmark = pytest.mark.real


def _signer(d: Path, cn: str) -> fakemod.Signer:
    sf = fakemod.find_sign_file()
    if not sf:
        require_binary("sign-file", "/usr/lib/linux-kbuild-6.1/scripts/sign-file")
    require_binary("openssl")
    key, cert = fakemod.make_signing_key(d, cn)
    return fakemod.Signer(key, cert, sf)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("signers")
    a, b = _signer(base / "a", "driverd test key A"), _signer(base / "b", "driverd test key B")
    pk = {"A": make_fake_package(base / "pA", "550.127.05", REL, signer=a),
          "B": make_fake_package(base / "pB", "550.127.05", REL, signer=b),
          "U": make_fake_package(base / "pU", "550.127.05", REL)}
    return {"a": a, "b": b, "pk": pk, "base": base}


def _host(tmp_path: Path, world, enrolled=("a",), **kw) -> Path:
    spec = HostSpec(release=REL, sig_enforce=True, pci=[h100("0000:1b:00.0")],
                    keyrings={".machine": [str(world[s].cert) for s in enrolled]}, **kw)
    return write_host(tmp_path / "host", spec)


def _cache(host: Path, pkg) -> None:
    c = host / "var/cache/driverd/packages"
    c.mkdir(parents=True, exist_ok=True)
    shutil.copy(pkg.path, c / pkg.path.name)


def _plan(host: Path) -> tuple[int, dict, str]:
    # a repository is configured: the plan is judged on the signers, not on "nothing can provide it"
    r = run_cli("plan", "--root", str(host), "--driver", "550.127.05", "--flavor", "open", "--json",
                env={"DRIVERD_PACKAGES_REPOSITORIES": "file:///srv/driverd"})
    return r.returncode, json.loads(r.stdout), r.stderr


# -- the signature trailer ---------------------------------------------------------------------------

def test_parser_agrees_with_modinfo(world, kmod_tools):
    mods = [p for p in world["pk"]["A"].manifest.module_files]
    tmp = world["base"] / "unpacked"
    if not tmp.exists():
        from driverd.package.archive import unpack
        unpack(world["pk"]["A"].path, tmp)
    paths = [tmp / f.path for f in mods]
    tool = kmod_modinfo(paths)
    for p in paths:
        sig = read_signature(p)
        [s] = sig.signers
        fields = tool[str(p.resolve())]
        assert sig.signed and sig.id_type == "PKCS#7" == fields["sig_id"][0]
        assert s.signer == fields["signer"][0] == "driverd test key A"
        assert s.serial == fields["sig_key"][0].replace(":", "").lower().rjust(len(s.serial), "0")
        assert s.hash_algo == fields["sig_hashalgo"][0] == "sha256"
    [cert] = read_certificates(world["a"].cert)
    assert cert.serial == s.serial and cert.subject == "driverd test key A" and cert.self_signed


def test_skid_signature_that_modinfo_cannot_name(world, tmp_path):
    """sign-file -k names the key by its subjectKeyIdentifier; kmod's modinfo then shows no signer."""
    b = fakemod.write_nvidia_build(tmp_path / "b")
    ko = b.modules[0]
    subprocess.run([world["a"].sign_file, "-k", "sha512", str(world["a"].key), str(world["a"].cert), str(ko)],
                   check=True, capture_output=True)
    [s] = read_signature(ko).signers
    [cert] = read_certificates(world["a"].cert)
    assert s.skid == cert.skid and s.serial is None and s.hash_algo == "sha512"
    assert not read_signature(b.modules[1]).signed


def test_damaged_trailer_is_reported_not_trusted():
    sig = signature_of_bytes("x.ko", b"\x7fELF" + b"\0" * 64 + b"\0\0\x02\0\0\0\0\0\xff\xff\xff\xff"
                             + b"~Module signature appended~\n")
    assert sig.signed and sig.error and not sig.signers


# -- the plan ----------------------------------------------------------------------------------------

def test_simulated_proc_keys_is_the_kernels_format(world, tmp_path):
    host = _host(tmp_path, world)
    text = (host / "proc/keys").read_text()
    line = next(ln for ln in text.splitlines() if "driverd test key A" in ln)
    [cert] = read_certificates(world["a"].cert)
    assert line.endswith(f"asymmetri driverd test key A: {cert.skid}: X509.rsa {cert.skid[-8:]} []")
    assert " I------     1 perm 1f030000     0     0 " in line          # as Linux 6.18 prints it (live H100 host)
    k = read_keyrings(Root(str(host)))
    [key] = [x for x in k.keys if x.name == "driverd test key A"]
    assert key.key_id == cert.skid and set(key.keyrings) == {".machine", ".secondary_trusted_keys"}


def test_plan_passes_for_the_enrolled_key_and_blocks_the_other(world, tmp_path):
    host = _host(tmp_path, world)
    _cache(host, world["pk"]["A"])
    rc, p, err = _plan(host)
    assert rc == 0 and not p["blocked_by"], (p["blocked_by"], err)
    sig = p["signatures"]
    assert sig["status"] == "accepted" and sig["enforced"] and sig["source"].startswith("cached package")
    assert "signed by 'driverd test key A' serial" in sig["summary"]
    assert "a key of that name is in .machine, .secondary_trusted_keys" in sig["summary"]
    assert {m["module"] for m in sig["modules"]} >= {"nvidia", "nvidia_uvm"}

    host2 = _host(tmp_path / "2", world)
    _cache(host2, world["pk"]["B"])
    rc, p, _ = _plan(host2)
    assert rc == 3 and len(p["blocked_by"]) == 1
    b = p["blocked_by"][0]
    assert "signed by 'driverd test key B'" in b and "not found in any trusted keyring" in b
    assert "Key was rejected by service" in b
    assert p["signatures"]["status"] == "refused" and "mokutil --import" in p["signatures"]["enrol"]
    r = run_cli("plan", "--root", str(host2), "--driver", "550.127.05", "--flavor", "open")
    assert r.returncode == 3 and "BLOCKED" in r.stdout and "fix: enrol" in r.stdout


def test_plan_blocks_unsigned_and_says_not_checked_without_a_package(world, tmp_path):
    host = _host(tmp_path, world)
    rc, p, _ = _plan(host)
    assert rc == 0 and p["signatures"]["status"] == "not-checked"          # nothing to judge yet: no block
    _cache(host, world["pk"]["U"])
    rc, p, _ = _plan(host)
    assert rc == 3 and "unsigned" in p["blocked_by"][0] and "Loading of unsigned module is rejected" in p["blocked_by"][0]


def test_declared_certificate_when_the_keyrings_cannot_be_read(world, tmp_path):
    """No /proc/keys (an unprivileged reader): the operator's signing.trusted_certs decide, read under --root."""
    host = write_host(tmp_path / "host", HostSpec(release=REL, sig_enforce=True, pci=[h100("0000:1b:00.0")]))
    _cache(host, world["pk"]["A"])
    rc, p, _ = _plan(host)
    assert rc == 0 and p["signatures"]["status"] == "unknown"          # cannot tell: warned, not blocked
    assert "cannot tell" in p["signatures"]["summary"]
    (host / "etc/driverd").mkdir(parents=True)
    shutil.copy(world["a"].cert, host / "etc/driverd/mok-a.pem")
    (host / "etc/driverd/config.toml").write_text('[signing]\ntrusted_certs = ["/etc/driverd/mok-a.pem"]\n')
    rc, p, _ = _plan(host)
    assert rc == 0 and p["signatures"]["status"] == "accepted"
    assert "matches the declared certificate" in p["signatures"]["summary"]


def test_local_signing_then_enrolment_flow(world, tmp_path):
    """A node that builds its own packages signs with signing.key/cert: the plan judges that
    certificate before any build; after `mokutil --import` and the reboot (the key in .machine), it passes."""
    host = _host(tmp_path, world, enrolled=())
    (host / "etc/driverd").mkdir(parents=True)
    shutil.copy(world["b"].key, host / "etc/driverd/mok.key")
    shutil.copy(world["b"].cert, host / "etc/driverd/mok.pem")
    (host / "etc/driverd/config.toml").write_text('[signing]\nkey = "/etc/driverd/mok.key"\n'
                                                  'cert = "/etc/driverd/mok.pem"\n')
    rc, p, _ = _plan(host)
    assert rc == 3 and p["signatures"]["source"].startswith("a local build signed with signing.cert")
    assert "mokutil --import mok.der" in p["signatures"]["enrol"] and "/etc/driverd/mok.pem" in p["signatures"]["enrol"]
    keys.setup(host, {".machine": [str(world["b"].cert)]})           # enrolled, rebooted
    rc, p, _ = _plan(host)
    assert rc == 0 and p["signatures"]["status"] == "accepted"


# -- install and the simulated kernel --------------------------------------------------------------

def test_install_refuses_the_untrusted_signer_before_writing(world, tmp_path, kmod_tools):
    host = _host(tmp_path, world)
    with pytest.raises(PackageError) as e:
        inst.install(Root(str(host)), world["pk"]["B"].path, Runner())
    assert "driverd test key B" in e.value.message and "not found in any trusted keyring" in e.value.message
    assert "mokutil" in (e.value.fix or "") or "trusted keyrings" in (e.value.fix or "")
    assert not (host / f"lib/modules/{REL}/updates").exists()
    rep = inst.install(Root(str(host)), world["pk"]["A"].path, Runner())
    assert rep.changed


@pytest.mark.parametrize("which,log", [("B", "Loading of module with unavailable key is rejected"),
                                       ("U", "Loading of unsigned module is rejected")])
def test_simulated_kernel_refuses_like_the_real_one(world, tmp_path, kmod_tools, which, log):
    host = _host(tmp_path, world)
    root = Root(str(host))
    inst.install(root, world["pk"][which].path, Runner(), enforce=False)      # past driverd's own preflight
    k = SimKernel(root)
    with pytest.raises(ModuleError) as e:
        k.load("nvidia")
    assert "Key was rejected by service" in e.value.message and log in "\n".join(e.value.details["kernel_log"])
    assert "nvidia" not in k.modules()


def test_simulated_kernel_loads_the_enrolled_signer_untainted(world, tmp_path, kmod_tools):
    host = _host(tmp_path, world)
    root = Root(str(host))
    inst.install(root, world["pk"]["A"].path, Runner())
    k = SimKernel(root)
    k.load("nvidia")
    assert (host / "sys/module/nvidia/taint").read_text().strip() == "O"


def test_apply_stops_before_unload_for_an_untrusted_signer(world, tmp_path, kmod_tools):
    """apply with the other key's package in the repository: refused with one line, nothing loaded changed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(world["pk"]["B"].path, repo)
    write_index(repo)
    host = _host(tmp_path, world)
    (host / "etc/driverd").mkdir(parents=True)
    (host / "etc/driverd/config.toml").write_text(
        f'[driver]\nversion = "550.127.05"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
        '[runtime]\nruntimes = ["none"]\n')
    r = run_cli("apply", "--root", str(host))
    assert r.returncode == 3, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("driverd: error")]
    assert len(err) == 1 and "driverd test key B" in err[0], r.stderr
    assert "nvidia" not in (host / "proc/modules").read_text()


def test_package_signatures_reads_the_archive(world):
    sigs = package_signatures(world["pk"]["U"].path)
    assert sigs and not any(s.signed for s in sigs)
    assert all(s.signers[0].signer == "driverd test key B" for s in package_signatures(world["pk"]["B"].path))
