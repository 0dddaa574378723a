"""A real Kubernetes node for tests: a private containerd 1.6 with runc, a kubelet v1.34.4 registered
against a control plane of its own (tests/controlplane.py with kube-scheduler and the controllers a node
needs), started in a temp directory and stopped by PID. What it took on this kind of machine (a cgroup v1
VM, root without CAP_SYS_RESOURCE, no container bridge networking) is shared/REAL-COMPONENTS.md's "A real
node"; docs/testing.md says how the tests use it.

- containerd: config version 2 with its own root, state, socket, runc root, `opt` directory and CNI
  config directory; `restrict_oom_score_adj = true` (runc cannot raise its oom_score_adj here); the CNI
  network is the loopback plugin (Debian's containernetworking-plugins) and POD_ADDRESS_PLUGIN (an address,
  no link), so the node is Ready, pods run with hostNetwork, and a pod without it runs with its loopback
  interface only (RealNode._write_cni). The sandbox ("pause") image is a busybox-static image built here
  with umoci.
- Addresses: the node's InternalIP is a TEST-NET-2 address and kube-apiserver listens on the first
  address of the service range, port 443, both /32 aliases on lo added for the run: a pod reaches the
  apiserver at $KUBERNETES_SERVICE_HOST:443 as in a cluster, without kube-proxy (nothing translates a
  ClusterIP here, so the apiserver simply is at it).
- One real node at a time on a machine (its addresses, port 443 and the kubelet's fixed host paths):
  an flock on /run/lock/driverd-realnode.lock; a second run waits for the first.
- What the kubelet writes outside its --root-dir, and what it changes, is put back at the end:
  /var/lib/kubelet/device-plugins and /var/log/containers (fixed paths in the kubelet), containerd 1.6's
  shim sockets in /run/containerd/s, the cgroups under kubepods, the kernel tunables the kubelet sets
  (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops ...), and every mount under the temp
  directory (the kubelet's volume tmpfs, the sandboxes' /dev/shm).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import urllib.error
from pathlib import Path

from tests.conftest import missing_component, require_binary, stop_process
from tests.controlplane import ControlPlane, find_binaries, started
from tests.kubetools import condition_true

NODE_IP = "198.51.100.35"              # TEST-NET-2 (RFC 5737): never a real peer
SERVICE_RANGE = "198.18.0.0/24"        # the benchmarking range (RFC 2544): never routed
APISERVER_IP = "198.18.0.1"            # the `kubernetes` Service's ClusterIP: the first of the range
NODE_NAME = "driverd-node-1"
PAUSE_IMAGE = "localhost/pause:test"
LOCK = "/run/lock/driverd-realnode.lock"
# The controllers a node's workloads need on top of the control plane's default set.
NODE_CONTROLLERS = ("daemonset", "replicaset", "deployment", "nodelifecycle", "podgc", "root-ca-cert-publisher",
                    "endpointslice")
# What the kubelet's container manager sets at start unless protectKernelDefaults (which makes it refuse
# to start on a machine whose values differ): restored at the end.
TUNABLES = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
            "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
KUBELET_FIXED_DIRS = ("/var/lib/kubelet/device-plugins", "/var/log/containers")
SHIM_SOCKETS = "/run/containerd/s"
# A CNI plugin (the CNI spec's ADD, DEL, CHECK, VERSION over environment and stdin) that changes nothing: its
# ADD answers the pod's interface with an address of TEST-NET-1 (RFC 5737) drawn from the container id, so
# that containerd's CRI takes the sandbox; the pod has its loopback interface only. RealNode._write_cni.
POD_ADDRESS_PLUGIN = r"""#!/bin/sh
case "$CNI_COMMAND" in
VERSION) echo '{"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0"]}' ;;
ADD)
    cat > /dev/null
    n=$(( $(printf '%d' "0x$(printf '%s' "$CNI_CONTAINERID" | cut -c1-2)") % 250 + 2 ))
    printf '{"cniVersion":"1.0.0","interfaces":[{"name":"%s","sandbox":"%s"}],' "$CNI_IFNAME" "$CNI_NETNS"
    printf '"ips":[{"address":"192.0.2.%s/32","interface":0}]}\n' "$n" ;;
