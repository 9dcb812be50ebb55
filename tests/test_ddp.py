"""Our DistributedDataParallel gives torch DDP's answer (CPU, gloo, spawned ranks)."""
import os

import pytest

from checks_ddp import (auto_buckets_equal_torch_ddp, auto_buckets_inside_no_sync,
                        compare_with_torch_ddp, train_ours)
from distributed import run_world, run_world_collecting_errors
from launchers import ROOT, TESTS, mpirun, python, run


def assert_same_on_every_rank(digests):
    assert len(set(digests)) == 1, f"ranks ended with different parameters: {digests}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_resnet18_with_batchnorm_equals_torch_ddp(world_size):
    assert_same_on_every_rank(run_world(compare_with_torch_ddp, world_size, ("resnet18",),
                                        timeout=280))


@pytest.mark.timeout(200)
def test_the_language_model_with_adamw_equals_torch_ddp():
    # the byte-level GPT (tied embedding and head, attention), AdamW, clipped gradients;
    # float64, 2 ranks, our parameters bitwise the same on both
    assert_same_on_every_rank(run_world(compare_with_torch_ddp, 2, ("gpt",), timeout=180))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("branches", ["together", "by-rank"])
def test_unused_branch_equals_torch_ddp(world_size, branches):
    assert_same_on_every_rank(run_world(compare_with_torch_ddp, world_size, ("mlp", branches),
                                        timeout=180))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("options", [
    dict(accumulate=3),                                   # no_sync() accumulation
    dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0005),   # a bucket per parameter or so
    dict(bucket_cap_mb=1000),                             # one giant bucket
    dict(gradient_as_bucket_view=True, accumulate=2),
    dict(bucket_cap_mb="auto", accumulate=2),  # re-cut inside no_sync() after 2 steps
    dict(algorithm="halving-doubling"), dict(algorithm="tree"), dict(algorithm="native"),
])
def test_bucketing_variants_equal_torch_ddp(options):
    accumulate = options.pop("accumulate", 1)
    kwargs = dict(options)
    results = run_world(_compare_mlp, 3, (accumulate, kwargs), timeout=180)
    assert_same_on_every_rank(results)


@pytest.mark.timeout(200)
def test_buckets_sized_for_the_link_are_chosen_alike_and_train_as_torch_ddp():
    results = run_world(auto_buckets_equal_torch_ddp, 3, timeout=180)
    assert_same_on_every_rank([digest for digest, _, _ in results])
    for _, choice, sizes in results:  # rank 0's sizes, on every rank, and in use
        choice = dict(choice)
        assert (choice["first_bucket_mb"], choice["bucket_cap_mb"]) == sizes == results[0][2]
        assert choice["buckets"] >= 1 and choice["exposed_s"] >= 0  # this rank's own replay


@pytest.mark.timeout(200)
def test_buckets_re_cut_inside_no_sync_still_only_accumulate():
    for sent in run_world(auto_buckets_inside_no_sync, 2, timeout=180):
        assert sent == [0, 0, 0, 0], sent


def _compare_mlp(comm, accumulate, options):
    return compare_with_torch_ddp(comm, "mlp", accumulate=accumulate, **options)


def _mismatched_model(comm):
    import collectives
    from checks_ddp import make_model
    collectives.DistributedDataParallel(make_model("mlp", hidden=32 + comm.rank))


@pytest.mark.timeout(120)
def test_mismatched_models_fail_clearly_on_every_rank():
    for status, message in run_world_collecting_errors(_mismatched_model, 2):
        assert status == "raised"
        assert "the model differs across ranks" in message, message


@pytest.mark.timeout(300)
def test_mpi_backend_equals_gloo():
    gloo = run_world(_train_ours_ring, 3, timeout=120)
    out = run(mpirun(3, *python("checks_ddp.py")), cwd=TESTS, timeout=240, check=False)
    assert out.returncode == 0, out.stderr
    digests = [line.split()[-1] for line in out.stdout.splitlines() if "digest" in line]
    assert len(digests) == 3 and set(digests) == {gloo[0]}, (digests, gloo)


def _train_ours_ring(comm):
    return train_ours(comm, "mlp", algorithm="ring")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_horovod_face_equals_torch_ddp(compression):
    from checks_ddp import compare_horovod_with_torch_ddp
    assert_same_on_every_rank(run_world(compare_horovod_with_torch_ddp, 3, (compression,),
                                        timeout=180))


@pytest.mark.timeout(300)
def test_horovod_mnist_example_runs_under_mpirun():
    data = os.path.join(ROOT, "..", "shared", "data")
    if not os.path.isdir(os.path.join(data, "MNIST", "raw")):
        pytest.skip(f"MNIST not found at {data}")
    out = run(mpirun(2, *python("../examples/horovod_mnist.py", "--data-dir", data,
                                "--epochs", "2", "--lr", "0.05", "--momentum", "0.9",
                                "--log-interval", "20")),
              cwd=TESTS, timeout=280, check=False)
    assert out.returncode == 0, out.stderr
    accuracy = float(out.stdout.split("Accuracy: ")[-1].rstrip().rstrip("%"))
    assert accuracy > 80, out.stdout  # two epochs of 4000 digits: it learns


@pytest.mark.timeout(200)
@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_accumulation_with_parameters_used_in_some_passes_equals_torch_ddp(
        gradient_as_bucket_view):
    """no_sync() and find_unused_parameters=True: a parameter used inside no_sync() on one
    rank, or in the syncing pass by one rank, is averaged as torch's DDP does."""
    from checks_ddp import compare_accumulation_with_torch_ddp
    assert_same_on_every_rank(run_world(compare_accumulation_with_torch_ddp, 2,
                                        (gradient_as_bucket_view,), timeout=180))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_bool_and_complex_buffers_are_broadcast_from_rank_0(world_size):
    """A causal mask (bool) and rotary frequencies (complex64): rank 0's on every rank,
    when wrapping and before each forward, as torch's DDP broadcasts them."""
    from checks_ddp import MaskAndFrequencies, bool_and_complex_buffers_come_from_rank_0
    rank_0s = MaskAndFrequencies(seed=0)
    when_wrapped = rank_0s.buffer_values()
    rank_0s.redraw(seed=10)
    for rank, (after_wrapping, after_forward) in enumerate(
            run_world(bool_and_complex_buffers_come_from_rank_0, world_size, timeout=100)):
        assert after_wrapping == when_wrapped, f"rank {rank} after wrapping"
        assert after_forward == rank_0s.buffer_values(), f"rank {rank} after a forward"
