"""driverd's CDI spec side by side with NVIDIA's: `nvidia-ctk cdi generate` (nvidia-container-toolkit,
the version .ci/build-toolkit pins) on the same host tree. nvidia-ctk runs in its management mode,
the one that needs no NVML (the tree has no GPU), and reads the tree's ELF sonames, symlinks and
character devices itself. Every difference between the two specs is either gone or listed here with
its reason — the same list as docs/cdi.md ("Compared with nvidia-ctk"); a new difference fails."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from driverd.root import Root
from driverd.runtime import cdi
from tests.conftest import CI_PREFIX, REPO, missing_component
from tests.runtime.driver_trees import (BINARIES, DEBIAN, DEVICE, NEW, OLD, OPERATOR, add_gpus, add_hook,
                                        add_socket, add_userspace, can_mknod)

VERSION = re.search(r"DRIVERD_TOOLKIT_VERSION:-([0-9.]+)", (REPO / ".ci/build-toolkit").read_text()).group(1)
HOOK = "/usr/bin/nvidia-cdi-hook"
IPC = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket", "/tmp/nvidia-mps")

# The differences that stay, and why (docs/cdi.md says the same):
CAPS = {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"}
# management mode gives its one `all` device every /dev/nvidia* node, the MIG config/monitor capabilities
# included; nvml mode (a real GPU host) gives a full GPU none of them, and neither does driverd.
WHY_CAPS = "management mode mounts every /dev/nvidia-caps node; nvml mode and driverd give full GPUs none"
NVML_HOOKS = {("disable-device-node-modification", ()), ("update-application-profile", ())}
WHY_HOOKS = ("nvml mode (pkg/nvcdi/driver-nvml.go, common-nvml.go) adds both; management mode disables the first "
             "(options.go) and never adds the second")


@pytest.fixture(scope="module")
def ctk(tmp_path_factory) -> str:
    path = CI_PREFIX / f"toolkit-v{VERSION}/bin/nvidia-ctk"
    if not os.access(path, os.X_OK):
        missing_component(f"nvidia-ctk v{VERSION} is not built in {path.parent} (bash .ci/build-toolkit builds it)")
    if not can_mknod(tmp_path_factory.mktemp("mknod")):
        pytest.skip("nvidia-ctk reads device nodes only from real character devices: mknod needs CAP_MKNOD")
    return str(path)


@pytest.fixture(scope="module")
def so_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("so")


def generate(ctk: str, host: Path, driver_root: str) -> dict:
    """`nvidia-ctk cdi generate` for the tree: driver root and /dev inside it, the hook at its host path."""
    root = str(host) + (driver_root if driver_root != "/" else "")
    res = subprocess.run([ctk, "cdi", "generate", "--mode", "management", "--format", "json",
                          "--driver-root", root, "--dev-root", str(host), "--nvidia-cdi-hook-path", HOOK],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(host), "XDG_CONFIG_HOME": str(host / "xdg")})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def facets(spec: dict, strip: str = "") -> dict[str, set]:
    """What a container gets, by kind, with host paths as host paths (nvidia-ctk's start with the tree)."""
    def host(p: str) -> str:
        return p[len(strip):] if strip and p.startswith(strip + "/") else p
    edits = [spec.get("containerEdits") or {}] + [d["containerEdits"] for d in spec["devices"]]
    out: dict[str, set] = {k: set() for k in ("libraries", "binaries", "firmware", "ipc", "other mounts",
                                              "device nodes", "hooks", "env")}
    for e in edits:
        for m in e.get("mounts") or []:
            c, h = m["containerPath"], host(m["hostPath"])
            base = os.path.basename(c)
            kind = ("ipc" if c in IPC else "firmware" if "/firmware/" in c else "binaries" if base in BINARIES
                    else "libraries" if re.match(r"lib.*\.so", base) else "other mounts")
            out[kind].add((h, c, tuple(m.get("options") or ())))
        out["device nodes"] |= {n["path"] for n in e.get("deviceNodes") or []}
        out["env"] |= set(e.get("env") or [])
        for hk in e.get("hooks") or []:
            args = hk["args"]
            name, rest = args[1], args[2:]
            if name == "create-symlinks":
                out["hooks"] |= {(name, link) for link in rest[1::2]}
            else:
                out["hooks"].add((name, tuple(rest)))
            assert (hk["hookName"], hk["path"]) == ("createContainer", HOOK)
    return out


def differences(ours: dict, theirs: dict) -> dict[str, tuple[set, set]]:
    a, b = facets(ours), facets(theirs[0], theirs[1])
    return {k: (a[k] - b[k], b[k] - a[k]) for k in a if a[k] != b[k]}


def both(ctk, host, driver_root) -> tuple[dict, dict, dict]:
    ours = cdi.build(Root(host))
    theirs = generate(ctk, host, driver_root)
    return ours, theirs, differences(ours, (theirs, str(host)))


def paths(items) -> set[str]:
    return {x[1] if isinstance(x, tuple) else x for x in items}


def test_device_layout(ctk, tmp_path, so_cache):
    """/usr/local/nvidia (lib64, bin, firmware), the host's own persistenced socket and MPS directory."""
    host = tmp_path / "h"
    add_userspace(host, DEVICE, NEW, so_cache, graphics=True)
    os.symlink("lib64", host / "usr/local/nvidia/lib")                 # as on the device
    add_gpus(host, 2)
    add_hook(host)
    add_socket(host, "/run/nvidia-persistenced/socket")
    (host / "tmp/nvidia-mps").mkdir(parents=True)
    ours, theirs, diff = both(ctk, host, DEVICE.driver_root)
    assert len(facets(ours)["libraries"]) == 13
    assert {("create-symlinks", f"libGLX_nvidia.so.{NEW}::/lib64/libGLX_indirect.so.0"),
            ("create-symlinks", f"libnvidia-eglcore.so.{NEW}::/lib64/libnvidia-eglcore.so")} <= facets(ours)["hooks"]
    assert set(diff) == {"device nodes", "hooks", "firmware", "ipc"}, diff
    assert diff["device nodes"] == (set(), CAPS), WHY_CAPS
    assert diff["hooks"] == (NVML_HOOKS, set()), WHY_HOOKS
    # nvidia-ctk looks for GSP firmware only in /lib/firmware (and firmware_class.path of the machine it
    # runs on), not in the driver root's firmware/; driverd also looks there and mounts it where the
    # standard layout has it.
    assert paths(diff["firmware"][0]) == {f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin",
                                          f"/lib/firmware/nvidia/{NEW}/gsp_tu10x.bin"} and not diff["firmware"][1]
    # nvidia-ctk looks for the sockets under the driver root only (/usr/local/nvidia/run/...), and its
    # file locator refuses directories, so it never mounts the MPS pipe directory.
    assert paths(diff["ipc"][0]) == {"/run/nvidia-persistenced/socket", "/tmp/nvidia-mps"} and not diff["ipc"][1]


def test_operator_driver_root(ctk, tmp_path, so_cache):
    """/run/nvidia/driver: host paths keep the prefix, container paths lose it — in both specs."""
    host = tmp_path / "h"
    add_userspace(host, OPERATOR, NEW, so_cache)
    add_gpus(host, 1)
    add_hook(host)
    add_socket(host, "/run/nvidia/driver/run/nvidia-persistenced/socket")
    add_socket(host, "/run/nvidia/driver/run/nvidia-fabricmanager/socket")
    # nvidia-ctk searches /lib/firmware/<release of the machine it runs on> too: the plain directory is in both
    ours, theirs, diff = both(ctk, host, OPERATOR.driver_root)
    assert set(diff) == {"device nodes", "hooks"}, diff
    assert diff["device nodes"] == (set(), CAPS) and diff["hooks"] == (NVML_HOOKS, set())
    f = facets(ours)
    assert (f"/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.{NEW}",
            f"/usr/lib/x86_64-linux-gnu/libcuda.so.{NEW}", ("ro", "nosuid", "nodev", "rbind", "rprivate")) in f["libraries"]
    assert len(f["ipc"]) == 2 and len(f["firmware"]) == 2


def test_debian_layout(ctk, tmp_path, so_cache):
    """Debian: nvidia/current behind alternatives links (relative here: nvidia-ctk follows links on the
    machine it runs on, not inside the tree; the finder's own test reads Debian's absolute ones)."""
    host = tmp_path / "h"
    add_userspace(host, DEBIAN, OLD, so_cache, absolute_links=False)
    add_gpus(host, 2)
    add_hook(host)
    ours, theirs, diff = both(ctk, host, "/")
    assert set(diff) == {"device nodes", "hooks"}, diff
    assert diff["device nodes"] == (set(), CAPS) and diff["hooks"] == (NVML_HOOKS, set())
    f = facets(ours)
    assert ("update-ldcache", ("--folder", "/usr/lib/x86_64-linux-gnu/nvidia/current")) in f["hooks"]
    assert ("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi", ("ro", "nosuid", "nodev", "rbind", "rprivate")) in f["binaries"]


def test_two_versions_side_by_side(ctk, tmp_path, so_cache):
    """535 left beside 580, the links on 580: nvidia-ctk takes the version of the first libcuda.so.*.*
    its glob returns (535 sorts first) and mounts the old driver's libraries; driverd takes the version
    libcuda.so.1 points to — the one the loader would load."""
    host = tmp_path / "h"
    add_userspace(host, DEVICE, OLD, so_cache)
    add_userspace(host, DEVICE, NEW, so_cache)
    add_gpus(host, 1)
    add_hook(host)
    ours, theirs, diff = both(ctk, host, DEVICE.driver_root)
    ours_libs, ctk_libs = paths(facets(ours)["libraries"]), paths(facets(theirs, str(host))["libraries"])
    assert ours_libs and all(p.endswith(NEW) for p in ours_libs)
    assert ctk_libs and all(p.endswith(OLD) for p in ctk_libs)
    assert ("enable-cuda-compat", (f"--host-driver-version={NEW}",)) in facets(ours)["hooks"]
    assert ("enable-cuda-compat", (f"--host-driver-version={OLD}",)) in facets(theirs, str(host))["hooks"]


def test_endpoints_and_files_only_root_controls(ctk, tmp_path, so_cache):
    """Issue 44, item 2: nvidia-ctk mounts what it finds (os.Stat follows links; no owner is read). driverd
    gives containers a socket, the MPS directory or a driver file only when root vouches for it: here the
    fabric manager's socket sits in a directory another user owns and a symbolic link stands where
    persistenced's socket would be. The options of what both mount are NVIDIA's own (equal below)."""
    host = tmp_path / "h"
    add_userspace(host, OPERATOR, NEW, so_cache)
    add_gpus(host, 1)
    add_hook(host)
    base = "/run/nvidia/driver/run"
    add_socket(host, f"{base}/nvidia-fabricmanager/socket")
    os.chown(host / f"{base.lstrip('/')}/nvidia-fabricmanager", 65534, 65534)
    os.chown(host / f"{base.lstrip('/')}/nvidia-fabricmanager/socket", 1000, 1000)
    add_socket(host, "/var/elsewhere/socket")
    (host / f"{base.lstrip('/')}/nvidia-persistenced").mkdir(parents=True)
    os.symlink("../../../../../var/elsewhere/socket", host / f"{base.lstrip('/')}/nvidia-persistenced/socket")
    ours, theirs, diff = both(ctk, host, OPERATOR.driver_root)
    assert set(diff) == {"device nodes", "hooks", "ipc"}, diff
    assert not diff["ipc"][0]
    assert paths(diff["ipc"][1]) == {"/run/nvidia-fabricmanager/socket", "/run/nvidia-persistenced/socket"}
    assert all(x[2] == ("nosuid", "nodev", "rbind", "rprivate", "noexec") for x in diff["ipc"][1])
    # the owner fixed and the link replaced by the socket: the same mounts, options included
    os.chown(host / f"{base.lstrip('/')}/nvidia-fabricmanager", 0, 0)
    os.chown(host / f"{base.lstrip('/')}/nvidia-fabricmanager/socket", 0, 0)
    os.unlink(host / f"{base.lstrip('/')}/nvidia-persistenced/socket")
    add_socket(host, f"{base}/nvidia-persistenced/socket")
    ours, theirs, diff = both(ctk, host, OPERATOR.driver_root)
    assert set(diff) == {"device nodes", "hooks"}, diff
