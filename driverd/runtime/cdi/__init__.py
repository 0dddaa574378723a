"""CDI spec for the NVIDIA GPUs (kind nvidia.com/gpu): one device per GPU by index (its /dev/nvidiaN
minor) and by UUID, plus `all`; what every GPU container needs goes in the spec-wide edits: the control
device nodes, the driver's user-space and a way for the container's loader to find it.

The user-space is what NVIDIA's own generator gives a container (`nvidia-ctk cdi generate`,
nvidia-container-toolkit v1.20.2, pkg/nvcdi/driver-nvml.go and common-nvml.go), found by
`driverd.driver.files.inventory` — the finder the workload validation uses too:
- every library of the driver's version (`*.so.<version>` in its library directories) and the binaries
  (nvidia-smi, nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control/-server, nvidia-imex[-ctl]),
  read-only bind mounts; GSP firmware (`/lib/firmware/nvidia/<version>/gsp*.bin`); the IPC sockets that
  exist (persistenced, fabric manager) and the MPS pipe directory, with NVIDIA's IPC options (no `ro`:
  internal/discover/ipc.go since "remove ro mount option from IPC sockets"); every host path only when
  root vouches for it (`driverfiles.mount_problem`: root's, not group/world-writable, in root's
  directories; IPC endpoints never through a link), else left out with a note;
- container paths are host paths without the driver root (/run/nvidia/driver/usr/lib/x86_64-linux-gnu/X
  is /usr/lib/x86_64-linux-gnu/X in the container, /usr/local/nvidia/lib64/X is /lib64/X), as nvidia-ctk;
- with NVIDIA's `nvidia-cdi-hook` on the host (where nvidia-ctk looks for it, and the GPU Operator's
  /usr/local/nvidia/toolkit), the createContainer hooks nvidia-ctk adds: create-symlinks (the soname and
  .so links the host has next to each library, and libcuda.so -> libcuda.so.1), enable-cuda-compat,
  update-ldcache --folder <lib dir>, disable-device-node-modification, update-application-profile;
- without it, the links are bind mounts of the library itself under the link's name and the loader
  finds the directory through LD_LIBRARY_PATH (which replaces the image's own value: docs/cdi.md).
NVIDIA_VISIBLE_DEVICES=void and the "void" device-list mount keep nvidia-container-runtime from
injecting the GPUs a second time. docs/cdi.md lists every difference from nvidia-ctk's spec and why.

IMEX channels (GB200/GB300 NVL72-class hosts: driverd.host.fabric): each /dev/nvidia-caps-imex-channels/
channel<N> the host has is a device of its own, `imex-channel<N>`, whose one edit is that node — path and
hostPath, the shape nvidia-ctk's imex mode gives it (pkg/nvcdi/lib-imex.go, imexChannel.GetDeviceSpecs;
NVIDIA names it nvidia.com/imex-channel=<N> in a spec of its own kind). A container asks for it beside its
GPUs; neither `all` nor the spec-wide edits carry it: a channel is the right to import memory other nodes
exported into it, which NVIDIA's runtime also gives only on request (NVIDIA_IMEX_CHANNELS).

Who writes the spec: driverd writes /var/run/cdi/nvidia.yaml — the file the toolkit's own
nvidia-cdi-refresh service writes — unless that service is installed and can run on this host, or
another spec of kind nvidia.com/gpu sits in the same directory; then the spec is left to the toolkit
(two specs of one kind and device names in one directory make the CDI registry refuse both), and a
spec driverd wrote there is taken back unless the toolkit's refresh writes the very same file.

We emit cdiVersion 0.5.0: the oldest version whose features cover what we write (containerd 2.1
reads 0.3.0 ... 1.0.0; Debian's containerd 1.6 has no CDI at all). `validate` checks a spec against
the rules of the version it declares, including the minimum version each feature needs.

CDI comes in two parts: `driverd runtime configure --cdi` enables CDI in the runtime at once (no GPU
needed); the spec needs the GPUs, so `refresh(root, options)` writes it once they are visible and
rewrites it when they (or the driver's device nodes or user-space) change.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.driver import files as driverfiles
from driverd.errors import RuntimeConfigError
from driverd.nvproc import gpu_addresses, gpu_information, imex_channels
from driverd.root import Root
from driverd.runtime.cdi.validate import validate

CDI_VERSION = "0.5.0"
KIND = "nvidia.com/gpu"
COMMON_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")

# NVIDIA's hook binary: nvidia-ctk resolves it on PATH and in its default PATH (api/config/v1/config.go
# ResolveNVIDIACDIHookPath, pkg/lookup/path.go); the GPU Operator installs the toolkit in
# /usr/local/nvidia/toolkit. nvidia-ctk itself runs the same hooks as `nvidia-ctk hook <name>`.
HOOK_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/nvidia/toolkit")
HOOK_BINARIES = (("nvidia-cdi-hook", ("nvidia-cdi-hook",)), ("nvidia-ctk", ("nvidia-ctk", "hook")))
HOOK_ENV = ["NVIDIA_CTK_DEBUG=false"]
LIB_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]          # internal/discover/mounts.go
IPC_OPTIONS = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]      # internal/discover/ipc.go
# pkg/nvcdi/wrapper.go GetCommonEdits: nvidia-container-runtime must not inject the devices again.
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"
VOID_MOUNT = {"hostPath": "/dev/null", "containerPath": "/var/run/nvidia-container-devices/void",
              "options": ["ro", "nosuid", "nodev", "bind"]}

# The toolkit's own writer of the spec (deployments/systemd/nvidia-cdi-refresh.{service,path}, installed
# by the nvidia-container-toolkit-base package since 1.18) and what it needs to run (its Condition*s).
TOOLKIT_UNIT = "nvidia-cdi-refresh.service"
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
             "/usr/lib/systemd/system", "/lib/systemd/system")
TOOLKIT_CTK = "/usr/bin/nvidia-ctk"
TOOLKIT_SMI = ("/usr/bin/nvidia-smi", "/usr/sbin/nvidia-smi", "/usr/lib/wsl/lib/nvidia-smi")
TOOLKIT_ENV = "/etc/nvidia-container-toolkit/nvidia-cdi-refresh.env"
TOOLKIT_OUTPUT = "/var/run/cdi/nvidia.yaml"


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


# -- the hook -------------------------------------------------------------------------------------------
def find_hook(root: Root) -> tuple[str, list[str]] | None:
    """(host path, argv before the hook's name) of NVIDIA's CDI hook binary, None when there is none."""
    for name, argv in HOOK_BINARIES:
        for d in HOOK_DIRS:
            p = f"{d}/{name}"
            real = root.safe_real(p)
            try:
                st = os.stat(real) if real is not None else None
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                return p, list(argv)
    return None


def _hook(hook: tuple[str, list[str]], name: str, *args: str) -> dict:
    return {"hookName": "createContainer", "path": hook[0], "args": [*hook[1], name, *args], "env": list(HOOK_ENV)}


# -- the user-space edits -----------------------------------------------------------------------------------
def _links(lib: driverfiles.Library, cdir: str) -> list[tuple[str, str]]:
    """(target, link) pairs nvidia-ctk's create-symlinks makes for one library (internal/discover/symlinks.go):
    the names some applications dlopen although no package ships them, then the soname and .so links
    the host itself has next to the library."""
    name, have = lib.name, {n for n, _ in lib.links}
    out = []
    if name.startswith("libcuda.so.") and name.count(".") >= 3:
        out.append(("libcuda.so.1", f"{cdir}/libcuda.so"))
    elif name.startswith("libGLX_nvidia.so."):
        out.append((name, f"{cdir}/libGLX_indirect.so.0"))
    elif name.startswith("libnvidia-opticalflow.so."):
        out.append(("libnvidia-opticalflow.so.1", f"{cdir}/libnvidia-opticalflow.so"))
    if lib.soname and lib.soname != name and lib.soname in have:
        out.append((name, f"{cdir}/{lib.soname}"))
    target = lib.soname or name
    dev = driverfiles.dev_link(target)
    if dev and dev != target and dev in have:
        out.append((target, f"{cdir}/{dev}"))
    return out


@dataclass
class UserSpaceEdits:
    """What a container is given to see the driver's user-space: mounts, hooks, environment."""
    env: list[str] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    hooks: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loader: str = "none"                   # hook (nvidia-cdi-hook: ldcache + links) | env (LD_LIBRARY_PATH) | none


def user_space_edits(inv: driverfiles.Inventory, hook: tuple[str, list[str]] | None) -> UserSpaceEdits:
    """The mounts, hooks and environment that give a container the driver's user-space `inv`."""
    us, out = inv.userspace, UserSpaceEdits()
    mounts: dict[str, dict] = {}

    def mount(host: str, container: str, options: list[str]) -> None:
        mounts.setdefault(container, {"hostPath": host, "containerPath": container, "options": list(options)})

    if inv.problem:
        out.notes.append(f"driver user-space: {inv.problem}; the CDI spec gives containers the device nodes only "
                         "(CUDA inside them cannot load libcuda.so.1)")
    for why in inv.left_out:
        out.notes.append(f"left out of the CDI spec: {why} — someone other than root could change what every GPU "
                         "container gets there (make it root's and not group/world-writable, never a link, and "
                         "refresh the spec)")
    links: list[str] = []
    lib_dirs: list[str] = []            # container directories of the libraries, in library order
    for lib in inv.libraries:
        cpath = us.relative(lib.path)
        cdir = os.path.dirname(cpath)
        mount(lib.path, cpath, LIB_OPTIONS)
        if cdir not in lib_dirs:
            lib_dirs.append(cdir)
        for target, link in _links(lib, cdir):
            if hook is not None:
                links.append(f"{target}::{link}")
            else:               # no hook to create the link: the library itself under the link's name
                mount(lib.path, link, LIB_OPTIONS)
    for name, p in inv.binaries.items():
        mount(p, us.relative(p), LIB_OPTIONS)
    for p in inv.firmware:
        mount(p, f"/lib/firmware/nvidia/{inv.version}/{os.path.basename(p)}", LIB_OPTIONS)
    for target, p in inv.ipc.items():
        mount(p, target, IPC_OPTIONS)
    # nvidia-ctk's NVIDIA_CTK_LIBCUDA_DIR: the directories of lib*.so.<version> (not vdpau/)
    main_dirs = [d for d in lib_dirs if os.path.basename(d) != "vdpau"] or lib_dirs
    if inv.libraries and hook is not None:
        out.loader = "hook"
        out.hooks.append(_hook(hook, "create-symlinks", *[a for x in dict.fromkeys(links) for a in ("--link", x)]))
        out.hooks.append(_hook(hook, "enable-cuda-compat", f"--host-driver-version={inv.version}"))
        out.hooks.append(_hook(hook, "update-ldcache", *[a for d in lib_dirs for a in ("--folder", d)]))
        out.hooks.append(_hook(hook, "disable-device-node-modification"))
        out.hooks.append(_hook(hook, "update-application-profile"))
        out.env.append("NVIDIA_CTK_LIBCUDA_DIR=" + ":".join(main_dirs))
    elif inv.libraries:
        out.loader = "env"
        out.env.append("LD_LIBRARY_PATH=" + ":".join(main_dirs))
        out.notes.append(f"nvidia-cdi-hook is not installed ({', '.join(HOOK_DIRS)}): containers find the driver's "
                         f"libraries through LD_LIBRARY_PATH={':'.join(main_dirs)}, which replaces the image's own "
                         "LD_LIBRARY_PATH; install NVIDIA's container toolkit for the ld-cache hooks (docs/cdi.md)")
    out.env.append(VOID_ENV)
    out.mounts = sorted(mounts.values(), key=lambda m: m["containerPath"]) + [dict(VOID_MOUNT)]
    return out


def build_if_visible(root: Root, facts=None) -> dict | None:
    """The spec for the GPUs visible now, None when there are none."""
    return build(root, facts) if gpu_devices(root, facts) else None


def build(root: Root, facts=None, driver_root: str | None = None) -> dict:
    return build_with_notes(root, facts, driver_root)[0]


def build_with_notes(root: Root, facts=None, driver_root: str | None = None) -> tuple[dict, list[str]]:
    """The spec for the GPUs visible now and what a reader of the report should know about it (the
    user-space found or not, the loader fallback)."""
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
    channels = imex_devices(root)
    devices += channels
    devices.append({"name": "all", "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{m}"} for m, _ in gpus]}})
    inv = driverfiles.inventory(root, driver_root=driver_root)
    us = user_space_edits(inv, find_hook(root))
    common: dict = {}
    if us.env:
        common["env"] = us.env
    nodes = [{"path": p} for p in COMMON_NODES if root.exists(p)]
    if nodes:
        common["deviceNodes"] = nodes
    if us.hooks:
        common["hooks"] = us.hooks
    common["mounts"] = us.mounts
    spec: dict = {"cdiVersion": CDI_VERSION, "kind": KIND, "devices": devices, "containerEdits": common}
    problems = validate(spec)
    if problems:   # a bug of ours: never write a spec the runtimes would reject
        raise RuntimeConfigError("generated CDI spec is invalid: " + "; ".join(problems))
    notes = us.notes
    if channels:
        names = ", ".join(d["name"] for d in channels)
        notes = notes + [f"IMEX channels: {names} (a container asks for one beside its GPUs, e.g. --device "
                         f"{KIND}={channels[0]['name']}; `all` does not include them)"]
    if inv.libraries:
        notes = [f"driver user-space {inv.version} from {inv.userspace.driver_root} ({len(inv.libraries)} libraries in "
                 f"{', '.join(inv.lib_dirs)}, {len(inv.binaries)} binaries, {len(inv.firmware)} firmware files, "
                 f"IPC: {', '.join(inv.ipc) or 'none'}; loader: {us.loader})"] + notes
    return spec, notes


