import pytest

from driverd.errors import PlanError, UsageError
from driverd.host.facts import GpuFacts
from driverd.host.gputable import lookup
from driverd.plan.flavor import decide


def gpu(device_id, addr="0000:01:00.0", sub=(None, None)):
    m = lookup(device_id, *sub)
    return GpuFacts(addr, "0x10de", device_id, sub[0], sub[1], "0x0302", 0, None,
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


# -- every unknown-device rule (gputable.INFERENCE_RULE; docs/gpus.md) -------------------------------

def test_unknown_without_inference_blocks_auto_naming_device_and_fix():
    with pytest.raises(PlanError) as e:
        decide((gpu(H100), gpu("0x1e00", "0000:02:00.0")), "570.195.03")
    line = e.value.one_line()
    assert "0000:02:00.0" in line and "0x1e00" in line and "--flavor" in line and "gen_gpus" in line


def test_unknown_without_inference_takes_an_explicit_flavour_with_a_warning():
    d = decide((gpu("0x1e00"),), "570.195.03", "open")
    assert d.flavor == "open" and any("0x1e00" in w for w in d.warnings)


def test_unknown_blackwell_range_id_is_inferred_open_only_and_never_proprietary():
    d = decide((gpu("0x2d50"),), "570.195.03")            # between two GB206 ids
    assert d.flavor == "open" and any("inferred as open-only" in w for w in d.warnings)
    with pytest.raises(PlanError) as e:
        decide((gpu("0x2d50"),), "570.195.03", "proprietary")
    assert "require the open" in e.value.one_line()


def test_known_pascal_with_unknown_blackwell_is_refused_not_mis_flavoured():
    """The old fallback picked proprietary (the Pascal's), which cannot drive Blackwell."""
    with pytest.raises(PlanError) as e:
        decide((gpu("0x1b80"), gpu("0x2d50", "0000:02:00.0")), "570.195.03")
    line = e.value.one_line()
    assert "no single kernel-module flavour" in line and "0000:00:00.0" not in line
    assert "0000:01:00.0" in line and "0000:02:00.0" in line


def test_unknown_id_in_a_pre_turing_block_is_never_given_open():
    d = decide((gpu("0x13a0"),), "570.195.03")            # inside a Maxwell block: proprietary-only, 580.xx
    assert d.flavor == "proprietary"
    with pytest.raises(PlanError) as e:
        decide((gpu("0x13a0"),), "570.195.03", "open")
    assert "do not support" in e.value.one_line()


def test_inferred_legacy_branch_refuses_later_branches_naming_it():
    with pytest.raises(PlanError) as e:
        decide((gpu("0x13a0"),), "590.48.01")
    line = e.value.one_line()
    assert "no longer supports" in line and "580.xx" in line and "580.x driver" in line


def test_above_every_known_id_is_open_only():
    d = decide((gpu("0x3300"),), "595.45.04")
    assert d.flavor == "open" and any("above every known id" in w for w in d.warnings)


def test_open_required_device_never_gets_proprietary_even_below_560():
    assert decide((gpu(GH200),), "535.261.03").flavor == "open"
    with pytest.raises(PlanError) as e:
        decide((gpu(GH200),), "535.261.03", "proprietary")
    assert "require the open" in e.value.one_line()


def test_legacy_branch_is_named_with_the_fix():
    with pytest.raises(PlanError) as e:
        decide((gpu(K80),), "535.261.03")
    line = e.value.one_line()
    assert "470.xx" in line and "request a 470.x driver" in line


def test_t4_on_535_is_proprietary_with_the_continuity_warning():
    d = decide((gpu(T4, sub=("0x10de", "0x12a2")),), "535.261.03")
    assert d.flavor == "proprietary" and any("continuity" in w for w in d.warnings)
