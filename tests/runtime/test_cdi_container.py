"""A container started with driverd's CDI spec can load the driver's libraries: NVIDIA's
nvidia-container-runtime (CDI mode: it applies the spec to the OCI bundle with the CDI library, the way
containerd and CRI-O do) then runc run a program that dlopens libcuda.so.1 and libnvidia-ml.so.1 by
soname, calls into libcuda and looks for the binaries, firmware and device nodes — once with NVIDIA's
nvidia-cdi-hook (ld cache + links made in the container) and once without it (LD_LIBRARY_PATH + the
links as mounts). The driver files are the stand-ins of driver_trees.py (no GPU here); the spec's host
paths are mapped into the tree the way `nvidia-ctk cdi transform root` would."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from driverd.root import Root
from driverd.runtime import cdi
from tests.conftest import CI_PREFIX, missing_component, require_binary
from tests.runtime.driver_trees import DEVICE, NEW, OPERATOR, add_gpus, add_socket, add_userspace, can_mknod
from tests.runtime.test_cdi_vs_nvidia_ctk import VERSION

PROBE_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static const char *have(const char *p, int mode) { return access(p, mode) == 0 ? "yes" : "no"; }
int main(int argc, char **argv) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) { printf("{\"error\": \"%s\"}\n", dlerror()); return 1; }
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
    int (*version)(int *) = (int (*)(int *))dlsym(cuda, "cuDriverGetVersion");
    const char *(*standin)(void) = (const char *(*)(void))dlsym(cuda, "driverd_standin_version");
    int v = 0;
    int rc = init(0) | version(&v);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    void *dev = dlopen("libcuda.so", RTLD_NOW);
    const char *llp = getenv("LD_LIBRARY_PATH");
    const char *mps = have("/tmp/nvidia-mps", F_OK);
    FILE *w = fopen("/tmp/nvidia-mps/written-by-container", "w");   /* what a container can leave on the host */
    if (w) fclose(w);
    printf("{\"rc\": %d, \"cuda_version\": %d, \"libcuda\": \"%s\", \"nvml\": \"%s\", \"libcuda_so\": \"%s\", "
           "\"smi\": \"%s\", \"firmware\": \"%s\", \"dev\": \"%s\", \"ctl\": \"%s\", \"socket\": \"%s\", "
           "\"mps\": \"%s\", \"mps_planted\": \"%s\", \"mps_write\": \"%s\", "
           "\"visible\": \"%s\", \"ld_library_path\": \"%s\"}\n",
           rc, v, standin(), nvml ? "yes" : "no", dev ? "yes" : "no", have(argv[1], X_OK), have(argv[2], R_OK),
           have("/dev/nvidia0", F_OK), have("/dev/nvidiactl", F_OK), have("/run/nvidia-persistenced/socket", F_OK),
           mps, have("/tmp/nvidia-mps/planted", F_OK), w ? "yes" : "no",
           getenv("NVIDIA_VISIBLE_DEVICES"), llp ? llp : "");
    return 0;
}
"""


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> dict[str, str]:
    if os.geteuid() != 0 or not can_mknod(tmp_path_factory.mktemp("mknod")):
        pytest.skip("runc needs root to create a container")
    bin_dir = CI_PREFIX / f"toolkit-v{VERSION}/bin"
    out = {n: str(bin_dir / n) for n in ("nvidia-container-runtime", "nvidia-cdi-hook")}
    for n, p in out.items():
        if not os.access(p, os.X_OK):
            missing_component(f"{n} v{VERSION} is not built in {bin_dir} (bash .ci/build-toolkit builds it)")
    out["runc"] = require_binary("runc", "/usr/sbin/runc")
    out["gcc"] = require_binary("gcc")
    out["ldconfig"] = require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    return out


@pytest.fixture(scope="module")
def so_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("so")


