#!/bin/bash
# trainer.replay's overlap=forward against a measured step: one traced trainer.bench run
# of allreduce, allreduce:overlap=forward and torch's DDP on 4 emulated hosts of one
# rank, then each replayed on the same shape and link (--emulated: tbf's bucket, the
# shared cores); overlap=forward is replayed from plain allreduce's traced buckets.
#     bash docs/data/overlap_forward/replay.sh      (about 10 minutes; as root)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
constants=$(python -c "from collectives.algorithms.auto import CALIBRATED; print(CALIBRATED)")
for rate in 100mbit 1gbit; do
    python -m collectives.cluster --hosts 4 --bandwidth "$rate" -- \
        python -m trainer.bench --sync allreduce,allreduce:overlap=forward,ddp \
        --steps 4 --rounds 1 --warmup 1 --json "$here/replay_$rate.jsonl" \
        --trace "$here/replay_$rate.trace" --trace-steps 4 > "$here/replay_$rate.log" 2>&1
    rm -f "$here/replay_$rate.trace"/rank*.json  # the merged trace.json is what replay reads
    python -m trainer.replay --trace "$here/replay_$rate.trace" --constants "$constants" \
        --ranks 4 --ranks-per-host 1 --bandwidth "$rate" --emulated \
        --json "$here/replay_${rate}_model.jsonl" | tee "$here/replay_${rate}_model.txt"
done
python - "$here" <<'PY' | tee "$here/replay_check.txt"
import json, sys
here = sys.argv[1]
print(f"{'link':>8} {'sync':>26} {'measured ms':>12} {'model ms':>9} {'error':>7}")
for rate in ("100mbit", "1gbit"):
    model = {r["sync"]: r for r in map(json.loads, open(f"{here}/replay_{rate}_model.jsonl"))}
    for row in map(json.loads, open(f"{here}/replay_{rate}.jsonl")):
        if row.get("sync") in model and model[row["sync"]].get("modelled"):
            m = model[row["sync"]]["step_ms"]
            print(f"{rate:>8} {row['sync']:>26} {row['step_ms']:>12.0f} {m:>9.0f} "
                  f"{(m - row['step_ms']) / row['step_ms']:>+7.1%}")
PY
