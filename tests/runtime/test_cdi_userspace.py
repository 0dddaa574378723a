"""The CDI spec gives containers the driver's user-space (libraries, binaries, firmware, IPC sockets)
and a way for their loader to find it (NVIDIA's nvidia-cdi-hook, or LD_LIBRARY_PATH without it), and
driverd writes it only where NVIDIA's own refresh does not (docs/cdi.md). The trees hold real ELF
shared objects (driver_trees.py)."""
from __future__ import annotations

import os

import pytest
import yaml

from driverd.root import Root
from driverd.runtime import Options, cdi, revert
from tests.runtime.driver_trees import (DEVICE, NEW, OLD, OPERATOR, add_gpus, add_hook, add_socket, add_userspace)

SPEC = "/var/run/cdi/nvidia.yaml"


@pytest.fixture(scope="module")
def so_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("so")


def _opts(**kw) -> Options:
    return Options(**{"restart": "none", "cdi": True, **kw})


def device_host(tmp_path, so_cache, *, hook: bool = True):
    host = tmp_path / "h"
    add_userspace(host, DEVICE, NEW, so_cache)
    add_gpus(host, 2, char_devices=False)
    add_socket(host, "/run/nvidia-persistenced/socket")
    if hook:
        add_hook(host)
    return host


def _mounts(spec) -> dict[str, str]:
    return {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}


def _hooks(spec) -> dict[str, list[str]]:
    return {h["args"][1]: h["args"][2:] for h in spec["containerEdits"].get("hooks", [])}


