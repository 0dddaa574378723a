"""Issue 43 on a REAL kernel, across REAL reboots: three boots of Debian's kernels under QEMU (TCG) sharing one
disk (the runtime image: /var/lib/driverd, /boot and the module trees persist; /etc, /run and /usr/local are
each boot's own, so the loader configuration and /run/nvidia/driver are gone after every reboot, as /run is on
any host). The issue asks for host mode and container mode, and for a user-space installed from the
repository and from `userspace.package`: boot 2 proves host mode with the repository's, boot 3 container mode
with userspace.package's (the simulated host, tests/daemon/test_reboot_offline.py, runs all four).

Boot 1, 6.1.0-47-amd64: `driverd apply` loads the stand-in 535.261.03 modules with NVIDIA's real 535 user-space
fetched from the repository (userspace.fetch). 6.1.0-50-amd64 is installed as its Debian package leaves it
(image and config in /boot, its modules with their index, its dpkg record) with no package for it in the
repository and no headers: `driverd reboot-ready` exits 1 naming it, "no package, no headers to build", and
the daemon's driverd_kernel_unprepared{kernel="6.1.0-50-amd64"} is 1. Its package appears in the repository:
the daemon prepares it in its next pass (the metric 0), `reboot-ready` exits 0.

Boot 2, 6.1.0-50-amd64 (the real next kernel): the repository refuses connections. Host mode, the user-space
from the repository: `driverd daemon` sends READY=1 with the stand-in modules loaded from the package prepared
in boot 1 and the user-space made active again from its installed tree (the loader configuration and the
driver-root link re-made) — no fetch. Then 6.1.0-47's image is removed: the daemon removes what driverd kept
for it. Last, the configuration switches the user-space to userspace.package, a local file of the same 535
version the repository does not list (built from fewer of Debian's .debs: another sha256): `driverd apply`
installs it from that file, with the driver loaded, no fetch.

Boot 3, 6.1.0-50-amd64 again, the repository still refusing connections. Container mode, the user-space from
userspace.package: `driverd container-entrypoint` as the driver container runs it (deploy/base/daemonset.yaml:
the host's / mounted at its host root with slave propagation, --root and DRIVERD_ROOT naming it, the
configuration from DRIVERD_CONFIG, the host's PIDs) sends READY=1 and /readyz answers 200, with the stand-in
modules loaded from the package prepared in boot 1 and userspace.package's tree made active again — the
links it makes are the host's paths, not the container's — no fetch."""
from __future__ import annotations

import shutil
import time

import pytest

from tests.conftest import missing_component
from tests.vm import harness as h

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(7200)]
NEXT = h.NEXT_RELEASE
NODE_DEBS = tuple(d for d in h.USERSPACE_DEBS if d != "nvidia-persistenced")
ROOT = "/var/lib/driverd/driver"
CONTAINER_ROOT = "/run/driverd-container/host"      # guest.CONTAINER_HOST


@pytest.fixture(scope="module")
def boots(tmp_path_factory):
    missing = h.missing_components() + h.missing_next() + h.missing_userspace()
    if missing:
        missing_component(f"VM engine or reboot components missing: {', '.join(missing)} "
                          "(bash .ci/install-components installs them)")
    from driverd.sim import fakemod
    from tests.conftest import run_cli
    base = tmp_path_factory.mktemp("vmreboot")
    t0 = time.monotonic()
    signer = fakemod.test_signer(base / "key", str(h.HEADERS))
    repo = base / "repo"
    h.build_package(base, h.OLD, repo, signer=signer)
    _, us, _ = h.build_userspace(base, versions=(h.OLD,))
    shutil.copy(us[h.OLD], repo)
    run_cli("repo", "index", str(repo), check=True)
    # userspace.package's: the same version from fewer .debs (the node runs no persistenced), not in the repository
    _, mine, _ = h.build_userspace(base, versions=(h.OLD,), debs_named=NODE_DEBS, tag="-node")
    uspkg = base / "uspkg"
    uspkg.mkdir()
    shutil.copy(mine[h.OLD], uspkg)
    nxt = base / "next"
    h.build_package(base, h.OLD, nxt, release=NEXT, headers=h.NEXT_HEADERS, signer=signer, tag="-next")
    image = h.runtime_image(base, {"repo": repo, "next": nxt, "uspkg": uspkg}, releases=(h.RELEASE, NEXT))
    disk = h.image_copy(image, base / "disk.img")
    prep = time.monotonic() - t0
    spec = {"repo": f"{h.RT_MOUNT}/repo", "next_pkg_dir": f"{h.RT_MOUNT}/next", "rt": h.RT_MOUNT,
            "versions": {"535": h.OLD}, "next_release": NEXT, "running_release": h.RELEASE,
            "running_image": str(h.vmlinuz(h.RELEASE)), "next_image": str(h.vmlinuz(NEXT)),
            "hide": [str(h.NEXT_HEADERS), str(h.NEXT_HEADERS).replace("-amd64", "-common")],
            "us_package": f"{h.RT_MOUNT}/uspkg/{mine[h.OLD].name}"}
    out = {"spec": spec, "sha": {"repository": _sha(us[h.OLD]), "package": _sha(mine[h.OLD])}}
    for n, (release, scenarios) in enumerate(((h.RELEASE, ["setup", "reboot_prepare"]),
                                               (NEXT, ["setup", "reboot_next", "userspace_from_package"]),
                                               (NEXT, ["setup", "reboot_container"])), 1):
        b = h.boot({**spec, "scenarios": scenarios}, base / f"out{n}", disk, timeout=3600, release=release)
        missing = [s for s in scenarios if s not in b.results]
        assert not missing, f"boot {n}: guest did not finish {missing} (rc {b.rc}); console tail:\n{b.console[-3000:]}"
        for name, r in b.results.items():
            assert "error" not in r, f"boot {n} {name}: {r['error']}"
        out[n] = b
        print(f"\nboot {n} ({release}): {b.seconds:.0f}s, scenarios "
              f"{ {k: v.get('seconds') for k, v in b.results.items()} }")
    print(f"preparation {prep:.0f}s")
    return out