def imex_devices(root: Root) -> list[dict]:
    """A device per IMEX channel node on the host, by channel number (see the module's docstring)."""
    return [{"name": f"imex-channel{n}", "containerEdits": {"deviceNodes": [{"path": p, "hostPath": p}]}}
            for n, p in imex_channels(root)]


# -- who writes the spec ----------------------------------------------------------------------------------
def _env_file(root: Root, path: str) -> dict[str, str]:
    out = {}
    for line in (root.read_text(path, 64 << 10) or "").splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip().strip("'\"")
    return out


@dataclass(frozen=True)
class ToolkitRefresh:
    """The NVIDIA container toolkit's own spec writer on this host, and whether it will run."""
    unit: str                          # host path of nvidia-cdi-refresh.service
    output: str                        # the spec it writes (NVIDIA_CTK_CDI_OUTPUT_FILE_PATH)
    driver_root: str                   # where it looks for the driver (NVIDIA_CTK_DRIVER_ROOT)
    runs: bool                         # not masked and its conditions hold (nvidia-ctk and nvidia-smi exist)
    why_not: str | None = None


def toolkit_refresh(root: Root) -> ToolkitRefresh | None:
    """nvidia-cdi-refresh.service as systemd would see it (the first unit file in systemd's search order;
    one in /etc or /run that is empty or links to /dev/null masks it), None when it is not installed."""
    unit = None
    for d in UNIT_DIRS:
        p = f"{d}/{TOOLKIT_UNIT}"
        link = root.readlink(p)
        if link == "/dev/null" or (root.exists(p) and root.is_file(p) and not (root.read_bytes(p, 1 << 20) or b"").strip()):
            return ToolkitRefresh(p, TOOLKIT_OUTPUT, "/", False, f"{TOOLKIT_UNIT} is masked ({p})")
        if root.is_file(p):
            unit = p
            break
    if unit is None:
        return None
    env = _env_file(root, TOOLKIT_ENV)
    output = env.get("NVIDIA_CTK_CDI_OUTPUT_FILE_PATH") or TOOLKIT_OUTPUT
    droot = env.get("NVIDIA_CTK_DRIVER_ROOT") or "/"
    if not root.exists(TOOLKIT_CTK):
        return ToolkitRefresh(unit, output, droot, False, f"{TOOLKIT_CTK} is missing (the unit's ConditionPathExists)")
    if not any(root.exists(p) for p in TOOLKIT_SMI):
        return ToolkitRefresh(unit, output, droot, False,
                              f"none of {', '.join(TOOLKIT_SMI)} exists (the unit's ConditionPathExists): it never runs")
    return ToolkitRefresh(unit, output, droot, True)


