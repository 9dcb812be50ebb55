#!/bin/bash
# The elastic trainer on 4 emulated hosts at 100 Mbit/s under host faults (docs/elastic.md).
#   [CASES="kill cut"] bash docs/data/elastic/faults.sh OUT_DIR [SYNC ...]   (project root, as root)
# Each job: its output in OUT_DIR/<sync>-<case>.log, every line stamped with the seconds
# since the job started (on arrival at the launcher), and its epochs in
# OUT_DIR/<sync>-<case>.jsonl; one line per job in OUT_DIR/summary.txt.
set -u
out=${1:?OUT_DIR}; shift
syncs=${*:-allreduce local-sgd}
mkdir -p "$out"
declare -A faults=(
  [none]=""
  [kill]="--kill node3@60"
  [cut]="--cut node2@60:40"
  [three]="--cut node1@40:40 --kill node3@150 --cut node2@200:40"
  [during-rejoin]="--cut node2@40:40 --kill node1@85"
)
for sync in $syncs; do
  options=""
  [ "$sync" = local-sgd ] && options="--sync-option period=8"
  for case in ${CASES:-none kill cut three during-rejoin}; do
    rm -f "$out/$sync-$case.jsonl"
    start=$(date +%s.%N)
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit --elastic-store ${faults[$case]} -- \
      python -m trainer --elastic --dataset mnist --data-dir ../shared/data --train-samples 2048 \
      --test-samples 500 --epochs 3 --timeout 30 --progress off --sync "$sync" $options \
      --metrics "$out/$sync-$case.jsonl" 2>&1 | python -u docs/data/elastic/stamp.py > "$out/$sync-$case.log"
    status=${PIPESTATUS[0]}
    echo "$sync $case exit $status $(python -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$out/summary.txt"
  done
done
