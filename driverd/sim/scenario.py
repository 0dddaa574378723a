"""Ready-made simulated hosts and package sets for tests, the demo and fleet benchmarks."""
from __future__ import annotations

import os
from pathlib import Path

from driverd.sim.hosttree import HostSpec, Module, Pci, h100, write_host

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