def _sha(path) -> str:
    from driverd.package.archive import sha256_file
    return sha256_file(path)


def test_the_second_kernel_closes_the_gate_until_the_daemon_prepares_it(boots):
    r = boots[1].results["reboot_prepare"]
    assert boots[1].results["setup"]["uname"] == h.RELEASE
    assert r["apply"]["rc"] == 0, r["apply"]["stderr"]
    steps = [s["action"] for s in r["state"]["journal"]["steps"]]
    assert "fetch-userspace" in steps and "install-userspace" in steps, steps
    assert r["userspace"]["driver_link"] and r["userspace"]["ld_conf"], r["userspace"]
    g = r["gate_closed"]
    assert g["rc"] == 1, g
    k = {x["release"]: x for x in g["json"]["kernels"]}
    assert list(k) == [NEXT] and k[NEXT]["short"] == "no package, no headers to build", g["json"]
    assert r["unprepared_metric"]["value"] == 1.0
    assert r["status"]["rc"] == 0, r["status"]
    assert r["status"]["json"]["kernels"]["kernels"][0]["release"] == NEXT
    # after the package appeared: one more prepare-kernel attempt, and it was the one that succeeded
    assert r["prepared_metric"]["value"] == 0.0
    prep = [x for x in r["runs"] if x["command"] == "prepare-kernel"]
    assert prep[-1]["state"] == "done" and all(x["state"] != "done" for x in prep[:-1]), prep
    assert "fetch-package" in prep[-1]["steps"] and "install-package" in prep[-1]["steps"]
    assert r["gate_open"]["rc"] == 0, r["gate_open"]
    assert "nvidia.ko" in r["next_tree"], r["next_tree"]
    assert r["daemon_stop"]["rc"] == 0


def came_back_from_disk(r: dict) -> list[dict]:
    """What a boot's daemon did after the reboot: the stand-in driver loaded from the package prepared for
    the next kernel, the user-space made active again, and nothing fetched. Its runs."""
    mods = r["kernel"]["modules"]
    assert mods["nvidia"]["version"] == h.OLD and h.OLD in r["kernel"]["nvidia_version"], r["kernel"]
    assert f"/lib/modules/{NEXT}/updates/driverd/" in r["modinfo_filename"]["stdout"], r["modinfo_filename"]
    runs = r["runs"]
    steps = [s for run in runs for s in run["steps"]]
    assert not any(s.startswith("fetch-") for s in steps), runs
    assert "install-userspace" in steps and "load-modules" in steps, runs
    return runs


