"""detect, plan, config, debug capture-host: the read-only commands."""
from __future__ import annotations

import argparse

from driverd.cli.options import Deprecated, add_flavor, root_of
from driverd.cli.output import emit, table, yesno
from driverd.errors import EXIT_BLOCKED, EXIT_OK


def register(sub, common) -> None:
    p = sub.add_parser("detect", parents=[common], help="read the host (kernel, GPUs, driver, runtimes); changes nothing",
                       description="Read the host and print what driverd sees: kernel and module signing, OS, "
                       "NVIDIA GPUs with product/architecture/open-module support, NVSwitches, Mellanox NICs, "
                       "nouveau, the loaded driver, GPU users, container runtimes, NVML. Changes nothing.")
    p.add_argument("--no-nvml", action="store_true", help="skip NVML even on a live host")
    p.set_defaults(handler=cmd_detect, read_only=True, early=early_detect)

    p = sub.add_parser("plan", parents=[common], help="print the steps a provisioning run would take, and why",
                       description="Decide the kernel-module flavour for the requested driver and print the "
                       "ordered steps that would bring this host to it, each with its reason. Steps already "
                       "satisfied are left out. A plan that cannot run says so: blocked_by (exit 3) or "
                       "reboot_required.")
    p.add_argument("--driver", metavar="VERSION", help="driver version, e.g. 535.261.03 (default: driver.version)")
    add_flavor(p, help="kernel-module flavour (default: driver.flavor)")
    p.set_defaults(handler=cmd_plan, read_only=True)

    p = sub.add_parser("gpus", parents=[common], help="look GPUs up in driverd's table: branches and flavours per NVIDIA",
                       description="Look device ids up in the GPU table generated from NVIDIA's lists "
                       "(supported-gpus.json, the open-modules README of every release; docs/gpus.md): name, "
                       "architecture, the branches that list each flavour, the legacy branch, and for --driver "
                       "whether that release supports each flavour, with the evidence. An id missing from the "
                       "table shows the inference rule's answer, if it has one. Without ids: this host's GPUs "
                       "(with their subsystem ids).")
    p.add_argument("ids", nargs="*", metavar="ID", help="PCI device id (2330, 0x2330) or ID:SUBVENDOR:SUBDEVICE "
                   "(2330:10de:16c1)")
    p.add_argument("--driver", metavar="VERSION", help="judge this driver release, e.g. 570.195.03")
    add_flavor(p, choices=("open", "proprietary"), help="only this kernel-module flavour's branches and verdict "
               "(default: both)")
    p.set_defaults(handler=cmd_gpus, read_only=True)

    p = sub.add_parser("config", parents=[common], help="show the effective configuration and where each value comes from",
                       description="Load and validate <root>/etc/driverd/config.toml plus DRIVERD_* environment "
                       "overrides; print the effective configuration as TOML driverd would load (every key with its "
                       "value and, as a comment, its source; unset keys commented out; the first line says which "
                       "file was read or that it is absent). --json: the same as an object.")
    p.add_argument("--keys", action="store_true", help="list every key, the environment variable that sets it (and "
                   "how: lists comma-separated; module parameters only in the file) and its help")
    p.set_defaults(handler=cmd_config, read_only=True)

    dbg = sub.add_parser("debug", help="tools for bug reports and fixtures")
    dsub = dbg.add_subparsers(dest="debug_command", metavar="COMMAND")
    p = dsub.add_parser("capture-host", parents=[common], help="pack the files detect reads into a tarball",
                        description="Run detect with a recording root and pack every small read-only file it "
                        "read (sysfs, procfs, /etc, /boot/config) into a .tar.gz that unpacks into a host tree "
                        "usable with --root. The NVML report is included when NVML is available. Secret values in "
                        "the copied configs (registry auth, tokens, passwords, private keys) are replaced with "
                        "REDACTED, and the output says which.")
    # --archive, not --out: --out names a directory everywhere else (build's, build-matrix's repository)
    p.add_argument("--archive", dest="out", metavar="FILE", help="tarball to write (.tar.gz); required")
    p.add_argument("--out", dest="out", metavar="FILE", action=Deprecated, new="--archive",
                   why=" here (--out names a directory in build and build-matrix)", help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_capture)


def early_detect(args):
    """Before the configuration: NVML's child and the pass over every process, on the live host
    (driverd.host.start_early)."""
    from driverd.host import start_early
    return start_early(root_of(args), nvml=not args.no_nvml)


