#!/usr/bin/env python3
"""Generate driverd/data/gpus.json from NVIDIA's own lists, kept in tools/gpu-sources/.

    python3 tools/gen_gpus.py             write driverd/data/gpus.json
    python3 tools/gen_gpus.py --check     exit 1 when the shipped table differs from what the sources give
    python3 tools/gen_gpus.py extract-readmes --git-dir DIR
                                          re-extract the open-modules README tables of every release tag
                                          from a clone of NVIDIA/open-gpu-kernel-modules

Inputs (each recorded in tools/gpu-sources/sources.json with origin, release, date and sha256):
- supported-gpus/<release>.json.gz: NVIDIA's supported-gpus.json (NVIDIA-Linux-*.run:
  supported-gpus/supported-gpus.json), one per driver release: {"chips": [{"devid", "subvendorid"?,
  "subdevid"?, "name", "legacybranch"?, "features": [...]}]}.
- open-readme-tables.txt: the "Compatible GPUs" table of README.md at every release tag of
  NVIDIA/open-gpu-kernel-modules, delta-encoded (see write_readme_tables).
- chips.tsv: driverd's device-id blocks per chip and architecture (display only; checked against
  NVIDIA's data below).
- nvswitch.tsv: NVSwitch device ids from the open modules' nvswitch.c.

How the sources combine (docs/gpus.md says why):
- open flavour: a device (or device + subsystem row) is supported by release R iff the README of R
  lists it. 515.43.04's README has no table: no evidence either way.
- proprietary flavour: R supports it iff R's supported-gpus.json lists it without a legacybranch;
  for a device that both flavours drive, also iff R's README lists it (the README is exactly the
  json's `kernelopen` rows, checked for every release that has both). A device whose row in the
  newest supported-gpus.json has `kernelopen` but not `gsp_proprietary_supported` is open-only.
- legacybranch "580.xx" on a device's rows: the branches up to and including 580 drive it (from the
  first that lists it), later ones do not; the table records the list that says so (`legacy_from`).
- `kernelopen` on rows with a legacybranch (a 590-era json tags Maxwell-Volta so) is ignored: the
  READMEs never list them and the open modules need a GSP, which pre-Turing GPUs lack.

Standard library only; the output is deterministic (sorted, no clock).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tools" / "gpu-sources"
OUT = ROOT / "driverd" / "data" / "gpus.json"
FORMAT = 2

# A row of the README table: "| Product Name | PCI ID |" where PCI ID is "1E30" or "1E30 10DE 129E".
_README_ROW = re.compile(r"^\|\s*(.+?)\s*\|\s*([0-9A-Fa-f]{4})(?:\s+([0-9A-Fa-f]{4})\s+([0-9A-Fa-f]{4}))?\s*\|\s*$")

# Legacy branches older than Kepler's: the architecture family NVIDIA moved to each (display only).
LEGACY_FAMILY = {"390": "Fermi", "340": "Tesla", "304": "Curie", "173": "Rankine", "96": "Celsius/Kelvin",
                 "71": "Fahrenheit/Celsius"}
PRE_TURING = ("Kepler", "Maxwell", "Pascal", "Volta")


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def branch(v: str) -> int:
    return int(v.split(".", 1)[0])


Key = tuple[str, str | None]      # ("0x2330", "10de:16c0") or ("0x2330", None)


def key_str(k: Key) -> str:
    return k[0][2:].upper() + ("" if k[1] is None else " " + " ".join(x.upper() for x in k[1].split(":")))


def kord(k: Key) -> tuple[str, str]:
    return k[0], k[1] or ""


def parse_key(s: str) -> Key:
    parts = s.split()
    dev = "0x" + parts[0].lower()
    return (dev, None) if len(parts) == 1 else (dev, f"{parts[1].lower()}:{parts[2].lower()}")


# -- the open-modules README tables --------------------------------------------------------------

def parse_readme_table(text: str) -> dict[Key, str] | None:
    """The rows of README.md's "Compatible GPUs" table; None when the README has no table."""
    rows: dict[Key, str] = {}
    for line in text.splitlines():
        m = _README_ROW.match(line.rstrip())
        if m:
            name, dev, sv, sd = m.groups()
            rows[parse_key(dev if sv is None else f"{dev} {sv} {sd}")] = name
    return rows or None


@dataclass
class ReadmeRelease:
    tag: str
    date: str
    commit: str
    blob: str                          # git blob id of README.md at the tag
    rows: dict[Key, str] | None        # None: this README has no table


