#!/usr/bin/env bash
# Where a rank's CPU goes during training steps (docs/benchmarks.md, "CPU"): one sync at a
# time on 4 emulated hosts at 1 Gbit/s, and py-spy (pip install py-spy) sampling rank 1's
# threads for 30 s once the timed rounds have begun. Run as root from the repository
# root with nothing else running: writes docs/data/cpu/<sync>.txt (collapsed stacks of the
# Python threads) and <sync>.json (CPU seconds of every thread, C++ ones too, over the
# same 30 s); `python docs/data/cpu/summarize.py` reads them.
set -uo pipefail
out=docs/data/cpu
for sync in "$@"; do
    python -m collectives.cluster --hosts 4 --bandwidth 1gbit --no-prefix -- \
        python -m trainer.bench --sync "$sync" --steps 12 --rounds 2 > $out/$sync.log 2>&1 &
    job=$!
    sleep 40  # start-up and warm-up
    rank=$(pgrep -f "python -m trainer.bench --sync $sync" | while read pid; do
        [ "$(tr '\0' '\n' < /proc/$pid/environ | grep -x RANK=1)" ] && echo $pid; done | head -1)
    python docs/data/cpu/thread_cpu.py "$rank" 30 > $out/$sync.json &
    threads=$!
    py-spy record --pid "$rank" --duration 30 --rate 100 --threads --nonblocking \
        --format raw --output $out/$sync.txt > /dev/null
    wait $threads
    wait $job
done
