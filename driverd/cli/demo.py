"""`driverd demo`: the whole product on a simulated DGX-class host in well under a minute, no GPU.

detect -> plan -> apply (fetch, verify, install, load, validate) -> status, an upgrade to 550.127.05
that switches the driver (kernel modules, user-space and the fabric manager of its version) in one
transaction, then an
upgrade to a package whose GSP firmware is missing: the load fails with the kernel's NVRM lines and the
host rolls back to the last-known-good driver, validated; `driverd rollback` goes back to 535, both halves.
The user-space half needs root (its install runs `ldconfig -r`, which chroots): without it the demo
shows the kernel half alone and says so.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

CONFIG = """[driver]
version = "535.261.03"
flavor = "open"
[packages]
repositories = ["file://{repo}"]
index_public_key = "/etc/driverd/repo-index.pub"
[runtime]
runtimes = ["containerd"]
restart = "none"
cdi = true
[modules]
kernel = "sim"        # the sandbox's kernel is simulated; driverd uses it only when told so
"""
UPGRADE = "550.127.05"
# the driver's user-space from the same repository (its index lists the "userspace" packages)
USERSPACE = """[userspace]
fetch = true
[companions]
fetch = true          # and its fabric manager (the host has 4 NVSwitches), switched with the driver
"""


def _say(msg: str) -> None:
    print(msg, flush=True)


MARKER = ".driverd-demo"          # in a workdir the demo made (or found empty): it may replace what is in it


def prepare_workdir(path: str | None) -> Path:
    """The demo's sandbox directory, which it fills and later empties again (rmtree of host/, cluster/):
    a new temporary directory, or `path` when that is safe to own — never through a symbolic link
    (another user's link in /tmp would send the demo's writes and deletions into that user's choice of
    directory), never in a directory others can change (driverd.fsutil.walk_trusted judges every
    directory on the way: a sticky /tmp is fine, an entry in it that another user made is not), and
    never a non-empty directory the demo did not make (its marker file says it did). Missing
    directories are created 0700, one at a time, without following anything."""
    import stat
    from driverd.errors import UsageError
    from driverd.fsutil import Untrusted, walk_trusted
    if not path:
        wd = Path(tempfile.mkdtemp(prefix="driverd-demo."))
        _mark(wd)
        return wd

    def refuse(problem: str, fix: str, cause: str = "the demo writes, and deletes, inside its workdir") -> UsageError:
        return UsageError(f"refusing demo workdir {path}: {problem}", cause=cause, fix=fix)
    try:
        real, st, missing = walk_trusted(path, follow_last=False)
    except Untrusted as u:
        raise refuse(u.problem, u.fix) from None
    except OSError as e:
        raise refuse(e.strerror or str(e), "pass a new directory, e.g. --work-dir /tmp/driverd-demo") from None
    if missing:
        for name in missing:
            real = os.path.join(real, name)
            try:
                os.mkdir(real, 0o700)
            except OSError as e:       # it appeared meanwhile (another user's link?), or cannot be made
                raise refuse(f"cannot create {real}: {e.strerror}", "pass a new directory of yours") from None
        _mark(Path(real))
        return Path(real)
    if stat.S_ISLNK(st.st_mode):
        raise refuse(f"it is a symbolic link (to {os.readlink(real)})", "pass the directory itself, not a link to it",
                     cause="the demo never follows a link: whoever made it chooses where the demo writes and deletes")
    if not stat.S_ISDIR(st.st_mode):
        raise refuse("it is not a directory", "pass a new or empty directory")
    if st.st_uid != os.geteuid():
        raise refuse(f"it belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})",
                     "pass a new directory (the demo creates it) or one of yours")
    if st.st_mode & 0o022:
        raise refuse(f"others can write to it (mode {stat.S_IMODE(st.st_mode):04o})", f"chmod go-w {real}")
    if not os.path.exists(os.path.join(real, MARKER)) and any(True for _ in os.scandir(real)):
        raise refuse("it is not empty and the demo did not make it",
                     "pass a new or empty directory (the demo replaces what it puts there on the next run)",
                     cause="the demo replaces the sandbox it made; it never takes over another directory")
    _mark(Path(real))
    return Path(real)


def _mark(wd: Path) -> None:
    p = wd / MARKER
    if not p.exists():
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write("made by `driverd demo`: the next demo run may replace everything in this directory\n")


def run_demo(workdir: str | None, as_json: bool = False, kubeconfig: str | None = None, keep: bool = False) -> int:
    """The demo; Ctrl-C or SIGTERM stops it where it is (exit 130 / 143), its processes stopped (the
    stage's own clean-up, the cluster stage's node daemons) and the sandbox kept as it was left."""
    from driverd.cli.interrupt import terminate_as_interrupt
    with terminate_as_interrupt():
        return _run_demo(workdir, as_json, kubeconfig, keep)


def _run_demo(workdir: str | None, as_json: bool, kubeconfig: str | None, keep: bool = False) -> int:
    from driverd.cli import main
    from driverd.cli.interrupt import EXIT_INTERRUPTED, EXIT_TERMINATED
    from driverd.sim.scenario import (dgx_spec, make_companion_packages, make_host, make_packages,
                                      make_userspace_packages)
    t0 = time.monotonic()
    wd = prepare_workdir(workdir)
    root, repo = wd / "host", wd / "repo"
    if root.exists():
        import shutil
        shutil.rmtree(root)
    _say(f"== driverd demo in {wd}\n   sandbox host: 8x H100 SXM, 4 NVSwitch, ConnectX-7 NIC, nouveau loaded, "
         "simulated kernel (its /proc and /sys live in the sandbox)")
    make_host(root, dgx_spec())
    marker = repo / ".built"
    from driverd.repo.index import write_index
    from driverd.sim.scenario import make_index_key
    key, pub = make_index_key(wd / "keys")
    if not marker.exists():
        _say("   building the package repository (fake but real ELF modules and user-space libraries) ...")
        pk = make_packages(repo, sign_key=key)
        make_userspace_packages(repo)
        make_companion_packages(repo)
        marker.write_text("\n".join(f"{k} {v}" for k, v in pk.items()) + "\n")
    # a fresh serial and expiry for the index (signed, so the node checks both)
    write_index(repo, sign_key=str(key), verify=False)
    write_index(repo / "broken", sign_key=str(key), verify=False)
    pk = dict(ln.split(" ", 1) for ln in marker.read_text().splitlines())
    (root / "etc/driverd").mkdir(parents=True, exist_ok=True)
    both = os.geteuid() == 0
    (root / "etc/driverd/config.toml").write_text(CONFIG.format(repo=repo) + (USERSPACE if both else ""))
    if not both:
        _say("   (not root: the user-space half is left out — its install runs `ldconfig -r`, which chroots; "
             "run the demo as root to see both halves switch)")
    # the node's key paths are host paths: the public key lives in the host tree
    (root / "etc/driverd/repo-index.pub").write_bytes(pub.read_bytes())
    _say(f"   repository index signed with {key.name}; the node checks it against /etc/driverd/repo-index.pub")
    for k in [k for k in os.environ if k.startswith("DRIVERD_")]:
        del os.environ[k]
    r = str(root)
    stages = [("detect: what is on this host", ["detect", "--root", r, "--no-nvml"]),
              ("plan: what driverd will do, and why", ["plan", "--root", r]),
              ("apply: fetch -> verify -> install -> load -> validate (journaled step by step)", ["apply", "--root", r]),
              ("status", ["status", "--root", r]),
              ("upgrade to 550.127.05: " + ("the whole driver — kernel modules, user-space and its fabric manager — "
                                            "in one transaction" if both else "the kernel modules"),
               ["apply", "--root", r, "--driver", UPGRADE]),
              ("upgrade to 550.127.08, whose package lacks its GSP firmware: the load fails, driverd rolls back",
               ["reload", "--root", r, "--package", pk["broken"]]),
              ("status after the rollback", ["status", "--root", r]),
              ("driverd rollback: back to the previous driver, 535.261.03" + (", both halves" if both else ""),
               ["rollback", "--root", r]),
              ("status", ["status", "--root", r])]
    for i, (title, argv) in enumerate(stages, 1):
        _say(f"\n== {i}. {title}\n$ driverd {' '.join(a if len(a) < 60 else '...' + a[-40:] for a in argv)}")
        rc = main(argv + (["--json"] if as_json else []))
        if rc in (EXIT_INTERRUPTED, EXIT_TERMINATED):      # the stage's command was stopped: so is the demo
            _say(f"demo: stopped at stage {i} ({argv[0]}); the sandbox stays in {wd} as it was left "
                 f"(`driverd status --root {root}` shows it; a run it cut short is finished by the next command)")
            return rc
        expect_fail = argv[0] == "reload"
        if (rc != 0) != expect_fail:
            _say(f"demo: stage {i} exited {rc} unexpectedly")
            return 1
        if expect_fail:
            _say(f"   (exit {rc} as expected: the failed upgrade is reported with the kernel's words, "
                 "and the host is back on the last-known-good driver)")
    if not as_json:
        rc = cluster_demo(wd / "cluster", len(stages) + 1, kubeconfig, keep=keep)
        if rc != 0:
            return rc
    _say(f"\n== done in {time.monotonic() - t0:.1f}s: the sandbox stays in {wd} (driverd status --root {root})")
    return 0


def _driverd_in_charge(kube) -> str:
    """What of a driverd already at work on this cluster the demo's nodes would act on, in words ("" for
    none). The demo's node daemons are coordinator candidates (a fleet's "nodes" mode): holding the
    Lease, they would carry out every DriverRollout and DriverPool of the cluster, not just the demo's."""
    from driverd.cluster import model as m
    from driverd.cluster.kube import KubeError, lease_path, pool_path, rollout_path
    from driverd.cluster.lease import LEASE_NAME
    found = []
    try:
        rollouts = [o for o in kube.list(rollout_path()).get("items") or []
                    if DEMO_LABEL not in ((o.get("metadata") or {}).get("labels") or {}) and not m.ended(o)]
        if rollouts:
            found.append("DriverRollout " + ", ".join(o["metadata"]["name"] for o in rollouts[:3]) + " in progress")
        pools = kube.list(pool_path()).get("items") or []
        if pools:
            found.append("DriverPool " + ", ".join(o["metadata"]["name"] for o in pools[:3]))
    except KubeError as e:
        if e.status != 404:          # 404: driverd's CRDs are not installed, so no driverd runs here
            raise
    try:
        holder = (kube.get(lease_path("driverd", LEASE_NAME)).get("spec") or {}).get("holderIdentity") or ""
    except KubeError as e:
        if e.status != 404:
            raise
        holder = ""
    if holder and not holder.startswith("demo-"):
        found.append(f"a coordinator ({holder} holds Lease driverd/{LEASE_NAME})")
    return "; ".join(found)


