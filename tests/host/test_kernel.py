import gzip

import pytest

from driverd.host.kernel import module_unload_evidence, parse_lockdown, read_kernel
from driverd.root import Root
from driverd.sim.hosttree import EFI_GUID, HostSpec, write_host


def kernel(tmp_path, **kw):
    write_host(tmp_path, HostSpec(**kw))
    warnings = []
    return read_kernel(Root(tmp_path), warnings), warnings


def test_plain_host(tmp_path):
    k, w = kernel(tmp_path)
    assert k.release == "6.1.0-47-cloud-amd64" and k.arch == "x86_64"
    assert not k.module_signature_enforced and k.module_unload_supported
    assert k.headers_present and k.headers_path == "/usr/src/linux-headers-6.1.0-47-cloud-amd64"
    assert k.lockdown == "none" and k.secure_boot == "not-efi"
    assert k.version.startswith("Linux version 6.1.0-47-cloud-amd64")


@pytest.mark.parametrize("kw,source", [
    ({"sig_enforce": True}, "sig_enforce=Y"),
    ({"cmdline": "ro quiet module.sig_enforce=1"}, "module.sig_enforce=1"),
    ({"config": {"CONFIG_MODULES": "y", "CONFIG_MODULE_SIG_FORCE": "y"}}, "CONFIG_MODULE_SIG_FORCE=y"),
    ({"lockdown": "none [integrity] confidentiality"}, "lockdown=integrity"),
])
def test_signature_enforcement_sources(tmp_path, kw, source):
    k, _ = kernel(tmp_path, **kw)
    assert k.module_signature_enforced
    assert any(source in s for s in k.signature_enforcement_sources)


def test_config_gz_when_boot_config_missing(tmp_path):
    write_host(tmp_path, HostSpec())
    (tmp_path / "boot/config-6.1.0-47-cloud-amd64").unlink()
    (tmp_path / "proc/config.gz").write_bytes(gzip.compress(b"CONFIG_MODULE_SIG_FORCE=y\n"))
    k = read_kernel(Root(tmp_path), [])
    assert k.config_source == "/proc/config.gz" and k.module_signature_enforced


def test_secure_boot_efivar(tmp_path):
    k, _ = kernel(tmp_path, secure_boot=True)
    assert k.secure_boot == "enabled"
    (tmp_path / f"sys/firmware/efi/efivars/SecureBoot-{EFI_GUID}").write_bytes(bytes([6, 0, 0, 0, 0]))
    assert read_kernel(Root(tmp_path), []).secure_boot == "disabled"


def test_no_unload_support_from_proc_modules(tmp_path):
    k, _ = kernel(tmp_path, module_unload=False)
    assert not k.module_unload_supported
    assert "CONFIG_MODULE_UNLOAD" in k.module_unload_evidence


def test_unload_evidence_rules():
    assert module_unload_evidence("nvidia 100 - - Live 0x0 (O)\n", {}) [0] is False
    assert module_unload_evidence("nvidia 100 2 nvidia_uvm, Live 0x0 (O)\n", {})[0] is True
    assert module_unload_evidence(None, {"CONFIG_MODULE_UNLOAD": "n"})[0] is False


def test_missing_headers(tmp_path):
    k, _ = kernel(tmp_path, headers=False)
    assert not k.headers_present and k.headers_path is None


def test_dangling_headers_link(tmp_path):
    write_host(tmp_path, HostSpec())
    import shutil
    shutil.rmtree(tmp_path / "usr/src")
    assert not read_kernel(Root(tmp_path), []).headers_present


def test_lockdown_parse():
    assert parse_lockdown("[none] integrity confidentiality") == "none"
    assert parse_lockdown("none integrity [confidentiality]\n") == "confidentiality"
    assert parse_lockdown(None) is None
    assert parse_lockdown("garbage") is None


def test_empty_tree_never_crashes(tmp_path):
    w = []
    k = read_kernel(Root(tmp_path), w)
    assert k.release is None and any("release unknown" in x for x in w)


@pytest.mark.parametrize("text", [
    "CONFIG_MODULES=y\n# CONFIG_MODULE_SIG_FORCE is not set\nCONFIG_MODULE_UNLOAD=y\n",
    "# CONFIG_MODULE_UNLOAD is not set\nCONFIG_MODULE_UNLOAD=y",             # set later, no final newline
    "CONFIG_MODULE_UNLOAD=y\n# CONFIG_MODULE_UNLOAD is not set",             # unset later, no final newline
    "CONFIG_MODULES_TREE_LOOKUP=y\nCONFIG_MODULE_SIG_FORCE_X=y\n",           # longer names: not the keys
    'CONFIG_MODULES="y" \n# CONFIG_MODULES is not set\nCONFIG_MODULES=m\n',
    "",
])
def test_the_few_keys_detect_reads_are_what_the_whole_parse_says(tmp_path, text):
    """Issue 47: the kernel config's options are found by string search instead of parsing the whole
    config (~10,000 lines); for the keys asked they must be what parsing every line says."""
    from driverd.host.kernel import CONFIG_KEYS, kernel_config
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "config-6.1.0-1-amd64").write_text(text)
    whole = _whole_parse(text)
    picked, src = kernel_config(Root(tmp_path), "6.1.0-1-amd64", CONFIG_KEYS)
    assert picked == {k: whole[k] for k in CONFIG_KEYS if k in whole} and src == "/boot/config-6.1.0-1-amd64"


def test_the_few_keys_on_the_real_configs_of_this_machine():
    """The same on the real distribution configs this machine's kernel header packages carry."""
    from pathlib import Path

    from driverd.host.kernel import CONFIG_KEYS
    configs = sorted(Path("/usr/src").glob("linux-headers-*/.config"))
    if not configs:
        pytest.skip("no kernel header package with a .config here")
    for cfg in configs:
        release = cfg.parent.name.removeprefix("linux-headers-")
        whole, (picked, _) = _whole_parse(cfg.read_text()), _config_at(cfg, release, CONFIG_KEYS)
        assert picked == {k: whole[k] for k in CONFIG_KEYS if k in whole}
        assert set(picked) == set(CONFIG_KEYS), cfg
        gate = ("CONFIG_MODULE_SIG_FORCE", "CONFIG_LOCK_DOWN_IN_EFI_SECURE_BOOT")     # the reboot gate's keys
        assert _config_at(cfg, release, gate)[0] == {k: whole[k] for k in gate if k in whole}


def _whole_parse(text):
    """The reference: every line parsed, as Kconfig writes them (the last occurrence wins)."""
    opts = {}
    for line in text.splitlines():
        if line.startswith("CONFIG_") and "=" in line:
            k, _, v = line.partition("=")
            opts[k] = v.strip().strip('"')
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            opts[line[2:-len(" is not set")]] = "n"
    return opts


def _config_at(cfg, release, keys):
    from driverd.host import kernel
    text = cfg.read_text()

    class R:
        def read_text(self, path):
            return text if path == f"/boot/config-{release}" else None
    return kernel.kernel_config(R(), release, keys)
