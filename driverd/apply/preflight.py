"""A node's answer to "can you take driver V?" before anything is touched, and the configuration
that names a driver other than the node's own. The cluster agent asks both (for a rollout's
preflight and its node transaction) and the daemon's cluster mode pins its reconciles with
`driver_config`; nothing here speaks Kubernetes: the caller says which pods leave the node.
"""
from __future__ import annotations

import dataclasses


def driver_config(cfg, version: str, flavor: str | None, *, source: str):
    """The node's configuration with another driver: `version`, and `flavor` unless it is empty or
    `auto` (then the node's own driver.flavor decides)."""
    over = {"driver.version": version}
    if flavor and flavor != "auto":
        over["driver.flavor"] = flavor
    return cfg.with_overrides(over, source=source)


def preflight(make_context, cfg, key: str, driver: str, flavor: str, *, leaving: set[str] = frozenset(),
              staying: dict[str, str] | None = None) -> dict:
    """This node's answer to a rollout (`key`) before any node is admitted: can it take the target (a
    plan that is not blocked — GPUs supported by the branch and flavour, signer accepted —, a package
    for its kernel in a repository or a local build), does it need to, and will it need a reboot.

    The host is judged as it will be after the drain: processes of pods that leave (`leaving`: pod
    UIDs the drain evicts or whose DaemonSet leaves with the driver-ready label) do not block; a
    process outside any pod, or in a pod that stays (`staying`: uid -> why), does, and is named."""
    from driverd.apply import steps as st
    from driverd.apply.hostplan import plan_for_host
    from driverd.errors import DriverdError
    from driverd.host import collect
    out = {"rollout": key, "driver": driver, "ok": True, "needed": True, "reasons": [], "reboot": False}
    try:
        c = driver_config(cfg, driver, flavor, source=f"rollout {key}")
        sctx = make_context(c)
        out["kernel"] = sctx.kernel.release
        loaded = st.loaded(sctx)
        out["current"] = f"{loaded['version']}/{loaded['flavor']}" if loaded else None
        facts = after_drain(collect(sctx.root, nvml=False, handler=c["runtime.handler"],
                                    binary=c["runtime.binary"]), leaving)
        p = plan_for_host(sctx.root, c, facts=facts).plan
        if loaded and loaded["version"] == driver and loaded["flavor"] == p.flavor:
            changed = settings_change(sctx, c)
            if not changed:
                out["needed"] = False
                out["reasons"] = [f"already runs {driver} ({loaded['flavor']}) with the configured settings"]
                return out
            # the same driver with other settings: the rollout applies them (drained, like a version change)
            out["reasons"] = [f"runs {driver} ({loaded['flavor']}) with other settings than configured: "
                              + "; ".join(changed)]
            if p.blocked_by:
                out["ok"], out["reasons"] = False, list(p.blocked_by) + _staying_words(facts, staying or {})
            out["flavor"] = p.flavor
            return out
        if p.blocked_by:
            out["ok"], out["reasons"] = False, list(p.blocked_by) + _staying_words(facts, staying or {})
            return out
        out["flavor"] = p.flavor
        out["reboot"] = bool(p.reboot_required)
        if p.reboot_required:
            out["reasons"].append("needs a reboot: " + "; ".join(p.reboot_reasons))
        where = package_source(sctx, c, driver, p.flavor)
        if where.startswith("none:"):
            out["ok"] = False
        out["reasons"].append(where.removeprefix("none:").strip())
        if where.startswith("package "):
            # pre-pull it into the node's cache (verified): the upgrade then starts from local files,
            # and the kernel's verdict on its signer is known now, not after the node is drained
            from driverd.build.obtain import fetch_configured
            from driverd.repo.fetch import Want
            fetch_configured(sctx.root, c, Want(driver, p.flavor or "", sctx.kernel.release, _arch(sctx)),
                             runner=sctx.runner, allow_build=False)
            again = plan_for_host(sctx.root, c, facts=facts).plan
            if again.blocked_by:
                out["ok"], out["reasons"] = False, list(again.blocked_by) + _staying_words(facts, staying or {})
    except DriverdError as e:
        out["ok"], out["reasons"] = False, [e.one_line()]
    return out


def settings_change(sctx, cfg) -> list[str]:
    """How the driver settings `cfg` wants differ from what the running driver converged with (the
    record of its last converge), and the module parameters it runs with otherwise; [] when none."""
    from driverd.apply import fingerprint as fpr
    from driverd.apply.hostplan import verdict_for_host
    from driverd.config import keep_settings
    from driverd.plan.actions import ACTIONS
    _, out = keep_settings(cfg, fpr.recorded_settings(fpr.read(sctx.root, cfg)) or {}, "the last converge")
    v = verdict_for_host(sctx, cfg)
    said = {x.split(":")[0].removeprefix("modules.parameters.") for x in out}      # "nvidia.NVreg_X"
    out += [d for d in v.drift if d.split(":")[0] not in said]
    out += [f"{s.action}: {s.reason}" for s in v.plan.changes if ACTIONS[s.action].touches]
    return out


def after_drain(facts, leaving: set[str]):
    """The host's facts without the GPU users whose pods the drain takes off."""
    if not leaving:
        return facts
    keep = tuple(u for u in facts.gpu_users if (u.pod_uid or "").replace("_", "-") not in leaving)
    return dataclasses.replace(facts, gpu_users=keep)


def _staying_words(facts, staying: dict[str, str]) -> list[str]:
    """Why the pods of the processes that still hold the GPU after the drain stay."""
    uids = {(u.pod_uid or "").replace("_", "-") for u in facts.gpu_users}
    return [f"pod {why}" for uid, why in sorted(staying.items()) if uid in uids]


def package_source(sctx, cfg, driver: str, flavor: str | None) -> str:
    """Where the node would get the package: "package … in URL", a local build, or "none: why"."""
    from driverd.errors import DriverdError
    from driverd.build.modules import local_builder
    from driverd.repo.fetch import Want, read_index
    from driverd.root.nodefiles import node_path
    from driverd.redact import redact
    release, arch = sctx.kernel.release, _arch(sctx)
    # the node's key, a host path under the root, refused when others can change it (not skipped below)
    public_key = node_path(sctx.root, cfg["packages.index_public_key"], "packages.index_public_key")
    unread: list[str] = []          # a repository that did not answer is not one without the package
    for url in cfg["packages.repositories"]:
        try:
            idx = read_index(url, public_key=public_key, runner=sctx.runner)
        except DriverdError as e:
            unread.append(f"{redact(url)}: {e.message}")
            continue
        if idx.find(driver, flavor or "", release, arch):
            return f"package {driver}/{flavor} for {release} in {url}"
    where = "in any repository" if not unread else \
        f"in the repositories that answered (could not read {'; '.join(unread)})"
    if cfg["packages.build_fallback"]:
        builder, why = local_builder(sctx.root, cfg, Want(driver, flavor or "", release, arch), sctx.runner)
        if builder is not None:
            return f"no repository has {driver}/{flavor} for {release}: it will be built on the node"
        return f"none: no package {driver}/{flavor} for kernel {release} {where}, and no local build: {why}"
    return f"none: no package {driver}/{flavor} for kernel {release} {where} (packages.build_fallback is off)"


def _arch(sctx) -> str:
    from driverd.host.kernel import read_kernel
    return read_kernel(sctx.root, []).arch or "x86_64"
