import re

from driverd.host import gputable
from driverd.host.gputable import ARCH_ORDER, OPEN_SUPPORT


def test_table_has_source_and_date():
    t = gputable.table()
    assert t["source"] and re.match(r"\d{4}-\d{2}-\d{2}$", t["date"])


def test_every_entry_is_well_formed():
    t = gputable.table()
    assert set(t["architectures"]) == set(ARCH_ORDER)
    for did, dev in t["devices"].items():
        assert re.match(r"^0x[0-9a-f]{4}$", did), did
        assert dev["architecture"] in ARCH_ORDER, did
        m = gputable.lookup(did)
        assert m.open_module_support in OPEN_SUPPORT, did
        assert m.min_branch is None or 300 <= m.min_branch <= 700, did
    for a in t["architectures"].values():
        assert a["open_module_support"] in OPEN_SUPPORT


def test_coverage_kepler_to_blackwell():
    archs = {d["architecture"] for d in gputable.table()["devices"].values()}
    assert archs == set(ARCH_ORDER)
    assert len(gputable.table()["devices"]) >= 100


def test_legacy_branches_and_open_rules():
    arch = gputable.table()["architectures"]
    assert arch["Kepler"]["last_branch"] == 470
    for a in ("Maxwell", "Pascal", "Volta"):
        assert arch[a]["last_branch"] == 580 and arch[a]["open_module_support"] == "unsupported"
    assert arch["Blackwell"]["open_module_support"] == "required"
    for a in ("Turing", "Ampere", "Ada Lovelace", "Hopper"):
        assert arch[a]["open_module_support"] == "supported"


def test_known_devices():
    assert gputable.lookup("0x2330").name.startswith("H100")
    assert gputable.lookup("0X2330").architecture == "Hopper"      # case-insensitive
    assert gputable.lookup("1eb8").name == "Tesla T4"              # unprefixed
    assert gputable.lookup("0x2342").open_module_support == "required"   # GH200
    assert gputable.lookup("0x102d").last_branch == 470               # K80
    assert gputable.lookup("0xfff0") is None
