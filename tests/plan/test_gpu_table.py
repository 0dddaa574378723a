"""The GPU table is generated from NVIDIA's own lists, holds all of them, and answers per branch and
flavour with evidence; the unknown-id inference is proven by holding every known id out in turn."""
import gzip
import importlib.util
import json
import sys

import pytest

from driverd.host import gputable as g
from tests.conftest import REPO, run_cli

GEN = REPO / "tools" / "gen_gpus.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_gpus", GEN)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_gpus"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(gen):
    return gen.build()


def test_shipped_table_is_exactly_what_the_generator_produces(gen, built):
    shipped = (REPO / "driverd" / "data" / "gpus.json").read_text(encoding="utf-8")
    assert shipped == gen.render(built), "driverd/data/gpus.json is stale: run python3 tools/gen_gpus.py"


def test_every_source_is_recorded_and_verified(gen):
    man = json.loads((gen.SRC / "sources.json").read_text())
    files = {s["file"] for s in man["sources"]}
    on_disk = {f"supported-gpus/{p.name}" for p in (gen.SRC / "supported-gpus").iterdir()}
    assert files == on_disk
    for s in man["sources"]:
        assert s["origin"] and s["release"] and s["sha256"] and "obtained" in s
        assert gen.sha256_of_json(gen.SRC / s["file"]) == s["sha256"]
    for extra in ("readme_tables", "nvswitch", "chips"):
        assert man[extra]["origin"]


def test_table_holds_every_id_of_every_source(gen, built):
    ids = set(built["devices"])
    for path in (gen.SRC / "supported-gpus").iterdir():
        rows = gen.read_supported(path)
        missing = {k[0] for k in rows} - ids
        assert not missing, f"{path.name}: {sorted(missing)[:5]}"
    readmes = gen.read_readme_tables(gen.SRC / "open-readme-tables.txt")
    assert len(readmes) == 193 and readmes[0].tag == "515.43.04" and readmes[-1].tag == "595.45.04"
    for r in readmes:
        assert r.tag.split(".")[0] >= "515"
        missing = {k[0] for k in (r.rows or {})} - ids
        assert not missing, f"README {r.tag}: {sorted(missing)[:5]}"
    assert built["counts"]["device_ids"] == len(ids) >= 1181


def test_readme_tables_file_is_lossless_per_tag(gen):
    """Every block's row count matches its header, and re-encoding gives the same file."""
    readmes = gen.read_readme_tables(gen.SRC / "open-readme-tables.txt")
    out = gen.SRC.parent / "open-readme-tables.roundtrip.txt"
    try:
        gen.write_readme_tables(readmes, out)
        assert out.read_text() == (gen.SRC / "open-readme-tables.txt").read_text()
    finally:
        out.unlink(missing_ok=True)
    by = {r.tag: r for r in readmes}
    assert by["515.43.04"].rows is None                       # that README has no table
    assert len(by["595.45.04"].rows) == 825
    assert by["595.45.04"].rows[("0x1e30", "10de:129e")] == "Quadro RTX 8000"


def test_readme_equals_kernelopen_rows_where_both_exist(gen, built):
    """The merge rule rests on this: each README lists exactly its release's kernelopen rows
    (build() stops otherwise); and the 590-era json's kernelopen on Maxwell-Volta is recorded."""
    readmes = {r.tag: r for r in gen.read_readme_tables(gen.SRC / "open-readme-tables.txt")}
    both = [s for s in json.loads((gen.SRC / "sources.json").read_text())["sources"] if s["release"] in readmes]
    assert {s["release"] for s in both} >= {"525.147.05", "535.261.03", "550.163.01", "555.58.02", "590.48.01"}
    for s in both:
        rows = gen.read_supported(gen.SRC / s["file"])
        ko = {k for k, v in rows.items() if "kernelopen" in v.features and v.legacy is None}
        assert ko == set(readmes[s["release"]].rows), s["release"]
    assert any("590.48.01" in n and "580.xx" in n and "READMEs win" in n for n in built["notes"])


