"""A parameter value reaches the kernel as modprobe passes it and the kernel splits it (issue 30).

modprobe (kmod's options_from_array) joins NAME=VALUE arguments into one string, quoting a value
with a ' ' unless it begins with a quote; the kernel's parse_args()/next_arg() (kernel/params.c,
lib/cmdline.c) splits it at blanks outside double quotes and drops the quotes. A charp value such as
`x" NVreg_EnableGpuFirmware=0 "y` would therefore set NVreg_EnableGpuFirmware behind the
configuration's back; it is refused before anything is unloaded, with one line naming the parameter
and the fix. The quoting is checked against the real modprobe (`-n -v` prints the string it would
pass to the kernel)."""
from __future__ import annotations

import subprocess

import pytest

from driverd.errors import ConfigError
from driverd.kmod import load as ld
from driverd.modinfo import ModInfo, Param
from tests.conftest import require_binary

SPLITS = [
    ('x" NVreg_EnableGpuFirmware=0 "y', ["NVreg_RegistryDwords=x", "NVreg_EnableGpuFirmware=0", "y"]),
    ('"x" NVreg_EnableGpuFirmware=0', ["NVreg_RegistryDwords=x", "NVreg_EnableGpuFirmware=0"]),
    ("x\tNVreg_EnableGpuFirmware=0", ["NVreg_RegistryDwords=x", "NVreg_EnableGpuFirmware=0"]),
    ("x\nNVreg_EnableGpuFirmware=0", ["NVreg_RegistryDwords=x", "NVreg_EnableGpuFirmware=0"]),
    ("'x NVreg_EnableGpuFirmware=0", ["NVreg_RegistryDwords='x", "NVreg_EnableGpuFirmware=0"]),
    ('a"b c', ['NVreg_RegistryDwords=a"b', 'c"']),
    ('"quoted"', ["NVreg_RegistryDwords=quoted"]),                 # one parameter, another value
    ("caf\u00e0", ["NVreg_RegistryDwords=caf\\xc3"]),              # UTF-8 c3 a0: 0xa0 is isspace() in the kernel
]
KEPT = ["RmMsg=:;RMSecBusResetEnable=1", "x NVreg_EnableGpuFirmware=0 NVreg_X=1",   # quoted by modprobe: one value
        "/var/tmp/nv files", 'a"b', 'ends with"', "", "a -- b", "ö"]


def _info() -> dict:
    params = {n: Param(n, t) for n, t in (("NVreg_RegistryDwords", "charp"), ("NVreg_EnableGpuFirmware", "int"),
                                          ("NVreg_Enable", "bool"))}
    return {"nvidia": ModInfo("/lib/modules/r/updates/driverd/nvidia.ko", "nvidia", "535.261.03", "NVIDIA", "r",
                              (), (), params)}


@pytest.mark.parametrize("value,parts", SPLITS)
def test_a_value_the_kernel_would_split_is_refused_in_one_line(value, parts):
    got = ld.kernel_split(ld.modprobe_option("NVreg_RegistryDwords", value))
    assert [p.decode("utf-8", "backslashreplace") + ("" if v is None else "=" + v.decode("utf-8", "backslashreplace"))
            for p, v in got] == parts
    with pytest.raises(ConfigError) as e:
        ld.validate_parameters(None, ["nvidia"], {"nvidia": {"NVreg_RegistryDwords": value}}, _info())
    line = e.value.one_line()
    assert "\n" not in line and line.startswith("module nvidia parameter NVreg_RegistryDwords: the value ")
    assert "would reach the kernel" in line and "next_arg" in line
    assert "fix: in [modules.parameters.nvidia] give NVreg_RegistryDwords a value without double quotes" in line


@pytest.mark.parametrize("value", KEPT)
def test_values_that_reach_the_kernel_whole_are_accepted(value):
    out = ld.validate_parameters(None, ["nvidia"], {"nvidia": {"NVreg_RegistryDwords": value}}, _info())
    assert out == {"nvidia": {"NVreg_RegistryDwords": value}}


def test_any_type_is_split_first():
    """A bool's check reads only its first characters: `y NVreg_X=1` would pass it, not the split."""
    assert ld.value_problem("bool", "y\tNVreg_EnableGpuFirmware=0") is None
    with pytest.raises(ConfigError, match="parameter NVreg_Enable: the value .* as 2 parameters"):
        ld.validate_parameters(None, ["nvidia"], {"nvidia": {"NVreg_Enable": "y\tNVreg_EnableGpuFirmware=0"}},
                               _info())


def test_the_quoting_is_modprobes(tmp_path):
    """modprobe_option() says what kmod's modprobe really passes (its dry run prints it)."""
    from driverd.install.modules import install
    from driverd.runner import Runner
    from driverd.sim.fakepkg import make_fake_package
    from driverd.sim.hosttree import HostSpec, write_host
    mp = require_binary("modprobe", "/usr/sbin/modprobe", "/sbin/modprobe")
    rel = "6.1.0-47-cloud-amd64"
    host = write_host(tmp_path / "h", HostSpec(release=rel))
    install(host, make_fake_package(tmp_path / "p", "535.261.03", rel).path, Runner())
    for value in [v for v, _ in SPLITS] + KEPT:
        if "\n" in value:
            continue                                     # modprobe -v prints it, but not on one line
        r = subprocess.run([mp, "-d", str(host), "-S", rel, "-n", "-v", "nvidia", f"NVreg_RegistryDwords={value}"],
                           capture_output=True)
        assert r.returncode == 0, r.stderr
        line = r.stdout.strip().splitlines()[-1]
        assert line.split(b"nvidia.ko ", 1)[1] == ld.modprobe_option("NVreg_RegistryDwords", value), (value, line)
