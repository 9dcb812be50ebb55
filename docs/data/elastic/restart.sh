#!/bin/bash
# The baseline a torch DDP user has: torchrun --max-restarts 3 on every host, the trainer
# (not --elastic) resuming from its last epoch's checkpoint after a restart, on the same 4
# emulated hosts at 100 Mbit/s, the same data and faults as faults.sh (docs/elastic.md).
#   [CASES="none cut"] bash docs/data/elastic/restart.sh OUT_DIR [SYNC ...]   (project root, as root)
# One torchrun per host (c10d rendezvous on node0, 4 nodes); a failed worker makes every
# agent stop its workers and start them all again once the 4 have met again. A killed
# host never comes back, so only faults a fixed-size job can outlive are run: the cut.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each restart a store of its own: in the
# rendezvous store that torchrun shares by default, a restarted worker may read the
# address of a peer's previous worker and fail to connect (Connection refused), which
# used up all 3 restarts here (pytorch/pytorch#167288; docs/elastic.md).
set -u
out=${1:?OUT_DIR}; shift
syncs=${*:-allreduce}
mkdir -p "$out"
declare -A faults=([none]="" [cut]="--cut node2@60:40")
for sync in $syncs; do
  options=""
  [ "$sync" = local-sgd ] && options="--sync-option period=8"
  for case in ${CASES:-none cut}; do
    checkpoints=$(mktemp -d /tmp/restart-checkpoints.XXXXXX)
    rm -f "$out/$sync-$case.jsonl"
    start=$(date +%s.%N)
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit ${faults[$case]} -- \
      bash -c 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 exec python -m torch.distributed.run \
        --nnodes 4 --nproc-per-node 1 \
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29511" \
        --rdzv-id "restart-$0" --no-python bash docs/data/elastic/restart_worker.sh "$@"' \
      "$case" "$checkpoints" --dataset mnist --data-dir ../shared/data --train-samples 2048 \
      --test-samples 500 --epochs 3 --timeout 30 --progress off --sync "$sync" $options \
      --metrics "$out/$sync-$case.jsonl" 2>&1 | python -u docs/data/elastic/stamp.py > "$out/$sync-$case.log"
    status=${PIPESTATUS[0]}
    rm -rf "$checkpoints"
    echo "$sync $case exit $status $(python -c "print(round($(date +%s.%N) - $start, 1))") s" | tee -a "$out/summary.txt"
  done
done