def cmd_detect(ctx, args) -> int:
    from driverd.host import collect
    facts = collect(ctx.root, nvml=not args.no_nvml, handler=ctx.config["runtime.handler"],
                    binary=ctx.config["runtime.binary"], driver_root=ctx.config["validation.driver_root"])
    out = facts.to_json()
    if out.get("fabric"):
        # who owns IMEX here: the facts (the fabric, the DRA driver's kubelet plugin) under daemons.imex
        from driverd.plan.companions import decide
        out["fabric"]["imex_owner"] = decide(facts.fabric, len(facts.nvswitches), ctx.config["daemons.fabricmanager"],
                                             ctx.config["daemons.imex"]).imex_owner
    emit(ctx.json, out, render_facts)
    return EXIT_OK


def render_facts(f: dict) -> str:
    k, o, d = f["kernel"], f["os"], f["driver"]
    lines = [f"host        {f['hostname'] or '?'}  (root {f['root']})",
             f"os          {o['pretty_name'] or o['id']} (id={o['id']} version_id={o['version_id']})",
             f"kernel      {k['release']} {k['arch'] or ''}",
             f"  signatures enforced: {yesno(k['module_signature_enforced'])}"
             + (f" ({'; '.join(k['signature_enforcement_sources'])})" if k['signature_enforcement_sources'] else ""),
             f"  lockdown: {k['lockdown'] or 'n/a'}   secure boot: {k['secure_boot']}",
             f"  module unload: {yesno(k['module_unload_supported'])} ({k['module_unload_evidence']})",
             f"  headers: {k['headers_path'] if k['headers_present'] else 'missing'}"]
    kr = f.get("keyrings")
    if kr:
        if kr["readable"] and kr["keyrings"]:
            lines.append(f"  keyrings: {', '.join(kr['keyrings'])} (membership: {kr['membership']})")
            lines.extend(f"    key '{key['name'] or key['description']}' {(key['key_id'] or '')[:12]} in "
                         f"{', '.join(key['keyrings']) or '?'}" for key in kr["keys"] if key["type"] == "asymmetric")
        else:
            lines.append("  keyrings: not visible here" + (f" ({kr['notes'][0]})" if kr["notes"] else ""))
    if f["gpus"]:
        lines.append(f"gpus        {len(f['gpus'])}")
        lines.append(table([[g["pci_address"], g["device_id"], g["name"], g["architecture"],
                             f"open:{g['open_module_support']}", f"driver:{g['bound_driver'] or '-'}",
                             f"numa:{g['numa_node'] if g['numa_node'] is not None else '-'}"] for g in f["gpus"]]))
    else:
        lines.append("gpus        none: no NVIDIA GPU on this host")
    if f["nvswitches"]:
        lines.append(f"nvswitches  {len(f['nvswitches'])}: " + ", ".join(s["pci_address"] for s in f["nvswitches"]))
    if f["mellanox_nics"]:
        lines.append(f"mellanox    {len(f['mellanox_nics'])}: " + ", ".join(n["pci_address"] for n in f["mellanox_nics"]))
    lines.extend(render_fabric(f.get("fabric")))
    nv = f["nouveau"]
    lines.append(f"nouveau     loaded: {yesno(nv['loaded'])}  blacklisted: {yesno(nv['blacklisted'])}"
                 + (f"  bound: {', '.join(nv['bound_devices'])}" if nv["bound_devices"] else ""))
    if d["loaded"]:
        lines.append(f"driver      {d['version']} ({d['flavor']})")
        lines.append(table([[m["name"], f"refcount {m['refcount'] if m['refcount'] is not None else '-'}",
                             "holders " + (",".join(m["holders"]) or "-")] for m in d["modules"]]))
    else:
        lines.append("driver      not loaded")
    for p in d["installed"]:
        lines.append(f"installed   {p['driver_version']} ({p['flavor']}) for {p['kernel_release']}")
    own = f.get("driver_owner")
    if own and own["owners"]:
        lines.append(f"owned by    {own['summary']}")
    rd = f.get("rdma")
    if rd:
        lines.append(f"rdma        ib_core {rd['ib_core_source']}"
                     + (f" ({rd['ofed_version']})" if rd["ofed_version"] else "")
                     + f"; peer-memory API: {yesno(rd['peer_memory_api'])} ({rd['evidence']})")
    for u in f["gpu_users"]:
        lines.append(f"gpu user    pid {u['pid']} {u['comm']}" + (f" pod {u['pod_uid']}" if u["pod_uid"] else ""))
    for r in f["runtimes"]:
        lines.append(f"runtime     {r['name']} {r['version'] or ''} config {r['config_path']}"
                     f"{'' if r['config_exists'] else ' (absent)'} handlers: {', '.join(r['handlers']) or '-'}")
        lines.extend(render_needs(r.get("needs")))
    if not f["runtimes"]:
        lines.append("runtime     none detected")
    us = f.get("userspace")
    if us:
        lines.append(f"userspace   {us['version'] or 'version unknown'} in {us['lib_dir']}" if us["libs"] else
                     "userspace   not found (libcuda.so.1, libnvidia-ml.so.1)")
        lines.extend(f"  not workload-ready: {p}" for p in us.get("problems") or ())
    n = f["nvml"]
    lines.append(f"nvml        {'available (' + n['source'] + ')' if n['available'] else 'unavailable: ' + str(n['reason'])}")
    for dev in n["devices"]:
        lines.append(f"  [{dev['index']}] {dev['name']} {dev['uuid']} {dev['memory_total_mib']} MiB "
                     f"persistence={yesno(dev['persistence_mode'])} mig={yesno(dev['mig_mode_current'])}")
    for w in f["warnings"]:
        lines.append(f"warning     {w}")
    return "\n".join(lines)


