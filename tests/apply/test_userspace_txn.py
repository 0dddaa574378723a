"""Both halves of one driver in one transaction (issue 31 part 2): `driverd apply` on a simulated host switches
the kernel modules and the user-space package of the same version (userspace.package), the validation's workload
check runs with the new libraries (tests/cudastandin's stand-ins packed as user-space packages: they answer for
the loaded module's version like NVIDIA's), and a failed validation rolls both halves back to the last-known-good."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from driverd.host import pci, workload
from driverd.install import userspace as ui
from driverd.driver import userspace as dus
from driverd.build.userspace import build_from_run_dir
from driverd.root import Root
from tests import cudastandin
from tests.apply.conftest import drv, journal, kernel_of
from tests.conftest import run_cli
from tests.packages import usfake

OLD, NEW = "535.261.03", "550.127.05"
USDIR = "/var/cache/driverd-userspace"
ON = '[validation]\nworkload = "on"\nworkload_timeout_s = 20\n'


def gpus(root) -> list[str]:
    g, _, _ = pci.classify(Root(root), pci.scan(Root(root), []), [])
    return [x.pci_address for x in g]


def us_package(root, version: str, *, libs_of: str | None = None, fail_device: int | None = None):
    """The user-space package of `version` built for host `root` into its USDIR. `libs_of`: libcuda and
    libnvidia-ml of that other version under `version`'s names (a stale set); `fail_device`: a libcuda
    whose context on that GPU fails."""
    rm = root / "proc/driver/nvidia/version"
    d = usfake.run_dir(root.parent / f"src-{version}-{os.urandom(3).hex()}", version, rm_file=rm,
                       gpus=tuple(gpus(root)))
    if libs_of or fail_device is not None:
        common = {"STANDIN_VERSION": f'"{libs_of or version}"', "STANDIN_RM_FILE": f'"{rm}"',
                  "STANDIN_BUSIDS": '"' + ",".join(gpus(root)) + '"'}
        shutil.copy(cudastandin._compile("nvml.c", "libnvidia-ml.so.1", common), d / f"libnvidia-ml.so.{version}")
        cuda = dict(common, **({"STANDIN_FAIL_DEVICE": str(fail_device)} if fail_device is not None else {}))
        shutil.copy(cudastandin._compile("cuda.c", "libcuda.so.1", cuda), d / f"libcuda.so.{version}")
    out = root / USDIR.lstrip("/")
    out.mkdir(parents=True, exist_ok=True)
    return build_from_run_dir(d, out).ref


def configure(root, version: str, repo, extra: str = "") -> None:
    p = root / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f'[driver]\nversion = "{version}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
                 f'[runtime]\nrestart = "none"\n[userspace]\npackage = "{USDIR}"\n{ON}{extra}')


def in_use(root) -> str | None:
    return dus.installed_sha256(Root(root), ui.Places())


def loaded(root) -> str:
    return kernel_of(root).modules()["nvidia"].version


def cuda_ok(root, version: str) -> workload.WorkloadCheck:
    return workload.check(Root(root), version, gpus(root), timeout_s=20)


def test_apply_then_upgrade_switches_modules_and_userspace_in_one_transaction(node, packages):
    old, new = us_package(node, OLD), us_package(node, NEW)
    configure(node, OLD, packages["old"].parent)
    r = drv(node, "plan")
    assert "install-userspace" in r.stdout and "not workload-ready" not in r.stdout, r.stdout + r.stderr
    r = drv(node, "apply")
    assert r.returncode == 0, r.stderr
    doc = journal(node)
    assert doc["state"] == "done" and doc["lkg"]["userspace"] == {"sha256": None, "version": None}
    acts = [s["action"] for s in doc["steps"]]
    assert acts.index("install-userspace") < acts.index("load-modules") < acts.index("validate")
    assert (loaded(node), in_use(node)) == (OLD, old.sha256)
    v = next(s for s in doc["steps"] if s["action"] == "validate")["result"]
    assert v["workload"]["ok"], v

    configure(node, NEW, packages["new"].parent)
    r = drv(node, "apply")
    assert r.returncode == 0, r.stderr
    doc = journal(node)
    assert doc["state"] == "done" and doc["lkg"]["userspace"] == {"sha256": old.sha256, "version": OLD}
    acts = [s["action"] for s in doc["steps"]]
    assert acts.index("unload-modules") < acts.index("install-userspace") < acts.index("load-modules")
    assert (loaded(node), in_use(node)) == (NEW, new.sha256)
    v = next(s for s in doc["steps"] if s["action"] == "validate")["result"]
    assert v["workload"]["ok"] and v["workload"]["userspace"]["version"] == NEW, v
    assert os.readlink(node / "var/lib/driverd/driver/current") == NEW
    # converged: nothing to do, and the plan is not blocked
    r = drv(node, "apply")
    assert r.returncode == 0 and "nothing to do" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr

    # a stale library set in front of the 550 modules is caught by the workload check
    ui.restore(Root(node), old.sha256)
    w = cuda_ok(node, NEW)
    assert not w.ok and any(f"user-space {OLD} does not match the loaded kernel driver {NEW}" in p for p in w.problems)


def test_a_failing_550_rolls_back_modules_and_userspace_and_cuda_works_again(node, packages):
    old = us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    us_package(node, NEW, fail_device=1)
    configure(node, NEW, packages["new"].parent)
    r = drv(node, "apply")
    assert r.returncode != 0
    doc = journal(node)
    assert doc["state"] == "rolled-back", doc["state"]
    assert doc["failure"]["step"] == "validate", doc["failure"]
    assert [s["action"] for s in doc["rollback"]].count("restore-userspace") == 1
    assert (loaded(node), in_use(node)) == (OLD, old.sha256)
    assert cuda_ok(node, OLD).ok


def test_a_stale_library_set_in_the_package_is_caught_by_the_validation_and_rolled_back(node, packages):
    """A 550 user-space package whose libcuda/libnvidia-ml are really 535's: the names say 550, NVML says
    535 — the transaction's workload check refuses it, both halves go back."""
    old = us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    us_package(node, NEW, libs_of=OLD)
    configure(node, NEW, packages["new"].parent)
    r = drv(node, "apply")
    doc = journal(node)
    assert r.returncode != 0 and doc["state"] == "rolled-back" and doc["failure"]["step"] == "validate"
    assert "mismatch" in r.stderr.lower() or "mismatch" in str(doc["failure"]).lower(), r.stderr
    assert (loaded(node), in_use(node)) == (OLD, old.sha256)
    assert cuda_ok(node, OLD).ok


