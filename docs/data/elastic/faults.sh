#!/bin/bash
# The elastic trainer on 4 emulated hosts at 100 Mbit/s under host faults (docs/elastic.md).
#   bash docs/data/elastic/faults.sh OUT_DIR [SYNC ...]       (from the project root, as root)
# Each job: one line of the cluster, its output in OUT_DIR/<sync>-<case>.log, its epochs
# in OUT_DIR/<sync>-<case>.jsonl.
set -u
out=${1:?OUT_DIR}; shift
syncs=${*:-allreduce local-sgd}
mkdir -p "$out"
declare -A faults=(
  [none]=""
  [kill]="--kill node3@60"
  [cut]="--cut node2@60:30"
  [three]="--cut node1@40:30 --kill node3@120 --cut node2@160:20"
  [during-rejoin]="--cut node2@40:30 --kill node1@75"
)
for sync in $syncs; do
  options=""
  [ "$sync" = local-sgd ] && options="--sync-option period=8"
  for case in none kill cut three during-rejoin; do
    rm -f "$out/$sync-$case.jsonl"
    start=$(date +%s.%N)
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit --elastic-store ${faults[$case]} -- \
      python -m trainer --elastic --dataset mnist --data-dir ../shared/data --train-samples 1024 \
      --test-samples 500 --epochs 3 --timeout 30 --progress off --sync "$sync" $options \
      --metrics "$out/$sync-$case.jsonl" > "$out/$sync-$case.log" 2>&1
    status=$?
    echo "$sync $case exit $status $(python -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$out/summary.txt"
  done
done
