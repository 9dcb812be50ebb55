"""CUDA tensors and NCCL (tests/checks_gpu.py). Skipped on a machine without a GPU.

NCCL wants a GPU per rank, so with one GPU it runs at world size 1; gloo and MPI
stage CUDA tensors through host memory, so two ranks share a GPU there.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from collectives.launch.mpirun import mpirun_command

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def run_ranks(argv, env=None):
    env = dict(env or os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env=env)
    assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
    return sorted(line.split()[1:] for line in result.stdout.splitlines()
                  if line.startswith("ok "))


def torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            *args]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", ["nccl", "nccl-mixed"])
def test_nccl_world_of_one(group):
    assert len(run_ranks(torchrun(1, "tests/checks_gpu.py", group))) == 1


@pytest.mark.timeout(300)
def test_the_main_job_shares_one_gpu_through_gloo():
    """More ranks than GPUs: auto takes gloo for the whole job (NCCL wants a GPU per
    rank), says so once, and the ranks train on the GPU they share."""
    if torch.cuda.device_count() >= 2:
        pytest.skip("needs fewer GPUs than ranks")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    result = subprocess.run(torchrun(2, "-m", "trainer", "--epochs", "1", "--train-samples",
                                     "256", "--test-samples", "64", "--progress", "lines"),
                            cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("backend auto: gloo") == 1, result.stderr
    assert "has 2 ranks and 1 GPU" in result.stderr
    first = next(line for line in result.stdout.splitlines() if line.startswith("training"))
    assert "backend gloo" in first and "on cuda:0 (1 GPU shared by 2 ranks here" in first


@pytest.mark.timeout(300)
def test_cuda_tensors_through_gloo_and_mpi_end_alike():
    """Both stage through host memory: every rank ends with the same digest on both."""
    gloo = run_ranks(torchrun(2, "tests/checks_gpu.py", "gloo"))
    argv, env = mpirun_command(2, [sys.executable, "tests/checks_gpu.py", "mpi"])
    assert len(gloo) == 2 and run_ranks(argv, env) == gloo


@pytest.mark.timeout(300)
def test_trainer_on_nccl_learns(tmp_path):
    run_ranks(torchrun(1, "-m", "trainer", "--backend", "nccl", "--epochs", "2",
                       "--train-samples", "1024", "--test-samples", "256",
                       "--metrics", str(tmp_path / "m.jsonl")))
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert records[-1]["test_acc"] > 0.2  # ten classes: chance is 0.1
