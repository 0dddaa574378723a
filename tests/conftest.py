"""Shared fixtures. Real components are required in CI (CI=true): a missing one fails the test there
instead of skipping it, so a green CI means the real thing ran."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import pytest

import driverd.sim
from driverd import safetar

# Tests are a composition root like the CLI: the simulated kernel, daemons and MIG are available.
driverd.sim.install_backends()
# ...and they ask for the simulated kernel explicitly (driverd never infers it from a host tree): every
# command run in this process or in a child (the helpers keep this one DRIVERD_ variable) gets
# modules.kernel = "sim". A test about the real kernel says so: --kernel-backend real, or KERNEL_ENV_REAL.
KERNEL_ENV = "DRIVERD_MODULES_KERNEL"
KERNEL_ENV_REAL = {KERNEL_ENV: "real"}
os.environ[KERNEL_ENV] = "sim"


def driverd_env(extra: dict | None = None, drop: tuple[str, ...] = ("DRIVERD_",)) -> dict:
    """This process's environment for a driverd child: DRIVERD_* settings dropped (and `drop`'s other
    prefixes), except the explicit kernel choice."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) or k == KERNEL_ENV}
    env.update(extra or {})
    return env

REPO = Path(__file__).resolve().parent.parent
# Where .ci/install-components puts the real components (the VM engine and kernel, containerd 2.1, the
# control plane): the same variable for the install script and the tests, so a throwaway prefix can prove
# the install on a fresh machine.
CI_PREFIX = Path(os.environ.get("DRIVERD_CI_PREFIX") or "/opt/driverd-ci")
FIXTURES = Path(__file__).resolve().parent / "fixtures"
HOSTS = FIXTURES / "hosts"


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server a test starts, or one that must refuse)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_binary(name: str, *candidates: str) -> str:
    """Path of a real tool; skip locally when missing, fail in CI where .ci/run installs it."""
    for c in (name, *candidates):
        found = shutil.which(c) or (c if os.path.isabs(c) and os.access(c, os.X_OK) else None)
        if found:
            return found
    missing_component(f"real component {name} is not installed (bash .ci/install-components installs it)")


