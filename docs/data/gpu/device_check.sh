#!/usr/bin/env bash
# The GPU checks, run on a machine with one CUDA GPU (docs/library.md "On a GPU"), in
# order of importance, each with a deadline, in about 5 minutes (8 at the most):
#   1. tests/test_gpu.py: NCCL at world size 1 (NCCL-only and mixed groups, what NCCL
#      lacks), CUDA tensors through gloo and MPI, the trainer on one GPU, and the main
#      job's choice on a box with fewer GPUs than ranks;
#   2. the README's main job as it stands, `mpirun -np 4 python -m trainer`: 4 ranks
#      sharing the GPU, communication through host memory;
#   3. trainer.bench --nproc 2 on CUDA tensors: ours against torch's DDP, both on gloo;
#   4. collectives.bench on the host's cores (gloo, shared memory), auto against each
#      algorithm;
#   5. with MEASURE=1, the cost model's GPU figures (measure.py).
# Offline machines get mpich, mpi4py, python-hostlist and expecttest from wheels in
# .gpu_wheels/ if present (docs/library.md says how to fetch them).
#   bash docs/data/gpu/device_check.sh OUTDIR
set -u
out=${1:-${OUT:-/tmp/gpu_out}}; mkdir -p "$out"
py=python3
export PYTHONUNBUFFERED=1
nvidia-smi -L
if [ -d .gpu_wheels ]; then
    $py -m pip install --no-index --no-deps -q .gpu_wheels/*.whl 2>&1 | tail -2
fi
$py -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -2
$py -c "import torch, mpi4py; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'mpi4py', mpi4py.__version__, 'cores', __import__('os').cpu_count())"
echo "mpirun: $(command -v mpirun)"

step() {  # step NAME SECONDS COMMAND...: run it, its output to OUTDIR/NAME.txt
    local name=$1 seconds=$2; shift 2
    local started=$SECONDS
    timeout "$seconds" "$@" > "$out/$name.txt" 2>&1
    echo "== $name: exit $? in $((SECONDS - started)) s"
    tail -"${TAIL:-12}" "$out/$name.txt"
}

TAIL=25 step test_gpu 240 $py -m pytest tests/test_gpu.py -v -p no:cacheprovider
step main_job 200 mpirun -np 4 $py -m trainer --progress lines
step trainer_bench_cuda 120 $py -m trainer.bench --nproc 2 --device cuda \
    --sync allreduce,ddp --steps 3 --rounds 3 --json "$out/trainer_bench_cuda.jsonl"
step collectives_bench 120 $py -m collectives.bench --nproc 4 --backend gloo \
    --sizes 64K,1M,16M,64M --trials 3 --seconds-per-row 0.3 --json "$out/collectives_bench.jsonl"
if [ "${MEASURE:-0}" = 1 ]; then
    step measure 150 $py docs/data/gpu/measure.py --json "$out/gpu_measure.jsonl"
fi