def test_590_json_tags_pre_turing_kernelopen_but_table_keeps_them_proprietary(gen):
    rows = gen.read_supported(gen.SRC / "supported-gpus" / "590.48.01.json.gz")
    gtx1080 = rows[("0x1b80", None)]
    assert "kernelopen" in gtx1080.features and gtx1080.legacy == "580.xx"
    m = g.lookup("0x1b80")
    assert m.flavor_class == "proprietary-only" and m.open_module_support == "unsupported" and m.last_branch == 580
    assert g.support(m, "open", "580.95.05").supported is False


@pytest.mark.parametrize("did,arch,cls,legacy", [
    ("0x102d", "Kepler", "proprietary-only", "470.xx"),        # Tesla K80
    ("0x0ff2", "Kepler", "proprietary-only", "367.xx"),        # GRID K1
    ("0x13f2", "Maxwell", "proprietary-only", "580.xx"),       # Tesla M60
    ("0x1b38", "Pascal", "proprietary-only", "580.xx"),        # Tesla P40
    ("0x1db1", "Volta", "proprietary-only", "580.xx"),         # V100 SXM2
    ("0x1eb8", "Turing", "open-or-proprietary", None),         # T4
    ("0x20b0", "Ampere", "open-or-proprietary", None),         # A100
    ("0x26b9", "Ada Lovelace", "open-or-proprietary", None),   # L40S
    ("0x2335", "Hopper", "open-or-proprietary", None),         # H200
    ("0x2342", "Hopper", "open-only", None),                   # GH200
    ("0x2901", "Blackwell", "open-only", None),                # B200
    ("0x31c2", "Blackwell", "open-only", None),                # GB300
    ("0x0020", "Fahrenheit/Celsius", "proprietary-only", "71.86.xx"),
])
def test_classes_and_legacy_branches(did, arch, cls, legacy):
    m = g.lookup(did)
    assert (m.architecture, m.flavor_class, m.legacy_branch) == (arch, cls, legacy)
    assert m.architecture in g.ARCH_ORDER


def test_lookup_is_case_and_prefix_insensitive():
    assert g.lookup("0X2330").name == g.lookup("2330").name == "NVIDIA H100 80GB HBM3"
    assert g.lookup("0xfff0") is None


def _fresh_table(monkeypatch, text=None):
    for f in (g._text, g.table, g._split):
        f.cache_clear()
    if text is not None:
        monkeypatch.setattr(g, "_text", lambda: text)


def test_a_lookup_decodes_only_the_devices_it_asks_for_and_says_what_the_whole_table_says(monkeypatch):
    """detect on a GPU host looks up one or two devices: it reads their lines, not all 1,181 entries, and
    each entry read alone is the whole table's (every id, every subsystem row)."""
    whole = g.table()
    _fresh_table(monkeypatch)
    h200 = g.lookup("0x2335", "0x10de", "0x18be")
    assert h200.name == "NVIDIA H200" and g.nvswitch_name("0x22a3") == "NVSwitch (3rd gen, LS10)"
    assert g.table.cache_info().currsize == 0, "a known device's lookup decoded the whole table"
    alone = {did: g._device(did) for did in whole["devices"]}
    assert alone == whole["devices"] and g.table.cache_info().currsize == 0
    assert g.lookup("0xfff0") is None          # unknown: the whole table decides
    assert g.table.cache_info().currsize == 1
    for f in (g._text, g.table, g._split):
        f.cache_clear()
    assert g.lookup("0x2335", "0x10de", "0x18be") == h200


def test_a_table_not_laid_out_one_device_a_line_is_read_whole(monkeypatch):
    """A table re-indented by hand (or by another tool) still answers every lookup, from its whole text."""
    whole = g.table()
    text = json.dumps(whole, indent=2)
    _fresh_table(monkeypatch, text)
    try:
        assert g.lookup("0x2335", "0x10de", "0x18be").name == "NVIDIA H200"
        assert g.lookup("0x1eb8", "0x10de", "0x12a2").name == "Tesla T4"
        assert g.nvswitch_name("0x1ae8") == "NVSwitch (2nd gen, LR10)"
    finally:
        for f in (g.table, g._split):
            f.cache_clear()


