import pytest

from driverd.errors import PlanError, UsageError
from driverd.host.facts import GpuFacts
from driverd.host.gputable import lookup
from driverd.plan.flavor import decide


def gpu(device_id, addr="0000:01:00.0"):
    m = lookup(device_id)
    return GpuFacts(addr, "0x10de", device_id, None, None, "0x0302", 0, None,
                    m.name if m else "unknown", m.architecture if m else "unknown", None,
                    m.open_module_support if m else "unknown", m.min_branch if m else None,
                    m.last_branch if m else None, m is not None)


H100, T4, V100, K80, B200, GH200, UNKNOWN = "0x2330", "0x1eb8", "0x1db4", "0x102d", "0x2901", "0x2342", "0xfff0"


@pytest.mark.parametrize("gpus,version,req,want", [
    ([H100], "570.195.03", "auto", "open"),            # branch >= 560, all support open
    ([H100], "550.127.05", "auto", "proprietary"),     # branch < 560
    ([H100, T4], "580.95.05", "auto", "open"),
    ([V100], "550.127.05", "auto", "proprietary"),     # pre-Turing
    ([V100, H100], "570.195.03", "auto", "proprietary"),
    ([B200], "570.195.03", "auto", "open"),            # Blackwell requires open
    ([GH200], "550.127.05", "auto", "open"),           # GH200 requires open even below 560
    ([H100], "535.261.03", "open", "open"),
    ([H100], "570.195.03", "proprietary", "proprietary"),
])
def test_decision_table(gpus, version, req, want):
    d = decide(tuple(gpu(g, f"0000:{i:02x}:00.0") for i, g in enumerate(gpus)), version, req)
    assert d.flavor == want and d.reason


@pytest.mark.parametrize("gpus,version,req,words", [
    ([T4], "510.108.03", "open", "no open kernel modules"),
    ([V100], "570.195.03", "open", "do not support"),
    ([B200], "570.195.03", "proprietary", "require the open"),
    ([B200, V100], "570.195.03", "auto", "no single kernel-module flavour"),
    ([K80], "535.261.03", "auto", "no longer supports"),
    ([B200], "550.127.05", "auto", "too old"),
])
def test_impossible_requests_name_the_gpus(gpus, version, req, words):
    with pytest.raises(PlanError) as e:
        decide(tuple(gpu(g, f"0000:{i:02x}:00.0") for i, g in enumerate(gpus)), version, req)
    assert words in e.value.one_line()
    if "open kernel modules" not in words:   # every GPU-specific refusal names the GPUs
        assert "0000:00:00.0" in e.value.one_line()


def test_unknown_gpu_is_warned():
    d = decide((gpu(H100), gpu(UNKNOWN, "0000:02:00.0")), "570.195.03")
    assert d.flavor == "open" and any("0000:02:00.0" in w for w in d.warnings)


def test_no_gpu_and_bad_version():
    assert decide((), "570.1.1").flavor is None
    with pytest.raises(UsageError):
        decide((gpu(H100),), "latest")