def render_fabric(fab: dict | None) -> list[str]:
    """The fabric's kind and why (driverd.host.fabric), then what it needs beside the driver, each with what
    holds it back now (modules not loaded yet, a device node not there)."""
    if not fab:
        return []
    out = [f"fabric      {fab['kind']}: {fab['why']}"]
    wants = []
    for c in fab["wants"]:
        extra = []
        if c["after_modules"]:
            extra.append("after " + ", ".join(c["after_modules"])
                         + (f"; not loaded yet: {', '.join(c['waiting_for'])}" if c["waiting_for"] else ""))
        if c["path"]:
            extra.append(c["path"] + ("" if c["present"] else f" missing: {c['how']}"))
        wants.append(c["name"] + (f" ({'; '.join(extra)})" if extra else ""))
    if wants:
        out.append("  wants: " + ", ".join(wants))
    if fab.get("imex_owner"):
        out.append(f"  imex: {fab['imex_owner']}")
    elif fab.get("compute_domains"):
        out.append(f"  compute domains: {fab['compute_domains']} (the DRA driver runs IMEX for them)")
    return out


def render_needs(n: dict | None, indent: str = "  ") -> list[str]:
    """What the handler needs in one runtime (driverd.runtime.needs): the verdict, then CDI."""
    if not n:
        return []
    warn = "warning: " if n["status"] == "binary-missing" else ""
    return [f"{indent}{warn}{n['verdict']}", f"{indent}{n['cdi_line']}"]


def cmd_plan(ctx, args) -> int:
    from driverd.apply.hostplan import plan_for_host
    cfg = ctx.config.with_overrides({"driver.version": args.driver, "driver.flavor": args.flavor})
    p = plan_for_host(ctx.root, cfg).plan
    emit(ctx.json, p.to_json(), render_plan)
    return EXIT_BLOCKED if p.blocked_by else EXIT_OK


def cmd_gpus(ctx, args) -> int:
    import re

    from driverd.errors import UsageError
    from driverd.host import gputable
    wanted: list[tuple[str, str | None, str | None]] = []
    for raw in args.ids:
        m = re.fullmatch(r"(?:0x)?([0-9a-fA-F]{1,4})(?::(?:0x)?([0-9a-fA-F]{4}):(?:0x)?([0-9a-fA-F]{4}))?", raw.strip())
        if not m:
            raise UsageError(f"invalid GPU id {raw!r}", cause="expected a PCI device id like 2330 or 0x2330, "
                             "optionally with subsystem ids: 2330:10de:16c1", fix="pass the id lspci -nn shows")
        wanted.append((m.group(1), f"{m.group(2).lower()}:{m.group(3).lower()}" if m.group(2) else None, None))
    if not wanted:
        from driverd.host import pci
        gpus, _, _ = pci.classify(ctx.root, pci.scan(ctx.root, []), [])
        wanted = [(g.device_id, f"{g.subsystem_vendor_id[2:]}:{g.subsystem_device_id[2:]}"
                   if g.subsystem_vendor_id and g.subsystem_device_id else None, g.pci_address) for g in gpus]
    if args.driver:
        from driverd.plan.flavor import branch_of
        branch_of(args.driver)                      # a bad version is a usage error
    out = []
    for did, sub, addr in wanted:
        d = gputable.describe(did, sub, args.driver)
        if args.flavor:                 # the one flavour asked about; describe() judges both
            for key in ("flavors", "verdicts"):
                if key in d:
                    d[key] = {f: v for f, v in d[key].items() if f == args.flavor}
        if addr:
            d["pci_address"] = addr
        if sub:
            d["subsystem"] = sub
        out.append(d)
    emit(ctx.json, {"driver": args.driver, "table": _table_source(), "gpus": out}, render_gpus)
    return EXIT_OK


