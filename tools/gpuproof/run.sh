#!/usr/bin/env bash
# The workload-ready proof on a real GPU host (docs/testing.md, "On the GPU machines"); never shipped.
# Run from the repository root on a host whose driver is loaded and whose user-space is installed
# (e.g. /usr/local/nvidia), with driverd's dependencies importable (PYTHONPATH) and, in WORK, what
# tools/gpuproof/prepare.sh gathered on a build host (Debian debs, NVIDIA's container toolkit binaries,
# cudacheck). It never loads or unloads a module and never changes a GPU setting: driverd runs with
# driver.manage = auto (the host's driver is left to the host) and its state under a private root.
#
#   tools/gpuproof/run.sh workload WORK OUT    detect / plan / daemon / bench with the host's user-space
#                                              and with Debian's 535.261.03 user-space in front (mismatch)
#   tools/gpuproof/run.sh containers WORK OUT  a container through NVIDIA's runtime (CDI mode) with
#                                              driverd's CDI spec and with nvidia-ctk's, cudacheck inside
set -uo pipefail
what=$1 WORK=$(readlink -f "$2") OUT=$3
mkdir -p "$OUT"
D="python3 -m driverd"
say() { printf '\n=== %s\n' "$*"; }
u535=/tmp/gpuproof-u535
if [ ! -d "$u535" ]; then
  for d in "$WORK"/libcuda1_*.deb "$WORK"/libnvidia-ml1_*.deb; do dpkg -x "$d" "$u535"; done
fi

daemon_probe() {   # $1: name, $2: extra config; prints READY/STATUS lines and /readyz
  local cfg=/tmp/gpuproof-$1.toml sock=/tmp/gpuproof-$1.sock port=19477
  printf '[driver]\nversion = "%s"\nmanage = "auto"\n[runtime]\nruntimes = ["none"]\n[state]\ndir = "/tmp/gpuproof-state-%s"\n%s\n' \
    "$(awk '{for(i=1;i<=NF;i++) if ($i ~ /^[0-9]+\.[0-9]+\.[0-9]+$/) {print $i; exit}}' /proc/driver/nvidia/version)" "$1" "$2" > "$cfg"
  rm -f "$sock"
  python3 - "$sock" > "$OUT/notify-$1.txt" <<'EOF' &
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind(sys.argv[1]); s.settimeout(20); t0 = time.monotonic()
try:
    while True:
        m = s.recv(65536).decode()
        print(f"{time.monotonic() - t0:6.2f}s {m}", flush=True)
except OSError:
    pass
EOF
  local lp=$!
  sleep 0.3
  NOTIFY_SOCKET=$sock $D daemon --config "$cfg" --listen 127.0.0.1:$port > "$OUT/daemon-$1.log" 2>&1 &
  local dp=$!
  sleep 12
  echo "--- /readyz ($1)"; python3 -c "
import urllib.request, urllib.error
try: r = urllib.request.urlopen('http://127.0.0.1:$port/readyz'); print(r.status, r.read().decode())
except urllib.error.HTTPError as e: print(e.code, e.read().decode())"
  python3 -c "
import urllib.request
for l in urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode().splitlines():
    if l.startswith(('driverd_workload', 'driverd_ready', 'process_resident_memory_bytes')): print(l)"
  kill -TERM $dp; wait $dp; echo "daemon exit $?"
  kill $lp 2>/dev/null; wait $lp 2>/dev/null
  echo "--- notifications ($1)"; cat "$OUT/notify-$1.txt"
  echo "--- daemon log tail ($1)"; tail -5 "$OUT/daemon-$1.log"
}

if [ "$what" = workload ]; then
  say "the host"; nvidia-smi -L; cat /proc/driver/nvidia/version | head -1; ls /usr/local/nvidia/lib64 | grep -E 'libcuda|libnvidia-ml' | head
  say "detect (host user-space)"; $D detect --no-nvml | grep -E '^(driver|userspace|nvml|  not workload)'
  $D detect --json > "$OUT/detect.json"
  say "plan (host user-space)"; $D plan; echo "exit $?"
  say "bench/workload_check.py (host user-space)"; python3 bench/workload_check.py -n 5
  say "detect with Debian's 535.261.03 user-space as the driver root"
  DRIVERD_VALIDATION_DRIVER_ROOT=$u535 $D detect | grep -E '^(driver|userspace|nvml|  not workload)'
  say "plan with it"; DRIVERD_VALIDATION_DRIVER_ROOT=$u535 $D plan; echo "exit $?"
  say "the check itself with it (what a transaction's validation would say)"
  python3 -c "
from driverd.root import Root; from driverd.host import workload, pci
g=[x.pci_address for x in pci.classify(Root('/'), pci.scan(Root('/'), []), [])[0]]
from driverd.driver.ident import parse_version_file
v=parse_version_file(open('/proc/driver/nvidia/version').read())[0]
r=workload.check(Root('/'), v, g, driver_root='$u535'); print(r.ok, r.reason()); print(r.nvml); print(r.cuda)"
  say "daemon, host user-space"; daemon_probe good ""
  say "daemon, Debian 535 user-space"; daemon_probe stale "[validation]
driver_root = \"$u535\""
fi

elapsed() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$1" "$(date +%s.%N)"; }