class _Given:
    """The API server of a kubeconfig the user gave (the demo never starts one: a test API server is
    no part of the product)."""

    def __init__(self, kubeconfig: str) -> None:
        self.path = kubeconfig

    def write_kubeconfig(self, path) -> None:
        import shutil
        shutil.copyfile(self.path, path)


DEMO_LABEL = "driverd.io/demo"


def cluster_demo(work: Path, stage: int, kubeconfig: str | None, nodes: int = 4, keep: bool = False) -> int:
    """A rolling upgrade across a small simulated cluster: node daemons (the real agent and node
    transaction, each on its own simulated host) against the API server of `kubeconfig`, driven and
    read through the real kubectl and `kubectl driverd`. Without a kubeconfig the stage is skipped in
    one line. What it made on the API server is removed at the end unless `keep`."""
    import shutil
    import subprocess
    import sys
    if not kubeconfig:
        _say(f"\n== {stage}. rolling upgrade across a simulated cluster: skipped, it needs a Kubernetes API server "
             "(`driverd demo --kubeconfig FILE` with a throwaway test cluster's admin kubeconfig)")
        return 0
    import uuid

    from driverd.cluster.kube import node_path, rollout_path
    from driverd.sim.fleet import NEW, Fleet, FleetConflict
    # kubectl finds its plugin on PATH; the installed entry point sits beside this interpreter in a venv,
    # in /usr/local/bin in the image.
    path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    kubectl, plugin_exe = shutil.which("kubectl", path=path), shutil.which("kubectl-driverd", path=path)
    if plugin_exe is None:
        _say(f"\n== {stage}. rolling upgrade across a simulated cluster: skipped, kubectl-driverd is not on PATH "
             "(it is installed with driverd's console scripts)")
        return 0
    if work.exists():
        shutil.rmtree(work)
    # The demo's own objects carry a label of this run: its rollout selects its nodes alone, and the
    # clean-up deletes nothing else. Its names are the run's too, so that it does not meet the nodes of
    # an earlier run kept with --keep (or any node of the cluster) under its own names; should a name
    # still be taken, the fleet refuses it (exclusive) rather than take over a node it did not make.
    from driverd.cluster.kube import Kube, KubeError, Target
    try:
        busy = _driverd_in_charge(Kube(Target(kubeconfig=kubeconfig)))
    except KubeError as e:
        _say(f"\n== {stage}. rolling upgrade across a simulated cluster: failed, {e.one_line()}")
        return 1
    if busy:
        _say(f"\n== {stage}. rolling upgrade across a simulated cluster: refused, this cluster's driverd is at work "
             f"({busy}): the demo's nodes coordinate rollouts and would act on them too; run the demo against a "
             "throwaway test cluster")
        return 1
    run = uuid.uuid4().hex[:6]
    mark, rollout = f"{DEMO_LABEL}={run}", f"demo-{run}"
    fleet = Fleet(work, nodes, server=_Given(kubeconfig), labels={DEMO_LABEL: run}, prefix=f"demo-{run}",
                  exclusive=True)
    try:
        fleet.build()
    except FleetConflict as e:
        fleet.remove()          # what it made before it met the name (nothing, unless that Node came meanwhile)
        _say(f"\n== {stage}. rolling upgrade across a simulated cluster: refused, {e.kind} {e.name} already "
             f"exists without this run's label {mark}, so the demo did not make it and will neither change nor "
             f"delete it (run the demo again: another run picks other names; or, if it is a leftover of "
             f"yours, `kubectl delete {e.kind.lower()} {e.name}`)")
        return 1
    try:
        _say(f"\n== {stage}. a rolling upgrade across a simulated cluster of {nodes} GPU nodes (API server "
             f"{fleet.admin.host}; each node runs driverd's cluster agent on its own simulated host, with a GPU pod "
             f"guarded by a PodDisruptionBudget; the demo's nodes are labelled {mark} and only they are upgraded)")
        fleet.start()
        fleet.wait(lambda: all((n["metadata"].get("labels") or {}).get("driverd.io/driver-version")
                               for n in fleet.admin.list(node_path(), labels=mark)["items"]), 60)
        env = dict(os.environ, KUBECONFIG=fleet.kubeconfig, PATH=path, HOME=str(work))
        plugin = [kubectl, "driverd"] if kubectl else [plugin_exe]
        steps = [(["get", "nodes", "-l", mark, "-L", "driverd.io/driver-version"], True),
                 (["driverd", "rollout", "start", "--driver", NEW, "--name", rollout, "--selector", mark,
                   "--max-parallel", "2", "--max-unavailable", "2"], False),
                 (["driverd", "rollout", "status", rollout, "--watch", "--timeout", "120"], False),
                 (["get", "driverrollout", rollout], True),
                 (["driverd", "nodes", "-l", mark], False)]
        for argv, kubectl_only in steps:
            if kubectl_only and not kubectl:
                continue
            cmd = ([kubectl] + argv) if kubectl else (plugin + argv[1:])
            _say("$ " + ("kubectl " if kubectl else "kubectl-driverd ") + " ".join(argv if kubectl else argv[1:]))
            res = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=180)
            out = res.stdout
            if "--watch" in argv:      # the last picture of the watch is the one that matters
                out = out.rstrip().split("\n\n")[-1]
            _say(out.rstrip() + (("\n" + res.stderr.rstrip()) if res.returncode else ""))
            if res.returncode != 0:
                _say(f"demo: `{' '.join(argv)}` exited {res.returncode}")
                return 1
            if argv[1:3] == ["rollout", "start"]:
                # only now is the rollout known to be this run's (a start that met one of its name failed):
                # the label lets the clean-up delete it, and nothing of that name it did not make
                fleet.admin.patch(rollout_path(rollout), {"metadata": {"labels": {DEMO_LABEL: run}}})
        return 0
    finally:
        if keep:
            fleet.stop()
            _say(f"demo: kept on the API server (--keep): the nodes labelled {mark} and rollout {rollout}")
        else:
            left = fleet.remove((rollout,))
            _say(f"demo: removed what it made on the API server: {len(fleet.nodes)} nodes ({mark}), their GPU "
                 f"pods and rollout {rollout}" + (f"; could not remove: {'; '.join(left)}" if left else ""))
