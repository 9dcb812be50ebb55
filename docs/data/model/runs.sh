#!/usr/bin/env bash
# Every run behind docs/cost_model.md, in order: calibrate once on the emulated cluster, then
# the collectives it was not fitted on, then the training steps. Run as root from the
# repository root with nothing else running; writes docs/data/model/*. A run whose
# output exists is skipped.
set -uo pipefail
out=docs/data/model
cluster() { python -m collectives.cluster --no-prefix "$@"; }

# 1. Calibrate: 2 hosts x 2 ranks at 1 Gbit/s (every route is seen alone and mixed).
[ -e $out/sweep.json ] || cluster --hosts 2 --ranks-per-host 2 --bandwidth 1gbit -- \
    python -m collectives.cost_model calibrate --out $PWD/$out/sweep.json \
    > $out/calibrate.log 2>&1
# (the constants.json kept here is `calibrate --points sweep.json --out constants.json`:
# the sweep was measured before the model's cores term existed; the fit is today's)
cp $out/sweep.json $out/constants.json

# 2. Collectives on shapes and links the fit never saw (skipping what takes minutes).
bench() {  # hosts ranks-per-host link sizes algorithms
    local name=$out/bench_${1}x${2}_$3.jsonl
    [ -e $name ] && return
    cluster --hosts $1 --ranks-per-host $2 --bandwidth $3 -- python -m collectives.bench \
        --sizes $4 --algorithms $5 --min-iters 1 --trials 3 --seconds-per-row 0.3 \
        --no-handshake --json $PWD/$name > ${name%.jsonl}.log 2>&1
}
for hosts in 2 3 4; do
    for per_host in 1 2; do
        algos=ring,tree,halving-doubling,native
        [ $per_host -gt 1 ] && algos=$algos,hierarchical
        bench $hosts $per_host 1gbit 64K,1M,16M,64M $algos
        bench $hosts $per_host 100mbit 64K,1M,16M $algos
        bench $hosts $per_host 25mbit 64K,1M $algos
    done
done
python -m collectives.cost_model check --constants $out/constants.json $out/bench_*.jsonl \
    --json $out/check.jsonl > $out/check.txt

# 3. Training steps: every modelled strategy and torch peer, traced for trainer.replay
#    (ddp-powersgd is not modelled: trainer/replay.py says why).
SYNCS=allreduce,ddp,bf16,ddp-bf16,powersgd,local-sgd,ddp-localsgd
steps() {  # hosts ranks-per-host link
    local name=$out/steps_${1}x${2}_$3
    [ -e $name.jsonl ] && return
    cluster --hosts $1 --ranks-per-host $2 --bandwidth $3 -- python -m trainer.bench \
        --sync $SYNCS --steps 4 --rounds 1 --warmup 1 --json $PWD/$name.jsonl \
        --trace $PWD/$name.trace --trace-steps 4 > $name.log 2>&1
}
steps 4 1 1gbit
steps 4 1 100mbit
steps 2 2 100mbit
steps 4 1 25mbit

# 4. ResNet-50's step, traced on one host, for the clusters we do not have.
[ -e $out/resnet50.jsonl ] || python -m trainer.bench --nproc 2 --model resnet50 \
    --sync $SYNCS --steps 3 --rounds 1 --warmup 1 --json $out/resnet50.jsonl \
    --trace $out/resnet50.trace --trace-steps 3 > $out/resnet50.log 2>&1