def test_subsystem_rows_are_matched_on_both_ids():
    assert g.lookup("0x1e30").name == "Quadro RTX 6000"                        # the plain row
    assert g.lookup("0x1e30", "0x10de", "0x129e").name == "Quadro RTX 8000"    # device + subsystem row
    t4 = g.lookup("0x1eb8", "0x10de", "0x12a2")
    assert "10de:12a2" in t4.rows and t4.subsystem_note is None and t4.name == "Tesla T4"
    other = g.lookup("0x2330", "0x10de", "0x0000")                             # H100 is listed only by subsystem
    assert other.subsystem_note and "10de:16c0, 10de:16c1" in other.subsystem_note


def test_branches_per_flavour_not_a_single_floor():
    """Some ids are listed in 570 and 580 but in no 575 release; the evidence says so."""
    m = g.lookup("0x2c33", "0x1028", "0x2053")           # RTX PRO 4000 Blackwell SFF (Dell)
    assert g.support(m, "open", "570.195.03").supported is True
    v = g.support(m, "open", "575.64.05")
    assert v.supported is False and "570.x from 570.190" in v.evidence and "575.x" in v.evidence.split("not in")[1]
    assert g.support(m, "open", "580.95.05").supported is True


def test_long_term_branches_list_what_the_old_floors_refused():
    """The old table refused H800 on 525 (floor 535), H20 on 535 (550), L4 SFF on 525; NVIDIA lists them."""
    for did, version in (("0x2324", "525.147.05"), ("0x2329", "535.261.03"), ("0x27b0", "525.147.05"),
                         ("0x26b3", "535.261.03"), ("0x2331", "525.147.05")):
        assert g.support(g.lookup(did), "open", version).supported is True, did


def test_open_only_part_is_not_accepted_before_its_first_open_listing():
    """GH200 144G: the old table said 550; no open-modules README before 565 lists it."""
    m = g.lookup("0x2348")
    v = g.support(m, "open", "550.163.01")
    assert v.supported is False and v.kind == "too-old" and v.first.startswith("565.")
    assert g.support(m, "proprietary", "580.95.05").kind == "open-only"


def test_release_within_a_branch_before_the_first_listing_is_too_old():
    h100 = g.lookup("0x2330", "0x10de", "0x16c1")
    v = g.support(h100, "open", "525.60.13")            # 525.85.05 (2023-01-19) is the first 525.60-line listing
    assert v.supported is False and v.kind == "too-old" and "525.85.05" in v.evidence
    assert g.support(h100, "open", "525.85.05").supported is True
    a10 = g.lookup("0x2236")                            # 515.57's README omits A10, 515.48.07's lists it
    assert g.support(a10, "open", "515.57").supported is True


def test_legacy_branch_refuses_later_branches_naming_it():
    k80 = g.lookup("0x102d")
    assert g.support(k80, "proprietary", "470.256.02").supported is True
    v = g.support(k80, "proprietary", "535.261.03")
    assert v.supported is False and v.kind == "legacy" and v.legacy == "470.xx"
    v100 = g.lookup("0x1db4")
    assert g.support(v100, "proprietary", "580.95.05").supported is True
    assert g.support(v100, "proprietary", "590.48.01").legacy == "580.xx"


def test_t4_gap_in_nvidias_lists_is_bridged_by_continuity_only_for_proprietary():
    t4 = g.lookup("0x1eb8", "0x10de", "0x12a2")
    v = g.support(t4, "proprietary", "535.261.03")
    assert v.supported is True and v.kind == "continuity" and "470.x" in v.evidence
    assert g.support(t4, "open", "535.261.03").supported is False
    assert g.support(t4, "open", "575.64.05").supported is True


def test_a_branch_before_the_first_listing_is_not_bridged():
    """Continuity needs a listing *before* the gap: the A10 (first listed by 460) is not driven by 450."""
    v = g.support(g.lookup("0x2236"), "proprietary", "450.248.02")
    assert v.supported is False and v.kind == "too-old"


