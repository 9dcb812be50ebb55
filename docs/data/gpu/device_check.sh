#!/usr/bin/env bash
# The GPU checks, run on a machine with one CUDA GPU (docs/library.md "On a GPU"):
# figures for the cost model (measure.py) and tests/test_gpu.py. Offline machines get
# mpich, mpi4py, python-hostlist and expecttest from wheels in .gpu_wheels/ if present.
#   bash docs/data/gpu/device_check.sh OUTDIR
set -u
out=${1:-${OUT:-/tmp/gpu_out}}; mkdir -p "$out"
py=python3
nvidia-smi -L
if [ -d .gpu_wheels ]; then
    $py -m pip install --no-index --no-deps -q .gpu_wheels/*.whl 2>&1 | tail -2
fi
$py -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -2
$py -c "import torch, mpi4py; print('torch', torch.__version__, 'mpi4py', mpi4py.__version__)"
echo "mpirun: $(command -v mpirun)"
timeout 150 $py docs/data/gpu/measure.py --json "$out/gpu_measure.jsonl"
echo "measure exit $?"
timeout 330 $py -m pytest tests/test_gpu.py -v -p no:cacheprovider > "$out/test_gpu.txt" 2>&1
echo "pytest exit $?"
tail -25 "$out/test_gpu.txt"