run_container() {   # $1: name, $2: CDI spec dir; nvidia-smi and cudacheck in a minimal Debian container
  local name=$1 specs=$2 b=/tmp/gp/bundle-$1 id=gpuproof-$1 t0
  rm -rf "$b"; mkdir -p "$b" "/tmp/gp/xdg-$1/nvidia-container-runtime"
  cp -a /tmp/gp/rootfs "$b/rootfs"
  printf '[nvidia-container-runtime]\nmode = "cdi"\nruntimes = ["/tmp/gp/runc"]\n[nvidia-container-runtime.modes.cdi]\nspec-dirs = ["%s"]\ndefault-kind = "nvidia.com/gpu"\nannotation-prefixes = ["cdi.k8s.io/"]\n' \
    "$specs" > "/tmp/gp/xdg-$1/nvidia-container-runtime/config.toml"
  (cd "$b" && /tmp/gp/runc spec) && python3 tools/gpuproof/bundle.py "$b/config.json"
  t0=$(date +%s.%N)
  if ! XDG_CONFIG_HOME=/tmp/gp/xdg-$1 /tmp/gp/nvidia-container-runtime create --bundle "$b" "$id" > "$OUT/container-$1.out" 2>&1; then
    echo "--- container $1: create failed"; cat "$OUT/container-$1.out"; return
  fi
  /tmp/gp/runc start "$id"
  for _ in $(seq 240); do
    /tmp/gp/runc state "$id" 2>/dev/null | grep -q '"status": "stopped"' && break; sleep 0.25
  done
  echo "--- container $1 ($(elapsed "$t0") s)"; cat "$OUT/container-$1.out"
  /tmp/gp/runc delete -f "$id"
}

if [ "$what" = containers ]; then
  rm -rf /tmp/gp; mkdir -p /tmp/gp/deb /tmp/gp/rootfs/usr/local/bin /tmp/gp/cdi-driverd /tmp/gp/cdi-driverd-hook /tmp/gp/cdi-ctk
  for d in "$WORK"/runc_*.deb "$WORK"/libseccomp2_*.deb; do dpkg -x "$d" /tmp/gp/deb; done
  for d in "$WORK"/libc6_*.deb "$WORK"/libc-bin_*.deb "$WORK"/libgcc-s1_*.deb "$WORK"/busybox-static_*.deb; do dpkg -x "$d" /tmp/gp/rootfs; done
  for t in sh ls cat; do ln -sf busybox /tmp/gp/rootfs/bin/$t; done
  cp "$WORK/cudacheck" /tmp/gp/rootfs/usr/local/bin/
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/gp/deb/usr/lib/x86_64-linux-gnu exec /tmp/gp/deb/usr/sbin/runc "$@"\n' > /tmp/gp/runc
  chmod +x /tmp/gp/runc
  cp "$WORK"/nvidia-container-runtime "$WORK"/nvidia-ctk /tmp/gp/ && chmod +x /tmp/gp/nvidia-*
  say "driverd's CDI spec, no nvidia-cdi-hook on the host (mounts + LD_LIBRARY_PATH)"
  t0=$(date +%s.%N)
  python3 -c 'from driverd.root import Root; from driverd.runtime import cdi; s, n = cdi.build_with_notes(Root("/")); print(cdi.render(s), end=""); [print("# note:", x) for x in n]' > /tmp/gp/cdi-driverd/nvidia.yaml
  echo "spec built in $(elapsed "$t0") s, $(grep -c containerPath /tmp/gp/cdi-driverd/nvidia.yaml) mounts"; grep '# note' /tmp/gp/cdi-driverd/nvidia.yaml
  cp /tmp/gp/cdi-driverd/nvidia.yaml "$OUT/driverd-env.yaml"
  run_container driverd-env /tmp/gp/cdi-driverd
  say "NVIDIA's nvidia-cdi-hook installed in /usr/local/bin: driverd's spec (hooks), then nvidia-ctk's"
  cp "$WORK"/nvidia-cdi-hook /usr/local/bin/ && chmod +x /usr/local/bin/nvidia-cdi-hook
  python3 -c 'from driverd.root import Root; from driverd.runtime import cdi; print(cdi.render(cdi.build(Root("/"))), end="")' > /tmp/gp/cdi-driverd-hook/nvidia.yaml
  cp /tmp/gp/cdi-driverd-hook/nvidia.yaml "$OUT/driverd-hook.yaml"
  run_container driverd-hook /tmp/gp/cdi-driverd-hook
  /tmp/gp/nvidia-ctk cdi generate --mode nvml --driver-root /usr/local/nvidia --dev-root / \
    --nvidia-cdi-hook-path /usr/local/bin/nvidia-cdi-hook --format yaml --output /tmp/gp/cdi-ctk/nvidia.yaml > "$OUT/ctk.log" 2>&1 \
    || tail -3 "$OUT/ctk.log"
  cp /tmp/gp/cdi-ctk/nvidia.yaml "$OUT/ctk.yaml"
  run_container ctk /tmp/gp/cdi-ctk
  rm -f /usr/local/bin/nvidia-cdi-hook
  say "the specs side by side"; python3 tools/gpuproof/specdiff.py "$OUT/driverd-hook.yaml" "$OUT/ctk.yaml"
fi

if [ "$what" = userspace ]; then
  mkdir -p /tmp/gpuproof-debs && cp "$WORK"/libcuda1_*.deb "$WORK"/libnvidia-ml1_*.deb /tmp/gpuproof-debs/
  say "driverd's own user-space trees beside the host's: 580 (the host's files) and Debian's 535"
  python3 tools/gpuproof/userspace.py /tmp/gpuproof-debs "$OUT"
fi