def write_readme_tables(releases: list[ReadmeRelease], path: Path) -> None:
    """One block per tag, in version order. A block is a delta against an earlier block (the one
    that gives the fewest lines): "= BASE" names it, "+ ID[ SV SD]<TAB>NAME" sets a row, "- ID[ SV
    SD]" drops one. The first block with a table lists every row."""
    out = ["# NVIDIA open-gpu-kernel-modules: README.md \"Compatible GPUs\" table at every release tag.",
           "# Origin: GitHub repository NVIDIA/open-gpu-kernel-modules, `git show TAG:README.md`; the",
           "# blob id lets anyone check a block: `git rev-parse TAG:README.md`. Written by",
           "# `python3 tools/gen_gpus.py extract-readmes --git-dir DIR`; read by tools/gen_gpus.py.",
           "# Format: '@ TAG date=YYYY-MM-DD commit=SHA readme=BLOB rows=N [base=TAG] [table=absent]',",
           "# then '+ ID[ SUBVENDOR SUBDEVICE]<TAB>PRODUCT NAME' or '- ID[ SUBVENDOR SUBDEVICE]' lines."]
    done: list[ReadmeRelease] = []
    for r in sorted(releases, key=lambda r: vkey(r.tag)):
        head = f"@ {r.tag} date={r.date} commit={r.commit} readme={r.blob} rows={len(r.rows or {})}"
        if r.rows is None:
            out.append(head + " table=absent")
            continue
        best, best_lines = None, _delta(None, r.rows)
        for b in done:
            lines = _delta(b.rows, r.rows)
            if len(lines) <= len(best_lines):
                best, best_lines = b, lines
        out.append(head + (f" base={best.tag}" if best else ""))
        out.extend(best_lines)
        done.append(r)
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def _delta(base: dict[Key, str] | None, rows: dict[Key, str]) -> list[str]:
    base = base or {}
    lines = [f"- {key_str(k)}" for k in sorted(base, key=kord) if k not in rows]
    lines += [f"+ {key_str(k)}\t{rows[k]}" for k in sorted(rows, key=kord) if base.get(k) != rows[k]]
    return lines


def read_readme_tables(path: Path) -> list[ReadmeRelease]:
    by_tag: dict[str, ReadmeRelease] = {}
    cur: ReadmeRelease | None = None
    want_rows: dict[str, int] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        if line.startswith("@ "):
            tag, *attrs = line[2:].split()
            a = dict(x.split("=", 1) for x in attrs)
            absent = a.get("table") == "absent"
            rows = None if absent else (dict(by_tag[a["base"]].rows) if "base" in a else {})
            cur = ReadmeRelease(tag, a["date"], a["commit"], a["readme"], rows)
            by_tag[tag] = cur
            want_rows[tag] = int(a["rows"])
        elif line[:2] in ("+ ", "- ") and cur is not None and cur.rows is not None:
            body = line[2:]
            if line[0] == "+":
                ident, _, name = body.partition("\t")
                cur.rows[parse_key(ident)] = name
            else:
                del cur.rows[parse_key(body)]
        else:
            raise SystemExit(f"{path}:{n}: unexpected line {line[:60]!r}")
    for tag, r in by_tag.items():
        if len(r.rows or {}) != want_rows[tag]:
            raise SystemExit(f"{path}: {tag} has {len(r.rows or {})} rows, its header says {want_rows[tag]}")
    return sorted(by_tag.values(), key=lambda r: vkey(r.tag))


def extract_readmes(git_dir: str) -> list[ReadmeRelease]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "--git-dir", git_dir, *a], check=True, capture_output=True,
                              text=True).stdout
    out = []
    for line in git("for-each-ref", "refs/tags", "--format=%(refname:short) %(*objectname) %(objectname) "
                    "%(taggerdate:short) %(committerdate:short)").splitlines():
        tag, peeled, obj, tdate, cdate = (line.split() + [""] * 5)[:5]
        if not re.fullmatch(r"\d{3}\.\d+(\.\d+)?", tag):
            continue
        commit = peeled or obj
        blob = git("rev-parse", f"{tag}:README.md").strip()
        text = git("show", f"{tag}:README.md")
        out.append(ReadmeRelease(tag, tdate or cdate, commit, blob, parse_readme_table(text)))
    return out


# -- supported-gpus.json ------------------------------------------------------------------------

