"""Issue 31 on a GPU host (tools/gpuproof/run.sh userspace; never shipped): driverd installs user-space
trees of its own beside the host's — the running 580's files laid out as NVIDIA's installer extracts them,
and Debian's 535.261.03 libcuda/libnvidia-ml — into a private driver root, switches `current` between
them, and the workload check against that root tells the matching set from the stale one. The host's
driver and user-space are never touched: with a host user-space present driverd writes no loader
configuration and no PATH links (driverd.install.userspace)."""
import glob
import os
import shutil
import sys
import time

from driverd.host import pci, workload
from driverd.driver.ident import parse_version_file as parse_nvidia_version
from driverd.build import userspace as ub
from driverd.install import userspace as ui
from driverd.root import Root

debs, out = sys.argv[1], sys.argv[2]
root = Root("/")
version = parse_nvidia_version(open("/proc/driver/nvidia/version").read())[0]
gpus = [g.pci_address for g in pci.classify(root, pci.scan(root, []), [])[0]]
run_dir = f"/tmp/gpuproof-run/NVIDIA-Linux-x86_64-{version}"
shutil.rmtree("/tmp/gpuproof-run", ignore_errors=True)
os.makedirs(f"{run_dir}/firmware")
for f in glob.glob(f"/usr/local/nvidia/lib64/lib*.so.{version}"):
    shutil.copy2(f, run_dir)
for f in glob.glob("/usr/local/nvidia/bin/nvidia-*"):
    if os.path.isfile(f) and not os.path.islink(f):
        shutil.copy2(f, run_dir)
for f in glob.glob(f"/usr/local/nvidia/firmware/nvidia/{version}/*.bin"):
    shutil.copy2(f, f"{run_dir}/firmware")
pkgs = "/tmp/gpuproof-pkgs"
shutil.rmtree(pkgs, ignore_errors=True)
t = time.monotonic()
new = ub.build_from_run_dir(run_dir, pkgs).to_json()
print(f"built {os.path.basename(new['package'])} in {time.monotonic() - t:.1f}s")
stale = ub.build_from_debs(debs, pkgs).to_json()
print(f"built {os.path.basename(stale['package'])}")
places = ui.Places(root="/tmp/gpuproof-driver", bin_dir=None, state_dir="/tmp/gpuproof-us-state")
for d in (places.root, places.state_dir):
    shutil.rmtree(d, ignore_errors=True)


def judge(label):
    r = workload.check(root, version, gpus, driver_root=places.current)
    print(f"{label}: user-space {r.userspace.get('version')} in {r.userspace.get('lib_dir')}: "
          f"{'workload-ready' if r.ok else 'NOT workload-ready: ' + r.reason()} ({r.seconds:.2f}s)")
    return r.ok


for label, pkg, want in (("install 580 tree", new["package"], True), ("switch to 535 tree", stale["package"], False)):
    t = time.monotonic()
    rep = ui.install(root, pkg, places=places)
    print(f"{label}: changed={rep.changed} replaced={(rep.replaced or '')[:12]} notes={rep.notes[:2]} "
          f"({time.monotonic() - t:.2f}s)")
    assert judge(label) is want
t = time.monotonic()
rep = ui.rollback(root, places=places) if hasattr(ui, "rollback") else None
print(f"rollback: {getattr(rep, 'changed', None)} ({time.monotonic() - t:.2f}s)")
assert judge("after rollback") is True
print("host loader config untouched:", not os.path.exists("/etc/ld.so.conf.d/00-driverd-nvidia.conf"))
