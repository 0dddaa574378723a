#!/usr/bin/env bash
# bench/fleet.py on a machine prepared by tools/fleetbench/prepare.sh (run from the repository root,
# DIR carried beside it): one bench per NODES:MAXPARALLEL:TIMEOUT_S, its JSON, stderr and --timeline
# written to OUT. NODES and MAXPARALLEL may be lists (500,1000: the coordinator's scaling between
# fleet sizes); FLEETBENCH_ARGS is passed on to bench/fleet.py (e.g. a shortened node's work).
#
#   tools/fleetbench/run.sh DIR OUT 500:50:250 1000:50:320
#   FLEETBENCH_ARGS='--reload-s 1 --validate-s 0.3' tools/fleetbench/run.sh DIR OUT 500,1000:10:580
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
  tag=${n//,/_}-${p//,/_}               # no commas in the names of what comes back
  # shellcheck disable=SC2086  # FLEETBENCH_ARGS is words
  timeout "$t" python3 bench/fleet.py --nodes "$n" --namespaces 20 --max-parallel "$p" --json \
    --timeline "$out/timeline-$tag.jsonl" ${FLEETBENCH_ARGS:-} > "$out/fleet-$tag.json" 2> "$out/fleet-$tag.err"
  echo "rc=$? nodes $n maxParallel $p: $(tail -1 "$out/fleet-$tag.err")"
done
