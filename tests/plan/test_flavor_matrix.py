"""Synthetic hosts built from the table: every data-centre part and a sample of workstation parts,
planned against one release of each branch 515...595, give the flavour NVIDIA's lists allow or a
block naming the GPU and the reason. The expectation is computed here from the raw source files
(tools/gpu-sources), not from driverd's table, so the two must agree."""
import importlib.util
import sys

import pytest

from driverd.errors import PlanError
from driverd.host import collect
from driverd.host import gputable as g
from driverd.plan import Desired, plan
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Pci, write_host
from tests.conftest import REPO

DATA_CENTRE = {      # device[:subvendor:subdevice], the subsystem NVIDIA's rows name where they name one
    "V100": "0x1db4", "V100-SXM2-16GB": "0x1df5", "P4": "0x1bb3", "P40": "0x1b38", "P100": "0x15f8", "T4": "0x1eb8:10de:12a2",
    "A10": "0x2236:10de:1482", "A30": "0x20b7:10de:1532", "A100": "0x20b0", "A800": "0x20f5:10de:1799",
    "L4": "0x27b8:10de:16ca", "L40": "0x26b5:10de:169d", "L40S": "0x26b9:10de:1851", "H100": "0x2330:10de:16c1",
    "H800": "0x2324:10de:17a6", "H20": "0x2329:10de:198b", "H200": "0x2335:10de:18be", "GH200": "0x2342:10de:16eb",
    "B200": "0x2901:10de:1999", "GB200": "0x2941:10de:2046", "B300": "0x3182:10de:20e6", "GB300": "0x31c2:10de:21f1",
}
WORKSTATION = {
    "RTX A6000": "0x2230:10de:1459", "RTX 6000 Ada": "0x26b1:10de:16a1", "RTX PRO 6000 Blackwell": "0x2bb1:10de:204b",
    "Quadro RTX 8000": "0x1e30:10de:129e", "Quadro P6000": "0x1b30", "GTX 1080": "0x1b80", "RTX 4090": "0x2684",
    "RTX 5090": "0x2b85",
}
LEGACY = {"Tesla K80": "0x102d", "GRID K2": "0x11bf"}      # driven by no branch 515-595 at all


def _gen():
    spec = importlib.util.spec_from_file_location("gen_gpus_matrix", REPO / "tools" / "gen_gpus.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_gpus_matrix"] = mod
    spec.loader.exec_module(mod)
    return mod


GEN = _gen()
READMES = [r for r in GEN.read_readme_tables(GEN.SRC / "open-readme-tables.txt") if r.rows is not None]
JSONS = {p.name.removesuffix(".json.gz"): GEN.read_supported(p) for p in (GEN.SRC / "supported-gpus").iterdir()}
NEWEST_JSON = max(JSONS, key=GEN.vkey)
BRANCHES = sorted({GEN.branch(r.tag) for r in READMES})
RELEASE = {b: max((r.tag for r in READMES if GEN.branch(r.tag) == b), key=GEN.vkey) for b in BRANCHES}


def test_one_release_of_every_branch_515_to_595():
    assert BRANCHES[0] == 515 and BRANCHES[-1] == 595 and len(BRANCHES) == 15


def _keys(spec: str) -> tuple[str, str | None]:
    dev, _, sub = spec.partition(":")
    return dev, sub or None


def _rows(did: str, sub: str | None, rows: dict) -> list:
    return [rows[k] for k in ((did, sub), (did, None)) if k in rows]


def expected(spec: str, version: str) -> str | None:
    """The oracle, from the raw lists: branch B supports the GPU with open when a README of B (at or
    below the release) lists its row; with proprietary when its newest supported-gpus.json row is not
    open-only, its legacy branch (if any) is >= B, and a list of B names it (README rows for parts
    both flavours drive; else the nearest supported-gpus.json at or below B), or continuity (a <= 470
    list names it and a later list does too, or its legacy branch is B or later: legacybranch 580.xx
    means driven up to and including 580). Both: open from 560, else proprietary."""
    did, sub = _keys(spec)
    b = GEN.branch(version)
    newest = _rows(did, sub, JSONS[NEWEST_JSON]) or [v for k, v in JSONS[NEWEST_JSON].items() if k[0] == did]

    def open_rows(r) -> bool:
        return any(k in r.rows for k in ((did, sub), (did, None)))
    open_ok = any(open_rows(r) for r in READMES if GEN.branch(r.tag) == b and GEN.vkey(r.tag) <= GEN.vkey(version))
    ko = [r for r in newest if "kernelopen" in r.features and r.legacy is None]
    legacy = next((r.legacy for r in newest if r.legacy), None)
    open_only = bool(ko) and not any("gsp_proprietary_supported" in r.features for r in ko)
    if legacy and b > int(legacy.split(".")[0]):
        prop_ok = False
        open_ok = False
    elif open_only:
        prop_ok = False
    elif ko:                                     # both flavours: the README rows of B, or continuity
        listed_b = {GEN.branch(r.tag) for r in READMES if open_rows(r)} | \
            {GEN.branch(rel) for rel, rows in JSONS.items() if any(x.legacy is None for x in _rows(did, sub, rows))}
        prop_ok = b in listed_b or (min(listed_b) <= 470 and max(listed_b) > b)
    else:                                        # proprietary only: the nearest supported-gpus.json <= B
        near = max((rel for rel in JSONS if GEN.branch(rel) <= b), key=GEN.vkey)
        listed_b = {GEN.branch(rel) for rel, rows in JSONS.items() if any(x.legacy is None for x in _rows(did, sub, rows))}
        until = max(listed_b | ({int(legacy.split(".")[0])} if legacy else set()), default=0)
        prop_ok = any(x.legacy is None for x in _rows(did, sub, JSONS[near])) or \
            (bool(listed_b) and min(listed_b) <= 470 and until >= b)
    if open_ok and prop_ok:
        return "open" if b >= 560 else "proprietary"
    return "open" if open_ok else "proprietary" if prop_ok else None


