"""CDI spec for the NVIDIA GPUs (kind nvidia.com/gpu): one device per GPU by index (its /dev/nvidiaN
minor) and by UUID, plus `all`; the control nodes every GPU container needs go in the spec-wide edits.

We emit cdiVersion 0.5.0: the oldest version whose features cover what we write (containerd 2.1
reads 0.3.0 ... 1.0.0; Debian's containerd 1.6 has no CDI at all). `validate` checks a spec against
the rules of the version it declares, including the minimum version each feature needs.

CDI comes in two parts: `driverd runtime configure --cdi` enables CDI in the runtime at once (no GPU
needed); the spec needs the GPUs, so `refresh(root, options)` writes it once they are visible and
rewrites it when they (or the driver's device nodes) change — the daemon calls it after a load.
"""
from __future__ import annotations

import re

from driverd.errors import RuntimeConfigError
from driverd.nvproc import gpu_addresses, gpu_information
from driverd.root import Root

CDI_VERSION = "0.5.0"
KIND = "nvidia.com/gpu"
COMMON_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_CLASS = _NAME
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def gpu_devices(root: Root, facts=None) -> list[tuple[int, str | None]]:
    """(minor, uuid) per GPU: /proc/driver/nvidia/gpus/*/information first (no NVML needed), then
    NVML facts, then the /dev/nvidiaN nodes alone."""
    out: dict[int, str | None] = {}
    # read afresh, not from the facts: the spec follows the GPUs visible now (after a load)
    for pci in gpu_addresses(root):
        info = gpu_information(root, pci)
        if info.get("Device Minor", "").isdigit():
            uuid = info.get("GPU UUID")
            out[int(info["Device Minor"])] = uuid if uuid and "?" not in uuid else None
    if not out and facts is not None and getattr(facts, "nvml", None) and facts.nvml.available:
        for d in facts.nvml.devices:
            out[d.index] = d.uuid
    if not out:
        for n in root.listdir("/dev"):
            m = re.fullmatch(r"nvidia(\d+)", n)
            if m:
                out[int(m.group(1))] = None
    return sorted(out.items())


PENDING = ("no NVIDIA GPU is visible yet (driver not loaded?): CDI is enabled in the runtime; the spec {path} is "
           "written when the GPUs appear (driverd.runtime.cdi.refresh, which the daemon runs after a driver load)")


def build_if_visible(root: Root, facts=None) -> dict | None:
    """The spec for the GPUs visible now, None when there are none."""
    return build(root, facts) if gpu_devices(root, facts) else None


def refresh(root: Root, options=None, facts=None, dry_run: bool | None = None):
    """Write or rewrite the CDI spec from the GPUs visible now; a ChangeReport says what changed.

    Nothing is written when CDI is not enabled (options.cdi / runtime.cdi), when no GPU is visible
    (an existing spec is kept: it goes stale only if the GPUs changed, and the next refresh after the
    driver is back rewrites it), or when the spec on disk is already the one the GPUs give. Changes go
    through driverd's runtime record ("cdi"), so `driverd runtime revert --runtime cdi` removes the
    spec (or puts back a spec another tool had written there). Call it under the host lock."""
    from driverd.runtime.model import ChangeReport, Options
    options = options or Options(cdi=True)
    dry = options.dry_run if dry_run is None else dry_run
    report = ChangeReport("cdi", options.handler, "refresh", options.cdi_spec_path, dry_run=dry)
    if not options.cdi:
        report.skipped = "CDI is not enabled (runtime.cdi / --cdi): no spec written"
        return report
    spec = build_if_visible(root, facts)
    if spec is None:
        kept = " (the existing spec is kept)" if root.exists(options.cdi_spec_path) else ""
        report.skipped = (f"no NVIDIA GPU is visible: {options.cdi_spec_path} is written when the GPUs appear"
                          f"{kept}")
        return report
    write_spec(root, options, report, facts, dry, spec)
    if not report.files_changed:
        report.skipped = f"{options.cdi_spec_path} already describes the GPUs on this host: nothing to do"
    return report


def write_spec(root: Root, options, report, facts=None, dry: bool = False, spec: dict | None = None) -> None:
    """Write the spec (built from the GPUs now visible unless given) through driverd's runtime record
    ("cdi"): backed up once if another tool's spec was there, restored or removed by revert."""
    from driverd.runtime import state
    from driverd.runtime.model import ChangeReport, FileEdit
    spec = spec or build(root, facts)
    new = render(spec).encode()
    old = root.read_bytes(options.cdi_spec_path)
    sub = ChangeReport("cdi", options.handler)
    state.apply(root, "cdi", options.handler, [FileEdit(options.cdi_spec_path, new, old, "owned")], sub, dry)
    report.files_changed += sub.files_changed
    report.backups += sub.backups
    report.diffs.update(sub.diffs)
    devs = [d["name"] for d in spec["devices"]]
    report.notes.append(f"CDI spec {options.cdi_spec_path} (cdiVersion {spec['cdiVersion']}, kind {spec['kind']}): "
                        f"devices {', '.join(devs)}")