@dataclass
class JsonRow:
    name: str
    legacy: str | None                 # "580.xx" etc.: this release no longer drives it
    features: tuple[str, ...]


def read_supported(path: Path) -> dict[Key, JsonRow]:
    doc = json.loads(gzip.decompress(path.read_bytes()))
    rows: dict[Key, JsonRow] = {}
    for c in doc["chips"]:
        dev = "0x" + c["devid"].lower().removeprefix("0x").rjust(4, "0")
        sub = None
        if c.get("subdevid"):
            sub = f"{c['subvendorid'].lower().removeprefix('0x')}:{c['subdevid'].lower().removeprefix('0x')}"
        rows[(dev, sub)] = JsonRow(c["name"], c.get("legacybranch"), tuple(c.get("features", ())))
    return rows


# -- helpers ------------------------------------------------------------------------------------

def intervals(listed: set[str], order: list[str]) -> list[list[str]]:
    """Runs of consecutive releases (in `order`) that are in `listed`, as [first, last] pairs."""
    out: list[list[str]] = []
    run: list[str] = []
    for r in order:
        if r in listed:
            run.append(r)
        elif run:
            out.append([run[0], run[-1]])
            run = []
    if run:
        out.append([run[0], run[-1]])
    return out


def read_tsv(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]


def sha256_of_json(path: Path) -> str:
    return hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()


@dataclass
class Blocks:
    rows: list[tuple[int, int, str | None, str]] = field(default_factory=list)

    def find(self, dev: str) -> tuple[str | None, str] | None:
        i = int(dev, 16)
        for lo, hi, chip, arch in self.rows:
            if lo <= i <= hi:
                return chip, arch
        return None


def flavour_class(open_rel: set[str], json_rows: list[JsonRow]) -> str:
    """open-only | open-or-proprietary | proprietary-only, from the newest supported-gpus.json row
    of the device (rows of one device id agree: checked) and the READMEs."""
    if not open_rel:
        return "proprietary-only"
    if not json_rows:
        return "open-only"            # a README lists it, no supported-gpus.json driverd ships does
    return "open-or-proprietary" if all("gsp_proprietary_supported" in r.features for r in json_rows) \
        else "open-only"


# -- the build ----------------------------------------------------------------------------------