def _spec_kind(root: Root, path: str) -> str | None:
    text = root.read_text(path, 4 << 20)
    if not text:
        return None
    try:
        import yaml
        doc = yaml.safe_load(text)
    except Exception:               # noqa: BLE001 - another tool's file: unreadable is not ours to judge
        return None
    return doc.get("kind") if isinstance(doc, dict) else None


def other_specs(root: Root, path: str) -> list[str]:
    """Specs of kind nvidia.com/gpu in the directory of `path` that are not `path`: with ours they would
    define the same devices twice at one priority, which the CDI registry refuses for both."""
    d = os.path.dirname(path)
    return [p for p in root.glob(d) if p != path and p.endswith((".yaml", ".yml", ".json")) and root.is_file(p)
            and _spec_kind(root, p) == KIND]


@dataclass
class SpecPlan:
    """What a refresh (or configure --cdi) does with the spec: write `spec`, wait for GPUs, or leave the
    spec to another writer (`owner`)."""
    path: str
    spec: dict | None = None
    notes: list[str] = field(default_factory=list)
    owner: str | None = None               # "toolkit" | "other" when driverd leaves the spec alone
    reason: str | None = None              # why driverd does not write it
    toolkit_output: str | None = None


def plan(root: Root, options, facts=None) -> SpecPlan:
    """Decide who writes the spec and, when driverd does, build it (raises only for a bug of ours)."""
    path = options.cdi_spec_path
    sp = SpecPlan(path)
    tk = toolkit_refresh(root)
    if tk is not None and tk.runs:
        sp.owner, sp.toolkit_output = "toolkit", tk.output
        sp.reason = (f"NVIDIA's container toolkit writes the CDI spec on this host ({tk.unit} -> {tk.output}, "
                     f"driver root {tk.driver_root}): driverd leaves the spec to it (two writers of one spec, or two "
                     "specs of one kind, make containers fail)")
        us = driverfiles.find(root)

        def real(p: str) -> str:           # compared as the finder reports roots: links followed inside the root
            try:
                return root.resolve(os.path.normpath(p)) if os.path.normpath(p) != "/" else "/"
            except (OSError, ValueError):
                return os.path.normpath(p)
        if us.found and real(tk.driver_root) != (us.driver_root or "/"):
            # a driver root that is a link (driverd's /run/nvidia/driver -> current) is named, not the tree it
            # points to now: the toolkit's setting then survives the next switch
            name = driverfiles.DRIVER_ROOTS[0] if real(driverfiles.DRIVER_ROOTS[0]) == us.driver_root else us.driver_root
            sp.notes.append(f"the driver's user-space is under {us.driver_root}, but the toolkit generates from "
                            f"{tk.driver_root}: its spec will lack the libraries; set NVIDIA_CTK_DRIVER_ROOT="
                            f"{name} in {TOOLKIT_ENV}")
        return sp
    if tk is not None:
        sp.notes.append(f"{TOOLKIT_UNIT} is installed ({tk.unit}) but will not write a spec: {tk.why_not}; driverd "
                        "writes it")
    others = other_specs(root, path)
    if others:
        sp.owner = "other"
        sp.reason = (f"another CDI spec of kind {KIND} is in {os.path.dirname(path)} ({', '.join(others)}): driverd "
                     f"does not write {path} beside it (the CDI registry refuses devices defined twice at one priority)")
        return sp
    if gpu_devices(root, facts):
        _refuse_mismatch(root, options)
        sp.spec, notes = build_with_notes(root, facts)
        sp.notes += notes
    return sp


