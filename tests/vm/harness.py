"""The VM harness (tests only, never in the wheel): builds the stand-in driver modules with driverd's own
build path, packs and signs them as driverd packages in a local repository, packs NVIDIA's real user-space
of the same versions from Debian's .debs (`driverd build-userspace --from-debs`), and boots Debian's real
kernel under QEMU (TCG) with virtme-ng to run tests/vm/guest.py. One boot serves a group of scenarios.

Where the engine lives (installed by .ci/install-components, outside the repository, keyed by version):
    $DRIVERD_CI_PREFIX (default /opt/driverd-ci):
    PREFIX/vng-<version>/bin/vng                       virtme-ng in its own virtualenv
    PREFIX/kernel-<release>/boot/vmlinuz-<release>     linux-image-<release>, unpacked (dpkg -x), depmod run
    /usr/src/linux-headers-<release>                            linux-headers-<release> (apt)
and qemu-system-x86 + busybox-static from Debian.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import CI_PREFIX

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin"
RELEASE = "6.1.0-47-amd64"
OTHER_RELEASE = "6.1.0-47-cloud-amd64"          # a module built for it must fail vermagic in the guest
CI_DIR = CI_PREFIX
KERNEL_DIR = CI_DIR / f"kernel-{RELEASE}"
VMLINUZ = KERNEL_DIR / "boot" / f"vmlinuz-{RELEASE}"
HEADERS = Path(f"/usr/src/linux-headers-{RELEASE}")
# The stand-ins carry the versions of NVIDIA's real user-space beside them (Debian's bookworm 535.261.03 and sid
# 550.163.01): driverd pairs a driver's two halves by the exact version (userspace_source.local_package).
OLD, NEW = "535.261.03", "550.163.01"
# The kernel the reboot tests (tests/vm/test_vm_reboot.py) install after the driver and boot next.
NEXT_RELEASE = "6.1.0-50-amd64"
NEXT_HEADERS = Path(f"/usr/src/linux-headers-{NEXT_RELEASE}")


def kernel_dir(release: str) -> Path:
    return CI_DIR / f"kernel-{release}"


def vmlinuz(release: str) -> Path:
    return kernel_dir(release) / "boot" / f"vmlinuz-{release}"


def missing_next() -> list[str]:
    """What the reboot tests need beyond the engine: the next kernel unpacked and indexed, its headers."""
    out = []
    d = kernel_dir(NEXT_RELEASE)
    if not vmlinuz(NEXT_RELEASE).is_file():
        out.append(f"the unpacked kernel {vmlinuz(NEXT_RELEASE)}")
    elif not (d / "lib" / "modules" / NEXT_RELEASE / "modules.dep.bin").is_file():
        out.append(f"the module index of {d}")
    if not (NEXT_HEADERS / "Makefile").is_file():
        out.append(f"headers {NEXT_HEADERS}")
    return out


def find_vng() -> str | None:
    found = sorted(glob.glob(str(CI_DIR / "vng-*" / "bin" / "vng")))
    return found[-1] if found else shutil.which("vng")


def missing_components() -> list[str]:
    out = []
    if not find_vng():
        out.append("virtme-ng (vng)")
    if not shutil.which("qemu-system-x86_64"):
        out.append("qemu-system-x86")
    if not (shutil.which("busybox") or os.path.exists("/bin/busybox")):
        out.append("busybox-static")
    if not VMLINUZ.is_file():
        out.append(f"the unpacked kernel {VMLINUZ}")
    elif not (KERNEL_DIR / "lib" / "modules" / RELEASE / "modules.dep.bin").is_file():
        out.append(f"the module index of {KERNEL_DIR} (modules.dep: depmod -b {KERNEL_DIR} {RELEASE})")
    for h in (HEADERS, Path(f"/usr/src/linux-headers-{OTHER_RELEASE}")):
        if not (h / "Makefile").is_file():
            out.append(f"headers {h}")
    for t in ("make", "gcc", "openssl"):
        if not shutil.which(t):
            out.append(t)
    return out


# -- stand-in packages ------------------------------------------------------------------------------

def standin_source(dest: Path, version: str) -> Path:
    """A source tree of the stand-in modules with `version` in Kbuild (as NVIDIA's Kbuild carries it)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in STANDIN.iterdir():
        if f.suffix in (".c",) or f.name == "Makefile":
            shutil.copy2(f, dest / f.name)
    (dest / "Kbuild").write_text((STANDIN / "Kbuild.in").read_text().replace("@VERSION@", version))
    return dest


def driverd_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIVERD_")}
    return subprocess.run([sys.executable, "-m", "driverd", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(REPO))


def build_package(base: Path, version: str, out: Path, *, release: str = RELEASE, headers: Path = HEADERS,
                  signer=None, tag: str = "") -> Path:
    """`driverd build` of the stand-in source for one kernel; returns the package path."""
    src = standin_source(base / f"src-{version}{tag}", version)
    args = ["build", "--source", str(src), "--kernel", release, "--flavor", "open", "--out", str(out),
            "--work-dir", str(base / f"work{tag}"), "--headers", str(headers), "--json"]
    if signer is not None:
        args += ["--sign-key", str(signer.key), "--sign-cert", str(signer.cert)]
    r = driverd_cli(*args)
    if r.returncode != 0:
        raise AssertionError(f"driverd build {version} for {release} failed: {r.stderr[-3000:]}")
    return Path(json.loads(r.stdout)["package"])


@dataclass
class Packages:
    repo: Path                   # the repository the guest's driverd fetches from (file://)
    old: Path                    # stand-in 535.261.03, signed by the test key
    new: Path                    # stand-in 550.163.01, signed by the test key
    unsigned: Path               # stand-in 535.261.03, unsigned (for the signature group)
    other_kernel_ko: Path        # nvidia.ko built for another kernel (vermagic)
    signer: object
    seconds: float


def build_all(base: Path) -> Packages:
    from driverd.sim import fakemod
    t0 = time.monotonic()
    signer = fakemod.test_signer(base / "key", str(HEADERS))
    assert signer is not None, "sign-file or openssl missing"
    repo = base / "repo"
    old = build_package(base, OLD, repo, signer=signer)
    new = build_package(base, NEW, repo, signer=signer)
    r = driverd_cli("repo", "index", str(repo), "--json")
    assert r.returncode == 0, r.stderr
    unsigned = build_package(base, OLD, base / "unsigned", tag="-unsigned")
    other = build_package(base, OLD, base / "other", release=OTHER_RELEASE,
                          headers=Path(f"/usr/src/linux-headers-{OTHER_RELEASE}"), tag="-other")
    ko = extract_module(other, base / "other-ko", "nvidia")
    return Packages(repo, old, new, unsigned, ko, signer, time.monotonic() - t0)


def extract_module(package: Path, dest: Path, name: str) -> Path:
    from driverd.package.archive import _open_stream
    dest.mkdir(parents=True, exist_ok=True)
    with _open_stream(package) as tar:
        for ti in tar:
            if ti.isreg() and ti.name.endswith(f"/{name}.ko"):
                (dest / f"{name}.ko").write_bytes(tar.extractfile(ti).read())
    return dest / f"{name}.ko"


# -- the real user-space ---------------------------------------------------------------------------
# NVIDIA's user-space as Debian ships it (.ci/install-components downloads the .debs of both versions into
# PREFIX/nvidia-userspace/<version>/ with their SHA256SUMS). The guest gets a named subset: compute and utility
# (libcuda, its PTX JIT, NVML, nvidia-smi, nvidia-persistenced), ~55 MB unpacked per version instead of
# ~355 MB. The whole set does not fit twice in the guest's 1 GiB (its /var is an overlay in guest memory),
# and every byte is hashed under TCG on install and verification; the graphics, video and firmware .debs
# go through the same code paths on host trees (tests/packages/test_userspace_real.py).
USERSPACE_DEBS = ("libcuda1", "libnvidia-ml1", "libnvidia-ptxjitcompiler1", "nvidia-smi", "nvidia-persistenced")
USERSPACE_DIR = CI_DIR / "nvidia-userspace"


def missing_userspace() -> list[str]:
    out = []
    for v in (OLD, NEW):
        d = USERSPACE_DIR / v
        names = (d / "SHA256SUMS").read_text().split() if (d / "SHA256SUMS").is_file() else []
        for p in USERSPACE_DEBS:
            if not any(n.startswith(f"{p}_") and n.endswith(".deb") and (d / n).is_file() for n in names):
                out.append(f"{d}/{p}_*.deb")
    return out


def build_userspace(base: Path, versions: tuple[str, ...] = (OLD, NEW), *, debs_named: tuple[str, ...] = USERSPACE_DEBS,
                    tag: str = "") -> tuple[Path, dict[str, Path], float]:
    """The user-space packages of OLD and NEW, made as a user makes them: the chosen .debs of one version
    in a directory (checked against the SHA256SUMS apt's verified download wrote), then `driverd
    build-userspace --from-debs DIR --out OUT`. Returns (OUT, {version: package}, seconds). `debs_named`:
    the .debs taken (another set gives another package of the same version); `tag`: OUT is userspace<tag>."""
    import hashlib
    t0 = time.monotonic()
    out = base / f"userspace{tag}"
    pkgs = {}
    for v in versions:
        src = USERSPACE_DIR / v
        sums = dict(reversed(ln.split()) for ln in (src / "SHA256SUMS").read_text().splitlines() if ln.strip())
        debs = base / f"debs-{v}{tag}"
        debs.mkdir(parents=True)
        for name, sha in sums.items():
            if name.split("_")[0] in debs_named:
                data = (src / name).read_bytes()
                assert hashlib.sha256(data).hexdigest() == sha, f"{src / name} does not match its SHA256SUMS"
                (debs / name).write_bytes(data)
        r = driverd_cli("build-userspace", "--from-debs", str(debs), "--out", str(out), "--json")
        if r.returncode != 0:
            raise AssertionError(f"driverd build-userspace {v} failed: {r.stderr[-3000:]}")
        doc = json.loads(r.stdout)
        assert doc["driver"] == v, doc
        pkgs[v] = Path(doc["package"])
    return out, pkgs, time.monotonic() - t0


# -- booting ----------------------------------------------------------------------------------------

@dataclass
class Boot:
    rc: int
    seconds: float
    console: str
    results: dict[str, dict]
    boot_seconds: float | None      # kernel start -> the guest script's first result (guest uptime)


def boot(spec: dict, out: Path, image: Path, *, append: str | None = None, timeout: float = 600, cpus: int = 2,
         icount: int | None = None, release: str = RELEASE) -> Boot:
    """Boot the real kernel once and run the scenarios of `spec` in it; results come back in `out`
    (a --rwdir shared with the guest, the only host directory the guest can write). `icount`: QEMU's
    `-icount shift=N,sleep=on`: while the guest runs, its clock is the instructions it executed (2**N ns
    each), not this machine's time, so other work here does not change its timings (bench/reload_cost.py);
    idle, waiting for a timer or a device, it follows this machine's clock (sleep=off jumps to the next
    timer and made a 9p read cost minutes). One vCPU: the kernel hangs bringing up a second in this mode."""
    out.mkdir(parents=True, exist_ok=True)
    rt = f"{RT_MOUNT}/py/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    spec = {**spec, "out": str(out), "python": rt, "repo_root": str(REPO), "faults_dir": f"{RT_MOUNT}/faults",
            "preflight": f"{RT_MOUNT}/preflight.py"}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    vng = find_vng()
    argv = [vng, "--run", str(vmlinuz(release)), "--user", "root", "--disable-kvm", "--force-9p", "--verbose",
            "--memory", "1G", "--cpus", str(1 if icount is not None else cpus), "--rwdir", str(out), "--disk", str(image)]
    if icount is not None:
        argv += ["--qemu-opts", f"-icount shift={icount},sleep=on"]
    if append:
        argv += ["--append", append]
    # The runtime image is the guest's only virtio disk (/dev/vda); its ext4 driver is a module.
    # /lib/modules/<release> becomes the image's module subset (writable: driverd installs into it; the
    # image is this test's own temporary file). The guest's containerd binaries are removed from its
    # private /usr overlay: running `containerd --version` over 9p costs ~20 s per driverd command and
    # no runtime is under test here.
    mods = f"/lib/modules/{release}"
    argv += ["--exec", f"modprobe virtio_blk && modprobe ext4 && sleep 1 && mkdir -p {RT_MOUNT} && mount /dev/vda {RT_MOUNT} && "
                       f"rm {mods} && mkdir {mods} && mount --bind {RT_MOUNT}/modroot{mods} {mods} && "
                       f"rm -f /usr/bin/containerd /usr/bin/containerd-shim* /usr/bin/ctr /usr/bin/runc /usr/bin/docker /usr/bin/crio && "
                       f"LD_LIBRARY_PATH={RT_MOUNT}/py/lib PYTHONPATH={RT_MOUNT}/src:{RT_MOUNT}/site "
                       f"PYTHONDONTWRITEBYTECODE=1 {rt} {RT_MOUNT}/guest.py {out / 'spec.json'}"]
    env = {**os.environ, "PATH": f"{os.path.dirname(vng)}:{os.environ.get('PATH', '')}"}
    env = {k: v for k, v in env.items() if not k.startswith("DRIVERD_")}
    t0 = time.monotonic()
    # vng starts QEMU as a child: its own session, so a timeout stops the whole group (by its id).
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         stdin=subprocess.DEVNULL, cwd="/", start_new_session=True)
    try:
        console, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        console, _ = p.communicate()
        rc = -9
    seconds = time.monotonic() - t0
    (out / "console.log").write_text(console)
    results = {}
    for name in spec["scenarios"]:
        f = out / f"{name}.json"
        if f.exists():
            results[name] = json.loads(f.read_text())
    boot_s = None
    done = out / "done.json"
    if done.exists():
        d = json.loads(done.read_text())
        up = float((d.get("uptime") or "0").split()[0])
        boot_s = round(up - d["seconds"], 1)
    return Boot(rc, seconds, console, results, boot_s)


