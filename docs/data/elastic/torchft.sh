#!/bin/bash
# torchft's fault-tolerant DDP on the same 4 emulated hosts at 100 Mbit/s, data and faults
# as faults.sh (docs/elastic.md): the third way to outlive a failure.
#   [CASES="none kill cut"] bash docs/data/elastic/torchft.sh OUT_DIR   (project root, as root)
# torchft's lighthouse runs on the switch (no host's failure takes it down); every host is
# a replica group of one rank (torchft_worker.py) under a torchrun of its own that starts
# it again when it exits (--max-restarts), as torchft deploys replica groups.
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
declare -A faults=([none]="" [kill]="--kill node3@60" [cut]="--cut node2@60:40")
for case in ${CASES:-none kill cut}; do
  rm -f "$out/torchft-$case.jsonl"
  start=$(date +%s.%N)
  python -m collectives.cluster --hosts 4 --bandwidth 100mbit ${faults[$case]} \
    --on-switch "RUST_LOG=warn exec torchft_lighthouse --min_replicas 2 --bind [::]:29510" -- \
    bash -c 'PYTHONPATH=$PWD REPLICA_GROUP_ID=$RANK NUM_REPLICA_GROUPS=$WORLD_SIZE \
      TORCHFT_LIGHTHOUSE=http://switch:29510 exec python -m torch.distributed.run --standalone \
      --nnodes 1 --nproc-per-node 1 --max-restarts 3 docs/data/elastic/torchft_worker.py "$@"' \
    torchft --dataset mnist --data-dir ../shared/data --train-samples 2048 \
    --test-samples 500 --epochs 3 --timeout 30 \
    --metrics "$out/torchft-$case.jsonl" 2>&1 | python -u docs/data/elastic/stamp.py > "$out/torchft-$case.log"
  status=${PIPESTATUS[0]}
  echo "torchft $case exit $status $(python -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$out/summary.txt"
done
