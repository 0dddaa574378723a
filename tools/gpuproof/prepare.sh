#!/usr/bin/env bash
# What tools/gpuproof/run.sh needs on a GPU host, gathered on a build host (this machine) into WORK (never
# shipped): Debian's packages by name (apt-get download: the 535.261.03 user-space for the mismatch case,
# runc and a minimal root file system for the container), NVIDIA's container toolkit binaries as
# .ci/install-components builds them, and cudacheck built from cudacheck.c. WORK is ~40 MB: carry it to
# the GPU host with the checkout.
#
#   tools/gpuproof/prepare.sh WORK
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 WORK" >&2; exit 2; }
src=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
WORK=$(cd "$1" && pwd)
toolkit=$(ls -d /opt/driverd-ci/toolkit-*/bin 2>/dev/null | sort -V | tail -1)
if [ -z "$toolkit" ]; then
  echo "prepare.sh: NVIDIA's container toolkit is not built here; fix: run .ci/install-components first" >&2
  exit 2
fi
cd "$WORK"
apt-get download libcuda1=535.261.03-1 libnvidia-ml1=535.261.03-1 runc libseccomp2 libc6 libc-bin libgcc-s1 \
  busybox-static
gcc -O2 -o cudacheck "$src/cudacheck.c" -ldl
cp "$toolkit"/nvidia-cdi-hook "$toolkit"/nvidia-container-runtime "$toolkit"/nvidia-ctk .
ls -la "$WORK"