def build(root: Root, facts=None) -> dict:
    gpus = gpu_devices(root, facts)
    if not gpus:
        raise RuntimeConfigError("no NVIDIA GPU found for the CDI spec",
                                 cause="neither /proc/driver/nvidia/gpus, NVML nor /dev/nvidiaN lists a GPU",
                                 fix="load the driver first (driverd apply), then run again", exit_code=3)
    devices = []
    for minor, uuid in gpus:
        edits = {"deviceNodes": [{"path": f"/dev/nvidia{minor}"}]}
        devices.append({"name": str(minor), "containerEdits": edits})
        if uuid:
            devices.append({"name": uuid, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{minor}"}]}})
    devices.append({"name": "all", "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{m}"} for m, _ in gpus]}})
    common = [{"path": p} for p in COMMON_NODES if root.exists(p)]
    spec: dict = {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices}
    if common:
        spec["containerEdits"] = {"deviceNodes": common}
    problems = validate(spec)
    if problems:   # a bug of ours: never write a spec the runtimes would reject
        raise RuntimeConfigError("generated CDI spec is invalid: " + "; ".join(problems))
    return spec


def render(spec: dict) -> str:
    import yaml
    return ("# Written by driverd from the GPUs on this host; `driverd runtime revert` removes it.\n"
            + yaml.safe_dump(spec, sort_keys=False, default_flow_style=False))


def _vt(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _edits(e: object, where: str, need: list[tuple[str, str]], errs: list[str]) -> None:
    if not isinstance(e, dict):
        errs.append(f"{where}: containerEdits must be a mapping")
        return
    allowed = {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids"}
    for k in e:
        if k not in allowed:
            errs.append(f"{where}: unknown containerEdits field {k!r}")
    if "intelRdt" in e or "additionalGids" in e:
        need.append(("0.7.0", f"{where}: intelRdt/additionalGids"))
    for i, env in enumerate(e.get("env") or []):
        if not isinstance(env, str) or "=" not in env or env.startswith("="):
            errs.append(f"{where}.env[{i}]: must be NAME=VALUE")
    for i, n in enumerate(e.get("deviceNodes") or []):
        w = f"{where}.deviceNodes[{i}]"
        if not isinstance(n, dict) or not isinstance(n.get("path"), str) or not n["path"].startswith("/"):
            errs.append(f"{w}: 'path' is required and must be absolute")
            continue
        if "hostPath" in n:
            need.append(("0.5.0", f"{w}: hostPath"))
        if "permissions" in n and (not isinstance(n["permissions"], str) or set(n["permissions"]) - set("rwm")):
            errs.append(f"{w}: permissions must be made of r, w, m")
        if "type" in n and n["type"] not in ("b", "c", "u", "p"):
            errs.append(f"{w}: type must be b, c, u or p")
    for i, m in enumerate(e.get("mounts") or []):
        w = f"{where}.mounts[{i}]"
        if not isinstance(m, dict) or not m.get("hostPath") or not str(m.get("containerPath", "")).startswith("/"):
            errs.append(f"{w}: hostPath and an absolute containerPath are required")
        elif "type" in m:
            need.append(("0.4.0", f"{w}: type"))
    for i, h in enumerate(e.get("hooks") or []):
        w = f"{where}.hooks[{i}]"
        if not isinstance(h, dict) or not str(h.get("path", "")).startswith("/") or h.get("hookName") not in (
                "prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"):
            errs.append(f"{w}: needs a known hookName and an absolute path")


def validate(spec: object) -> list[str]:
    """Problems with `spec` under the rules of the CDI version it declares (empty: valid)."""
    errs: list[str] = []
    need: list[tuple[str, str]] = []
    if not isinstance(spec, dict):
        return ["the spec must be a mapping"]
    for k in spec:
        if k not in ("cdiVersion", "kind", "annotations", "devices", "containerEdits"):
            errs.append(f"unknown field {k!r}")
    ver = spec.get("cdiVersion")
    if ver not in KNOWN_VERSIONS:
        errs.append(f"cdiVersion {ver!r} is not a released CDI version ({', '.join(KNOWN_VERSIONS)})")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind.count("/") != 1:
        errs.append(f"kind {kind!r} must be vendor/class, e.g. nvidia.com/gpu")
    else:
        vendor, cls = kind.split("/")
        if not vendor or len(vendor) > 253 or not all(_LABEL.match(l) for l in vendor.split(".")):
            errs.append(f"kind {kind!r}: vendor must be a DNS subdomain")
        if not _CLASS.match(cls) or len(cls) > 63:
            errs.append(f"kind {kind!r}: class must be alphanumerics with - _ . inside, at most 63 characters")
        elif "." in cls:
            need.append(("0.6.0", "a dot in the kind's class"))
    if "annotations" in spec:
        need.append(("0.6.0", "spec annotations"))
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        errs.append("devices: at least one device is required")
        devices = []
    seen: set[str] = set()
    for i, d in enumerate(devices):
        if not isinstance(d, dict):
            errs.append(f"devices[{i}]: must be a mapping")
            continue
        name = d.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            errs.append(f"devices[{i}]: name {name!r} must start and end with an alphanumeric (- _ . inside)")
        elif name in seen:
            errs.append(f"devices[{i}]: duplicate name {name!r}")
        else:
            seen.add(name)
        for k in d:
            if k not in ("name", "annotations", "containerEdits"):
                errs.append(f"devices[{i}]: unknown field {k!r}")
        if "annotations" in d:
            need.append(("0.6.0", f"devices[{i}].annotations"))
        e = d.get("containerEdits")
        if not e:
            errs.append(f"devices[{i}]: containerEdits are required and must not be empty")
        else:
            _edits(e, f"devices[{i}].containerEdits", need, errs)
    if "containerEdits" in spec:
        _edits(spec["containerEdits"], "containerEdits", need, errs)
    if ver in KNOWN_VERSIONS:
        for minimum, what in need:
            if _vt(ver) < _vt(minimum):
                errs.append(f"{what} needs cdiVersion >= {minimum} (spec says {ver})")
    return errs
