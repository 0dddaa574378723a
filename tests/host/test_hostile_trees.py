"""Damaged and hostile host trees: detect and plan report (warnings, unknown values) or fail with
one line and exit 2/3 — never a traceback, never a hang. Tests run as root, so "unreadable" is
simulated with directories, dangling symlinks, loops and FIFOs instead of chmod 000."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driverd.errors import DriverdError
from driverd.host import collect
from driverd.host.kernel import cmdline_args, cmdline_params
from driverd.driver.ident import parse_version_file as parse_nvidia_version
from driverd.host.modules import PROC_STATES, parse_proc_modules
from driverd.host.nouveau import parse_modprobe_conf
from driverd.host.osrelease import parse_os_release
from driverd.plan import Desired, plan
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, h100, nvidia_version_line, write_host
from tests.conftest import run_cli

JUNK = bytes(range(256)) * 3 + b"\xff\xfe\x00\n\x80\x81"
ADDR = "0000:17:00.0"
PCI = f"/sys/devices/pci0000:00/{ADDR}"


def loaded_host(path: Path) -> Path:
    """A realistic host: one H100 with the 535 open driver loaded, containerd, a blacklist."""
    return write_host(path, HostSpec(
        pci=[h100(ADDR, "nvidia")], secure_boot=True,
        modules=[Module("nvidia", 56381440, 2, ("nvidia_uvm",), "OE", "535.261.03"),
                 Module("nvidia_uvm", 1519616, 0, (), "OE", "535.261.03")],
        nvidia_version_text=nvidia_version_line("535.261.03", "open"),
        modprobe_d={"/etc/modprobe.d/blacklist-nouveau.conf": "blacklist nouveau\noptions nouveau modeset=0\n"},
        files={"/etc/containerd/config.toml": 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n',
               "/usr/bin/containerd": "#!/bin/sh\n",
               f"/proc/driver/nvidia/gpus/{ADDR}/information": "GPU UUID: \t GPU-4ba22e54-1086-e7cd-2c47-046899b49032\nDevice Minor: \t 0\n"}))


def replace(root: Path, hostpath: str, *, data: bytes | None = None, kind: str = "file", target: str = "") -> None:
    p = root / hostpath.lstrip("/")
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        p.write_bytes(data or b"")
    elif kind == "dir":
        p.mkdir()
    elif kind == "link":
        os.symlink(target, p)
    elif kind == "fifo":
        os.mkfifo(p)


def checked(root: Path):
    """collect + plan must not raise anything but a DriverdError; the facts must be JSON."""
    facts = collect(Root(root), nvml=False)
    json.dumps(facts.to_json())
    try:
        p = plan(facts, Desired(driver_version="570.195.03"))
        json.dumps(p.to_json())
    except DriverdError:
        pass
    return facts


TEXT_FILES = ["/proc/modules", "/proc/cmdline", "/proc/version", "/proc/sys/kernel/osrelease",
              "/proc/sys/kernel/hostname", "/etc/os-release", "/proc/driver/nvidia/version",
              f"{PCI}/vendor", f"{PCI}/device", f"{PCI}/class", f"{PCI}/numa_node",
              f"/proc/driver/nvidia/gpus/{ADDR}/information", "/sys/module/nvidia/refcnt",
              "/sys/module/nvidia/initstate", "/sys/module/nvidia/taint", "/sys/module/nvidia/version",
              "/sys/kernel/security/lockdown", "/sys/module/module/parameters/sig_enforce",
              "/etc/modprobe.d/blacklist-nouveau.conf", "/etc/containerd/config.toml",
              "/boot/config-6.1.0-47-cloud-amd64", "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-e0a9e8d14b8c"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return loaded_host(tmp_path_factory.mktemp("pristine") / "root")


@pytest.fixture
def host(pristine, tmp_path) -> Path:
    dst = tmp_path / "root"
    shutil.copytree(pristine, dst, symlinks=True)
    return dst


@pytest.mark.parametrize("kind", ["junk", "empty", "dir", "dangling", "loop", "fifo"])
def test_every_file_damaged_the_same_way(host, kind):
    for hp in TEXT_FILES:
        if kind == "junk":
            replace(host, hp, data=JUNK)
        elif kind == "empty":
            replace(host, hp, data=b"")
        elif kind == "dir":
            replace(host, hp, kind="dir")
        elif kind == "dangling":
            replace(host, hp, kind="link", target="/nonexistent/x")
        elif kind == "loop":
            replace(host, hp, kind="link", target=hp)       # points at itself
        else:
            replace(host, hp, kind="fifo")                  # would block a plain open()
    f = checked(host)
    if kind in ("dir", "dangling", "loop", "fifo"):
        assert f.kernel.release is None and f.os.id == "unknown" and f.gpus == ()
        assert not f.driver.loaded
    if kind == "junk":
        # junk in /proc/modules and initstate is no evidence that nvidia is loaded
        assert f.gpus == () and not f.driver.loaded and f.os.id == "linux" and f.hostname is None
        assert any("garbled" in w for w in f.warnings)


def test_the_undamaged_tree_reads_back(host):
    f = checked(host)
    assert f.gpus[0].uuid and f.driver.version == "535.261.03" and f.nouveau.blacklisted


def test_pci_entry_that_is_a_regular_file_and_a_driver_link_loop(host):
    (host / "sys/bus/pci/devices/0000:99:00.0").write_text("not a device\n")
    replace(host, f"{PCI}/driver", kind="link", target="driver")
    f = checked(host)
    assert [g.pci_address for g in f.gpus] == [ADDR] and f.gpus[0].bound_driver is None
    assert any("0000:99:00.0" in w for w in f.warnings)


def test_symlink_loops_in_directories(host):
    replace(host, "/sys/module/nvidia/holders", kind="link", target="/sys/module/nvidia/holders")
    replace(host, "/lib/modules/6.1.0-47-cloud-amd64/build", kind="link", target="build")
    replace(host, "/sys/bus/pci/devices", kind="link", target="/sys/bus/pci/devices")
    replace(host, "/etc/modprobe.d", kind="link", target="../etc/modprobe.d")
    f = checked(host)
    assert f.gpus == () and not f.kernel.headers_present and not f.nouveau.blacklisted
    assert any("symlink loop" in w for w in f.warnings)


def test_non_utf8_names_and_contents(host):
    (host / "sys/module/nvidia/holders").joinpath(os.fsdecode(b"bad\xffname")).mkdir()
    (host / "etc/modprobe.d").joinpath(os.fsdecode(b"\xfe.conf")).write_bytes(b"blacklist nouveau\n")
    (host / "etc/os-release").write_bytes('ID=alpine\nPRETTY_NAME="Caf\xe9"\n'.encode("latin-1"))
    (host / "proc" / os.fsdecode(b"12\xb2")).mkdir()
    f = checked(host)
    assert f.os.id == "alpine" and "\ufffd" in f.os.pretty_name


def test_huge_files_are_bounded(host):
    with open(host / "proc/modules", "wb") as fh:
        fh.write(b"x 1 0 - Live 0x0\n" * 800_000)           # ~13 MB, read up to the 4 MiB cap
    (host / "etc/os-release").write_bytes(b"ID=" + b"a" * (6 << 20))
    f = checked(host)
    assert not f.driver.loaded or f.driver.version == "535.261.03"


def test_no_proc_at_all(host):
    shutil.rmtree(host / "proc")
    f = checked(host)
    assert f.kernel.release is None and f.gpu_users == ()
    p = plan(f, Desired(driver_version="570.195.03"))
    assert any("kernel release is unknown" in b for b in p.blocked_by)


def test_unicode_digits_and_enormous_numbers(host):
    (host / "sys/module/nvidia/refcnt").write_text("²\n")
    (host / PCI.lstrip("/") / "numa_node").write_text("9" * 6000 + "\n")
    (host / "proc/modules").write_text("nvidia ² ³ - Live 0x0 (OE)\n")
    f = checked(host)
    assert f.gpus[0].numa_node is None and f.driver.modules[0].refcount is None


def test_corrupt_config_gz_and_nested_toml_json(host):
    (host / "boot/config-6.1.0-47-cloud-amd64").unlink()
    (host / "proc/config.gz").write_bytes(b"\x1f\x8b\x08\x00" + JUNK)
    (host / "etc/containerd/config.toml").write_text("a = " + "[" * 5000)
    (host / "etc/docker").mkdir(parents=True)
    (host / "etc/docker/daemon.json").write_text("[" * 100000)
    (host / "usr/bin/dockerd").write_text("")
    (host / "etc/containerd/config.toml").write_text('[plugins]\n"io.containerd.grpc.v1.cri" = "str"\n')
    f = checked(host)
    assert f.kernel.config_source is None
    assert {r.name for r in f.runtimes} >= {"containerd", "docker"}


def test_installed_manifest_of_the_wrong_shape(host):
    d = host / "lib/modules/6.1.0-47-cloud-amd64/updates/driverd"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text('{"kernel": {"release": 1}, "driver": {"version": []}, "flavor": "open"}')
    (d / "install.json").write_text("[]")
    f = checked(host)
    assert f.driver.installed == () and any("manifest" in w for w in f.warnings)


# -- the console script: one line, exit 0/2/3, never a traceback ------------------------------
def _cli_ok(res, codes=(0, 3)):
    assert "Traceback" not in res.stderr and res.returncode in codes, res.stderr
    if "--json" in res.args:
        json.loads(res.stdout)
    else:
        assert res.stdout.startswith("host ")


def test_cli_on_a_junk_tree(host):
    for hp in TEXT_FILES:
        replace(host, hp, data=JUNK)
    shutil.rmtree(host / "sys/bus/pci/devices")
    (host / "sys/bus/pci/devices").write_bytes(JUNK)
    _cli_ok(run_cli("detect", "--root", str(host), "--json"))
    _cli_ok(run_cli("detect", "--root", str(host)), codes=(0,))
    _cli_ok(run_cli("plan", "--root", str(host), "--driver", "570.195.03", "--json"))


def test_cli_binary_driverd_config_is_one_line_exit_2(host):
    (host / "etc/driverd").mkdir(parents=True)
    (host / "etc/driverd/config.toml").write_bytes(JUNK)
    for args in (("detect",), ("plan", "--driver", "570.195.03")):
        res = run_cli(*args, "--root", str(host), "--json")
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "config.toml" in res.stderr


def test_cli_config_path_that_loops_or_is_a_fifo(host):
    (host / "etc/driverd").mkdir(parents=True)
    os.symlink("config.toml", host / "etc/driverd/config.toml")
    res = run_cli("plan", "--root", str(host), "--driver", "570.195.03", "--json")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (host / "etc/driverd/config.toml").unlink()
    os.mkfifo(host / "etc/driverd/config.toml")
    res = run_cli("detect", "--root", str(host), "--json")
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_cli_without_proc_and_with_non_utf8_names_in_human_output(host):
    shutil.rmtree(host / "proc")
    (host / "sys/module/nvidia/holders").joinpath(os.fsdecode(b"h\xff")).mkdir()
    _cli_ok(run_cli("detect", "--root", str(host)), codes=(0,))
    _cli_ok(run_cli("plan", "--root", str(host), "--driver", "570.195.03", "--json"))


# -- fuzzing the parsers -------------------------------------------------------------------
texty = st.text(alphabet=st.characters(codec="utf-8"), max_size=400) | st.lists(
    st.sampled_from(["nvidia", "1", "-", "0", "Live", "Loading", "(OE)", "(OE+)", "[permanent],", "0x0", " ",
                     "\n", '"', "=", "#", "\\", "\r", "\ufeff", "ID", "NVRM version:", "Kernel Module",
                     "535.261.03", "blacklist", "options", "nouveau", "modeset=0", "'"]),
    max_size=60).map("".join)


@settings(max_examples=300, deadline=None)
@given(texty)
def test_fuzz_parsers_never_raise_and_keep_their_invariants(text):
    rows = parse_proc_modules(text)
    for name, r in rows.items():
        assert name and " " not in name
        assert r["state"] in PROC_STATES + (None,)
        assert r["taints"].isupper() or r["taints"] == ""
        assert r["refcount"] is None or isinstance(r["refcount"], int)
    vals, bad = parse_os_release(text)
    assert all(isinstance(v, str) for v in vals.values()) and all(isinstance(b, str) for b in bad)
    version, flavor, line = parse_nvidia_version(text)
    assert flavor in (None, "open", "proprietary") and (version is None or version[0].isdigit())
    for cmd in parse_modprobe_conf(text):
        assert cmd and all(w and not any(c.isspace() for c in w) for w in cmd)
    params = cmdline_params(text)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in params.items())
    assert len(cmdline_args(text)) >= len(params)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.from_regex(r"[a-z_.]{1,8}(=[a-z0-9,]{0,6})?", fullmatch=True), max_size=12))
def test_fuzz_cmdline_last_occurrence_wins(tokens):
    expect: dict[str, str] = {}
    for t in tokens:
        k, _, v = t.partition("=")
        expect[k] = v
    assert cmdline_params(" ".join(tokens)) == expect


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(TEXT_FILES), st.binary(max_size=300), max_size=8))
def test_fuzz_random_bytes_in_a_real_tree(pristine, contents):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "root"
        shutil.copytree(pristine, root, symlinks=True)
        for hp, data in contents.items():
            replace(root, hp, data=data)
        checked(root)
