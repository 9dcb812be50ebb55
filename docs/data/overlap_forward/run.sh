#!/bin/bash
# allreduce with overlap=forward against plain allreduce and torch's DDP, side by side
# in one trainer.bench run (rounds that rotate), on 4 emulated hosts of one rank at
# 100 Mbit/s and 1 Gbit/s; three runs each, one after another, nothing else running.
#     bash docs/data/overlap_forward/run.sh      (about 20 minutes; as root)
#     STEPS=9 ROUNDS=2 OUT=docs/data/overlap_forward/rounds9 bash docs/data/overlap_forward/run.sh
#                                                (about 30 minutes: steps 9 to a round)
#     RATES=1gbit ...                            (one rate: about 12 minutes at 9 steps)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here}
mkdir -p "$out"
for rate in ${RATES:-100mbit 1gbit}; do
    for run in 1 2 3; do
        python -m collectives.cluster --hosts 4 --bandwidth "$rate" -- \
            python -m trainer.bench --sync allreduce,allreduce:overlap=forward,ddp \
            --steps "${STEPS:-3}" --rounds "${ROUNDS:-3}" --json "$out/${rate}_$run.jsonl" \
            2>&1 | tee "$out/${rate}_$run.txt"
    done
done
python "$here/summary.py" "$out"
