#!/bin/bash
# overlap=forward with its chunk size from the rule (chunk_mb=auto: 1 MiB here) against
# 4 MiB chunks and torch's DDP, side by side in rotating rounds, 4 emulated hosts of
# one rank at 100 Mbit/s; two runs one after another, nothing else running.
#     bash docs/data/overlap_forward/chunks/run.sh      (about 10 minutes; as root)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for run in 1 2; do
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit -- \
        python -m trainer.bench \
        --sync allreduce:overlap=forward,allreduce:overlap=forward:chunk_mb=4,ddp \
        --steps 3 --rounds 3 --json "$here/100mbit_$run.jsonl" \
        2>&1 | grep -v "^\[rank [123]" > "$here/100mbit_$run.txt"
done