def build(src: Path = SRC) -> dict:
    manifest = json.loads((src / "sources.json").read_text(encoding="utf-8"))
    readmes = [r for r in read_readme_tables(src / "open-readme-tables.txt")]
    with_table = [r for r in readmes if r.rows is not None]
    open_order = [r.tag for r in with_table]
    json_sources = sorted((s for s in manifest["sources"] if s["kind"] == "supported-gpus.json"),
                          key=lambda s: vkey(s["release"]))
    jsons: dict[str, dict[Key, JsonRow]] = {}
    for s in json_sources:
        p = src / s["file"]
        got = sha256_of_json(p)
        if got != s["sha256"]:
            raise SystemExit(f"{p}: sha256 {got} differs from sources.json ({s['sha256']})")
        jsons[s["release"]] = read_supported(p)
    json_order = [s["release"] for s in json_sources]
    newest_json = json_order[-1]
    prop_order = sorted(set(json_order) | set(open_order), key=vkey)

    # Disagreements inside NVIDIA's data, counted and resolved (docs/gpus.md).
    notes: list[str] = []
    for rel, rows in jsons.items():
        readme = next((r for r in with_table if r.tag == rel), None)
        ko = {k for k, v in rows.items() if "kernelopen" in v.features and v.legacy is None}
        ko_legacy = {k for k, v in rows.items() if "kernelopen" in v.features and v.legacy is not None}
        if readme is not None and set(readme.rows) != ko:
            raise SystemExit(f"{rel}: README rows and supported-gpus.json kernelopen rows differ "
                             f"({len(set(readme.rows) ^ ko)} rows); the merge rule needs a look")
        if ko_legacy:
            in_readme = {k for k in ko_legacy if any(k in r.rows for r in with_table)}
            if in_readme:
                raise SystemExit(f"{rel}: rows with a legacybranch are in an open-modules README: "
                                 f"{sorted(in_readme, key=kord)[:3]}")
            legacies = sorted({rows[k].legacy for k in ko_legacy})
            notes.append(f"supported-gpus.json {rel} tags {len(ko_legacy)} rows ({len({k[0] for k in ko_legacy})} "
                         f"device ids, legacy branch {', '.join(legacies)}) `kernelopen`; no open-modules README "
                         f"lists them and the open modules need a GSP, which they lack: the READMEs win and "
                         f"these devices are proprietary-only")

    keys: set[Key] = set()
    for rows in jsons.values():
        keys |= set(rows)
    for r in with_table:
        keys |= set(r.rows)
    by_dev: dict[str, list[Key]] = {}
    for k in keys:
        by_dev.setdefault(k[0], []).append(k)

    blocks = Blocks([(int(lo, 16), int(hi, 16), chip if chip != "-" else None, arch)
                     for lo, hi, chip, arch in read_tsv(src / "chips.tsv")])

    devices: dict[str, dict] = {}
    for dev in sorted(by_dev):
        variants = []
        dev_open: set[str] = set()
        newest_rows = [jsons[newest_json][k] for k in by_dev[dev] if k in jsons[newest_json]]
        for k in sorted(by_dev[dev], key=lambda k: (k[1] is not None, k[1] or "")):
            open_rel = {r.tag for r in with_table if k in r.rows}
            json_rel = {rel for rel, rows in jsons.items() if k in rows and rows[k].legacy is None}
            dev_open |= open_rel
            # the name of the newest list that has the row
            named = [(vkey(r.tag), r.rows[k]) for r in with_table if k in r.rows] + \
                    [(vkey(rel), rows[k].name) for rel, rows in jsons.items() if k in rows]
            name = max(named)[1]
            v: dict = {"subsystem": k[1], "name": name}
            if open_rel:
                v["open"] = intervals(open_rel, open_order)
            if json_rel:
                v["supported_gpus"] = intervals(json_rel, json_order)
            variants.append(v)
        cls = flavour_class(dev_open, newest_rows)
        gsp = {"gsp_proprietary_supported" in r.features for r in newest_rows if "kernelopen" in r.features}
        if len(gsp) > 1:
            raise SystemExit(f"{dev}: rows of supported-gpus.json {newest_json} disagree on gsp_proprietary_supported")
        # the legacy branch: from the newest supported-gpus.json with a row for the device (a row
        # that a later list dropped, e.g. an OEM subsystem, takes the device's)
        newest_rel = next((rel for rel in reversed(json_order) if any(k in jsons[rel] for k in by_dev[dev])), None)
        newest = jsons[newest_rel] if newest_rel else {}
        legacies = {newest[k].legacy for k in by_dev[dev] if k in newest}
        if len(legacies) > 1:
            raise SystemExit(f"{dev}: its rows disagree on the legacy branch: {sorted(map(str, legacies))}")
        legacy = legacies.pop() if legacies else None
        blk = blocks.find(dev)
        if blk is not None:
            chip, arch = blk
        elif legacy is not None and legacy.split(".")[0] in LEGACY_FAMILY:
            chip, arch = None, LEGACY_FAMILY[legacy.split(".")[0]]
        else:
            raise SystemExit(f"{dev} ({variants[0]['name']}): no chip block in chips.tsv and no legacy family")
        _check_arch(dev, arch, cls, legacy, variants[0]["name"])
        plain = next((v for v in variants if v["subsystem"] is None), variants[0])
        name = plain["name"]
        for v in variants:             # a variant's name only where it differs from the device's
            if v["name"] == name:
                del v["name"]
        d = {"name": name, "architecture": arch, "chip": chip, "class": cls, "legacy": legacy,
             "variants": variants}
        if legacy is not None:
            # which list says so: a legacybranch is NVIDIA's statement that every branch up to and
            # including it drives the device (from the first that lists it), cited in the evidence
            d["legacy_from"] = newest_rel
        if not newest_rows:
            d["class_from"] = ("open-modules READMEs only: no supported-gpus.json driverd ships lists it"
                               if not any(k in rows for rows in jsons.values() for k in by_dev[dev])
                               else f"dropped from supported-gpus.json before {newest_json}")
        devices[dev] = d

    nvswitches = {f"0x{int(i, 16):04x}": {"name": name, "generation": int(gen)}
                  for i, name, gen in read_tsv(src / "nvswitch.tsv")}
    readme_ids = {k[0] for r in with_table for k in r.rows}
    json_ids = {rel: {k[0] for k in rows} for rel, rows in jsons.items()}
    counts = {
        "device_ids": len(devices),
        "variants": sum(len(d["variants"]) for d in devices.values()),
        "ids_per_supported_gpus_json": {rel: len(ids) for rel, ids in json_ids.items()},
        "ids_in_open_readmes": len(readme_ids),
        "ids_per_open_readme_branch": {str(b): len({k[0] for r in with_table if branch(r.tag) == b for k in r.rows})
                                       for b in sorted({branch(r.tag) for r in with_table})},
        "by_class": {c: sum(1 for d in devices.values() if d["class"] == c)
                     for c in ("open-only", "open-or-proprietary", "proprietary-only")},
    }
    return {
        "format": FORMAT,
        "generated_by": "tools/gen_gpus.py from tools/gpu-sources (see docs/gpus.md); do not edit by hand",
        "sources": [{k: s[k] for k in ("kind", "release", "release_date", "origin", "sha256") if k in s}
                    for s in json_sources] + [
            {"kind": "open-modules README tables", "origin": manifest["readme_tables"]["origin"],
             "releases": len(readmes), "with_table": len(with_table), "first": readmes[0].tag,
             "last": readmes[-1].tag, "last_date": readmes[-1].date}],
        "notes": notes,
        "releases": {"open": open_order, "supported_gpus": json_order, "proprietary": prop_order},
        "release_dates": {r: d for r, d in sorted(
            [(r.tag, r.date) for r in with_table] + [(s["release"], s.get("release_date")) for s in json_sources],
            key=lambda x: vkey(x[0])) if d},
        "counts": counts,
        "chip_blocks": [[f"0x{lo:04x}", f"0x{hi:04x}", chip, arch] for lo, hi, chip, arch in blocks.rows],
        "devices": devices,
        "nvswitches": nvswitches,
    }


