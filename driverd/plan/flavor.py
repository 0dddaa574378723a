"""Which kernel-module flavour (open / proprietary) serves every GPU of a host, and why.

Every answer comes from NVIDIA's own lists (driverd/host/gputable.py, docs/gpus.md): for each GPU and
flavour, does the requested release support it? `auto` picks the flavour that serves every GPU;
when both do, NVIDIA's default for the branch (open from 560 on). A GPU missing from the table gets
a flavour only from the inference rule that the table's tests prove (gputable.INFERENCE_RULE); when
that rule does not apply, `auto` is refused with the device id and the fix, never guessed.
"""
from __future__ import annotations

from driverd.datatypes import dataclass
from driverd.errors import PlanError, UsageError
from driverd.host import gputable
from driverd.host.facts import GpuFacts
from driverd.plan.model import FlavorDecision

FIRST_OPEN_BRANCH = gputable.FIRST_OPEN_BRANCH
OPEN_DEFAULT_BRANCH = 560        # NVIDIA's default flavour is open from 560 on (for GPUs both drive)
TABLE_FIX = "update driverd's GPU table (tools/gen_gpus.py from a newer supported-gpus.json and README tables)"


def branch_of(version: str) -> int:
    try:
        return gputable.branch_of(version)
    except ValueError:
        raise UsageError(f"invalid driver version {version!r}", cause="expected a version like 535.261.03",
                         fix="pass --driver with NVIDIA's full version number") from None


@dataclass(frozen=True)
class GpuVerdicts:
    """What NVIDIA's lists say about one GPU: which flavours of the requested release support it."""
    gpu: GpuFacts
    label: str                                   # "0000:01:00.0 (Tesla V100-PCIE-16GB, Volta)"
    verdicts: dict[str, gputable.Verdict] | None   # None: unknown device, no inference
    note: str | None = None                      # inference / subsystem remark (a warning)


def _label(g: GpuFacts, name: str | None = None, arch: str | None = None) -> str:
    return f"{g.pci_address} ({name or g.name}, {arch or g.architecture})"


def _inferred_verdicts(inf: gputable.Inference, version: str) -> dict[str, gputable.Verdict]:
    b = branch_of(version)
    why = f"device id {inf.device_id} is not in NVIDIA's lists; inferred {inf.flavor_class}: {inf.rule}"
    out = {}
    for f in gputable.FLAVORS:
        if f == "open" and b < FIRST_OPEN_BRANCH:
            out[f] = gputable.Verdict(False, f"branch {b} has no open kernel modules", "no-open-modules")
        elif inf.last_branch is not None and b > inf.last_branch:
            out[f] = gputable.Verdict(False, f"{why}; its legacy branch {inf.legacy_branch} ends at {inf.last_branch}",
                                      "legacy", legacy=inf.legacy_branch)
        elif (f == "open" and inf.flavor_class == "proprietary-only") or \
                (f == "proprietary" and inf.flavor_class == "open-only"):
            out[f] = gputable.Verdict(False, why, "open-only" if f == "proprietary" else "not-listed")
        else:
            out[f] = gputable.Verdict(None, why, "unknown")
    return out


def assess(g: GpuFacts, version: str) -> GpuVerdicts:
    m = gputable.lookup(g.device_id, g.subsystem_vendor_id, g.subsystem_device_id)
    if m is not None:
        return GpuVerdicts(g, _label(g, m.name, m.architecture),
                           {f: gputable.support(m, f, version) for f in gputable.FLAVORS}, m.subsystem_note)
    inf = gputable.infer(g.device_id)
    if inf is not None:
        return GpuVerdicts(g, _label(g, "unknown", f"{inf.architecture or 'unknown'} by device id"),
                           _inferred_verdicts(inf, version),
                           f"GPU {g.pci_address}: device id {g.device_id} is not in NVIDIA's lists; flavour class "
                           f"inferred as {inf.flavor_class} ({inf.rule}); the driver's support for it is unverified")
    return GpuVerdicts(g, _label(g), None)


def _names(vs: list[GpuVerdicts]) -> str:
    return ", ".join(v.label for v in vs)


def _why(vs: list[GpuVerdicts], flavor: str) -> str:
    return "; ".join(f"{v.gpu.pci_address}: {v.verdicts[flavor].evidence}" for v in vs)