def test_device_layout_with_nvidia_cdi_hook(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    spec, notes = cdi.build_with_notes(Root(host))
    assert cdi.validate(yaml.safe_load(cdi.render(spec))) == []
    m = _mounts(spec)
    lib = "/usr/local/nvidia/lib64"
    # the driver's libraries at their path under the driver root, read-only
    for base in ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libcudadebugger",
                 "libnvidia-opencl", "libnvidia-cfg", "libnvidia-gpucomp", "libnvidia-allocator", "libnvidia-pkcs11"):
        assert m[f"/lib64/{base}.so.{NEW}"] == f"{lib}/{base}.so.{NEW}"
    assert m["/bin/nvidia-smi"] == "/usr/local/nvidia/bin/nvidia-smi" and "/bin/nvidia-cuda-mps-server" in m
    assert m[f"/lib/firmware/nvidia/{NEW}/gsp_ga10x.bin"] == f"/usr/local/nvidia/firmware/nvidia/{NEW}/gsp_ga10x.bin"
    assert m["/run/nvidia-persistenced/socket"] == "/run/nvidia-persistenced/socket"
    assert "/lib64/libcuda.so.1" not in m                       # the hook makes the links
    opts = {x["containerPath"]: x["options"] for x in spec["containerEdits"]["mounts"]}
    assert opts[f"/lib64/libcuda.so.{NEW}"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert "ro" not in opts["/run/nvidia-persistenced/socket"]
    hooks = spec["containerEdits"]["hooks"]
    assert {h["path"] for h in hooks} == {"/usr/bin/nvidia-cdi-hook"} and {h["hookName"] for h in hooks} == {"createContainer"}
    h = _hooks(spec)
    assert list(h) == ["create-symlinks", "enable-cuda-compat", "update-ldcache", "disable-device-node-modification",
                       "update-application-profile"]
    links = set(h["create-symlinks"][1::2])
    assert {"libcuda.so.1::/lib64/libcuda.so", f"libcuda.so.{NEW}::/lib64/libcuda.so.1",
            f"libnvidia-ml.so.{NEW}::/lib64/libnvidia-ml.so.1", "libnvidia-ml.so.1::/lib64/libnvidia-ml.so",
            f"libnvidia-ptxjitcompiler.so.{NEW}::/lib64/libnvidia-ptxjitcompiler.so.1"} <= links
    assert not any("gpucomp" in x for x in links)               # its soname is its file name: no link
    assert h["update-ldcache"] == ["--folder", "/lib64"] and h["enable-cuda-compat"] == [f"--host-driver-version={NEW}"]
    env = spec["containerEdits"]["env"]
    assert env == ["NVIDIA_CTK_LIBCUDA_DIR=/lib64", "NVIDIA_VISIBLE_DEVICES=void"]
    assert m["/var/run/nvidia-container-devices/void"] == "/dev/null"
    assert any("loader: hook" in n for n in notes)
    assert [d["name"] for d in spec["devices"]][-1] == "all"
    assert spec["containerEdits"]["deviceNodes"] == [{"path": p} for p in ("/dev/nvidiactl", "/dev/nvidia-uvm",
                                                                           "/dev/nvidia-uvm-tools")]


def test_without_the_hook_links_are_mounts_and_ld_library_path_finds_them(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache, hook=False)
    spec, notes = cdi.build_with_notes(Root(host))
    assert cdi.validate(spec) == [] and "hooks" not in spec["containerEdits"]
    m = _mounts(spec)
    real = f"/usr/local/nvidia/lib64/libcuda.so.{NEW}"
    assert m["/lib64/libcuda.so.1"] == m["/lib64/libcuda.so"] == m[f"/lib64/libcuda.so.{NEW}"] == real
    assert m["/lib64/libnvidia-ml.so.1"] == f"/usr/local/nvidia/lib64/libnvidia-ml.so.{NEW}"
    assert spec["containerEdits"]["env"] == ["LD_LIBRARY_PATH=/lib64", "NVIDIA_VISIBLE_DEVICES=void"]
    assert any("replaces the image's own" in n for n in notes)


@pytest.mark.parametrize("where,argv", [("/usr/local/nvidia/toolkit/nvidia-cdi-hook", ["nvidia-cdi-hook"]),
                                        ("/usr/bin/nvidia-ctk", ["nvidia-ctk", "hook"])])
def test_hook_where_the_operator_or_the_ctk_puts_it(tmp_path, so_cache, where, argv):
    host = device_host(tmp_path, so_cache, hook=False)
    add_hook(host, where)
    spec = cdi.build(Root(host))
    assert {h["path"] for h in spec["containerEdits"]["hooks"]} == {where}
    assert spec["containerEdits"]["hooks"][0]["args"][:len(argv) + 1] == [*argv, "create-symlinks"]


def test_operator_root_maps_to_container_paths_without_prefix(tmp_path, so_cache):
    host = tmp_path / "h"
    add_userspace(host, OPERATOR, NEW, so_cache)
    add_gpus(host, 1, char_devices=False)
    add_hook(host)
    spec = cdi.build(Root(host))
    m = _mounts(spec)
    assert m[f"/usr/lib/x86_64-linux-gnu/libcuda.so.{NEW}"] == f"/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.{NEW}"
    assert m["/usr/bin/nvidia-smi"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert _hooks(spec)["update-ldcache"] == ["--folder", "/usr/lib/x86_64-linux-gnu"]


def test_mixed_user_space_gives_device_nodes_only_and_says_why(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    add_userspace(host, DEVICE, OLD, so_cache, links=False)
    os.unlink(host / "usr/local/nvidia/lib64/libnvidia-ml.so.1")
    os.symlink(f"libnvidia-ml.so.{OLD}", host / "usr/local/nvidia/lib64/libnvidia-ml.so.1")
    spec, notes = cdi.build_with_notes(Root(host))
    assert not any(x["containerPath"].endswith((NEW, OLD)) for x in spec["containerEdits"]["mounts"])
    assert "hooks" not in spec["containerEdits"] and any("a mixture" in n for n in notes)


# -- who writes the spec -------------------------------------------------------------------------------
def toolkit(host, *, smi: bool = True, env: str | None = None, unit_dir: str = "lib/systemd/system"):
    """NVIDIA's toolkit package as installed: nvidia-ctk, its refresh units (and nvidia-smi in /usr/bin)."""
    add_hook(host, "/usr/bin/nvidia-ctk")
    add_hook(host, "/usr/bin/nvidia-cdi-hook")
    for u in ("nvidia-cdi-refresh.service", "nvidia-cdi-refresh.path"):
        p = host / unit_dir / u
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("[Unit]\nDescription=Refresh NVIDIA CDI specification file\n")
    if smi:
        add_hook(host, "/usr/bin/nvidia-smi")
    if env is not None:
        (host / "etc/nvidia-container-toolkit").mkdir(parents=True, exist_ok=True)
        (host / "etc/nvidia-container-toolkit/nvidia-cdi-refresh.env").write_text(env)


def test_driverd_writes_the_spec_when_no_toolkit_refresh(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    rep = cdi.refresh(Root(host), _opts())
    assert rep.files_changed == [SPEC]
    spec = yaml.safe_load((host / SPEC.lstrip("/")).read_text())
    assert cdi.validate(spec) == [] and f"/lib64/libcuda.so.{NEW}" in _mounts(spec)
    assert cdi.refresh(Root(host), _opts()).files_changed == []           # idempotent


def test_the_toolkits_refresh_owns_the_spec(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    toolkit(host)
    rep = cdi.refresh(Root(host), _opts())
    assert rep.files_changed == [] and not (host / SPEC.lstrip("/")).exists()
    assert "leaves the spec to it" in rep.skipped and "nvidia-cdi-refresh.service" in rep.skipped
    # ... and says that it will generate from / while the libraries are under /usr/local/nvidia
    assert any("NVIDIA_CTK_DRIVER_ROOT=/usr/local/nvidia" in n for n in rep.notes)
    toolkit(host, env="NVIDIA_CTK_DRIVER_ROOT=/usr/local/nvidia\n")
    assert not any("NVIDIA_CTK_DRIVER_ROOT" in n for n in cdi.refresh(Root(host), _opts()).notes)


def test_the_toolkit_pointed_at_a_driver_root_link_finds_what_driverd_finds(tmp_path, so_cache):
    """/run/nvidia/driver a link to the tree (driverd's link to userspace.root/current, here to
    /usr/local/nvidia): the toolkit's NVIDIA_CTK_DRIVER_ROOT=/run/nvidia/driver is the same driver root, and
    the one named when the toolkit looks elsewhere (it survives the next switch, the tree's name does not)."""
    host = device_host(tmp_path, so_cache)
    (host / "run/nvidia").mkdir(parents=True, exist_ok=True)
    os.symlink("../../usr/local/nvidia", host / "run/nvidia/driver")
    toolkit(host)
    assert any("NVIDIA_CTK_DRIVER_ROOT=/run/nvidia/driver in" in n for n in cdi.refresh(Root(host), _opts()).notes)
    toolkit(host, env="NVIDIA_CTK_DRIVER_ROOT=/run/nvidia/driver\n")
    assert not any("NVIDIA_CTK_DRIVER_ROOT" in n for n in cdi.refresh(Root(host), _opts()).notes)


@pytest.mark.parametrize("why", ["masked", "no-nvidia-smi"])
def test_a_refresh_that_cannot_run_leaves_the_spec_to_driverd(tmp_path, so_cache, why):
    host = device_host(tmp_path, so_cache)
    toolkit(host, smi=why != "no-nvidia-smi")
    if why == "masked":
        (host / "etc/systemd/system").mkdir(parents=True)
        os.symlink("/dev/null", host / "etc/systemd/system/nvidia-cdi-refresh.service")
    rep = cdi.refresh(Root(host), _opts())
    assert rep.files_changed == [SPEC]
    assert any(("masked" if why == "masked" else "never runs") in n for n in rep.notes)


def test_spec_handed_over_when_the_toolkit_arrives(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    spec_file = host / SPEC.lstrip("/")
    assert cdi.refresh(Root(host), _opts()).files_changed == [SPEC]
    ours = spec_file.read_bytes()
    toolkit(host)
    # the toolkit has not run yet: driverd's spec stays (no moment without a spec), and is still driverd's
    rep = cdi.refresh(Root(host), _opts())
    assert rep.files_changed == [] and spec_file.read_bytes() == ours
    assert any("until the toolkit's refresh rewrites it" in n for n in rep.notes)
    spec_file.write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n# nvidia-ctk\n")     # it ran
    theirs = spec_file.read_bytes()
    rep = cdi.refresh(Root(host), _opts())
    assert any("it is theirs now" in n for n in rep.notes) and spec_file.read_bytes() == theirs
    # driverd's record is gone: a revert never removes the toolkit's spec
    rep = revert(Root(host), "cdi", _opts())
    assert spec_file.read_bytes() == theirs and rep.files_changed == []


def test_revert_leaves_a_spec_another_tool_rewrote(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    cdi.refresh(Root(host), _opts())
    (host / SPEC.lstrip("/")).write_text("# written by nvidia-ctk cdi generate\n")
    dry = revert(Root(host), "cdi", _opts(dry_run=True))               # the preview says the same
    assert dry.files_changed == [] and "rewritten by another tool" in dry.skipped
    rep = revert(Root(host), "cdi", _opts())
    assert (host / SPEC.lstrip("/")).read_text() == "# written by nvidia-ctk cdi generate\n"
    assert "rewritten by another tool" in rep.skipped


def test_driverd_takes_its_spec_back_when_the_toolkit_writes_elsewhere(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    cdi.refresh(Root(host), _opts())
    toolkit(host, env="NVIDIA_CTK_CDI_OUTPUT_FILE_PATH=/var/run/cdi/nvidia-ctk.yaml\n")
    rep = cdi.refresh(Root(host), _opts())
    assert rep.files_changed == [SPEC] and not (host / SPEC.lstrip("/")).exists()
    assert "/var/run/cdi/nvidia-ctk.yaml" in rep.skipped


def test_another_spec_of_the_kind_in_the_directory(tmp_path, so_cache):
    host = device_host(tmp_path, so_cache)
    other = host / "var/run/cdi/management.yaml"
    other.parent.mkdir(parents=True)
    other.write_text("cdiVersion: 0.5.0\nkind: management.nvidia.com/gpu\ndevices: []\n")
    assert cdi.refresh(Root(host), _opts()).files_changed == [SPEC]        # another kind: no conflict
    (host / SPEC.lstrip("/")).unlink()
    revert(Root(host), "cdi", _opts())
    gen = host / "var/run/cdi/nvidia-generated.json"
    gen.write_text('{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []}')
    rep = cdi.refresh(Root(host), _opts())
    assert rep.files_changed == [] and not (host / SPEC.lstrip("/")).exists()
    assert "/var/run/cdi/nvidia-generated.json" in rep.skipped


def test_configure_reports_the_decision(tmp_path, so_cache):
    from driverd.runtime import configure
    from tests.runtime.conftest import make_host
    host = device_host(tmp_path, so_cache)
    make_host(host, {"/etc/docker/daemon.json": "{}\n"}, {"/usr/bin/dockerd": "27.0", "/usr/bin/nvidia-container-runtime": ""})
    toolkit(host)
    rep = configure(Root(host), "docker", _opts())
    assert rep.files_changed == ["/etc/docker/daemon.json"] and any("leaves the spec to it" in n for n in rep.notes)


def test_a_spec_of_a_user_space_that_is_not_the_loaded_drivers_is_refused_unless_forced(tmp_path, so_cache):
    """Issue 48: on a live host with 535 libraries in front of a loaded 580, `runtime configure --cdi` wrote a
    spec whose containers failed (nvidia-smi: version mismatch, cuInit 803) without a word. Now it is refused,
    naming both versions, and nothing is written; --allow-mismatch (force_cdi) writes it."""
    from driverd.errors import RuntimeConfigError
    from driverd.sim.hosttree import nvidia_version_line
    host = device_host(tmp_path, so_cache)                         # the user-space is NEW
    (host / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
    (host / "proc/driver/nvidia/version").write_text(nvidia_version_line(OLD, "open"))
    with pytest.raises(RuntimeConfigError) as e:
        cdi.refresh(Root(host), _opts())
    msg = e.value.one_line()
    assert f"is {NEW}, the loaded driver is {OLD}" in msg and "--allow-mismatch" in msg and "\n" not in msg, msg
    assert not (host / SPEC.lstrip("/")).exists()
    rep = cdi.refresh(Root(host), _opts(force_cdi=True))
    assert rep.files_changed == [SPEC]
    (host / "proc/driver/nvidia/version").write_text(nvidia_version_line(NEW, "open"))
    assert cdi.refresh(Root(host), _opts()).files_changed == []      # the matching driver: written as before