# -- legacy branches and gaps between listings (issue 17: Tesla P4 and V100 fleets) --------------

def _plan_one(tmp_path, did: str, version: str, **kw):
    from driverd.host import collect
    from driverd.plan import Desired, plan
    from driverd.root import Root
    from driverd.sim.hosttree import HostSpec, Pci, write_host
    root = tmp_path / f"host{len(list(tmp_path.iterdir()))}"          # a fresh host tree per plan
    write_host(root, HostSpec(pci=[Pci(f"0000:{i + 0x41:02x}:00.0", "0x10de", did, "0x030200") for i in range(2)]))
    return plan(collect(Root(root), nvml=False), Desired(version, runtimes=("none",), **kw))


def test_tesla_p4_plans_proprietary_through_580_and_is_refused_from_590_naming_580(tmp_path):
    """0x1bb3: in the 450-470 supported-gpus.json files, in none of 525-555, and in 590.48.01's with
    legacybranch 580.xx: NVIDIA drives it up to and including 580."""
    p4 = g.lookup("0x1bb3")
    assert (p4.name, p4.legacy_branch, p4.legacy_from) == ("Tesla P4", "580.xx", "590.48.01")
    p = _plan_one(tmp_path, "0x1bb3", "580.95.05")
    assert p.flavor == "proprietary"                               # Pascal: no open modules, ever
    assert "open does not serve" in p.flavor_reason and "gap filled by continuity" in p.flavor_reason
    assert any("450.248.02" in w and "legacybranch 580.xx" in w for w in p.warnings)
    from driverd.errors import PlanError
    for newer in ("590.48.01", "595.45.04"):
        with pytest.raises(PlanError) as e:
            _plan_one(tmp_path, "0x1bb3", newer)
        line = e.value.one_line()
        assert "no longer supports" in line and "580.xx" in line and "request a 580.x driver" in line, line
        assert "0000:41:00.0" in line and "590.48.01: legacybranch 580.xx" in line
    with pytest.raises(PlanError):
        _plan_one(tmp_path, "0x1bb3", "580.95.05", flavor="open")


@pytest.mark.parametrize("did", ["0x1df5", "0x1db1"])       # both are "Tesla V100-SXM2-16GB" in NVIDIA's lists
@pytest.mark.parametrize("version", ["535.261.03", "550.163.01", "550.127.05", "570.195.03", "580.95.05"])
def test_v100_sxm2_16gb_fleets_plan_proprietary_citing_the_evidence(tmp_path, did, version):
    p = _plan_one(tmp_path, did, version)
    assert p.flavor == "proprietary", p.flavor_reason
    said = p.flavor_reason.split("; proprietary: ", 1)[1]
    assert "0000:41:00.0, 0000:42:00.0: " in said                  # one answer for a fleet of one model
    if did == "0x1df5":                                            # missing from the 525-555 files
        assert "not in 525.x-555.x" in said and "listed before (450.248.02)" in said and "legacybranch 580.xx" in said
        assert any("gap filled by continuity" in w for w in p.warnings)
    else:                                                          # listed by 450-555; 590 names legacy 580.xx
        assert "lists it" in said or "list it" in said
        assert ("legacybranch 580.xx" in said) == (version.split(".")[0] not in ("535", "550")), said
    v = g.support(g.lookup(did), "proprietary", version)
    assert v.supported is True and v.kind == ("continuity" if did == "0x1df5" else "listed")