_ARCH_OF_LEGACY = {"470": ("Kepler",), "367": ("Kepler",), "580": ("Maxwell", "Pascal", "Volta")}


def _check_arch(dev: str, arch: str, cls: str, legacy: str | None, name: str) -> None:
    """chips.tsv is driverd's; NVIDIA's data must agree with it, or the build stops."""
    lb = legacy.split(".")[0] if legacy else None
    if arch in PRE_TURING:
        ok = cls == "proprietary-only" and (lb is None or arch in _ARCH_OF_LEGACY.get(lb, ()))
    elif arch in LEGACY_FAMILY.values():
        ok = cls == "proprietary-only" and lb in LEGACY_FAMILY
    else:   # Turing and later: no legacy branch (a few, e.g. the T4G, appear in one old list only)
        ok = lb is None
    if not ok:
        raise SystemExit(f"{dev} ({name}): chips.tsv says {arch}, NVIDIA's data says {cls}, legacy {legacy}")


def render(doc: dict) -> str:
    """Stable JSON, one device (or NVSwitch) per line so that a regeneration diffs by device, and so that
    driverd.host.gputable decodes only the lines of the devices a host has."""
    def one(v) -> str:
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    lines = ["{"]
    keys = list(doc)
    for i, k in enumerate(keys):
        end = "," if i < len(keys) - 1 else ""
        if k in ("devices", "nvswitches"):
            lines.append(f" {json.dumps(k)}: {{")
            items = list(doc[k].items())
            for j, (dk, dv) in enumerate(items):
                lines.append(f"  {json.dumps(dk)}: {one(dv)}" + ("," if j < len(items) - 1 else ""))
            lines.append(" }" + end)
        elif k == "chip_blocks":
            lines.append(f" {json.dumps(k)}: [")
            lines.extend(f"  {one(b)}" + ("," if j < len(doc[k]) - 1 else "") for j, b in enumerate(doc[k]))
            lines.append(" ]" + end)
        else:
            body = json.dumps(doc[k], indent=1, sort_keys=True, ensure_ascii=False).replace("\n", "\n ")
            lines.append(f" {json.dumps(k)}: {body}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the shipped table; exit 1 when it differs")
    ap.add_argument("--out", type=Path, default=OUT)
    sub = ap.add_subparsers(dest="cmd")
    ex = sub.add_parser("extract-readmes", help="re-extract the README tables from a git clone")
    ex.add_argument("--git-dir", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "extract-readmes":
        rel = extract_readmes(args.git_dir)
        write_readme_tables(rel, SRC / "open-readme-tables.txt")
        print(f"wrote {SRC / 'open-readme-tables.txt'}: {len(rel)} tags")
        return 0
    text = render(build())
    if args.check:
        if args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} is not what tools/gen_gpus.py produces: run python3 tools/gen_gpus.py", file=sys.stderr)
            return 1
        print(f"{args.out} matches its sources")
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