def _table_source() -> dict:
    from driverd.host import gputable
    t = gputable.table()
    return {"releases_open": [t["releases"]["open"][0], t["releases"]["open"][-1]],
            "supported_gpus": t["releases"]["supported_gpus"], "device_ids": t["counts"]["device_ids"]}


def render_gpus(doc: dict) -> str:
    if not doc["gpus"]:
        return "no NVIDIA GPU on this host (pass device ids to look them up)"
    import json
    # identical GPUs (same id, subsystem and verdicts: all but the address) are one block: a DGX's eight
    # H100s are "8 × 2330 … at 0000:18:00.0, …", not eight copies
    groups: dict[str, list[dict]] = {}
    for g in doc["gpus"]:
        groups.setdefault(json.dumps({k: v for k, v in g.items() if k != "pci_address"}, sort_keys=True), []).append(g)
    lines = []
    for same in groups.values():
        g = same[0]
        addrs = [x["pci_address"] for x in same if x.get("pci_address")]
        many = len(same) > 1
        where = f"{len(same)} × " if many else (f"{addrs[0]}  " if addrs else "")
        sub = f" subsystem {g['subsystem']}" if g.get("subsystem") else ""
        at = [f"  at:           {', '.join(addrs)}"] if many and addrs else []
        if not g["known"]:
            inf = g["inference"]
            lines.append(f"{where}{g['device_id']}{sub}  not in driverd's GPU table")
            lines.extend(at)
            if inf:
                lines.append(f"  inferred:     {inf['flavor_class']}"
                             + (f" (legacy {inf['legacy_branch']})" if inf["legacy_branch"] else "")
                             + (f", {inf['architecture']} by its id block" if inf["architecture"] else ""))
                lines.append(f"  rule:         {inf['rule']}")
            else:
                lines.append("  inferred:     nothing: no written-down rule applies; plan with --flavor open|proprietary")
            lines.append(f"  fix:          {g['fix']}")
            continue
        lines.append(f"{where}{g['device_id']}{sub}  {g['name']}  ({g['architecture']}"
                     + (f" {g['chip']}" if g["chip"] else "") + ")")
        lines.extend(at)
        lines.append(f"  flavours:     {g['flavor_class']}" + (f" ({g['class_from']})" if g.get("class_from") else ""))
        if g["legacy_branch"]:
            n = g["legacy_branch"].split(".")[0]
            src = f" (supported-gpus.json {g['legacy_from']})" if g.get("legacy_from") else ""
            lines.append(f"  legacy:       {g['legacy_branch']}{src}: branches up to and including {n}.x drive it, "
                         f"no later one")
        if g["subsystems"]:
            lines.append(f"  rows:         {', '.join(g['rows'])} (NVIDIA lists subsystems {', '.join(g['subsystems'])})")
        if g.get("subsystem_note"):
            lines.append(f"  note:         {g['subsystem_note']}")
        for f, info in g["flavors"].items():
            lines.append(f"  {f + ':':<13} {info['history']}")
        for f, v in (g.get("verdicts") or {}).items():
            ok = {True: "yes", False: "NO", None: "unknown"}[v["supported"]]
            lines.append(f"  {doc['driver']} {f}: {ok}: {v['evidence']}")
    return "\n".join(lines)