def _gaps_in_the_raw_lists(gen) -> dict[str, list[str]]:
    """From the recorded supported-gpus.json files alone (not driverd's table): device id -> the
    releases whose file omits it although an earlier file already listed it (a <= 470 one, or one
    dated no later) and a later file lists it or names a legacy branch at or above that release's."""
    manifest = json.loads((gen.SRC / "sources.json").read_text())
    srcs = sorted((s for s in manifest["sources"] if s["kind"] == "supported-gpus.json"), key=lambda s: gen.vkey(s["release"]))
    files = {s["release"]: gen.read_supported(gen.SRC / s["file"]) for s in srcs}
    date = {s["release"]: s.get("release_date") for s in srcs}
    order = [s["release"] for s in srcs]
    gaps: dict[str, list[str]] = {}
    for dev in sorted({k[0] for rows in files.values() for k in rows}):
        rows = {r: [v for k, v in files[r].items() if k[0] == dev] for r in order}
        listed = [r for r in order if any(v.legacy is None for v in rows[r])]
        legacy = max((int(v.legacy.split(".")[0]) for r in order for v in rows[r] if v.legacy), default=0)
        for z in order:
            if z in listed or any(gen.branch(r) == gen.branch(z) for r in listed):
                continue
            before = [r for r in listed if gen.branch(r) < gen.branch(z)
                      and (gen.branch(r) <= 470 or (date[r] and date[z] and date[r] <= date[z]))]
            after = [r for r in listed if gen.branch(r) > gen.branch(z)] or (legacy >= gen.branch(z))
            if before and after:
                gaps.setdefault(dev, []).append(z)
    return gaps


def test_every_id_listed_before_and_after_a_gap_is_supported_in_the_gap(gen):
    gaps = _gaps_in_the_raw_lists(gen)
    # the ids the 525-555 files omit: GeForce 940A (Lenovo), Tesla P4, V100-SXM2-16GB, Tesla T4
    assert set(gaps) == {"0x137d", "0x1bb3", "0x1df5", "0x1eb8"}, gaps
    assert gaps["0x1bb3"] == ["525.147.05", "535.261.03", "535.274.02", "550.54.15", "550.163.01", "555.58.02"]
    for dev, releases in gaps.items():
        m = g.lookup(dev)
        for z in releases + ["560.35.03", "570.195.03"]:                # and the branches the table has no file of
            v = g.support(m, "proprietary", z)
            assert v.supported is True and v.kind == "continuity", (dev, z, v)
            assert "gap filled by continuity: listed before (4" in v.evidence, (dev, z, v.evidence)
    # an id first listed by a file dated after a branch's file is not bridged into that branch:
    # 0x2822 is in 550.163.01 (2025-04-17), not in 555.58.02 (2024-07-01)
    v = g.support(g.lookup("0x2822"), "proprietary", "555.58.02")
    assert v.supported is False and "555.x" in v.evidence
    assert "0x2822" not in gaps


def test_branches_outside_the_table():
    h200 = g.lookup("0x2335")
    newer = g.support(h200, "open", "600.10.01")
    assert newer.supported is True and "newer than driverd's table" in newer.evidence
    assert g.support(g.lookup("0x102d"), "proprietary", "418.226.00").supported is None
    assert g.support(h200, "open", "510.108.03").kind == "no-open-modules"


# -- the inference for unknown ids ---------------------------------------------------------------

def test_inference_rule_is_proven_by_holding_every_known_id_out():
    ids, classes = g._known()
    devs = g.table()["devices"]
    wrong, covered, total = [], 0, 0
    for k, dev in devs.items():
        if not g._class_evidence(dev):
            continue
        total += 1
        i = int(k, 16)
        rest = [x for x in ids if x != i]
        got = g.infer_from(rest, classes, i)
        if got is None:
            continue
        covered += 1
        if got[0] != classes[i]:
            wrong.append((k, classes[i], got))
    assert not wrong, wrong
    assert covered / total > 0.8          # the rule answers for most ids (the rest: plan blocked)


def test_inference_never_gives_open_to_pre_turing_nor_proprietary_to_open_only():
    ids, classes = g._known()
    devs = g.table()["devices"]
    for k, dev in devs.items():
        if not g._class_evidence(dev):
            continue
        i = int(k, 16)
        got = g.infer_from([x for x in ids if x != i], classes, i)
        if got is None:
            continue
        if dev["class"] == "proprietary-only":
            assert got[0][0] == "proprietary-only", k
        if dev["class"] == "open-only":
            assert got[0][0] == "open-only", k


