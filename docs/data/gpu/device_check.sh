#!/usr/bin/env bash
# The GPU checks, run on a machine with one CUDA GPU (docs/library.md "On a GPU"), in
# order of importance, each with a deadline, all within DEADLINE seconds (default 540):
#   1. tests/test_gpu.py: NCCL at world size 1 (NCCL-only and mixed groups, what NCCL
#      lacks), CUDA tensors through gloo and MPI, the trainer on one GPU, and the main
#      job's choice on a box with fewer GPUs than ranks;
#   2. the README's main job as it stands, `mpirun -np 4 python -m trainer`: 4 ranks
#      sharing the GPU, communication through host memory;
#   3. auto on the host's cores (docs/library.md "auto: measured where it runs"):
#      collectives.bench --in-turns at 4 ranks (gloo, shared memory) with no tuning
#      table, then collectives.tune, then the bench again with its table; the same at
#      2 ranks and through MPI without a table;
#   4. trainer.bench --nproc 2 on CUDA tensors: ours against torch's DDP, both on gloo;
#      trainer.bench --nproc 4 on the CPU (bytes per step against torch's DDP);
#   5. with MEASURE=1, the cost model's GPU figures (measure.py).
# Offline machines get mpich, mpi4py, python-hostlist and expecttest from wheels in
# .gpu_wheels/ if present (docs/library.md says how to fetch them). With ARCHIVE=FILE
# the outputs so far are packed into FILE after each step (a run cut short keeps them);
# ONLY="NAME ..." runs only the steps named.
#   bash docs/data/gpu/device_check.sh OUTDIR
set -u
out=${1:-${OUT:-/tmp/gpu_out}}; mkdir -p "$out"
py=python3
export PYTHONUNBUFFERED=1
nvidia-smi -L
if [ "${INSTALL:-1}" = 1 ]; then  # INSTALL=0: use what is installed
    if [ -d .gpu_wheels ]; then
        $py -m pip install --no-index --no-deps -q .gpu_wheels/*.whl 2>&1 | tail -2
    fi
    $py -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -2
fi
export PATH="$(dirname "$(command -v $py)"):$PATH"  # the mpirun beside this python's mpi4py
$py -c "import torch, mpi4py; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'mpi4py', mpi4py.__version__, 'cores', __import__('os').cpu_count())"
echo "mpirun: $(command -v mpirun)"

deadline=${DEADLINE:-540}
# No tuning table but the ones this run makes (the "without a table" rows stay so).
export XDG_CACHE_HOME="$out/cache"; unset COLLECTIVES_TUNING

step() {  # step NAME SECONDS COMMAND...: run it, its output to OUTDIR/NAME.txt
    local name=$1 seconds=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    local left=$((deadline - SECONDS - 10))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped, $left s left"; return; fi
    [ "$seconds" -gt "$left" ] && seconds=$left
    local started=$SECONDS
    timeout -k 5 "$seconds" "$@" > "$out/$name.txt" 2>&1
    echo "== $name: exit $? in $((SECONDS - started)) s"
    tail -"${TAIL:-12}" "$out/$name.txt"
    if [ -n "${ARCHIVE:-}" ]; then tar -czf "$ARCHIVE" -C "$out" . ; fi
}

auto_bench() {  # auto_bench NAME SECONDS LAUNCH...: auto against each algorithm, in turns
    local name=$1 seconds=$2; shift 2
    step "$name" "$seconds" "$@" --sizes 4K,64K,1M,16M,64M --trials 3 \
        --seconds-per-row 0.3 --in-turns --json "$out/$name.jsonl"
}

TAIL=25 step test_gpu 180 $py -m pytest tests/test_gpu.py -v -p no:cacheprovider
step main_job 150 mpirun -np 4 $py -m trainer --progress lines
auto_bench bench_gloo4_no_table 70 $py -m collectives.bench --nproc 4 --backend gloo
step tune_gloo4 90 $py -m collectives.tune --nproc 4 --backend gloo
auto_bench bench_gloo4_table 70 $py -m collectives.bench --nproc 4 --backend gloo
step trainer_bench_cuda 100 $py -m trainer.bench --nproc 2 --device cuda \
    --sync allreduce,ddp,allreduce:overlap=forward --steps 3 --rounds 3 \
    --json "$out/trainer_bench_cuda.jsonl"
auto_bench bench_gloo2_no_table 50 $py -m collectives.bench --nproc 2 --backend gloo
auto_bench bench_mpi4_no_table 70 mpirun -np 4 $py -m collectives.bench --backend mpi
step trainer_bench_cpu 100 $py -m trainer.bench --nproc 4 --device cpu \
    --sync allreduce,ddp --steps 3 --rounds 2 --json "$out/trainer_bench_cpu.jsonl"
if [ "${MEASURE:-0}" = 1 ]; then
    step measure 150 $py docs/data/gpu/measure.py --json "$out/gpu_measure.jsonl"
fi
echo "== done in $SECONDS s"