def test_reload_with_the_user_space_of_another_version_is_refused_in_one_line(node, packages):
    old = us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    r = drv(node, "reload", "--package", str(packages["new"]), "--userspace", old.path)
    assert r.returncode != 0 and f"is the {OLD} user-space, the driver is {NEW}" in r.stderr, r.stderr
    assert (loaded(node), in_use(node)) == (OLD, old.sha256)


def test_reload_takes_userspace_package_of_the_new_version(node, packages):
    us_package(node, OLD)
    new = us_package(node, NEW)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    r = drv(node, "reload", "--package", str(packages["new"]))
    assert r.returncode == 0, r.stderr
    assert (loaded(node), in_use(node)) == (NEW, new.sha256)
    assert cuda_ok(node, NEW).ok


def test_a_host_managed_userspace_is_never_touched(node, packages):
    """driver.manage = never: the user-space package is configured, but driverd leaves the driver and its user-space."""
    us_package(node, OLD)
    configure(node, OLD, packages["old"].parent, extra="")
    cfg = node / "etc/driverd/config.toml"
    cfg.write_text(cfg.read_text().replace('flavor = "open"\n', 'flavor = "open"\nmanage = "never"\n', 1))
    r = drv(node, "plan")
    assert "install-userspace" not in r.stdout, r.stdout
    assert in_use(node) is None and not (node / "etc/ld.so.conf.d/00-driverd-nvidia.conf").exists()


def test_a_missing_userspace_package_path_is_one_line(node, packages):
    configure(node, OLD, packages["old"].parent)
    cfg = node / "etc/driverd/config.toml"
    cfg.write_text(cfg.read_text().replace(USDIR, "/nowhere/userspace"))
    r = drv(node, "plan")
    assert r.returncode != 0 and "userspace.package /nowhere/userspace does not exist" in r.stderr, r.stderr



