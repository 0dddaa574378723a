"""Ready-made simulated hosts and package sets for tests, the demo and fleet benchmarks."""
from __future__ import annotations

import os
from pathlib import Path

from driverd.sim.hosttree import HostSpec, Module, Pci, h100, vpd_image, write_host

RELEASE = "6.1.0-47-cloud-amd64"
CONTAINERD_CONFIG = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  default_runtime_name = "runc"\n' \
                    '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n  runtime_type = "io.containerd.runc.v2"\n'


def dgx_spec(gpus: int = 8, nvswitches: int = 4, nic: bool = True, nouveau: bool = True,
             nouveau_in_use: bool = False) -> HostSpec:
    pci = [h100(f"0000:{0x18 + 0x10 * i:02x}:00.0", "nouveau" if nouveau else None, i // 4) for i in range(gpus)]
    pci += [Pci(f"0000:{0xc0 + i:02x}:00.0", "0x10de", "0x22a3", "0x068000") for i in range(nvswitches)]
    if nic:
        pci.append(Pci("0000:0c:00.0", "0x15b3", "0x1021", "0x020700", "mlx5_core", 0, "0x15b3", "0x0023"))
    mods = [Module("ext4", 1000000, 1, (), "")]
    if nouveau:
        mods.append(Module("nouveau", 2400000, 1 if nouveau_in_use else 0, (), ""))
    return HostSpec(release=RELEASE, pci=pci, modules=mods, hostname="dgx-h100-01",
                    files={"/etc/containerd/config.toml": CONTAINERD_CONFIG, "/usr/bin/containerd": "",
                           # as Debian and Ubuntu ship it: the loader reads the drop-ins driverd's user-space uses
                           "/etc/ld.so.conf": "include /etc/ld.so.conf.d/*.conf\n"})


# -- NVLink5 hosts (issue 46): the device ids are driverd/data/gpus.json's (NVIDIA's supported-gpus lists) --
B200, B200_SUB = "0x2901", "0x1999"        # NVIDIA B200 (GB100), HGX B200 baseboard
GB200, GB200_SUB = "0x2941", "0x2046"      # NVIDIA GB200: the Blackwell GPU of a Grace-Blackwell superchip
CX7 = "0x1021"                             # ConnectX-7: the compute NICs and the baseboard's bridge share the id
BLUEFIELD3 = "0xa2dc"
IB_CLASS, ETH_CLASS = "0x020700", "0x020000"
GRACE_SOC_ID = "jep106:036b:0241"          # SMCCC SOC_ID of NVIDIA Grace (drivers/firmware/smccc/soc_id.c format)
IMEX_MAJOR = 237                           # dynamic in the kernel (alloc_chrdev_region); any free number here
UBUNTU_2404 = ('PRETTY_NAME="Ubuntu 24.04.2 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\nVERSION="24.04.2 LTS (Noble '
               'Numbat)"\nVERSION_CODENAME=noble\nID=ubuntu\nID_LIKE=debian\n')


def cx7_vpd(serial: str, smdl: str | None = None,
            product: str = "NVIDIA ConnectX-7 adapter, NDR InfiniBand, PCIe 5.0 x16 (simulated)") -> bytes:
    """A ConnectX-7's VPD as NVIDIA's adapters lay it out: part number, revision, serial, and the
    vendor-specific VA keyword of colon-separated KEY=VALUE fields; `smdl` adds the SMDL field the Fabric
    Manager User Guide names (SW_MNG on the baseboard bridge's limited PFs). Product strings are examples."""
    va = "MLX:MN=MLNX:CSKU=V2:UUID=V3:PCI=V0:MODL=CX75310A" + (f":SMDL={smdl}" if smdl is not None else "")
    return vpd_image(product, [("PN", "MCX75310AAS-NEAT"), ("EC", "A7"), ("V2", "MCX75310AAS-NEAT"), ("SN", serial),
                      ("V3", serial.lower().rjust(32, "0")), ("VA", va), ("V0", "PCIeGen5 x16")])


def hgx_b200_spec(gpus: int = 8, bridge: bool = True, ib_umad: bool = False) -> HostSpec:
    """An HGX B200 host: 8 B200 GPUs, no NVSwitch on PCI, eight ConnectX-7 compute NICs and the baseboard's
    ConnectX-7 bridge — per port a full-capability PF and a limited PF (LPF) whose VPD says SMDL=SW_MNG (the
    full PFs say SMDL=0 here: the guide's "non-zero value" is the LPF's). mlx5_core and ib_core are loaded,
    ib_umad not yet (NVLSM waits for it; `ib_umad`: loaded too). Without `bridge`: the same host with its bridge
    hidden."""
    buses = (0x1b, 0x43, 0x52, 0x61, 0x9d, 0xc3, 0xd1, 0xdf)       # DGX-style GPU placement, two NUMA nodes
    pci = [Pci(f"0000:{b:02x}:00.0", "0x10de", B200, "0x030200", None, i // 4, "0x10de", B200_SUB)
           for i, b in enumerate(buses[:gpus])]
    pci += [Pci(f"0000:{b - 3:02x}:00.0", "0x15b3", CX7, IB_CLASS, "mlx5_core", i // 4, "0x15b3", "0x0041",
                cx7_vpd(f"MT2405XZ0{i:03d}"), f"mlx5_{i}") for i, b in enumerate(buses)]
    if bridge:
        for port, bus in enumerate((0xa5, 0xa6)):
            pci += [Pci(f"0000:{bus:02x}:00.0", "0x15b3", CX7, IB_CLASS, "mlx5_core", 1, "0x15b3", "0x0041",
                        cx7_vpd(f"MT2405BR0{port}0", "0"), f"mlx5_{8 + 2 * port}"),
                    Pci(f"0000:{bus:02x}:00.1", "0x15b3", CX7, IB_CLASS, "mlx5_core", 1, "0x15b3", "0x0041",
                        cx7_vpd(f"MT2405BR0{port}1", "SW_MNG"), f"mlx5_{9 + 2 * port}")]
    mods = [Module("ext4", 1000000, 1, (), ""), Module("ib_core", 500000, 1, ("mlx5_ib",), ""),
            Module("mlx5_core", 2000000, 1, ("mlx5_ib",), ""), Module("mlx5_ib", 400000, 0, (), "")]
    if ib_umad:
        mods.append(Module("ib_umad", 40000, 0, (), ""))
    return HostSpec(release=RELEASE, pci=pci, modules=mods, hostname="hgx-b200-01",
                    files={"/etc/containerd/config.toml": CONTAINERD_CONFIG, "/usr/bin/containerd": "",
                           "/etc/ld.so.conf": "include /etc/ld.so.conf.d/*.conf\n"})


def gb200_spec(driver: str | None = None) -> HostSpec:
    """A GB200 NVL72 compute tray: aarch64, two Grace CPUs (SMCCC SOC_ID jep106:036b:0241), four GB200 GPUs
    (PCI domains 8, 9, 0x18, 0x19 as nvidia-smi shows them there), four ConnectX-7 and two BlueField-3
    (none with SW_MNG), no NVSwitch and no fabric manager: the switch trays are managed off the node.
    With `driver` (a version), the open driver is loaded as NVIDIA's IMEX guide sets it up: nvidia with
    NVreg_CreateImexChannel0=1, /proc/devices' nvidia-caps-imex-channels and the channel0 node, the GPUs'
    /proc/driver/nvidia/gpus entries and /dev/nvidia* nodes."""
    addrs = ("0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0")
    pci = [Pci(a, "0x10de", GB200, "0x030200", "nvidia" if driver else None, i // 2, "0x10de", GB200_SUB)
           for i, a in enumerate(addrs)]
    pci += [Pci(f"{dom:04x}:03:00.0", "0x15b3", CX7, IB_CLASS, "mlx5_core", i // 2, "0x15b3", "0x0041",
                cx7_vpd(f"MT2420XZ1{i:03d}"), f"mlx5_{i}") for i, dom in enumerate((0x0, 0x2, 0x10, 0x12))]
    pci += [Pci(f"{dom:04x}:03:00.0", "0x15b3", BLUEFIELD3, ETH_CLASS, "mlx5_core", i, "0x15b3", "0x0051",
                cx7_vpd(f"MT2420BF3{i:03d}", product="NVIDIA BlueField-3 DPU (simulated)"), None)
            for i, dom in enumerate((0x6, 0x16))]
    files = {"/sys/devices/soc0/soc_id": GRACE_SOC_ID + "\n", "/sys/devices/soc0/family": "jep106:036b\n",
             "/sys/devices/soc0/revision": "0x00000002\n", "/usr/bin/containerd": "",
             "/etc/containerd/config.toml": CONTAINERD_CONFIG, "/etc/ld.so.conf": "include /etc/ld.so.conf.d/*.conf\n"}
    mods = [Module("ext4", 1000000, 1, (), ""), Module("mlx5_core", 2000000, 0, (), "")]
    devices: dict[str, tuple[int, int]] = {}
    version = None
    if driver:
        mods += [Module("nvidia", 90000000, 2, ("nvidia_uvm", "nvidia_modeset"), "OE", driver),
                 Module("nvidia_uvm", 4000000, 0, (), "OE", driver),
                 Module("nvidia_modeset", 1500000, 0, (), "OE", driver)]
        version = (f"NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  {driver}  Release Build  "
                   "(dvs-builder@U22-I3-AF03-09-1)  Tue Jul  8 18:12:11 UTC 2025\nGCC version:  gcc version 13.3.0 "
                   "(Ubuntu 13.3.0-6ubuntu2~24.04)\n")
        files["/etc/modprobe.d/nvidia-imex.conf"] = "options nvidia NVreg_CreateImexChannel0=1\n"
        files["/proc/devices"] = ("Character devices:\n  1 mem\n  4 tty\n195 nvidia-frontend\n"
                                  f"{IMEX_MAJOR:3d} nvidia-caps-imex-channels\n238 nvidia-caps\n239 nvidia-uvm\n"
                                  "\nBlock devices:\n259 blkext\n")
        for i, a in enumerate(addrs):
            files[f"/proc/driver/nvidia/gpus/{a}/information"] = (
                f"Model: \t\t NVIDIA GB200\nIRQ:   \t\t {200 + i}\n"
                f"GPU UUID: \t GPU-6b2d6ad4-55e3-4f6c-9a1e-0000000000{i:02d}\nBus Location: \t {a}\n"
                f"Device Minor: \t {i}\nGPU Excluded:\t No\n")
            devices[f"/dev/nvidia{i}"] = (195, i)
        devices.update({"/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (239, 0), "/dev/nvidia-uvm-tools": (239, 1),
                        "/dev/nvidia-caps-imex-channels/channel0": (IMEX_MAJOR, 0)})
    return HostSpec(release="6.8.0-1025-nvidia-64k", arch="aarch64", os_release=UBUNTU_2404, pci=pci, modules=mods,
                    hostname="gb200-tray-01", nvidia_version_text=version, files=files, char_devices=devices)


def make_host(root: str | os.PathLike, spec: HostSpec | None = None) -> Path:
    return write_host(root, spec or dgx_spec())


def make_index_key(directory: str | os.PathLike) -> tuple[Path, Path]:
    """An RSA key pair (PEM) for signing repository indexes, made by openssl (kept when present)."""
    import subprocess
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key, pub = d / "index-key.pem", d / "index-key.pub"
    if not (key.is_file() and pub.is_file()):
        subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out",
                        str(key)], check=True, capture_output=True, timeout=60)
        subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True,
                       capture_output=True, timeout=60)
        os.chmod(key, 0o600)
    return key, pub


def make_userspace_packages(out: str | os.PathLike, versions: tuple[str, ...] = ("535.261.03", "550.127.05"),
                            arch: str = "x86_64") -> dict[str, Path]:
    """The user-space half of those drivers (driverd.sim.fakelib's miniature, real ELF sonames), packed by
    the same builder as NVIDIA's files (build-userspace --from-run-dir) into `out`: version -> package."""
    import tempfile
    from driverd.build.userspace import build_from_run_dir
    from driverd.sim.fakelib import run_dir
    out = Path(out)
    made = {}
    with tempfile.TemporaryDirectory(prefix="driverd-sim-userspace.") as t:
        for v in versions:
            made[v] = build_from_run_dir(run_dir(t, v, arch), out).ref.path
    return made


def make_packages(out: str | os.PathLike, release: str = RELEASE, sign_key: str | os.PathLike | None = None
                  ) -> dict[str, Path]:
    """old (535, open), new (550, open), broken (550.x, open, GSP firmware missing: loads fail); the
    indexes signed with `sign_key` when given."""
    from driverd.sim.fakepkg import make_fake_package
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from driverd.repo.index import write_index
    pk = {"old": make_fake_package(out, "535.261.03", release).path,
          "new": make_fake_package(out, "550.127.05", release).path,
          "broken": make_fake_package(out / "broken", "550.127.08", release, with_firmware=False).path}
    key = os.fspath(sign_key) if sign_key else None
    write_index(out, sign_key=key)
    write_index(out / "broken", sign_key=key)
    return pk


def make_companion_packages(out: str | os.PathLike, versions: tuple[str, ...] = ("535.261.03", "550.127.05"),
                            arch: str = "x86_64", components: tuple[str, ...] = ("fabricmanager",)) -> dict:
    """The companions of those drivers, each an archive in NVIDIA's redistributable layout
    (<key>-linux-<platform>-<version>-archive/: bin/, sbin/, lib/, etc/, share/, LICENSE) packed by the same builder
    as NVIDIA's archives (driverd build-companion) into `out`. Their daemons are the version-checking stand-ins:
    nv-fabricmanager (sim/fabricmanager.py), nvidia-imex and nvlsm (sim/companiond.py); NSCQ's library is a real
    ELF shared object with NVIDIA's soname (sim/fakelib.py), so the loader caches it. `components`: any of
    fabricmanager, nscq, nvlsm, imex. Returns version -> package when only the fabric manager is asked for (the
    default), else (component, version) -> package."""
    import tempfile
    from driverd.build.companion import build_from_archive
    out = Path(out)
    made: dict = {}
    with tempfile.TemporaryDirectory(prefix="driverd-sim-companion.") as t:
        for c in components:
            for v in versions:
                a, driver = companion_archive(Path(t), c, v, arch)
                made[(c, v)] = build_from_archive(a, out, driver=driver).ref.path
    return {v: p for (c, v), p in made.items()} if tuple(components) == ("fabricmanager",) else made


def companion_archive(dest: Path, component: str, version: str, arch: str = "x86_64",
                      script: str | None = None) -> tuple[Path, str | None]:
    """(NVIDIA's archive of `component` for driver `version`, in miniature, the --driver its build needs: NVLSM's
    name carries its own version). `script`: the daemon's executable instead of the stand-in."""
    import io
    import lzma
    import tarfile
    from driverd.package.companion import COMPONENTS, PLATFORMS
    from driverd.sim import companiond, fabricmanager
    from driverd.sim.fakelib import shared_object
    platform = next(p for p, a in PLATFORMS.items() if a == arch)
    lic = {"LICENSE": (b"NVIDIA Software License Agreement (simulated)\n", 0o644)}
    links: dict[str, str] = {}
    own = version
    if component == "fabricmanager":
        files = {"bin/nv-fabricmanager": ((script or fabricmanager.script(version)).encode(), 0o755),
                 "etc/fabricmanager.cfg": (b"LOG_LEVEL=4\nLOG_FILE_NAME=/var/log/fabricmanager.log\nDAEMONIZE=1\n"
                                           b"FABRIC_MODE=0\nTOPOLOGY_FILE_PATH=/usr/share/nvidia/nvswitch\n", 0o644),
                 "share/nvidia/nvswitch/dgxh100_hgxh100_topology": (b"simulated HGX H100 topology\n", 0o644)}
    elif component == "imex":
        files = {"bin/nvidia-imex": ((script or companiond.script("imex", version)).encode(), 0o755),
                 "bin/nvidia-imex-ctl": (b"#!/bin/sh\necho 'nvidia-imex-ctl (simulated)'\n", 0o755),
                 "etc/nvidia-imex/config.cfg": (b"IMEX_PORT=50000\nIMEX_NODE_CONFIG_FILE=/etc/nvidia-imex/"
                                                b"nodes_config.cfg\nLOG_FILE_NAME=/var/log/nvidia-imex.log\n", 0o644),
                 "systemd/nvidia-imex.service": (b"[Service]\nType=forking\nExecStart=/usr/bin/nvidia-imex -c "
                                                 b"/etc/nvidia-imex/config.cfg\n", 0o644)}
    elif component == "nvlsm":
        own = companiond.NVLSM_VERSION
        files = {"sbin/nvlsm": ((script or companiond.script("nvlsm", version)).encode(), 0o755),
                 "share/nvidia/nvlsm/nvlsm.conf": (b"# nvlsm (simulated)\nsm_priority 15\n", 0o644)}
    elif component == "nscq":
        lib = f"libnvidia-nscq.so.{version}"
        files = {f"lib/{lib}": (shared_object("libnvidia-nscq.so.2", arch, f"nscq {version}"), 0o755)}
        links = {"lib/libnvidia-nscq.so.2": lib, "lib/libnvidia-nscq.so": "libnvidia-nscq.so.2"}
    else:
        raise ValueError(f"no simulated {component} archive")
    files.update(lic)
    top = f"{COMPONENTS[component].archives[0]}-linux-{platform}-{own}-archive"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        dirs = sorted({top} | {f"{top}/{'/'.join(p.split('/')[:i])}" for p in [*files, *links]
                               for i in range(1, p.count('/') + 1)})
        for d in dirs:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1700000000
            tar.addfile(ti)
        for p, (data, mode) in sorted(files.items()):
            ti = tarfile.TarInfo(f"{top}/{p}")
            ti.size, ti.mode, ti.mtime = len(data), mode, 1700000000
            tar.addfile(ti, io.BytesIO(data))
        for p, target in sorted(links.items()):
            ti = tarfile.TarInfo(f"{top}/{p}")
            ti.type, ti.linkname, ti.mode, ti.mtime = tarfile.SYMTYPE, target, 0o777, 1700000000
            tar.addfile(ti)
    dest.mkdir(parents=True, exist_ok=True)
    a = dest / f"{top}.tar.xz"
    a.write_bytes(lzma.compress(buf.getvalue(), preset=1))
    return a, (version if COMPONENTS[component].own_version else None)
