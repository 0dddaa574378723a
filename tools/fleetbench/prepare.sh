#!/usr/bin/env bash
# Gather what bench/fleet.py needs on a machine that has none of it (the 16-core GPU machines of
# docs/testing.md, "The fleet bench on 16 cores"): the real control plane .ci/build-control-plane built
# (xz-compressed), driverd's Python dependencies as wheels for that machine's Python, and deploy/
# rendered by kustomize (applied there by tools/fleetbench/kubectl, which stands in for kubectl).
# Writes DIR (default .fleetbench: ignore it, carry it); never shipped, never run by CI.
#
#   tools/fleetbench/prepare.sh [DIR] [PYTHON_VERSION]     (default .fleetbench 3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.fleetbench} py=${2:-3.12}
bin=$(bash .ci/build-control-plane --print)
for b in etcd kube-apiserver kube-controller-manager; do
  [ -x "$bin/$b" ] || { echo "prepare.sh: $bin/$b missing; fix: bash .ci/build-control-plane" >&2; exit 1; }
done
mkdir -p "$dir/whl"
for b in etcd kube-apiserver kube-controller-manager; do
  [ -s "$dir/$b.xz" ] || xz -T0 -9 -c "$bin/$b" > "$dir/$b.xz"
done
kubectl kustomize deploy/overlays/container-mode > "$dir/deploy.yaml"
# driverd's runtime dependencies at the versions this checkout's environment runs (zstandard left out:
# only package archives use it), with the Kubernetes client's own
venv=${VENV:-.venv}
pins=$("$venv/bin/python" -m pip freeze | grep -i -E '^(kubernetes|durationpy|oauthlib|python-dateutil|requests-oauthlib|websocket-client|six|pydantic|pydantic[-_]core|typing[-_]extensions|typing-inspection|annotated-types|requests|urllib3|idna|certifi|charset-normalizer|psutil|sh|tenacity|packaging|pyyaml|tomlkit|asn1crypto)==')
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 -d "$dir/whl" $pins
du -sh "$dir"