def _refuse_mismatch(root: Root, options) -> None:
    """A spec of a user-space that is not the loaded driver's gives every container an NVML/RM version
    mismatch (nvidia-smi: "Failed to initialize NVML: Driver/library version mismatch"; cuInit
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH): refused, naming both versions, unless asked for (force_cdi)."""
    from driverd.driver.ident import loaded
    drv = loaded(root)
    us = driverfiles.find(root)
    if drv is None or not us.found or not us.version or us.version == drv.version:
        return
    if getattr(options, "force_cdi", False):
        return
    raise RuntimeConfigError(f"not writing the CDI spec: the driver's user-space under {us.driver_root} is "
                             f"{us.version}, the loaded driver is {drv.version}; containers given it would fail with "
                             "an NVML/RM version mismatch (cuInit CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)",
                             cause="the user-space found first is not the loaded driver's version",
                             fix=f"install the {drv.version} user-space (or load the {us.version} driver), then run "
                                 "again; runtime configure --allow-mismatch writes the spec anyway")


def commit(root: Root, options, report, sp: SpecPlan, dry: bool = False) -> None:
    """Carry out `sp`: write the spec through driverd's runtime record ("cdi"), or step back."""
    report.notes += sp.notes
    if sp.owner is not None:
        report.notes.append(sp.reason)
        _step_back(root, options, report, sp, dry)
    elif sp.spec is None:
        report.notes.append(PENDING.format(path=sp.path))
    else:
        _forget_rewritten(root, options.state_dir, report, dry, keep=sp.path)
        write_spec(root, options, report, None, dry, sp.spec)


