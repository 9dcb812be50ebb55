#!/usr/bin/env bash
# auto against the quickest fixed algorithm, every algorithm timed call by call in turns
# (collectives.bench --in-turns). For each world, python -m collectives.tune writes its
# table; then one bench run says, per size, what the table and the cost model (this
# machine's cores, no table) choose, and how each compares with the quickest.
# From the repository's root on a quiet machine (root for the emulated cluster):
#     bash docs/data/auto_in_turns/run.sh [local] [cluster]      (default: both)
# OUT=folder writes the rows there (another run beside these); RATES="1gbit" runs the
# cluster at that rate only; TRIALS_1GBIT=15 times three times as many calls there.
set -eu
out=${OUT:-$(dirname "$0")}  # where the rows go (OUT=folder: another run beside them)
mkdir -p "$out"
export OMP_NUM_THREADS=1
export XDG_CACHE_HOME=$(mktemp -d)  # tables of this run only
trap 'rm -rf "$XDG_CACHE_HOME"' EXIT
measure() {  # measure NAME "TUNE-AND-BENCH ARGS" [LAUNCH PREFIX...]
    local name=$1 args=$2; shift 2
    "$@" python -m collectives.tune $args --sizes "$LADDER" --min-iters "$TUNE_MIN_ITERS" \
        > "$out/${name}_tune.txt"
    "$@" python -m collectives.bench $args --in-turns --sizes "$SIZES" --trials "$TRIALS" \
        --min-iters "$MIN_ITERS" --seconds-per-row "$PER_ROW" --no-handshake \
        --algorithms ring,halving-doubling,tree,naive,native,auto$EXTRA \
        --json "$out/$name.jsonl" > "$out/$name.txt"
    grep "# at " "$out/$name.txt" || true
}
local_runs() {  # one host, through shared memory
    LADDER=4K,16K,64K,256K,1M,4M,16M,64M SIZES=4K:64M PER_ROW=0.5 TRIALS=5 MIN_ITERS=3
    TUNE_MIN_ITERS=2
    EXTRA=
    for backend in gloo mpi; do
        for ranks in 2 4; do
            measure "${backend}_${ranks}" "--nproc $ranks --backend $backend"
        done
    done
}
cluster_runs() {  # 4 hosts of 1 rank, 2 hosts of 2 (gloo: TCP between hosts, shm within)
    for rate in ${RATES:-1gbit 100mbit}; do
        # a 64 MiB call takes seconds at 100 Mbit/s: there a call per trial, three trials;
        # at 1 Gbit/s two calls per trial, five trials (one call swings by 1.5x)
        LADDER=4K,64K,1M,16M,64M SIZES=4K,64K,1M,16M,64M PER_ROW=0.5 TRIALS=3 MIN_ITERS=1
        TUNE_MIN_ITERS=1
        if [ "$rate" = 1gbit ]; then TRIALS=${TRIALS_1GBIT:-5} MIN_ITERS=2; fi
        EXTRA= measure "cluster_4x1_$rate" "" \
            python -m collectives.cluster --hosts 4 --bandwidth "$rate" --
        EXTRA=,hierarchical measure "cluster_2x2_$rate" "" \
            python -m collectives.cluster --hosts 2 --ranks-per-host 2 --bandwidth "$rate" --
    done
}
for part in "${@:-local cluster}"; do
    for each in $part; do "${each}_runs"; done
done