def render_plan(p: dict) -> str:
    if p.get("driver_managed_by"):
        lines = [f"driver left to {p['driver_managed_by']} (kernel {p['kernel_release']})",
                 f"  {p['flavor_reason']}"]
        if p["blocked_by"]:
            lines.append("BLOCKED:")
            lines.extend(f"  - {b}" for b in p["blocked_by"])
        lines.extend(f"{i:2}. {s['action']:<20} {s['reason']}" for i, s in enumerate(p["steps"], 1))
        if not p["steps"] and not p["blocked_by"]:
            lines.append("nothing to do: the runtimes are configured")
        if p["modules"]:
            lines.append(f"converged means: driver {p['driver_version']} ({p['flavor']}) with "
                         f"{', '.join(p['modules'])} loaded, as the host runs it")
        lines.extend(_plan_runtimes(p))
        lines.extend(f"warning: {w}" for w in _other_warnings(p))
        return "\n".join(lines)
    if p["flavor"] is None:
        return f"nothing to do: {p['flavor_reason']}"
    lines = [f"driver {p['driver_version']} ({p['flavor']}) for kernel {p['kernel_release']}",
             f"  flavour: {p['flavor_reason']}"]
    if p["blocked_by"]:
        lines.append("BLOCKED:")
        lines.extend(f"  - {b}" for b in p["blocked_by"])
    if p["reboot_required"]:
        lines.append("REBOOT REQUIRED:")
        lines.extend(f"  - {r}" for r in p["reboot_reasons"])
    if not p["steps"]:
        lines.append("nothing to do: the host is already in the desired state" if not p["blocked_by"] else "")
    for i, s in enumerate(p["steps"], 1):
        lines.append(f"{i:2}. {s['action']:<20} {s['reason']}")
    if p["modules"]:
        lines.append(f"modules: {', '.join(p['modules'])}")
    if p["persistence"]:            # a daemon, not a module: a line of its own
        lines.append("daemons: nvidia-persistenced")
    if p.get("fabric"):
        lines.append(f"fabric: {p['fabric']}")
    sig = p.get("signatures")
    if sig:
        lines.append(f"signatures: {sig['status']}: {sig['summary']}"
                     + (f" (read from {sig['source']})" if sig.get("source") else ""))
        lines.extend(f"  {m['module']}: {m['evidence']}" for m in sig["modules"][1:])
        if sig.get("enrol"):
            lines.append(f"  fix: {sig['enrol']}")
    lines.extend(_plan_runtimes(p))
    for w in _other_warnings(p):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _plan_runtimes(p: dict) -> list[str]:
    needs = p.get("runtimes") or []
    return (["runtimes:"] + [ln for n in needs for ln in render_needs(n)]) if needs else []


def _other_warnings(p: dict) -> list[str]:
    """The plan's warnings less the runtime verdicts the runtimes section already printed as warnings."""
    shown = {n["verdict"] for n in p.get("runtimes") or []}
    return [w for w in p["warnings"] if w not in shown]


def cmd_config(ctx, args) -> int:
    from driverd import config as config_mod
    if args.keys:
        def env(k: str) -> str:
            if not config_mod.env_settable(k):
                return "(" + config_mod.env_syntax(k) + ")"
            return config_mod.env_name(k) + (" (comma-separated)" if config_mod.SCHEMA[k].type == "list" else "")
        rows = [[k, env(k), s.help + (f" [{'|'.join(s.choices())}]" if s.choices() else "")]
                for k, s in config_mod.SCHEMA.items()]
        emit(ctx.json, {k: {"env": config_mod.env_name(k) if config_mod.env_settable(k) else None,
                            "env_syntax": config_mod.env_syntax(k), "help": s.help, "allowed": list(s.choices()),
                            "default": s.default} for k, s in config_mod.SCHEMA.items()}, lambda _: table(rows, ""))
        return EXIT_OK
    cfg = ctx.config
    emit(ctx.json, {"path": cfg.path, "read": bool(cfg.found), "values": cfg.to_json()}, lambda _: cfg.to_toml())
    return EXIT_OK


def cmd_capture(ctx, args) -> int:
    from driverd.host.capture import capture
    if not args.out:             # not argparse's required=: the old spelling --out must satisfy it too
        from driverd.errors import UsageError
        raise UsageError("capture-host needs the tarball to write", fix="pass --archive FILE (e.g. host.tar.gz)")
    res = capture(ctx.root, args.out)

    def say(r: dict) -> str:
        red = r.get("redacted") or []
        what = (f"redacted {sum(len(x['keys']) for x in red)} secret value(s) in {len(red)} file(s): "
                + "; ".join(f"{x['path']} ({', '.join(x['keys'])})" for x in red)) if red else \
            "no secret values found to redact"
        return f"wrote {r['out']} ({r['files']} files, {r['bytes']} bytes); {what}; unpack it and use --root DIR"
    emit(ctx.json, res, say)
    return EXIT_OK


__all__ = ["register", "argparse"]
