"""allreduce with overlap="forward": the same weights as plain allreduce, step by step,
while the next forward starts before the last buckets have landed."""
import pytest

from checks_overlap import (a_deep_copy_of_the_model_evaluates,
                            a_step_in_flight_sees_what_plain_allreduce_sees,
                            forward_overlap_equals_allreduce,
                            heads_reduced_early_equal_allreduce, nothing_stays_on_the_model,
                            refusals,
                            the_first_layer_runs_before_the_last_buckets_land,
                            what_cannot_be_right_is_refused)
from distributed import run_world


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size, algorithm, optimizer", [
    (2, "ring", "sgd"), (3, "naive", "sgd"), (3, "naive", "adam"), (2, "ring", "adamw")])
def test_float64_weights_equal_plain_allreduce_bitwise_at_every_step(world_size, algorithm,
                                                                     optimizer):
    # naive sums each element in rank order wherever the chunk boundaries fall; the ring
    # at 2 ranks adds two numbers, which is the same in either order
    results = run_world(forward_overlap_equals_allreduce, world_size,
                        (algorithm, optimizer, "float64"), timeout=130)
    for equal, worst, moved, _ in results:
        assert moved and equal, worst


@pytest.mark.timeout(150)
def test_float32_on_3_ranks_with_the_ring_equals_it_to_rounding():
    # the ring splits a chunk into other segments than its whole bucket: each element is
    # summed in another order, so only the last bits may differ
    results = run_world(forward_overlap_equals_allreduce, 3, ("ring", "sgd", "float32"),
                        timeout=130)
    for equal, worst, moved, _ in results:
        assert moved and worst < 1e-5, worst


@pytest.mark.timeout(150)
def test_a_bucket_s_head_reduced_before_its_last_gradient_gives_the_same_weights():
    # naive at 3 ranks sums each element in rank order: bitwise, early or not
    results = run_world(heads_reduced_early_equal_allreduce, 3, ("naive", "float64"),
                        timeout=130)
    for equal, worst, moved, early in results:
        assert moved and equal, worst
        assert early >= 2, early  # fc's weight, 160 elements: two 65-element chunks at least


@pytest.mark.timeout(120)
def test_the_first_layer_is_stepped_while_the_first_buckets_are_still_on_the_wire():
    # over gloo alone (no shared memory), as across hosts
    ((unreduced, reduced_from), sizes), _ = run_world(
        the_first_layer_runs_before_the_last_buckets_land, 2, timeout=100, shm="off")
    last = len(sizes) - 1
    assert len(sizes) >= 3, sizes
    assert reduced_from[last] <= sizes[last] - 224  # conv1's slots, at the end, are in
    assert unreduced[0] > 0, (unreduced, sizes)  # fc's bucket, launched first, is not


@pytest.mark.timeout(120)
def test_what_it_cannot_do_is_refused_with_one_line():
    said = run_world(refusals, 2, timeout=100)[0]
    assert "find_unused_parameters" in said[0]
    assert "model.step_in_forward(optimizer)" in said[1]
    assert "LBFGS is not one of the optimizers" in said[2]
    assert "'sideways'" in said[3] and "backward, forward" in said[3], said[3]


@pytest.mark.timeout(120)
def test_a_deep_copy_of_the_model_evaluates_as_the_trainer_makes_one():
    assert run_world(a_deep_copy_of_the_model_evaluates, 2, timeout=100) == [(4, 10)] * 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3])
def test_loads_checkpoints_evaluations_and_no_sync_see_what_plain_allreduce_sees(world_size):
    # the weights, buffers, momentum and evaluation outputs, bitwise, on every rank
    for rank, differences in enumerate(run_world(
            a_step_in_flight_sees_what_plain_allreduce_sees, world_size, timeout=130)):
        assert all(d is None for d in differences.values()), (rank, differences)


@pytest.mark.timeout(120)
def test_a_scaler_clipping_or_the_wrapped_optimizer_is_refused_on_every_rank():
    for said in run_world(what_cannot_be_right_is_refused, 2, timeout=100):
        assert "GradScaler" in (said["GradScaler on the stepper"] or ""), said
        for name in ("GradScaler on the optimizer", "the optimizer itself"):
            assert "was stepped itself" in (said[name] or ""), said
        assert "were changed between backward and step()" in (said["clip_grad_norm_"] or ""), said


@pytest.mark.timeout(60)
def test_a_refused_or_closed_wrapper_leaves_no_hook_on_the_model():
    assert run_world(nothing_stays_on_the_model, 1, timeout=50) == [(0, 0)]