# -- the guest's Python runtime on a disk image ----------------------------------------------------
# The guest reads this machine's file system over 9p without caching: every stat is a round trip
# through QEMU (about 20 ms under TCG), so a Python process importing driverd spends most of a minute
# in the import system. The interpreter, its standard library, the test venv's packages and a copy of
# the worktree's driverd go onto an ext4 image instead (a block device: the guest's page cache serves
# every later read). The guest mounts it read-only at RT_MOUNT.
RT_MOUNT = "/run/driverd-rt"
_STDLIB_SKIP = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages", "pydoc_data")


# Debian's modules the scenarios load (and their dependencies). The guest's /lib/modules/<release> is
# this subset on the image, not the 395 MB tree over 9p: depmod, which driverd runs after every
# install, reads every module of the tree, and over 9p under TCG that takes minutes.
GUEST_MODULES = ("nouveau", "dummy", "drm", "ext4", "virtio_blk")


def _module_subset(modroot: Path, release: str = RELEASE) -> None:
    kdir = kernel_dir(release)
    src = kdir / "lib" / "modules" / release
    dst = modroot / "lib" / "modules" / release
    dst.mkdir(parents=True)
    for f in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
        shutil.copy2(src / f, dst / f)
    for name in GUEST_MODULES:
        r = subprocess.run(["modprobe", "-d", str(kdir), "-S", release, "--show-depends", name],
                           capture_output=True, text=True, timeout=60, check=True)
        for line in r.stdout.splitlines():
            if line.startswith("insmod "):
                ko = Path(line.split()[1])
                rel = ko.relative_to(src)
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ko, dst / rel)
    subprocess.run(["depmod", "-b", str(modroot), release], check=True, capture_output=True, timeout=120)