def rootfs(tools, base: Path) -> Path:
    """An image with glibc and ldconfig only (and ld.so.conf as distributions ship it): no NVIDIA file and
    no LD_LIBRARY_PATH of its own."""
    fs = base / "rootfs"
    (fs / "etc").mkdir(parents=True)
    (fs / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")     # as Debian's, Ubuntu's, UBI's
    src = base / "probe.c"
    src.write_text(PROBE_C)
    subprocess.run([tools["gcc"], "-O1", "-o", str(fs / "probe"), str(src), "-ldl"], check=True, capture_output=True)
    libs = subprocess.run(["ldd", str(fs / "probe")], capture_output=True, text=True, check=True).stdout
    for line in libs.splitlines():
        p = line.split("=>")[-1].split("(")[0].strip()
        if p.startswith("/"):
            dest = fs / p.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest)            # the interpreter must stay executable
    (fs / "sbin").mkdir()
    shutil.copy2(tools["ldconfig"], fs / "sbin/ldconfig")
    return fs


def in_tree(spec: dict, host: Path) -> dict:
    """The spec with its host paths inside the tree (mounts, device nodes, hook binaries)."""
    t = str(host)
    edits = [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"]]
    for e in edits:
        for m in e.get("mounts", []):
            if m["hostPath"] != "/dev/null":
                m["hostPath"] = t + m["hostPath"]
        for n in e.get("deviceNodes", []):
            n["hostPath"] = t + n["path"]
        for h in e.get("hooks", []):
            h["path"] = t + h["path"]
    return spec


def run_container(tools, base: Path, spec: dict, args: list[str]) -> dict:
    specs = base / "cdi"
    specs.mkdir()
    (specs / "nvidia.yaml").write_text(yaml.safe_dump(spec))
    conf = base / "xdg/nvidia-container-runtime"
    conf.mkdir(parents=True)
    (conf / "config.toml").write_text(
        '[nvidia-container-runtime]\nmode = "cdi"\nlog-level = "debug"\n'
        f'debug = "{base}/runtime.log"\nruntimes = ["{tools["runc"]}"]\n'
        f'[nvidia-container-runtime.modes.cdi]\nspec-dirs = ["{specs}"]\ndefault-kind = "nvidia.com/gpu"\n'
        'annotation-prefixes = ["cdi.k8s.io/"]\n')
    bundle = base / "bundle"
    bundle.mkdir()
    os.rename(rootfs(tools, base), bundle / "rootfs")
    subprocess.run([tools["runc"], "spec"], cwd=bundle, check=True)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].update(terminal=False, args=["/probe", *args])
    cfg["root"]["readonly"] = False
    cfg["annotations"] = {"cdi.k8s.io/driverd-test": "nvidia.com/gpu=all"}
    (bundle / "config.json").write_text(json.dumps(cfg))
    env = {"PATH": f"{Path(tools['nvidia-cdi-hook']).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
           "XDG_CONFIG_HOME": str(base / "xdg")}
    state, cid = str(base / "runc-state"), f"driverd-cdi-{os.getpid()}-{base.name}"
    try:
        create = subprocess.Popen([tools["nvidia-container-runtime"], "--root", state, "create", "--bundle",
                                   str(bundle), cid], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        # the container keeps create's stdout: its output arrives once it is started
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = subprocess.run([tools["runc"], "--root", state, "state", cid], capture_output=True, text=True)
            if st.returncode == 0 and json.loads(st.stdout)["status"] == "created":
                break
            if create.poll() is not None and create.returncode != 0:
                break
            time.sleep(0.1)
        if create.poll() not in (None, 0):
            log = (base / "runtime.log").read_text() if (base / "runtime.log").exists() else ""
            raise AssertionError(f"create failed: {create.stderr.read().decode()}\n{log[-3000:]}")
        subprocess.run([tools["runc"], "--root", state, "start", cid], check=True, capture_output=True, timeout=60)
        out, err = create.communicate(timeout=60)
        applied = json.loads((bundle / "config.json").read_text())
        lines = out.decode().strip().splitlines()
        assert lines, f"no output from the container: {err.decode()}"
        return {"probe": json.loads(lines[-1]), "oci": applied, "stderr": err.decode()}
    finally:
        subprocess.run([tools["runc"], "--root", state, "delete", "--force", cid], capture_output=True)


def driver_host(base: Path, so_cache, layout=DEVICE, hook: str | None = None) -> Path:
    host = base / "h"
    add_userspace(host, layout, NEW, so_cache)
    add_gpus(host, 2)
    add_socket(host, "/run/nvidia-persistenced/socket")
    if hook:
        dest = host / "usr/bin/nvidia-cdi-hook"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(hook, dest)
    return host


def test_container_loads_libcuda_with_nvidia_cdi_hook(tools, tmp_path, so_cache):
    host = driver_host(tmp_path, so_cache, hook=tools["nvidia-cdi-hook"])
    spec = cdi.build(Root(host))
    assert spec["containerEdits"]["hooks"]
    res = run_container(tools, tmp_path, in_tree(spec, host), ["/bin/nvidia-smi", f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin"])
    p = res["probe"]
    assert "error" not in p, res
    assert p["libcuda"] == NEW and p["cuda_version"] == 580000 and p["rc"] == 0, res
    assert p["nvml"] == p["libcuda_so"] == p["smi"] == p["firmware"] == p["dev"] == p["ctl"] == p["socket"] == "yes", res
    assert p["visible"] == "void" and p["ld_library_path"] == ""          # the ld cache found them
    hooks = [h["args"][1] for h in res["oci"]["hooks"]["createContainer"]]
    assert "update-ldcache" in hooks and "create-symlinks" in hooks


@pytest.mark.parametrize("layout", [DEVICE, OPERATOR], ids=["device", "operator"])
def test_container_loads_libcuda_without_the_hook(tools, tmp_path, so_cache, layout):
    host = driver_host(tmp_path, so_cache, layout)
    spec = cdi.build(Root(host))
    assert "hooks" not in spec["containerEdits"]
    smi = "/bin/nvidia-smi" if layout is DEVICE else "/usr/bin/nvidia-smi"
    res = run_container(tools, tmp_path, in_tree(spec, host), [smi, f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin"])
    p = res["probe"]
    assert "error" not in p, res
    assert p["libcuda"] == NEW and p["rc"] == 0, res
    assert p["nvml"] == p["libcuda_so"] == p["smi"] == p["firmware"] == p["dev"] == p["socket"] == "yes", res
    assert p["ld_library_path"] == ("/lib64" if layout is DEVICE else "/usr/lib/x86_64-linux-gnu")
    assert "hooks" not in res["oci"] or not res["oci"]["hooks"].get("createContainer")


NOBODY = 65534


def _tmp(host: Path) -> Path:
    """The tree's /tmp as a host has it: world-writable with the sticky bit."""
    t = host / "tmp"
    t.mkdir(parents=True, exist_ok=True)
    os.chmod(t, 0o1777)
    return t


@pytest.mark.parametrize("owner,mode,given", [(0, 0o755, True), (NOBODY, 0o755, False), (NOBODY, 0o777, False),
                                              (0, 0o777, False)],
                         ids=["root-0755", "user-0755", "user-0777", "root-0777"])
def test_an_mps_pipe_directory_only_root_controls_is_given_to_containers(tools, tmp_path, so_cache, owner, mode, given):
    """Issue 44, item 2: a non-root user who makes /tmp/nvidia-mps first (or any directory others can
    write) had it mounted read-write into every GPU container: containers wrote into it and saw each
    other's files, and left programs there for the user. Only the MPS control daemon's own directory —
    root's, not group/world-writable — is mounted now; otherwise it is left out with a note."""
    host = driver_host(tmp_path, so_cache)
    mps = _tmp(host) / "nvidia-mps"
    mps.mkdir()
    (mps / "planted").write_text("a user's file\n")
    os.chown(mps / "planted", owner, owner)
    os.chown(mps, owner, owner)
    os.chmod(mps, mode)
    spec, notes = cdi.build_with_notes(Root(host))
    mounted = [m for m in spec["containerEdits"]["mounts"] if m["containerPath"] == "/tmp/nvidia-mps"]
    res = run_container(tools, tmp_path, in_tree(copy.deepcopy(spec), host), ["/bin/nvidia-smi", f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin"])
    p = res["probe"]
    assert p["libcuda"] == NEW and p["socket"] == "yes", res          # the rest of the spec is untouched
    if given:
        assert mounted == [{"hostPath": "/tmp/nvidia-mps", "containerPath": "/tmp/nvidia-mps",
                            "options": ["nosuid", "nodev", "rbind", "rprivate", "noexec"]}]   # NVIDIA's IPC options
        assert p["mps"] == p["mps_planted"] == "yes", res
    else:
        assert not mounted and p["mps"] == p["mps_planted"] == p["mps_write"] == "no", res
        assert not (mps / "written-by-container").exists()
        assert any(n.startswith("left out of the CDI spec: /tmp/nvidia-mps: ") for n in notes), notes


def test_an_mps_pipe_directory_made_a_link_to_etc_is_not_followed(tools, tmp_path, so_cache):
    """Issue 44, item 2: /tmp/nvidia-mps made a symbolic link to /etc (here the tree's own etc/, as
    '../etc') was followed: every GPU container got the host's /etc read-write and wrote into it. An IPC
    endpoint is taken only where it is, never through a link."""
    host = driver_host(tmp_path, so_cache)
    (host / "etc").mkdir(exist_ok=True)
    os.symlink("../etc", _tmp(host) / "nvidia-mps")
    spec, notes = cdi.build_with_notes(Root(host))
    assert not [m for m in spec["containerEdits"]["mounts"] if m["containerPath"] == "/tmp/nvidia-mps"]
    assert any("/tmp/nvidia-mps: it is a symbolic link" in n for n in notes), notes
    res = run_container(tools, tmp_path, in_tree(copy.deepcopy(spec), host), ["/bin/nvidia-smi", f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin"])
    assert res["probe"]["mps"] == res["probe"]["mps_write"] == "no", res
    assert not (host / "etc/written-by-container").exists()


def test_driver_files_another_user_can_change_are_not_given_to_containers(tools, tmp_path, so_cache):
    """Issue 44, item 2: the same owner checks for every host path the spec mounts. A driver binary another
    user owns, and a library in a directory everyone can write, are left out (with a note); the
    persistenced socket another user planted in a directory of theirs is not mounted."""
    host = driver_host(tmp_path, so_cache)
    smi = host / "usr/local/nvidia/bin/nvidia-smi"
    os.chown(smi, NOBODY, NOBODY)
    ptx = next((host / "usr/local/nvidia/lib64").glob(f"libnvidia-ptxjitcompiler.so.{NEW}"), None)
    spec, notes = cdi.build_with_notes(Root(host))
    hosts = {m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert "/usr/local/nvidia/bin/nvidia-smi" not in hosts
    assert any(n.startswith("left out of the CDI spec: /usr/local/nvidia/bin/nvidia-smi: it is owned by uid 65534")
               for n in notes), notes
    assert f"/usr/local/nvidia/lib64/libcuda.so.{NEW}" in hosts
    res = run_container(tools, tmp_path, in_tree(copy.deepcopy(spec), host), ["/bin/nvidia-smi", f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin"])
    assert res["probe"]["smi"] == "no" and res["probe"]["libcuda"] == NEW, res
    # a library directory anyone can write: nothing of it is given
    os.chown(smi, 0, 0)
    os.chmod(host / "usr/local/nvidia/lib64", 0o777)
    spec, notes = cdi.build_with_notes(Root(host))
    assert not [m for m in spec["containerEdits"]["mounts"] if m["hostPath"].startswith("/usr/local/nvidia/lib64/")]
    assert any("usr/local/nvidia/lib64 is writable by its group and everyone" in n for n in notes), notes
    del ptx
    # a socket made in a directory of another user's, where persistenced's would be
    sock_dir = host / "run/nvidia-persistenced"
    shutil.rmtree(sock_dir)
    add_socket(host, "/run/nvidia-persistenced/socket")
    os.chown(sock_dir, NOBODY, NOBODY)
    os.chown(sock_dir / "socket", 1000, 1000)
    os.chmod(host / "usr/local/nvidia/lib64", 0o755)
    spec, notes = cdi.build_with_notes(Root(host))
    assert not [m for m in spec["containerEdits"]["mounts"] if m["containerPath"] == "/run/nvidia-persistenced/socket"]
    # the daemon's own account (Debian: nvpd) owning both its directory and its socket is fine
    os.chown(sock_dir / "socket", NOBODY, NOBODY)
    spec, notes = cdi.build_with_notes(Root(host))
    assert [m for m in spec["containerEdits"]["mounts"] if m["containerPath"] == "/run/nvidia-persistenced/socket"]
