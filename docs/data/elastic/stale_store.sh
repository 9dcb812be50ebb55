#!/bin/bash
# torchrun --max-restarts with the rendezvous store shared with the workers (torch's
# default) and with a store of their own per restart (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1):
# two agents on this host, one worker failing once (stale_store_worker.py).
#   bash docs/data/elastic/stale_store.sh [JOBS]        (docs/launching.md)
jobs=${1:-5}
here=$(dirname "$0")
log=$(mktemp -d)
for share in shared own; do
  for job in $(seq "$jobs"); do
    offset=0; [ $share = own ] && offset=50
    port=$((29700 + job + offset))
    for agent in 0 1; do
      env $([ $share = own ] && echo TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) timeout 120 \
        python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --max-restarts 2 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port --rdzv-id "$share$job" \
        "$here/stale_store_worker.py" > "$log/$agent.txt" 2>&1 &
    done
    wait
    refused=$(cat "$log"/*.txt | grep -c "RuntimeError: Gloo connectFullMesh failed")
    done=$(cat "$log"/*.txt | grep -c ": done")
    echo "store $share: job $job: workers that finished $done of 2, worker starts that could not connect $refused"
  done
done
rm -rf "$log"
