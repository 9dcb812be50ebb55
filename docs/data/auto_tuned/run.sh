#!/usr/bin/env bash
# auto against the quickest fixed algorithm, without a tuning table (the cost model for
# this machine's cores) and with one (python -m collectives.tune), at 2 and 4 ranks
# through gloo+shm and mpi+shm, 4 KiB to 64 MiB. Run from the repository's root on a
# quiet machine:   bash docs/data/auto_tuned/run.sh
set -eu
out=$(dirname "$0")
export XDG_CACHE_HOME=$(mktemp -d)  # a cache of its own: "without" has no table
trap 'rm -rf "$XDG_CACHE_HOME"' EXIT
bench() {  # bench BACKEND RANKS NAME
    python -m collectives.bench --nproc "$2" --backend "$1" --sizes 4K:64M \
        --algorithms ring,halving-doubling,tree,naive,native,auto --trials 3 \
        --seconds-per-row 0.3 --no-handshake --json "$out/$1_$2_$3.jsonl" > "$out/$1_$2_$3.txt"
}
for backend in gloo mpi; do
    for ranks in 2 4; do
        bench "$backend" "$ranks" without
        python -m collectives.tune --nproc "$ranks" --backend "$backend" > "$out/${backend}_${ranks}_tune.txt"
        bench "$backend" "$ranks" with
    done
done