def missing_component(msg: str) -> NoReturn:
    """A real component a test needs is absent: a failure in CI (where .ci/run installs every one),
    a skip with the reason elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def kmod_tools():
    """The real kmod tools (modinfo, depmod, modprobe) that package installs drive."""
    for t in ("modinfo", "depmod", "modprobe"):
        require_binary(t, f"/usr/sbin/{t}", f"/sbin/{t}")


@pytest.fixture
def unpack_host(tmp_path):
    """Unpack a captured host tarball from tests/fixtures/hosts into a temp root."""
    def _unpack(name: str) -> Path:
        dest = tmp_path / name.split(".")[0]
        dest.mkdir()
        # Captures hold symlinks, absolute ones meaning a path inside the tree (var/run -> /run).
        safetar.extract_file(HOSTS / name, dest, links="rooted")
        return dest
    return _unpack


def stop_process(p: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM, `grace` seconds to exit, then SIGKILL: how the tests stop the real components they started."""
    p.terminate()
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def run_cli(*args: str, env: dict | None = None, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the installed console script `driverd` (falls back to python -m driverd outside a venv)."""
    exe = Path(sys.executable).parent / "driverd"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]
    full_env = driverd_env(env)
    res = subprocess.run(cmd + list(args), capture_output=True, text=True, env=full_env, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"driverd {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res


# Host state that tests must never change on the machine running them (every test works in a temp root).
_GUARDED = ("/etc/modprobe.d", "/etc/containerd", "/etc/crio", "/etc/docker", "/etc/driverd", "/var/lib/driverd",
            "/var/cache/driverd", "/var/run/cdi", "/run/cdi", "/etc/cdi", "/lib/firmware/nvidia",
            # what a user-space install writes (the loader's configuration, a PATH link); not the ld cache or
            # /usr/local/bin as a whole: another apt-get on the machine rewrites those legitimately
            "/etc/ld.so.conf.d/00-driverd-nvidia.conf", "/usr/local/bin/nvidia-smi")


def _snapshot_host() -> dict[str, object]:
    snap: dict[str, object] = {}
    for top in _GUARDED:
        if not os.path.lexists(top):
            snap[top] = None
            continue
        if not os.path.isdir(top):
            st = os.lstat(top)
            snap[top] = (st.st_mtime_ns, st.st_size)
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            for name in filenames + dirnames:
                p = os.path.join(dirpath, name)
                try:
                    st = os.lstat(p)
                    snap[p] = (st.st_mtime_ns, st.st_size)
                except OSError:
                    pass
    for rel in os.listdir("/lib/modules") if os.path.isdir("/lib/modules") else []:
        d = f"/lib/modules/{rel}/updates"
        snap[d] = sorted(os.listdir(d)) if os.path.isdir(d) else None
    return snap


@pytest.fixture(scope="session", autouse=True)
def never_touch_the_real_host():
    """Fails the run if any test wrote into this machine's /etc, /lib/modules or driverd state."""
    before = _snapshot_host()
    yield
    after = _snapshot_host()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"tests changed the real host: {changed[:10]}"


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """The real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager; see
    tests/controlplane.py), one for the whole run. Missing binaries skip locally and fail in CI."""
    from tests.controlplane import finish, start_session_control_plane
    cp = start_session_control_plane()
    try:
        yield cp
    finally:
        finish(cp)


@pytest.fixture(scope="session")
def deployed(control_plane, tmp_path_factory):
    """The session's control plane with deploy/ applied (container-mode: the CRD, RBAC, admission
    policy driverd's daemons run under) and the operators' group bound to driverd-operator."""
    from tests.controlplane import apply_deploy
    apply_deploy(control_plane, tmp_path_factory.mktemp("kubectl-home"))
    return control_plane


@pytest.fixture(scope="session")
def driver_image(tmp_path_factory):
    """The driver image built by images/build-image.sh (an OCI layout, tag driver-test), once per run:
    tests/test_image.py runs it with runc, tests/node/ under a real kubelet. DRIVERD_TEST_IMAGE names an
    already built layout of this tree instead (local iteration; CI always builds)."""
    if os.geteuid() != 0:
        pytest.skip("building and running an image needs root")
    for t in ("mmdebstrap", "umoci", "runc"):
        require_binary(t)
    prebuilt = os.environ.get("DRIVERD_TEST_IMAGE")
    if prebuilt and not os.environ.get("CI"):
        return Path(prebuilt)
    from tests.test_image import TAG, _build
    return _build("driver", tmp_path_factory.mktemp("image") / "oci", TAG)


@pytest.fixture(scope="session")
def real_node():
    """A real node (tests/realnode.py): its own control plane with kube-scheduler, a private containerd
    1.6 and a kubelet, one for the whole run. Missing components skip locally and fail in CI."""
    from tests.controlplane import finish
    from tests.realnode import start_real_node
    node = start_real_node()
    print("\nreal node: " + ", ".join(f"{k} {v:.1f}s" for k, v in node.timings.items()))
    try:
        yield node
    finally:
        finish(node)


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Both ways driverd.root resolves a path inside the root: openat2(RESOLVE_IN_ROOT) where the kernel
    has it, and the O_NOFOLLOW walk (forced: openat2 must then never be called)."""
    import driverd.root as root_mod
    if request.param == "openat2":
        monkeypatch.setattr(root_mod, "OPENAT2", None)
        if not root_mod.openat2_available():
            pytest.skip("this kernel has no openat2")
    else:
        monkeypatch.setattr(root_mod, "OPENAT2", False)

        def never(*a, **k):
            raise AssertionError("openat2 used although the walk was forced")
        monkeypatch.setattr(root_mod, "_openat2", never)
    return request.param



# -- running the suite in parallel (pytest-xdist, `.ci/run`) -------------------------------------------
# One test file runs on one worker, start to end, in its own order: its module-scoped fixtures (a VM boot,
# a private containerd, a fleet) are made once, and a file's tests never race each other. The files that
# build or run the driver image share a worker, so that it is built once and only one real node (fixed
# addresses on lo) runs at a time. The longest groups are handed out first (xdist gives work in
# collection order), so that the run does not end waiting on one of them. (xdist's own `loadgroup` marks
# do not take with pytest 9, whose node ids no longer come from the attribute xdist rewrites: the
# grouping is this scheduler's.)
_SHARED_GROUPS = {"tests/test_image.py": "driver-image", "tests/node/test_daemonset.py": "driver-image",
                  "tests/node/test_realnode.py": "driver-image"}
# Measured with --durations (docs/testing.md, "How long the suite takes"): the groups that take minutes.
_LONG_FIRST = ("tests/vm/test_vm_reboot.py", "driver-image", "tests/test_package_real.py", "tests/vm/",
               "tests/packages/test_userspace_real.py", "tests/packages/test_compiler_cache.py",
               "tests/cluster/test_fleet_bench.py", "tests/apply/test_concurrency.py")


def _group(nodeid: str) -> str:
    rel = nodeid.split("::", 1)[0]
    return _SHARED_GROUPS.get(rel, rel)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)
    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):     # only a worker of `pytest -n N` collects for the scheduler
        return

    def rank(item) -> int:
        g = _group(item.nodeid)
        return next((i for i, p in enumerate(_LONG_FIRST) if g.startswith(p)), len(_LONG_FIRST))
    items.sort(key=rank)                   # stable: each file keeps its own order; the same on every worker
