#!/usr/bin/env bash
# bench/fleet.py on a machine prepared by tools/fleetbench/prepare.sh (run from the repository root,
# DIR carried beside it): one bench per NODES:MAXPARALLEL:TIMEOUT_S, its JSON, stderr and --timeline
# written to OUT.
#
#   tools/fleetbench/run.sh DIR OUT 500:50:250 1000:50:320
set -uo pipefail
dir=$(readlink -f "$1") out=$2; shift 2
mkdir -p "$out" /tmp/fleetbench-site /tmp/fleetbench-bin
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fleetbench-site \
  "$dir"/whl/*.whl || exit 1
for f in "$dir"/*.xz; do xz -dc "$f" > "/tmp/fleetbench-bin/$(basename "$f" .xz)"; done
cp tools/fleetbench/kubectl /tmp/fleetbench-bin/
chmod +x /tmp/fleetbench-bin/*
export PATH=/tmp/fleetbench-bin:$PATH PYTHONPATH=/tmp/fleetbench-site:$PWD DRIVERD_K8S_BIN=/tmp/fleetbench-bin \
  FLEETBENCH_DEPLOY=$dir/deploy.yaml PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE          # as an installed driverd runs: from cached bytecode
echo "cores: $(nproc); $(uptime)"
for spec in "$@"; do
  IFS=: read -r n p t <<< "$spec"
  timeout "$t" python3 bench/fleet.py --nodes "$n" --namespaces 20 --max-parallel "$p" --json \
    --timeline "$out/timeline-$n-$p.jsonl" > "$out/fleet-$n-$p.json" 2> "$out/fleet-$n-$p.err"
  echo "rc=$? nodes $n maxParallel $p: $(tail -1 "$out/fleet-$n-$p.err")"
done