*) cat > /dev/null ;;
esac
"""


def find_node_binaries() -> tuple[dict[str, str], str]:
    """(paths of kubelet, kube-scheduler, containerd, ctr, runc and the CNI loopback plugin; what is
    missing: "" when complete)."""
    bindir, msg = find_binaries()
    missing = []
    if msg:
        missing.append(msg)
    found: dict[str, str] = {}
    for b in ("kubelet", "kube-scheduler"):
        if os.access(bindir / b, os.X_OK):
            found[b] = str(bindir / b)
        else:
            missing.append(f"{b} is not built in {bindir}; fix: bash .ci/build-control-plane")
    for b in ("containerd", "ctr", "runc", "umoci", "busybox"):
        p = shutil.which(b) or next((c for c in (f"/usr/sbin/{b}", f"/bin/{b}") if os.access(c, os.X_OK)), None)
        if p:
            found[b] = p
        else:
            missing.append(f"{b} is not installed; fix: bash .ci/install-components")
    if os.access("/usr/lib/cni/loopback", os.X_OK):
        found["cni"] = "/usr/lib/cni"
    else:
        missing.append("the CNI loopback plugin is not installed (/usr/lib/cni/loopback); "
                       "fix: apt-get install containernetworking-plugins (.ci/install-components does)")
    return found, "; ".join(missing)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run(*cmd: str, timeout: float = 120) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


class RealNode:
    """The control plane, containerd and kubelet of one real node; start() then stop() (always)."""

    def __init__(self, work: Path, bins: dict[str, str], bindir: Path) -> None:
        self.dir, self.bins = work, bins
        self.name = NODE_NAME
        self.cp = ControlPlane(bindir, work / "cp", address=APISERVER_IP, port=443, service_range=SERVICE_RANGE,
                               controllers=NODE_CONTROLLERS, scheduler=True, node_tokens=(NODE_NAME,),
                               apiserver_args=("--kubelet-preferred-address-types=InternalIP,Hostname",))
        # containerd's configuration and socket are where a host keeps them, in a host tree of the node's
        # own (`host`): a test that mounts that tree at the driver container's /host has driverd edit the
        # very file this containerd reads and wait for the socket the kubelet uses.
        self.host = work / "host"
        self.config_toml = self.host / "etc/containerd/config.toml"
        self.sock = str(self.host / "run/containerd/containerd.sock")
        self.containerd_starts = 0
        self._systemd: threading.Thread | None = None
        self._stopping = threading.Event()
        self.systemd_restarts = 0
        self.systemd_error = ""
        self.procs: dict[str, subprocess.Popen] = {}
        self.timings: dict[str, float] = {}
        self._lock_fd: int | None = None
        self._added_addresses: list[str] = []
        self._tunables: dict[str, str] = {}
        self._existed: dict[str, set[str] | None] = {}
        self._cgroups_before: set[str] = set()
        self._had_kubelet_dir = True
        self.started_at = 0.0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> RealNode:
        t0 = time.monotonic()
        os.makedirs(os.path.dirname(LOCK), exist_ok=True)
        self._lock_fd = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._remember_host()
        for ip in (NODE_IP, APISERVER_IP):
            if ip not in _run("ip", "-4", "-o", "addr", "show", "dev", "lo"):
                _run("ip", "addr", "add", f"{ip}/32", "dev", "lo")
                self._added_addresses.append(ip)
        self.cp.start()
        self.timings["control plane"] = time.monotonic() - t0
        t = time.monotonic()
        self._start_containerd()
        self.import_image(self._pause_image(), "pause", PAUSE_IMAGE)
        self.timings["containerd + pause image"] = time.monotonic() - t
        t = time.monotonic()
        self._start_kubelet()
        self.wait_node_ready(60)
        self.timings["kubelet to Node Ready"] = time.monotonic() - t
        self.timings["total"] = time.monotonic() - t0
        return self

    def _remember_host(self) -> None:
        for k in TUNABLES:
            self._tunables[k] = Path(f"/proc/sys/{k}").read_text().strip()
        for d in (*KUBELET_FIXED_DIRS, SHIM_SOCKETS):
            self._existed[d] = set(os.listdir(d)) if os.path.isdir(d) else None
        self._cgroups_before = {str(p) for p in Path("/sys/fs/cgroup").glob("*/kubepods")}
        self._had_kubelet_dir = os.path.isdir("/var/lib/kubelet")

    def write_containerd_config(self) -> None:
        """The node's containerd configuration, at host/etc/containerd/config.toml (what a sample host
        tree written over the node's host directory replaces: write it again after)."""
        d = self.dir / "containerd"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        self.config_toml.parent.mkdir(parents=True, exist_ok=True)
        self.config_toml.write_text(f"""version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{d}/runc"
  netns_mounts_under_state_dir = true
[{cri}.cni]
  bin_dir = "{self.dir}/cni-bin"
  conf_dir = "{self.dir}/cni"
""")

    def _write_cni(self) -> None:
        """The pod network: Debian's loopback plugin and POD_ADDRESS_PLUGIN, which gives each pod an address
        and no link (containerd's CRI refuses a sandbox whose network result has no address for eth0, and
        this machine kind has neither dummy links nor forwarding for a bridge or veth pair). A pod without
        hostNetwork then runs with only its loopback interface, which is all a pod that reaches nothing
        needs (driverd's validation workload pod). The network namespaces are mounted under containerd's
        state directory (netns_mounts_under_state_dir), inside the node's directory, and go with it."""
        bin_dir = self.dir / "cni-bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        if not (bin_dir / "loopback").exists():
            (bin_dir / "loopback").symlink_to(Path(self.bins["cni"]) / "loopback")
        (bin_dir / "pod-address").write_text(POD_ADDRESS_PLUGIN)
        (bin_dir / "pod-address").chmod(0o755)
        (self.dir / "cni").mkdir(parents=True, exist_ok=True)
        (self.dir / "cni" / "10-pod-address.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "pod-address", "plugins": [{"type": "pod-address"}]}))

    def _start_containerd(self) -> None:
        self._write_cni()
        (self.dir / "containerd").mkdir(exist_ok=True)
        Path(self.sock).parent.mkdir(parents=True, exist_ok=True)
        if not self.config_toml.exists():
            self.write_containerd_config()
        self._spawn("containerd", [self.bins["containerd"], "--config", str(self.config_toml)])
        self.containerd_starts += 1
        end = time.monotonic() + 30
        while time.monotonic() < end:
            self._alive("containerd")
            if os.path.exists(self.sock):
                try:
                    plugins = self.ctr("plugins", "ls")
                except RuntimeError:
                    plugins = ""
                cri = [line for line in plugins.splitlines() if " cri " in f" {line} "]
                if cri and cri[0].split()[-1] == "ok":
                    return
                if cri and cri[0].split()[-1] == "error":
                    raise RuntimeError(f"containerd's CRI plugin did not load: {self.log_tail('containerd')}")
            time.sleep(0.2)
        raise RuntimeError(f"containerd not serving after 30 s: {self.log_tail('containerd')}")

    def restart_containerd(self) -> None:
        """Stop containerd (SIGTERM: its shims and the containers stay) and start it again with the
        configuration file as it is now -- what `systemctl restart containerd` does on a host."""
        stop_process(self.procs["containerd"])
        self._start_containerd()

    def play_systemd(self) -> None:
        """systemd's part for the node's containerd, inside the host tree: `systemctl` there (busybox
        sh) answers is-active/show from the unit's state and turns try-restart into a request that a
        thread here carries out with restart_containerd(), then gives the unit a new InvocationID. Only
        systemd is played: the configuration read and the restart are containerd's own."""
        h = self.host
        (h / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.bins["busybox"], h / "bin/busybox")
        if not (h / "bin/sh").exists():
            (h / "bin/sh").symlink_to("busybox")
        state = h / "run/test-systemd"
        state.mkdir(parents=True, exist_ok=True)
        (state / "containerd.invocation").write_text(uuid.uuid4().hex)
        (state / "containerd.state").write_text("active")
        (h / "usr/bin").mkdir(parents=True, exist_ok=True)
        (h / "usr/bin/systemctl").write_text(r"""#!/bin/sh
# systemd played for the test node's containerd (tests/realnode.py, RealNode.play_systemd)
d=/run/test-systemd
for a; do unit=${a%.service}; done
[ "$unit" = containerd ] || { echo "unknown"; exit 4; }
case "$1" in
  is-active) s=$(/bin/busybox cat $d/containerd.state); echo "$s"; [ "$s" = active ] ;;
  show) echo "ActiveState=$(/bin/busybox cat $d/containerd.state)"
        echo "InvocationID=$(/bin/busybox cat $d/containerd.invocation)" ;;
  try-restart|restart) /bin/busybox touch $d/containerd.restart ;;
  *) echo "systemctl (test): $1 not played" >&2; exit 1 ;;
esac
""")
        (h / "usr/bin/systemctl").chmod(0o755)
        self.systemd_restarts = 0

        def run() -> None:
            req = state / "containerd.restart"
            while not self._stopping.wait(0.1):
                if req.exists():
                    req.unlink()
                    (state / "containerd.state").write_text("activating")
                    try:
                        self.restart_containerd()
                        (state / "containerd.state").write_text("active")
                    except Exception as e:         # a configuration containerd refuses: the unit failed
                        (state / "containerd.state").write_text("failed")
                        self.systemd_error = str(e)
                    (state / "containerd.invocation").write_text(uuid.uuid4().hex)
                    self.systemd_restarts += 1
        self._systemd = threading.Thread(target=run, name="test-systemd", daemon=True)
        self._systemd.start()

    def _pause_image(self) -> Path:
        """The sandbox image: busybox-static sleeping, an OCI layout made with umoci (no registry)."""
        layout, bundle = self.dir / "pause-oci", self.dir / "pause-bundle"
        umoci = self.bins["umoci"]
        _run(umoci, "init", "--layout", str(layout))
        _run(umoci, "new", "--image", f"{layout}:pause")
        _run(umoci, "unpack", "--image", f"{layout}:pause", str(bundle))
        (bundle / "rootfs" / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.bins["busybox"], bundle / "rootfs" / "bin" / "busybox")
        _run(umoci, "repack", "--image", f"{layout}:pause", str(bundle))
        _run(umoci, "config", "--image", f"{layout}:pause", "--config.entrypoint", "/bin/busybox",
             "--config.cmd", "sleep", "--config.cmd", "2147483647")
        shutil.rmtree(bundle)
        return layout

    def import_image(self, layout: Path, tag: str, ref: str) -> str:
        """An OCI image layout (umoci's, images/build-image.sh's) into the node's containerd, in the k8s.io
        namespace the kubelet uses, as `ref` (pods then name it with imagePullPolicy: Never)."""
        tar = self.dir / f"{tag}.tar"
        _run("tar", "-C", str(layout), "-cf", str(tar), ".")
        base = ref.rsplit(":", 1)[0]
        out = self.ctr("-n", "k8s.io", "images", "import", "--base-name", base, str(tar), timeout=600)
        tar.unlink()
        got = f"{base}:{tag}"
        if got != ref:
            self.ctr("-n", "k8s.io", "images", "tag", "--force", got, ref)
        listed = self.ctr("-n", "k8s.io", "images", "ls", "-q")
        if ref not in listed.split():
            raise RuntimeError(f"ctr images import {layout}: {ref} not in the image store ({out.strip()})")
        return ref

    def _start_kubelet(self) -> None:
        root = self.dir / "kubelet"
        root.mkdir()
        kubeconfig = self.cp.write_kubeconfig(self.dir / "kubelet.kubeconfig", token=self.cp.node_token(self.name),
                                              user=f"system:node:{self.name}")
        self.kubelet_port = _free_port(NODE_IP)
        self.pod_logs = self.dir / "pod-logs"
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs", "failSwapOn": False, "failCgroupV1": False,
            "podLogsDir": str(self.pod_logs),
            "address": NODE_IP, "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": _free_port(),
            # the apiserver never calls this kubelet (no logs/exec through it): nobody else may either
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            # a shared test machine's disk is not this node's to manage: no evictions for disk pressure,
            # no image garbage collection of the imported images
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "2s", "syncFrequency": "10s",
            "serializeImagePulls": False, "resolvConf": "/etc/resolv.conf",
        }
        (self.dir / "kubelet.yaml").write_text(json.dumps(cfg))
        self._spawn("kubelet", [
            self.bins["kubelet"], "--config", str(self.dir / "kubelet.yaml"), "--kubeconfig", kubeconfig,
            "--root-dir", str(root), "--cert-dir", str(root / "pki"),
            "--container-runtime-endpoint", f"unix://{self.sock}",
            "--node-ip", NODE_IP, "--hostname-override", self.name, "-v", "1"])

    def wait_node_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._alive("kubelet")
            try:
                node = self.cp.api("GET", f"/api/v1/nodes/{self.name}")
                if condition_true(node, "Ready"):
                    return
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
            time.sleep(0.2)
        raise RuntimeError(f"Node {self.name} not Ready after {timeout}s: {self.log_tail('kubelet')}")

    def stop(self) -> None:
        """Pods deleted through the API (the kubelet stops their containers and tears their volumes
        down), then the kubelet, whatever containerd still runs, containerd, the control plane; then the
        host put back as it was. Each step runs even if one before it failed."""
        errors: list[str] = []
        self._stopping.set()
        if self._systemd is not None:
            self._systemd.join(60)

        def step(what, fn):
            try:
                fn()
            except Exception as e:          # the rest of the clean-up still runs
                errors.append(f"{what}: {e}")
        if self.procs.get("kubelet") and self.procs["kubelet"].poll() is None:
            step("pods", self._delete_pods)
        if "kubelet" in self.procs:
            step("kubelet", lambda: stop_process(self.procs["kubelet"]))
        if "containerd" in self.procs:
            step("containers", self._kill_containers)
            step("containerd", lambda: stop_process(self.procs["containerd"]))
            step("shims", self._kill_shims)
        step("control plane", self.cp.stop)
        step("mounts", self._unmount_all)
        step("host", self._restore_host)
        for ip in self._added_addresses:
            step(f"address {ip}", lambda ip=ip: _run("ip", "addr", "del", f"{ip}/32", "dev", "lo"))
        step("leftovers", self._check_nothing_left)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        if errors:
            raise RuntimeError("real node clean-up: " + "; ".join(errors))

    def _delete_pods(self) -> None:
        """Controllers' objects first (they would make new pods), then every pod without a grace period,
        again until none is left; what is waited for is the kubelet's part (volumes down, sandboxes
        stopped): the runtime running nothing."""
        for kind in ("daemonsets", "deployments", "replicasets"):
            for o in self.cp.api("GET", f"/apis/apps/v1/{kind}")["items"]:
                md = o["metadata"]
                try:
                    self.cp.api("DELETE", f"/apis/apps/v1/namespaces/{md['namespace']}/{kind}/{md['name']}")
                except urllib.error.HTTPError:
                    pass
        end = time.monotonic() + 30
        while time.monotonic() < end:
            pods = self.cp.api("GET", "/api/v1/pods")["items"]
            if not pods and not self._tasks():
                return
            for p in pods:
                md = p["metadata"]
                try:
                    self.cp.api("DELETE", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}",
                                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})
                except urllib.error.HTTPError:
                    pass
            time.sleep(0.5)

    def _tasks(self) -> list[str]:
        out = self.ctr("-n", "k8s.io", "tasks", "ls", "-q")
        return [t for t in out.split() if t]

    def _kill_containers(self) -> None:
        for t in self._tasks():
            subprocess.run([self.bins["ctr"], "-a", self.sock, "-n", "k8s.io", "tasks", "kill", "-s", "KILL", t],
                           capture_output=True, timeout=30)
        end = time.monotonic() + 15
        for t in self._tasks():
            while time.monotonic() < end and subprocess.run(
                    [self.bins["ctr"], "-a", self.sock, "-n", "k8s.io", "tasks", "delete", t],
                    capture_output=True, timeout=30).returncode != 0:
                time.sleep(0.3)

    def _kill_shims(self) -> None:
        """A shim outlives containerd by design; ours are the ones given this containerd's address."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and self.sock.encode() in cmd:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass

    def _unmount_all(self) -> None:
        prefix = str(self.dir) + "/"
        points = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(prefix):
                points.append(mp)
        for mp in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)

    def _restore_host(self) -> None:
        for k, v in self._tunables.items():
            try:
                if Path(f"/proc/sys/{k}").read_text().strip() != v:
                    Path(f"/proc/sys/{k}").write_text(v)
            except OSError:
                pass
        for d, before in self._existed.items():
            if not os.path.isdir(d):
                continue
            for name in set(os.listdir(d)) - (before or set()):
                p = os.path.join(d, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
            if before is None:
                os.rmdir(d)
        if not self._had_kubelet_dir and os.path.isdir("/var/lib/kubelet") and not os.listdir("/var/lib/kubelet"):
            os.rmdir("/var/lib/kubelet")            # made for device-plugins alone
        for cg in Path("/sys/fs/cgroup").glob("*/kubepods"):
            if str(cg) in self._cgroups_before:
                continue
            for sub in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(str(p)), reverse=True):
                try:
                    sub.rmdir()
                except OSError:
                    pass
            try:
                cg.rmdir()
            except OSError:
                pass

    def _check_nothing_left(self) -> None:
        """The machine as the node found it: no process of the node, no mount under its directory, the
        fixed paths, cgroups, tunables and addresses as before."""
        left = []
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and str(self.dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    left.append(f"process {pid}")
            except OSError:
                pass
        prefix = str(self.dir) + "/"
        left += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
                 if line.split()[4].startswith(prefix)]
        for d, before in self._existed.items():
            now = set(os.listdir(d)) if os.path.isdir(d) else None
            if now != before:
                was = "absent" if before is None else sorted(before)
                left.append(f"{d}: {sorted(now or ())} (before: {was})")
        left += [str(p) for p in Path("/sys/fs/cgroup").glob("*/kubepods") if str(p) not in self._cgroups_before]
        left += [f"sysctl {k}" for k, v in self._tunables.items() if Path(f"/proc/sys/{k}").read_text().strip() != v]
        addrs = _run("ip", "-4", "-o", "addr", "show", "dev", "lo")
        left += [f"address {ip}" for ip in self._added_addresses if f" {ip}/" in addrs]
        if left:
            raise RuntimeError("left on the machine: " + ", ".join(left))

    # -- helpers -------------------------------------------------------------------------------
    def ctr(self, *args: str, timeout: float = 60) -> str:
        return _run(self.bins["ctr"], "-a", self.sock, *args, timeout=timeout)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "a")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def _alive(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited {p.returncode}: {self.log_tail(name)}")

    def log_tail(self, name: str, n: int = 3000) -> str:
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """What the container wrote, every restart of it, from the kubelet's podLogsDir
        (<ns>_<pod>_<uid>/<container>/<restart>.log, CRI format: time stream tag message)."""
        out = []
        for d in sorted(self.pod_logs.glob(f"{namespace}_{pod}_*/{container}")):
            for f in sorted(d.glob("*.log"), key=lambda f: int(f.stem) if f.stem.isdigit() else -1):
                for line in f.read_text(errors="replace").splitlines():
                    out.append(line.split(" ", 3)[3] if line.count(" ") >= 3 else line)
        return "\n".join(out)


def start_real_node() -> RealNode:
    """A started node, or a skip (a failure in CI) naming what is missing."""
    if os.geteuid() != 0:
        missing_component("a real node (containerd, kubelet) needs root")
    require_binary("ip")
    bins, msg = find_node_binaries()
    if msg:
        missing_component(msg)
    bindir, _ = find_binaries()
    return started(RealNode(Path(tempfile.mkdtemp(prefix="driverd-node-")), bins, bindir))