def test_the_reboot_into_it_comes_back_ready_from_disk_with_the_repository_refusing_connections(boots):
    r = boots[2].results["reboot_next"]
    assert boots[2].results["setup"]["uname"] == NEXT
    # what a reboot leaves: no loader configuration (/etc), no driver-root link (/run), no driver loaded
    assert r["before"]["ld_conf"] is None and r["before"]["driver_link"] is None
    assert "nvidia" not in r["before"]["kernel"]["modules"]
    plan = r["plan"]["json"]
    assert not plan["blocked_by"] and not any(s["action"].startswith("fetch-") for s in plan["steps"]), plan
    assert "READY=1" in r["ready"]["message"]
    came_back_from_disk(r)
    u = r["userspace"]
    assert u["driver_link"] and u["ld_conf"] and u["current"] == h.OLD, u
    assert "connection refused" not in r["log"].lower() and "cannot reach" not in r["log"], r["log"][-3000:]


def test_the_previous_kernels_packages_go_when_it_is_removed_after_the_reboot(boots):
    r = boots[2].results["reboot_next"]
    assert h.RELEASE in r["kept_before"], r["kept_before"]
    assert h.RELEASE not in r["kept_after"] and NEXT in r["kept_after"], r["kept_after"]
    assert r["daemon_stop"]["rc"] == 0


def test_the_user_space_switches_to_userspace_package_from_its_file_with_nothing_fetched(boots):
    r = boots[2].results["userspace_from_package"]
    sha = boots["sha"]
    assert sha["package"] != sha["repository"]
    assert r["apply"]["rc"] == 0, r["apply"]["stderr"]
    steps = [s for run in r["runs"] for s in run["steps"]]
    assert not any(s.startswith("fetch-") for s in steps) and "load-modules" not in steps, r["runs"]
    (us,) = [p for run in r["runs"] for p in run["userspace"]]
    assert (us["package"], us["sha256"]) == (boots["spec"]["us_package"], sha["package"]), us
    assert r["current"] == f"{h.OLD}-{sha['package'][:12]}", r
    assert {h.OLD, r["current"]} <= set(r["trees"]), r["trees"]
    assert r["kernel"]["modules"]["nvidia"]["version"] == h.OLD


def test_container_mode_comes_back_ready_after_the_reboot_with_userspace_package_and_the_repository_refusing(boots):
    r = boots[3].results["reboot_container"]
    sha = boots["sha"]
    assert boots[3].results["setup"]["uname"] == NEXT
    tree_name = f"{h.OLD}-{sha['package'][:12]}"
    tree = f"{ROOT}/{tree_name}"
    # what the reboot left: userspace.package's tree still the current one on disk, nothing active, nothing loaded
    b = r["before"]
    assert b["ld_conf"] is None and b["driver_link"] is None and b["current"] == tree_name, b
    assert "nvidia" not in b["kernel"]["modules"]
    assert r["container"]["argv"][-5:] == ["container-entrypoint", "--root", CONTAINER_ROOT, "--listen", "127.0.0.1:0"]
    assert r["container"]["env"]["DRIVERD_ROOT"] == CONTAINER_ROOT, r["container"]
    assert "READY=1" in r["ready"]["message"], r["ready"]
    assert r["readyz"]["code"] == 200, r["readyz"]
    assert "driverd container-entrypoint: no fast path" in r["log"], r["log"][-3000:]
    runs = came_back_from_disk(r)
    # from userspace.package (the host's file, through the container's mount of the host), not the repository
    us = [p for run in runs for p in run["userspace"]]
    assert us and all(p.get("sha256") == sha["package"] and
                      p.get("package") == CONTAINER_ROOT + boots["spec"]["us_package"] for p in us), us
    # active again, as the host sees it: the links name the host's paths, not the container's mount of them
    u = r["userspace"]
    assert (u["current"], u["tree"]) == (tree_name, tree), u
    assert u["driver_link"].endswith("/current") and CONTAINER_ROOT not in u["driver_link"], u
    assert u["driver_link_real"] == tree, u
    assert u["ld_conf"] and CONTAINER_ROOT not in u["ld_conf"] and u["ldconfig_rc"] == 0, u["ld_conf"]
    assert u["ld_cache"] and all(e["real"].startswith(f"{tree}/") for e in u["ld_cache"].values()), u["ld_cache"]
    assert (u["bin_link"], u["bin_real"]) == (f"{ROOT}/current/bin/nvidia-smi", f"{tree}/bin/nvidia-smi"), u
    assert u["nvidia_smi_libnvidia_ml"] == [f"{ROOT}/current/lib64/libnvidia-ml.so.1"], u["nvidia_smi_libnvidia_ml"]
    assert {i["name"] for i in u["manifest"]["provenance"]["inputs"]} == set(NODE_DEBS), u["manifest"]["provenance"]
    assert "connection refused" not in r["log"].lower() and "cannot reach" not in r["log"], r["log"][-3000:]
    assert r["daemon_stop"]["rc"] == 0