def _recorded_specs(root: Root, state_dir: str) -> dict[str, dict]:
    from driverd.runtime import state
    return dict((state.recorded(root, "cdi", state_dir) or {}).get("files") or {})


def _forget_rewritten(root: Root, state_dir: str, report, dry: bool, keep: str | None = None) -> list[str]:
    """Drop from driverd's record the spec files (but `keep`) someone else rewrote since driverd wrote
    them (the toolkit's refresh writes the same file): they are theirs now, and a revert must not remove
    them. Returns the paths dropped."""
    from driverd.runtime import state
    files = _recorded_specs(root, state_dir)
    drop = [p for p, f in files.items() if p != keep and (cur := state.read(root, p)) is not None
            and state.sha256(cur) != f.get("written_sha256")]
    for p in drop:
        report.notes.append(f"{p} was rewritten by another tool since driverd wrote it: it is theirs now "
                            "(driverd's record of it dropped, the file left as it is)")
    if not drop or dry:
        return drop
    data = state.load(root, state_dir)
    rec = data["runtimes"].get("cdi") or {}
    for p in drop:
        frec = rec.get("files", {}).pop(p, None)
        if frec and frec.get("backup"):
            root.unlink(frec["backup"])
    if not rec.get("files"):
        data["runtimes"].pop("cdi", None)
    state.save(root, data, state_dir)
    return drop