@pytest.mark.parametrize("did,want", [
    ("0x2d50", ("open-only", None)),                  # between two Blackwell GB206 ids
    ("0x3200", ("open-only", None)),                  # above every known id: the top run is open-only
    ("0x13a0", ("proprietary-only", "580.xx")),       # inside a Maxwell block
    ("0x2500", ("open-or-proprietary", None)),        # inside GA106
    ("0x1e00", None),                                 # between Volta and Turing: no rule applies
    ("0x2380", None),                                 # between GH200 (open-only) and GA103 (both)
    ("0x11be", None),                                 # next to GRID K2 (367.xx) and GK106 (470.xx)
    ("0x0010", None),                                 # below every known id
])
def test_inference_examples(did, want):
    inf = g.infer(did)
    assert (inf.flavor_class, inf.legacy_branch) == want if want else inf is None


def test_known_ids_are_not_inferred():
    assert g.infer("0x2330") is None


# -- driverd gpus ---------------------------------------------------------------------------------

def test_gpus_command_json_names_the_evidence():
    res = run_cli("gpus", "2c33:1028:2053", "0x1db4", "2d50", "1e00", "--driver", "575.64.05", "--json", check=True)
    d = json.loads(res.stdout)
    pro4000, v100, inferred, unknown = d["gpus"]
    assert pro4000["flavor_class"] == "open-only" and pro4000["verdicts"]["open"]["supported"] is False
    assert "575.x" in pro4000["flavors"]["open"]["history"]
    assert 570 in pro4000["flavors"]["open"]["branches"] and 575 not in pro4000["flavors"]["open"]["branches"]
    assert v100["legacy_branch"] == "580.xx" and v100["verdicts"]["proprietary"]["supported"] is True
    assert inferred["known"] is False and inferred["inference"]["flavor_class"] == "open-only"
    assert unknown["inference"] is None and "--flavor" in unknown["fix"]


def test_gpus_command_human_and_host(tmp_path):
    from driverd.sim.hosttree import HostSpec, Pci, h100, write_host
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0"), Pci("0000:41:00.0", "0x10de", "0x1db4", "0x030200")]))
    out = run_cli("gpus", "--root", str(tmp_path), "--driver", "590.48.01", check=True).stdout
    assert "0000:1b:00.0  0x2330 subsystem 10de:16c1  NVIDIA H100 80GB HBM3" in out
    assert "Tesla V100-PCIE-16GB" in out and "580.xx legacy branch" in out
    bad = run_cli("gpus", "zz99")
    assert bad.returncode == 2 and "invalid GPU id" in bad.stderr


def test_gpus_command_states_the_legacy_branch_and_the_evidence():
    out = run_cli("gpus", "1bb3", "--driver", "580.95.05", check=True).stdout
    assert "0x1bb3  Tesla P4  (Pascal GP104)" in out
    assert "legacy:       580.xx (supported-gpus.json 590.48.01): branches up to and including 580.x drive it" in out
    assert "proprietary:  listed in 450.x, 460.x, 470.x, 590.x (590.48.01) with legacybranch 580.xx" in out
    line = next(x for x in out.splitlines() if x.startswith("  580.95.05 proprietary:"))
    assert line.startswith("  580.95.05 proprietary: yes: ") and "not in 525.x-555.x" in line \
        and "listed before (450.248.02) and after (590.48.01: legacybranch 580.xx)" in line
    d = json.loads(run_cli("gpus", "1bb3", "--driver", "590.48.01", "--json", check=True).stdout)["gpus"][0]
    assert d["legacy_branch"] == "580.xx" and d["legacy_from"] == "590.48.01"
    assert d["verdicts"]["proprietary"]["kind"] == "legacy" and "580 is the last branch" in \
        d["verdicts"]["proprietary"]["evidence"]


def test_sources_are_gzip_json_with_chips(gen):
    for p in (gen.SRC / "supported-gpus").iterdir():
        doc = json.loads(gzip.decompress(p.read_bytes()))
        assert doc["chips"] and {"devid", "name", "features"} <= set(doc["chips"][0])