def host(tmp_path, spec: str):
    did, sub = _keys(spec)
    sv, sd = ("0x" + sub.split(":")[0], "0x" + sub.split(":")[1]) if sub else ("0x10de", "0x0000")
    write_host(tmp_path, HostSpec(pci=[Pci("0000:41:00.0", "0x10de", did, "0x030200", None, 0, sv, sd)]))
    return collect(Root(tmp_path), nvml=False)


@pytest.mark.parametrize("part", sorted(DATA_CENTRE) + sorted(WORKSTATION) + sorted(LEGACY))
def test_plan_per_branch_gives_the_flavour_nvidia_lists_allow(tmp_path, part):
    spec = DATA_CENTRE.get(part) or WORKSTATION.get(part) or LEGACY[part]
    facts = host(tmp_path, spec)
    [gpu] = facts.gpus
    assert gpu.known, part
    seen = set()
    for version in RELEASE.values():
        want = expected(spec, version)
        if want is None:
            with pytest.raises(PlanError) as e:
                plan(facts, Desired(version, runtimes=("none",)))
            line = e.value.one_line()
            assert "0000:41:00.0" in line, (part, version, line)
            assert any(w in line for w in ("no longer supports", "too old", "do not support", "supports no flavour",
                                           "no single")), (part, version, line)
        else:
            p = plan(facts, Desired(version, runtimes=("none",)))
            assert p.flavor == want, (part, version, p.flavor_reason)
            assert p.flavor_reason
        seen.add(want)
    assert (seen == {None}) == (part in LEGACY), (part, seen)


def test_matrix_spot_checks():
    """A few answers spelled out, so a regression in the oracle cannot hide one in driverd."""
    assert expected(DATA_CENTRE["T4"], RELEASE[535]) == "proprietary"       # continuity across 515-570
    assert expected(DATA_CENTRE["T4"], RELEASE[575]) == "open"
    assert expected(DATA_CENTRE["V100"], RELEASE[580]) == "proprietary"
    assert expected(DATA_CENTRE["V100"], RELEASE[590]) is None               # 580.xx legacy
    for part in ("P4", "V100-SXM2-16GB"):          # not in the 525-555 jsons; 450-470 and 590 (legacy 580.xx) list them
        assert [expected(DATA_CENTRE[part], RELEASE[b]) for b in (535, 550, 570, 580, 590)] == \
            ["proprietary"] * 4 + [None], part
    assert expected(DATA_CENTRE["B200"], RELEASE[565]) is None                # first listed in 570.86.15
    assert expected(DATA_CENTRE["B200"], RELEASE[570]) == "open"
    assert expected(DATA_CENTRE["GH200"], RELEASE[550]) == "open"             # open-only, listed since 535.x
    assert expected(DATA_CENTRE["H100"], RELEASE[550]) == "proprietary" and \
        expected(DATA_CENTRE["H100"], RELEASE[560]) == "open"
    assert expected(LEGACY["Tesla K80"], RELEASE[515]) is None                 # 470.xx legacy


def test_explicit_flavour_is_checked_against_the_same_lists(tmp_path):
    facts = host(tmp_path, DATA_CENTRE["V100"])
    with pytest.raises(PlanError) as e:
        plan(facts, Desired("570.211.01", flavor="open", runtimes=("none",)))
    assert "0000:41:00.0" in e.value.one_line() and "do not support" in e.value.one_line()
    assert plan(facts, Desired("570.211.01", flavor="proprietary", runtimes=("none",))).flavor == "proprietary"
    assert g.lookup("0x1db4").last_branch == 580
