"""detect, plan, config, debug capture-host: the read-only commands."""
from __future__ import annotations

import argparse

from driverd.cli.output import emit, table, yesno
from driverd.errors import EXIT_BLOCKED, EXIT_OK


def register(sub, common) -> None:
    p = sub.add_parser("detect", parents=[common], help="read the host (kernel, GPUs, driver, runtimes); changes nothing",
                       description="Read the host and print what driverd sees: kernel and module signing, OS, "
                       "NVIDIA GPUs with product/architecture/open-module support, NVSwitches, Mellanox NICs, "
                       "nouveau, the loaded driver, GPU users, container runtimes, NVML. Changes nothing.")
    p.add_argument("--no-nvml", action="store_true", help="skip NVML even on a live host")
    p.set_defaults(handler=cmd_detect)

    p = sub.add_parser("plan", parents=[common], help="print the steps a provisioning run would take, and why",
                       description="Decide the kernel-module flavour for the requested driver and print the "
                       "ordered steps that would bring this host to it, each with its reason. Steps already "
                       "satisfied are left out. A plan that cannot run says so: blocked_by (exit 3) or "
                       "reboot_required.")
    p.add_argument("--driver", metavar="VERSION", help="driver version, e.g. 535.261.03 (default: driver.version)")
    p.add_argument("--flavor", choices=("auto", "open", "proprietary"), help="kernel-module flavour (default: driver.flavor)")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("config", parents=[common], help="show the effective configuration and where each value comes from",
                       description="Load and validate <root>/etc/driverd/config.toml plus DRIVERD_* environment "
                       "overrides; print every key with its value and source.")
    p.add_argument("--keys", action="store_true", help="list every key, its environment variable and help")
    p.set_defaults(handler=cmd_config)

    dbg = sub.add_parser("debug", help="tools for bug reports and fixtures")
    dsub = dbg.add_subparsers(dest="debug_command", metavar="COMMAND")
    p = dsub.add_parser("capture-host", parents=[common], help="pack the files detect reads into a tarball",
                        description="Run detect with a recording root and pack every small read-only file it "
                        "read (sysfs, procfs, /etc, /boot/config) into a .tar.gz that unpacks into a host tree "
                        "usable with --root. The NVML report is included when NVML is available.")
    p.add_argument("--out", required=True, metavar="FILE", help="tarball to write (.tar.gz)")
    p.set_defaults(handler=cmd_capture)


def cmd_detect(ctx, args) -> int:
    from driverd.host import collect
    facts = collect(ctx.root, nvml=not args.no_nvml, handler=ctx.config["runtime.handler"])
    emit(ctx.json, facts.to_json(), render_facts)
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
    for u in f["gpu_users"]:
        lines.append(f"gpu user    pid {u['pid']} {u['comm']}" + (f" pod {u['pod_uid']}" if u["pod_uid"] else ""))
    for r in f["runtimes"]:
        lines.append(f"runtime     {r['name']} {r['version'] or ''} config {r['config_path']}"
                     f"{'' if r['config_exists'] else ' (absent)'} handlers: {', '.join(r['handlers']) or '-'}")
    if not f["runtimes"]:
        lines.append("runtime     none detected")
    n = f["nvml"]
    lines.append(f"nvml        {'available (' + n['source'] + ')' if n['available'] else 'unavailable: ' + str(n['reason'])}")
    for dev in n["devices"]:
        lines.append(f"  [{dev['index']}] {dev['name']} {dev['uuid']} {dev['memory_total_mib']} MiB "
                     f"persistence={yesno(dev['persistence_mode'])} mig={yesno(dev['mig_mode_current'])}")
    for w in f["warnings"]:
        lines.append(f"warning     {w}")
    return "\n".join(lines)


def cmd_plan(ctx, args) -> int:
    from driverd.host import collect
    from driverd.plan import Desired, plan
    cfg = ctx.config.with_overrides({"driver.version": args.driver, "driver.flavor": args.flavor})
    facts = collect(ctx.root, nvml=False, handler=cfg["runtime.handler"])
    p = plan(facts, Desired.from_config(cfg))
    emit(ctx.json, p.to_json(), render_plan)
    return EXIT_BLOCKED if p.blocked_by else EXIT_OK


def render_plan(p: dict) -> str:
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
    for w in p["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def cmd_config(ctx, args) -> int:
    from driverd import config as config_mod
    if args.keys:
        rows = [[k, config_mod.env_name(k), s.help + (f" [{'|'.join(s.allowed)}]" if s.allowed else "")]
                for k, s in config_mod.SCHEMA.items()]
        emit(ctx.json, {k: {"env": config_mod.env_name(k), "help": s.help, "allowed": list(s.allowed),
                            "default": s.default} for k, s in config_mod.SCHEMA.items()}, lambda _: table(rows, ""))
        return EXIT_OK
    cfg = ctx.config
    emit(ctx.json, {"path": cfg.path, "values": cfg.to_json()},
         lambda d: f"config {d['path']}\n" + table([[k, repr(v["value"]), v["source"]] for k, v in d["values"].items()]))
    return EXIT_OK


def cmd_capture(ctx, args) -> int:
    from driverd.host.capture import capture
    res = capture(ctx.root, args.out)
    emit(ctx.json, res, lambda r: f"wrote {r['out']} ({r['files']} files, {r['bytes']} bytes); "
                                  f"unpack it and use --root DIR")
    return EXIT_OK


__all__ = ["register", "argparse"]