def _evidence(vs: list[GpuVerdicts], flavor: str) -> str:
    """NVIDIA's evidence for `flavor`, once per distinct answer (a fleet of identical GPUs says it once)."""
    by: dict[str, list[str]] = {}
    for v in vs:
        by.setdefault(v.verdicts[flavor].evidence, []).append(v.gpu.pci_address)
    return "; ".join(f"{', '.join(addrs)}: {ev}" for ev, addrs in by.items())


def _refused(vs: list[GpuVerdicts], flavor: str) -> list[GpuVerdicts]:
    return [v for v in vs if v.verdicts is not None and v.verdicts[flavor].supported is False]


def _kinds(vs: list[GpuVerdicts], flavor: str) -> set[str]:
    return {v.verdicts[flavor].kind for v in vs}


def _refusal(flavor: str | None, branch: int, vs: list[GpuVerdicts], both: bool) -> PlanError:
    """One line naming the GPUs, NVIDIA's evidence, and what would work instead."""
    legacy = [v for v in vs if any(x.kind == "legacy" for x in v.verdicts.values())]
    if legacy:
        last = min(x.legacy for v in legacy for x in v.verdicts.values() if x.kind == "legacy")
        n = last.split(".")[0]
        return PlanError(f"driver branch {branch} no longer supports {_names(legacy)}",
                         cause="; ".join(f"{v.gpu.pci_address}: {next(x.evidence for x in v.verdicts.values() if x.kind == 'legacy')}"
                                         for v in legacy),
                         fix=f"request a {n}.x driver (NVIDIA's legacy branch {last}) or move these GPUs")
    f = flavor or "open"
    firsts = [v.verdicts[x].first for v in vs for x in gputable.FLAVORS if v.verdicts[x].kind == "too-old"]
    if both and firsts and all(any(v.verdicts[x].kind == "too-old" for x in gputable.FLAVORS) for v in vs):
        need = max(firsts, key=gputable.vkey)
        return PlanError(f"driver branch {branch} is too old for {_names(vs)}",
                         cause="; ".join(f"{v.gpu.pci_address}: " + " / ".join(
                             v.verdicts[x].evidence for x in gputable.FLAVORS if v.verdicts[x].kind != "open-only")
                             for v in vs),
                         fix=f"request {need} or newer")
    if both:
        return PlanError(f"driver {branch}.x supports no flavour for {_names(vs)}",
                         cause="; ".join(f"{v.gpu.pci_address}: open: {v.verdicts['open'].evidence}; proprietary: "
                                         f"{v.verdicts['proprietary'].evidence}" for v in vs),
                         fix="request a driver release that lists these GPUs (`driverd gpus ID` shows which)")
    other = "proprietary" if f == "open" else "open"
    if f == "proprietary" and _kinds(vs, f) == {"open-only"}:
        return PlanError(f"proprietary kernel modules do not support {_names(vs)}",
                         cause="these GPUs require the open kernel modules: " + _why(vs, f),
                         fix="use --flavor open or auto")
    if f == "open" and _kinds(vs, f) == {"no-open-modules"}:
        return PlanError(f"driver branch {branch} has no open kernel modules",
                         cause=f"open modules exist from branch {FIRST_OPEN_BRANCH}",
                         fix=f"request a {FIRST_OPEN_BRANCH}+ driver or --flavor proprietary")
    return PlanError(f"{f} kernel modules of {branch}.x do not support {_names(vs)}",
                     cause=_why(vs, f), fix=f"use --flavor {other} or auto, or another driver release")