def _step_back(root: Root, options, report, sp: SpecPlan, dry: bool) -> None:
    """driverd does not write the spec: a spec it wrote where the toolkit writes stays until the toolkit
    rewrites it (no moment without a spec); one it wrote anywhere else goes (it would define the devices
    a second time)."""
    from driverd.runtime import state
    from driverd.runtime.changes import ChangeReport
    dropped = _forget_rewritten(root, options.state_dir, report, dry)
    files = {p: f for p, f in _recorded_specs(root, options.state_dir).items() if p not in dropped}
    if not files:
        return
    if sp.owner == "toolkit" and set(files) == {sp.toolkit_output}:
        report.notes.append(f"{sp.toolkit_output} still holds driverd's spec until the toolkit's refresh rewrites it")
        return
    sub = ChangeReport("cdi", options.handler, "revert", dry_run=dry)
    state.revert(root, "cdi", sub, dry, options.state_dir)
    report.files_changed += sub.files_changed
    report.diffs.update(sub.diffs)
    report.notes += [f"driverd's own spec taken back: {n}" for n in sub.notes]


def refresh(root: Root, options=None, facts=None, dry_run: bool | None = None):
    """Write or rewrite the CDI spec from the GPUs visible now; a ChangeReport says what changed.

    Nothing is written when CDI is not enabled (options.cdi / runtime.cdi), when the spec is left to
    another writer (the toolkit's nvidia-cdi-refresh, another spec of the kind: `plan`), when no GPU is
    visible (an existing spec is kept: it goes stale only if the GPUs changed, and the next refresh after
    the driver is back rewrites it), or when the spec on disk is already the one the host gives. Changes
    go through driverd's runtime record ("cdi"), so `driverd runtime revert --runtime cdi` removes the
    spec (or puts back a spec another tool had written there). Call it under the host lock."""
    from driverd.runtime.changes import ChangeReport, Options
    options = options or Options(cdi=True)
    dry = options.dry_run if dry_run is None else dry_run
    report = ChangeReport("cdi", options.handler, "refresh", options.cdi_spec_path, dry_run=dry)
    if not options.cdi:
        report.skipped = "CDI is not enabled (runtime.cdi / --cdi): no spec written"
        return report
    sp = plan(root, options, facts)
    if sp.owner is None and sp.spec is None:
        kept = " (the existing spec is kept)" if root.exists(options.cdi_spec_path) else ""
        report.skipped = (f"no NVIDIA GPU is visible: {options.cdi_spec_path} is written when the GPUs appear"
                          f"{kept}")
        report.notes += sp.notes
        return report
    commit(root, options, report, sp, dry)
    if sp.owner is not None:
        report.skipped = sp.reason
    elif not report.files_changed:
        report.skipped = f"{options.cdi_spec_path} already describes the GPUs on this host: nothing to do"
    return report