def runtime_image(base: Path, extra: dict[str, Path] | None = None, releases: tuple[str, ...] = (RELEASE,)) -> Path:
    """`extra`: directories copied onto the image as RT_MOUNT/<name> (read from the guest's page cache,
    not over 9p). `releases`: the kernels whose module subsets the image carries (booted, or installed)."""
    import sysconfig
    stage = base / "rt-stage"
    shutil.rmtree(stage, ignore_errors=True)
    py = Path(sys.base_prefix)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (stage / "py" / "bin").mkdir(parents=True)
    shutil.copy2(Path(sys.executable).resolve(), stage / "py" / "bin" / ver)
    for lib in py.glob("lib/libpython*.so*"):
        shutil.copy2(lib, stage / "py" / "lib" / lib.name) if (stage / "py" / "lib").exists() else (
            (stage / "py" / "lib").mkdir(parents=True), shutil.copy2(lib, stage / "py" / "lib" / lib.name))
    shutil.copytree(py / "lib" / ver, stage / "py" / "lib" / ver, symlinks=True,
                    ignore=lambda d, names: [n for n in names if d == str(py / "lib" / ver) and n in _STDLIB_SKIP])
    (stage / "py" / "lib" / ver / "site-packages").mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    shutil.copytree(site, stage / "site", symlinks=True,
                    ignore=lambda d, names: [n for n in names if n.startswith(("__editable__", "_driverd"))
                                             or n.endswith(".pth")])
    shutil.copytree(REPO / "driverd", stage / "src" / "driverd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tests" / "faults", stage / "faults", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("guest.py", "preflight.py"):
        shutil.copy2(Path(__file__).parent / f, stage / f)
    for rel in releases:
        _module_subset(stage / "modroot", rel)
    for name, src in (extra or {}).items():
        shutil.copytree(src, stage / name)
    img = base / "rt.img"
    img.unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file() and not p.is_symlink())
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(stage), "-L", "driverdrt", str(img),
                    f"{size // (1 << 20) * 2 + 64}M"], check=True, capture_output=True, timeout=300)
    shutil.rmtree(stage, ignore_errors=True)
    return img


def image_copy(image: Path, dest: Path) -> Path:
    """A private copy of the runtime image for one boot (the guest writes its module tree into it)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "--sparse=always", str(image), str(dest)], check=True, timeout=300)
    return dest