def test_driverd_rollback_restores_the_previous_userspace_with_the_previous_modules(node, packages):
    """`driverd rollback` (no run pending): the previous kernel package and the previous user-space, switched with
    the driver out of the kernel and validated together; a second rollback goes forward again."""
    old, new = us_package(node, OLD), us_package(node, NEW)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    configure(node, NEW, packages["new"].parent)
    assert drv(node, "apply").returncode == 0
    assert (loaded(node), in_use(node)) == (NEW, new.sha256)
    r = drv(node, "rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = journal(node)
    acts = [s["action"] for s in doc["steps"]]
    assert doc["state"] == "done" and doc["command"] == "rollback", doc
    assert (acts.index("unload-modules") < acts.index("restore-previous-package") < acts.index("restore-userspace")
            < acts.index("load-modules") < acts.index("validate"))
    assert next(s for s in doc["steps"] if s["action"] == "restore-userspace")["params"] == {"sha256": old.sha256}
    assert (loaded(node), in_use(node)) == (OLD, old.sha256)
    v = next(s for s in doc["steps"] if s["action"] == "validate")["result"]
    assert v["workload"]["ok"] and v["workload"]["userspace"]["version"] == OLD, v
    assert os.readlink(node / "run/nvidia/driver") == "../../var/lib/driverd/driver/current"
    r = drv(node, "rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (loaded(node), in_use(node)) == (NEW, new.sha256) and cuda_ok(node, NEW).ok


def test_driverd_rollback_keeps_a_userspace_already_of_the_version_rolled_back_to(node, packages):
    """A reload that switched the modules alone (no 550 user-space offered): rolling back to the 535 modules
    keeps the 535 user-space in use — never the "none" its own install replaced."""
    old = us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0 and in_use(node) == old.sha256
    cfg = node / "etc/driverd/config.toml"                         # the mismatched reload must go through
    cfg.write_text(cfg.read_text().replace('workload = "on"', 'workload = "off"'))
    r = drv(node, "reload", "--package", str(packages["new"]))
    assert loaded(node) == NEW and in_use(node) == old.sha256, r.stdout + r.stderr
    r = drv(node, "rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = journal(node)
    assert doc["command"] == "rollback" and "restore-userspace" not in [s["action"] for s in doc["steps"]]
    assert (loaded(node), in_use(node)) == (OLD, old.sha256) and cuda_ok(node, OLD).ok


def test_after_a_reboot_the_lost_driver_root_link_is_made_again_by_the_next_pass(node, packages):
    """/run is a tmpfs: after a reboot /run/nvidia/driver (the toolkit's driver root) is gone while driverd's
    tree, loader configuration and PATH links are still there. plan names it, and the next apply (the daemon's
    pass runs the same request) makes the link again without switching anything."""
    old = us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    link = node / "run/nvidia/driver"
    target = os.readlink(link)
    link.unlink()
    r = drv(node, "plan")
    assert "install-userspace" in r.stdout and "installed but not active" in r.stdout, r.stdout + r.stderr
    r = drv(node, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.readlink(link) == target and in_use(node) == old.sha256
    acts = [s["action"] for s in journal(node)["steps"]]
    assert "unload-modules" not in acts and "install-userspace" in acts, acts
    r = drv(node, "plan")
    assert "install-userspace" not in r.stdout, r.stdout


def _persistenced_cmdlines(root) -> list[str]:
    out = []
    for p in (root / "proc").iterdir():
        if p.name.isdigit() and (p / "comm").read_text().strip() == "nvidia-persiste":
            out.append((p / "cmdline").read_text().split("\0")[0])
    return out


def test_persistenced_is_started_from_the_user_space_of_the_drivers_version(node, packages):
    us_package(node, OLD), us_package(node, NEW)
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    assert _persistenced_cmdlines(node) == ["/var/lib/driverd/driver/current/bin/nvidia-persistenced"]
    configure(node, NEW, packages["new"].parent)
    assert drv(node, "apply").returncode == 0
    # the daemon was stopped with the old driver and started after the switch: one, from the 550 tree
    assert _persistenced_cmdlines(node) == ["/var/lib/driverd/driver/current/bin/nvidia-persistenced"]
    assert os.readlink(node / "var/lib/driverd/driver/current") == NEW


def test_after_a_failed_upgrade_rolled_back_driverd_rollback_goes_to_the_driver_before_not_the_failed_one(node, packages):
    """535 -> 550 (both halves), then 550.127.08 fails to load and is rolled back to 550: the failed run must not
    become "previous". `driverd rollback` then goes to 535, both halves — not into the package that just failed."""
    old, new = us_package(node, OLD), us_package(node, NEW)
    us_package(node, "550.127.08")
    configure(node, OLD, packages["old"].parent)
    assert drv(node, "apply").returncode == 0
    configure(node, NEW, packages["new"].parent)
    assert drv(node, "apply").returncode == 0
    r = drv(node, "reload", "--package", str(packages["broken"]))
    assert r.returncode == 3 and "rolled back to 550.127.05" in r.stderr, r.stdout + r.stderr
    assert (loaded(node), in_use(node)) == (NEW, new.sha256)
    r = drv(node, "rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (loaded(node), in_use(node)) == (OLD, old.sha256)
    assert cuda_ok(node, OLD).ok


def _fetch_repo(node, packages, tmp_path, version: str) -> tuple[object, str]:
    """A file:// repository holding the kernel package of `version` and its user-space package, indexed by
    `driverd repo index` as an operator does; the node is configured with userspace.fetch and no
    userspace.package. Returns (the user-space package's ref, the repository)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(packages["old" if version == OLD else "new"], repo)
    ref = us_package(node, version)
    shutil.move(ref.path, repo / os.path.basename(ref.path))
    shutil.rmtree(node / USDIR.lstrip("/"))
    r = run_cli("repo", "index", str(repo), "--json", check=True)
    assert json.loads(r.stdout)["userspace_packages"] == 1, r.stdout
    configure(node, version, repo)
    cfg = node / "etc/driverd/config.toml"
    cfg.write_text(cfg.read_text().replace(f'package = "{USDIR}"', "fetch = true"))
    return ref, str(repo)


def _cached_userspace(node) -> list[str]:
    d = node / "var/cache/driverd"
    return sorted(p.name for p in d.rglob("driverd-userspace-*")) if d.is_dir() else []


def test_userspace_fetch_takes_the_package_the_repository_index_lists(node, packages, tmp_path):
    ref, repo = _fetch_repo(node, packages, tmp_path, OLD)
    r = drv(node, "plan")
    assert "fetch-userspace" in r.stdout and "packages.repositories" in r.stdout, r.stdout + r.stderr
    r = drv(node, "apply")
    assert r.returncode == 0, r.stderr
    doc = journal(node)
    acts = [s["action"] for s in doc["steps"]]
    assert doc["state"] == "done"
    assert acts.index("fetch-userspace") < acts.index("install-userspace") < acts.index("load-modules"), acts
    got = next(s for s in doc["steps"] if s["action"] == "fetch-userspace")["result"]
    assert got["sha256"] == ref.sha256 and got["source"] == f"file://{repo}", got
    assert _cached_userspace(node) == [os.path.basename(ref.path)]
    assert (loaded(node), in_use(node)) == (OLD, ref.sha256)
    assert cuda_ok(node, OLD).ok


def test_a_repository_entry_whose_sha256_does_not_match_is_refused_and_nothing_installed(node, packages, tmp_path):
    ref, repo = _fetch_repo(node, packages, tmp_path, OLD)
    index = os.path.join(repo, "index.json")
    doc = json.loads(open(index).read())
    e = doc["userspace"][0]
    e["sha256"] = ("0" if e["sha256"][0] != "0" else "1") + e["sha256"][1:]      # same size, another sha256
    with open(index, "w") as f:
        json.dump(doc, f)
    r = drv(node, "apply")
    assert r.returncode == 3, r.stdout + r.stderr
    # (the lines above it are the run's progress: what was done and undone)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("driverd: error:")]
    assert len(errors) == 1 and "apply failed at fetch-userspace" in errors[0], r.stderr
    assert f"has sha256 {ref.sha256}, expected {e['sha256']} (from file://{repo})" in errors[0], errors[0]
    assert "fix:" in errors[0]
    doc = journal(node)
    assert doc["failure"]["step"] == "fetch-userspace", doc["failure"]
    # nothing of it kept or installed, and the driver not loaded
    assert _cached_userspace(node) == []
    assert in_use(node) is None and not (node / "var/lib/driverd/driver").exists()
    assert not (node / "etc/ld.so.conf.d/00-driverd-nvidia.conf").exists()
    assert "nvidia" not in kernel_of(node).modules()


def test_userspace_fetch_reuses_its_cache_and_replaces_a_damaged_entry(node, packages, tmp_path):
    from driverd.config import load
    from driverd.repo.userspace import fetch
    ref, repo = _fetch_repo(node, packages, tmp_path, OLD)
    root = Root(node)
    cfg = load(root, None, {})
    first = fetch(root, cfg, OLD, "x86_64")
    cached = node / "var/cache/driverd/packages" / os.path.basename(ref.path)
    assert (first.package, first.sha256) == (str(cached), ref.sha256)
    os.unlink(os.path.join(repo, os.path.basename(ref.path)))          # a cache hit reads no repository file
    assert fetch(root, cfg, OLD, "x86_64").package == str(cached)
    shutil.copy(cached, tmp_path / "good")
    with open(cached, "r+b") as f:                                      # damaged in the cache: fetched again
        f.seek(100)
        f.write(b"\0" * 16)
    shutil.copy(tmp_path / "good", os.path.join(repo, os.path.basename(ref.path)))
    again = fetch(root, cfg, OLD, "x86_64")
    assert again.sha256 == ref.sha256 and hashlib.sha256(cached.read_bytes()).hexdigest() == ref.sha256


NOBODY = 65534


@pytest.mark.parametrize("where", ["package", "directory", "parent"])
def test_a_userspace_package_another_user_can_change_is_refused_in_one_line(node, packages, where):
    """Issue 44, item 5: userspace.package naming a package, or a directory of them, that a non-root user
    can write — or in a directory on the way that they can — is refused before anything is installed: root
    would install their package and load their libnvidia-ml."""
    pkg = us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    usdir = node / USDIR.lstrip("/")
    target = {"package": pkg.path, "directory": usdir, "parent": usdir.parent}[where]
    os.chown(target, NOBODY, NOBODY)
    if where == "package":
        cfg = node / "etc/driverd/config.toml"
        cfg.write_text(cfg.read_text().replace(f'package = "{USDIR}"', f'package = "{USDIR}/{os.path.basename(pkg.path)}"'))
    for cmd in ("plan", "apply"):
        r = drv(node, cmd)
        assert r.returncode == 2, r.stdout + r.stderr
        line = r.stderr.strip().splitlines()[0]
        assert line.startswith("driverd: error: refusing userspace.package ") and f"owned by uid {NOBODY}" in line, r.stderr
        assert "fix:" in r.stderr and "chown root" in r.stderr, r.stderr
    assert in_use(node) is None and "nvidia" not in kernel_of(node).modules()


def test_a_userspace_root_under_a_directory_another_user_can_write_is_refused(node, packages):
    """Issue 44, item 5: a non-root owner of a parent of userspace.root could swap the tree the loader
    configuration names; driverd refuses to install there, in one line."""
    us_package(node, OLD)
    configure(node, OLD, packages["old"].parent)
    cfg = node / "etc/driverd/config.toml"
    cfg.write_text(cfg.read_text().replace(f'package = "{USDIR}"', f'package = "{USDIR}"\nroot = "/srv/gpu/driver"'))
    (node / "srv/gpu").mkdir(parents=True)
    os.chmod(node / "srv/gpu", 0o777)
    r = drv(node, "apply")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing userspace.root /srv/gpu/driver: the directory" in r.stderr and "chmod go-w" in r.stderr, r.stderr
    assert not (node / "srv/gpu/driver").exists() and in_use(node) is None
    # fixed, the same apply installs it
    os.chmod(node / "srv/gpu", 0o755)
    r = drv(node, "apply")
    assert r.returncode == 0, r.stderr
    assert os.path.islink(node / "srv/gpu/driver/current")
