"""Which kernel-module flavour (open / proprietary) serves every GPU of a host, and why.

Rules: branches before 515 have no open modules; pre-Turing GPUs need proprietary; GPUs whose open
support is `required` (Blackwell, GH200) need open; `auto` picks open when every GPU supports it and
the branch is >= 560 (NVIDIA's default from then on), else proprietary when that serves every GPU.
"""
from __future__ import annotations

from driverd.errors import PlanError, UsageError
from driverd.host.facts import GpuFacts
from driverd.plan.model import FlavorDecision

FIRST_OPEN_BRANCH = 515
OPEN_DEFAULT_BRANCH = 560


def branch_of(version: str) -> int:
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        raise UsageError(f"invalid driver version {version!r}", cause="expected a version like 535.261.03",
                         fix="pass --driver with NVIDIA's full version number") from None


def _names(gpus: list[GpuFacts]) -> str:
    return ", ".join(f"{g.pci_address} ({g.name}, {g.architecture})" for g in gpus)


def check_branch(gpus: tuple[GpuFacts, ...], branch: int) -> None:
    too_old = [g for g in gpus if g.min_branch is not None and branch < g.min_branch]
    too_new = [g for g in gpus if g.last_branch is not None and branch > g.last_branch]
    if too_old:
        need = max(g.min_branch for g in too_old)
        raise PlanError(f"driver branch {branch} is too old for {_names(too_old)}",
                        cause=f"these GPUs need branch {need} or newer", fix=f"request a {need}+ driver")
    if too_new:
        last = min(g.last_branch for g in too_new)
        raise PlanError(f"driver branch {branch} no longer supports {_names(too_new)}",
                        cause=f"their last supported branch is {last}", fix=f"request a {last}.x driver or older")


def decide(gpus: tuple[GpuFacts, ...], version: str, requested: str = "auto") -> FlavorDecision:
    if requested not in ("auto", "open", "proprietary"):
        raise UsageError(f"invalid flavor {requested!r}", cause="flavor must be auto, open or proprietary",
                         fix="pass --flavor auto|open|proprietary")
    if not gpus:
        return FlavorDecision(None, "no NVIDIA GPU on this host")
    branch = branch_of(version)
    known = tuple(g for g in gpus if g.known)
    unknown = [g for g in gpus if not g.known]
    warnings = tuple(f"GPU {g.pci_address} (device id {g.device_id}) is not in the GPU table; the flavour "
                     "decision does not account for it" for g in unknown)
    check_branch(known, branch)
    need_open = [g for g in known if g.open_module_support == "required"]
    no_open = [g for g in known if g.open_module_support == "unsupported"]
    if need_open and no_open:
        raise PlanError("no single kernel-module flavour serves every GPU on this host",
                        cause=f"{_names(need_open)} need the open modules; {_names(no_open)} need proprietary",
                        fix="split these GPUs across hosts")
    if requested == "open" or (requested == "auto" and need_open):
        if branch < FIRST_OPEN_BRANCH:
            raise PlanError(f"driver branch {branch} has no open kernel modules",
                            cause=f"open modules exist from branch {FIRST_OPEN_BRANCH}",
                            fix=f"request a {FIRST_OPEN_BRANCH}+ driver" + ("" if need_open else " or --flavor proprietary"))
        if no_open:
            raise PlanError(f"open kernel modules do not support {_names(no_open)}",
                            cause="GPUs before Turing need the proprietary modules", fix="use --flavor proprietary")
        if requested == "open":
            return FlavorDecision("open", "requested open", warnings)
        return FlavorDecision("open", f"{_names(need_open)} require the open kernel modules", warnings)
    if requested == "proprietary":
        if need_open:
            raise PlanError(f"proprietary kernel modules do not support {_names(need_open)}",
                            cause="these GPUs require the open kernel modules", fix="use --flavor open or auto")
        return FlavorDecision("proprietary", "requested proprietary", warnings)
    # auto, nothing requires open
    if not known:
        return FlavorDecision("open" if branch >= OPEN_DEFAULT_BRANCH else "proprietary",
                              f"no GPU is in the table; branch {branch} default "
                              f"({'open' if branch >= OPEN_DEFAULT_BRANCH else 'proprietary'}); set the flavour explicitly",
                              warnings)
    if not no_open and branch >= OPEN_DEFAULT_BRANCH:
        return FlavorDecision("open", f"every GPU supports the open modules and branch {branch} >= "
                                      f"{OPEN_DEFAULT_BRANCH} defaults to them", warnings)
    if no_open:
        return FlavorDecision("proprietary", f"{_names(no_open)} are not supported by the open modules", warnings)
    return FlavorDecision("proprietary", f"branch {branch} < {OPEN_DEFAULT_BRANCH}: NVIDIA's default for "
                                         "this branch is the proprietary modules", warnings)
