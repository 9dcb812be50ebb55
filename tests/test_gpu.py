"""CUDA tensors and NCCL (tests/checks_gpu.py). Skipped on a machine without a GPU.

NCCL wants a GPU per rank, so with one GPU it runs at world size 1; gloo and MPI
stage CUDA tensors through host memory, so two ranks share a GPU there.
"""
import json
import sys

import pytest
import torch

from collectives.launch.mpirun import mpirun_command
from launchers import rank_env, run, torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_ranks(argv, env=None):
    """The `ok ...` lines the ranks of `argv` printed, each split into words, sorted."""
    result = run(argv, env=rank_env(env))
    return sorted(line.split()[1:] for line in result.stdout.splitlines()
                  if line.startswith("ok "))


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
    result = run(torchrun(2, "-m", "trainer", "--epochs", "1", "--train-samples", "256",
                          "--test-samples", "64", "--progress", "lines"), check=False)
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


@pytest.mark.timeout(240)
def test_buckets_by_priority_on_the_gpu_end_where_plain_allreduce_ends():
    """A CUDA model through gloo: the communication thread's own stream and the chunks by
    priority (overlap="forward") read each gradient only once it is in its bucket and
    hand each reduced chunk back only once it is in place: every step's weights equal
    plain allreduce's (float64, the ring at 2 ranks adds two numbers: bitwise)."""
    from checks_overlap import forward_overlap_equals_allreduce
    from distributed import run_world
    results = run_world(forward_overlap_equals_allreduce, 2,
                        ("ring", "sgd", "float64", 6, "cuda"), timeout=220)
    for equal, worst, moved, _ in results:
        assert moved and equal, worst