def decide(gpus: tuple[GpuFacts, ...], version: str, requested: str = "auto") -> FlavorDecision:
    if requested not in ("auto", "open", "proprietary"):
        raise UsageError(f"invalid flavor {requested!r}", cause="flavor must be auto, open or proprietary",
                         fix="pass --flavor auto|open|proprietary")
    if not gpus:
        return FlavorDecision(None, "no NVIDIA GPU on this host")
    b = branch_of(version)
    assessed = [assess(g, version) for g in gpus]
    warnings = [v.note for v in assessed if v.note]
    unknown = [v for v in assessed if v.verdicts is None]
    known = [v for v in assessed if v.verdicts is not None]
    for v in known:
        for f in gputable.FLAVORS:
            if v.verdicts[f].supported is None and v.verdicts[f].kind == "unknown" and not v.note:
                warnings.append(f"GPU {v.label}: {f}: {v.verdicts[f].evidence}")

    if requested in ("open", "proprietary"):
        if requested == "open" and b < FIRST_OPEN_BRANCH:
            raise PlanError(f"driver branch {b} has no open kernel modules",
                            cause=f"open modules exist from branch {FIRST_OPEN_BRANCH}",
                            fix=f"request a {FIRST_OPEN_BRANCH}+ driver or --flavor proprietary")
        bad = _refused(known, requested)
        if bad:
            raise _refusal(requested, b, bad, both=False)
        warnings += [f"GPU {v.gpu.pci_address} (device id {v.gpu.device_id}) is not in driverd's GPU table; "
                     f"--flavor {requested} is taken as given" for v in unknown]
        return FlavorDecision(requested, f"requested {requested}" + (f" ({_evidence(known, requested)})" if known else ""),
                              tuple(warnings + _continuity(known, requested)))

    if unknown:
        v = unknown[0]
        raise PlanError(f"GPU {v.gpu.pci_address} (device id {v.gpu.device_id}) is not in driverd's GPU table and "
                        "no written-down rule infers its flavour",
                        cause="driver.flavor=auto never guesses a flavour (" + gputable.INFERENCE_RULE + ")",
                        fix=f"pass --flavor open|proprietary (driver.flavor) or {TABLE_FIX}; "
                            f"`driverd gpus {v.gpu.device_id}` shows what is known")
    ok = {f: [v for v in known if v.verdicts[f].supported is not False] for f in gputable.FLAVORS}
    serves = [f for f in gputable.FLAVORS if len(ok[f]) == len(known) and (f != "open" or b >= FIRST_OPEN_BRANCH)]
    if not serves:
        only_open = [v for v in known if v.verdicts["proprietary"].supported is False
                     and v.verdicts["open"].supported is not False]
        only_prop = [v for v in known if v.verdicts["open"].supported is False
                     and v.verdicts["proprietary"].supported is not False]
        if only_open and only_prop:
            raise PlanError("no single kernel-module flavour serves every GPU on this host",
                            cause=f"{_names(only_open)} need the open modules ({_why(only_open, 'proprietary')}); "
                                  f"{_names(only_prop)} need proprietary ({_why(only_prop, 'open')})",
                            fix="split these GPUs across hosts")
        neither = [v for v in known if all(v.verdicts[f].supported is False for f in gputable.FLAVORS)]
        if neither:
            raise _refusal(None, b, neither, both=True)
        if only_open and b < FIRST_OPEN_BRANCH:
            raise PlanError(f"driver branch {b} has no open kernel modules, which {_names(only_open)} need",
                            cause=_why(only_open, "proprietary"), fix=f"request a {FIRST_OPEN_BRANCH}+ driver")
        raise _refusal("open", b, _refused(known, "open"), both=False)
    if len(serves) == 2:
        f = "open" if b >= OPEN_DEFAULT_BRANCH else "proprietary"
        reason = (f"NVIDIA's lists give both flavours for every GPU and branch {b} "
                  + (f">= {OPEN_DEFAULT_BRANCH} defaults to the open modules" if f == "open"
                     else f"< {OPEN_DEFAULT_BRANCH} defaults to the proprietary modules"))
        return FlavorDecision(f, reason, tuple(warnings + _continuity(known, f)))
    f = serves[0]
    other = "proprietary" if f == "open" else "open"
    forced = [v for v in known if v.verdicts[other].supported is False]
    if other == "open" and b < FIRST_OPEN_BRANCH:
        return FlavorDecision(f, f"branch {b} has no open kernel modules", tuple(warnings + _continuity(known, f)))
    return FlavorDecision(f, f"{other} does not serve {_names(forced)}: {_evidence(forced, other)}; {f}: "
                             f"{_evidence(known, f)}", tuple(warnings + _continuity(known, f)))


def _continuity(known: list[GpuVerdicts], flavor: str) -> list[str]:
    return [f"GPU {v.label}: {v.verdicts[flavor].evidence}" for v in known
            if v.verdicts[flavor].kind == "continuity"]