def revert(root: Root, options, report, dry: bool = False) -> None:
    """`driverd runtime revert --runtime cdi`: take back the spec driverd wrote; a spec file another tool
    rewrote since (the toolkit's refresh) is left to it."""
    from driverd.runtime import state
    dropped = _forget_rewritten(root, options.state_dir, report, dry)
    if dropped and not set(_recorded_specs(root, options.state_dir)) - set(dropped):
        report.skipped = "every spec driverd wrote has been rewritten by another tool since: nothing to take back"
        return
    state.revert(root, "cdi", report, dry, options.state_dir)


def write_spec(root: Root, options, report, facts=None, dry: bool = False, spec: dict | None = None) -> None:
    """Write the spec (built from the GPUs now visible unless given) through driverd's runtime record
    ("cdi"): backed up once if another tool's spec was there, restored or removed by revert."""
    from driverd.runtime import state
    from driverd.runtime.changes import ChangeReport, FileEdit
    spec = spec or build(root, facts)
    new = render(spec).encode()
    old = root.read_bytes(options.cdi_spec_path)
    sub = ChangeReport("cdi", options.handler)
    state.apply(root, "cdi", options.handler, [FileEdit(options.cdi_spec_path, new, old, "owned")], sub, dry,
                options.state_dir)
    report.files_changed += sub.files_changed
    report.backups += sub.backups
    report.diffs.update(sub.diffs)
    devs = [d["name"] for d in spec["devices"]]
    report.notes.append(f"CDI spec {options.cdi_spec_path} (cdiVersion {spec['cdiVersion']}, kind {spec['kind']}): "
                        f"devices {', '.join(devs)}")


def render(spec: dict) -> str:
    import yaml
    return ("# Written by driverd from the GPUs on this host; `driverd runtime revert` removes it.\n"
            + yaml.safe_dump(spec, sort_keys=False, default_flow_style=False))
