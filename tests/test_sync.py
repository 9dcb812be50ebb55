"""The sync-strategy zoo: exact properties, byte counts, and learning on real MNIST."""
import os
import warnings
from datetime import timedelta

import pytest
import torch

from checks_sync import (DATA, GRADIENT_STRATEGIES, async_avg_does_not_wait_for_a_slow_rank,
                         async_avg_settles_ranks_a_round_apart,
                         byte_counts_match_formulas, delayed_is_one_step_late,
                         delayed_unscales_each_gradient_with_its_own_scale,
                         every_strategy_learns_mnist, gossip_keeps_the_mean,
                         local_sgd_h1_equals_allreduce, mlp, one_bad_gradient_is_forgotten)
from collectives import sync
from collectives.transport.local import LocalTransport
from distributed import run_world


def test_unknown_strategy_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown sync strategy 'sgd2': choose from allreduce, "
                                         "async-avg, bf16, delayed, demo, diloco, fp16, "
                                         "gossip, hier-local-sgd, local-sgd, muloco, noloco, "
                                         "onebit-adam, powersgd, sparseloco, sparta, "
                                         "topk$"):
        sync.create("sgd2")


@pytest.mark.timeout(120)
def test_local_sgd_with_period_1_equals_allreduce_for_plain_sgd():
    assert run_world(local_sgd_h1_equals_allreduce, 3, timeout=100) == ["ok"] * 3


@pytest.mark.timeout(120)
def test_async_avg_settles_an_epoch_with_its_ranks_a_round_apart():
    assert run_world(async_avg_settles_ranks_a_round_apart, 2, timeout=60) == ["ok"] * 2


@pytest.mark.timeout(120)
def test_delayed_applies_each_average_one_step_late():
    assert run_world(delayed_is_one_step_late, 2, timeout=100) == ["ok"] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_one_non_finite_gradient_step_leaves_no_trace_in_any_strategy(value):
    # Rank 1's gradient is non-finite at step 2 only, and that step is skipped. Every
    # rank must see the bad step as non-finite (so all skip it together), and every
    # later step finite: no strategy may keep the inf or NaN in its state (powersgd's Q
    # and error, topk's residual). delayed applies step 2's gradient at step 3.
    per_rank = run_world(one_bad_gradient_is_forgotten, 2, (value,), timeout=100)
    wrong = {}
    for name in GRADIENT_STRATEGIES:
        bad = 3 if name == "delayed" else 2
        expected = [step != bad for step in range(1, 7)]
        seen = [finite[name] for finite in per_rank]
        if seen != [expected] * 2:
            wrong[name] = seen
    assert not wrong, f"finite at steps 1-6, per rank: {wrong}"


@pytest.mark.timeout(120)
def test_delayed_unscales_each_gradient_with_the_scale_it_was_computed_with():
    scales, _ = run_world(delayed_unscales_each_gradient_with_its_own_scale, 2, timeout=100)
    # The check covered a scale that grew and one that fell between two steps.
    changes = [after / before for before, after in zip(scales, scales[1:])]
    assert 2.0 in changes and 0.5 in changes, scales


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_gossip_keeps_the_mean_of_the_parameters(world_size):
    assert run_world(gossip_keeps_the_mean, world_size, timeout=100) == ["ok"] * world_size


@pytest.mark.timeout(120)
def test_compression_byte_counts_match_their_formulas():
    results = run_world(byte_counts_match_formulas, 3, timeout=100)
    assert results[0]["topk"] < results[0]["dense"] / 5


@pytest.mark.timeout(120)
def test_async_avg_is_not_stalled_by_a_slow_rank(tmp_path):
    (_, fast_rounds, fast_bytes), (finished_first, slow_rounds, _) = run_world(
        async_avg_does_not_wait_for_a_slow_rank, 2, (str(tmp_path / "rank0-done"),),
        timeout=100)
    assert finished_first, "rank 0 could not finish its steps while rank 1 stalled"
    assert fast_bytes > 0, "the background rounds' bytes were not counted"
    assert fast_rounds == slow_rounds >= 1  # both ranks stopped after the same round


# Every strategy against allreduce on the 4000-image MNIST subset, 2 ranks, SGD with
# momentum 0.9 and a cosine decay over 3 epochs: each must end within 2 points.
# Two need more, and say why:
# - topk sends 1% of each bucket per step; error feedback delivers the rest later, so
#   it needs more steps to catch up: 5 epochs.
# - delayed applies gradients one step late. Staleness acts like extra momentum
#   (Mitliagkas et al., "Asynchrony begets momentum", 2016): with momentum 0.9 it is
#   unstable (about 80%). With momentum 0.7, uncompensated, and 5 epochs it reaches
#   allreduce's level (its default compensation is checked in test_delayed.py).
SETTINGS = {"local-sgd": {}, "async-avg": {}, "gossip": {}, "fp16": {}, "bf16": {},
            "powersgd": {}, "topk": {"epochs": 5},
            "delayed": {"epochs": 5, "momentum": 0.7,
                        "options": {"compensate": "none", "warmup_steps": 0}}}


@pytest.mark.timeout(600)
def test_every_strategy_learns_mnist_within_2_points_of_allreduce():
    if not os.path.isdir(os.path.join(DATA, "MNIST", "raw")):
        pytest.skip(f"MNIST not found at {DATA}")
    runs = {"allreduce": {}, **SETTINGS}
    (accuracy, _) = run_world(every_strategy_learns_mnist, 2, (runs,), timeout=560)
    reference = accuracy["allreduce"]
    assert reference > 0.94, accuracy
    for name in SETTINGS:
        assert accuracy[name] >= reference - 0.02, (name, accuracy)


class LossScale:
    """A stand-in for fp16 AMP's GradScaler: the loss scale a step's gradients carry."""

    def __init__(self, scale):
        self.scale = scale

    def get_scale(self):
        return self.scale


def unscaled_gradients(name, scales, **options):
    """What strategy `name` hands the optimizer at each step, unscaled, in a world of one
    (no launcher: every collective is the identity), when step t's gradients carry the
    loss scale scales[t]. The gradients themselves are the same seeded ones whatever the
    scales, so with error feedback kept right the results cannot depend on the scales."""
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    model = mlp()
    params = list(model.parameters())
    strategy = sync.create(name, algorithm="ring", **options)
    strategy.setup(model, comm)
    bucket = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)  # reused
    generator = torch.Generator().manual_seed(0)
    applied = []
    for scale in scales:
        strategy.grad_scaler = LossScale(scale)
        grads = [torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale
                 for p in params]
        if strategy.uses_buckets:  # topk: the model's gradients as one bucket
            bucket.copy_(torch.cat([g.reshape(-1) for g in grads]))
            strategy.reduce_bucket(bucket)
            applied.append(bucket / scale)
        else:  # powersgd
            for p, g in zip(params, grads):
                p.grad = g
            strategy.after_backward(model)
            applied.append(torch.cat([p.grad.reshape(-1) for p in params]) / scale)
    return applied


@pytest.mark.parametrize("name, options", [("topk", {"ratio": 0.05}), ("powersgd", {"rank": 1})])
def test_error_feedback_does_not_depend_on_a_changing_loss_scale(name, options):
    # fp16 AMP's GradScaler doubles its scale after good steps and halves it after an
    # overflow: a residual left at one scale and added to a gradient at another must be
    # rescaled. Powers of two scale exactly, so the unscaled results agree to rounding.
    plain = unscaled_gradients(name, [1.0] * 4, **options)
    scaled = unscaled_gradients(name, [2.0 ** 10, 2.0 ** 14, 2.0 ** 8, 2.0 ** 12], **options)
    for step, (expected, actual) in enumerate(zip(plain, scaled), 1):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=0,
                                   msg=lambda m: f"{name}, step {step}: {m}")


def test_topk_residuals_resume_by_bucket_index_in_new_buffers():
    # A resumed run's buckets live at other addresses: the residuals one strategy saved
    # must come back to the same buckets of another, by the bucketer's index.
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    generator = torch.Generator().manual_seed(0)
    gradients = [[torch.randn(size, generator=generator) for size in (300, 500)]
                 for step in range(2)]

    def reduce(strategy, buckets, step):
        for bucket, gradient in zip(buckets, gradients[step]):
            bucket.copy_(gradient)
            strategy.reduce_bucket(bucket)  # in index order, as the bucketer hands them
        return [bucket.clone() for bucket in buckets]

    straight = sync.create("topk", ratio=0.05)
    straight.setup(mlp(), comm)
    buckets = [torch.zeros(300), torch.zeros(500)]
    reduce(straight, buckets, 0)
    saved = straight.state_dict()
    expected = reduce(straight, buckets, 1)
    resumed = sync.create("topk", ratio=0.05)
    resumed.setup(mlp(), comm)
    resumed.load_state_dict(saved)
    actual = reduce(resumed, [torch.zeros(300), torch.zeros(500)], 1)  # new addresses
    for index, (a, b) in enumerate(zip(actual, expected)):
        assert torch.equal(a, b), f"bucket {index} differs after the state moved"


@pytest.mark.parametrize("view", [False, True])
def test_gradients_reach_the_strategy_divided_as_they_enter_their_bucket(view):
    # An averaging strategy's division is done by the copy into the bucket: reduce_bucket
    # sees gradient / divisor, asked once a step (None: the gradients as they are), in
    # copy mode and when .grad is a view of the bucket alike.
    from collectives.bucketer import Bucketer, BucketOptions
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    model = mlp()
    divisors = iter([4, None])
    seen = []
    bucketer = Bucketer(model.parameters(), lambda flat: seen.append(flat.clone()), comm,
                        BucketOptions(gradient_as_bucket_view=view),
                        divisor=lambda: next(divisors))
    try:
        x = torch.randn(8, 20, dtype=torch.float64)
        for divisor in (4, None):
            model.zero_grad()
            seen.clear()
            model(x).square().sum().backward()
            expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
            wanted = torch.cat([g.reshape(-1) for g in reversed(expected)])
            got = torch.cat(seen)
            torch.testing.assert_close(got, wanted / (divisor or 1), rtol=0, atol=0)
            for param, gradient in zip(model.parameters(), expected):
                torch.testing.assert_close(param.grad, gradient / (divisor or 1), rtol=0, atol=0)
    finally:
        bucketer.close()


def test_local_sgd_divides_gradients_only_while_it_averages_them():
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    comm.world_size = 4  # the divisor is all that is asked of it here
    strategy = sync.create("local-sgd", period=4, warmup_steps=2)
    strategy.setup(mlp(), comm)
    assert strategy.gradient_divisor() == 4  # warm-up: gradients are averaged
    strategy.steps_done = 2
    assert strategy.gradient_divisor() is None  # local steps: each rank's own gradient
    strategy = sync.create("topk", ratio=0.5)
    strategy.setup(mlp(), comm)
    assert strategy.gradient_divisor() is None  # divides after gathering, itself
    for name in ("allreduce", "bf16", "fp16"):
        strategy = sync.create(name)
        strategy.setup(mlp(), comm)
        assert strategy.gradient_divisor() == 4, name


def test_gradients_with_a_graph_of_their_own_are_divided_too():
    # backward(create_graph=True) (a gradient penalty): the gradients require grad, which
    # a division written straight into the bucket (out=) refuses
    from collectives.bucketer import Bucketer
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    model = mlp()
    bucketer = Bucketer(model.parameters(), lambda flat: None, comm, divisor=lambda: 4)
    try:
        x = torch.randn(8, 20, dtype=torch.float64)
        expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
        with warnings.catch_warnings():  # torch's about the reference cycle below
            warnings.simplefilter("ignore")
            model(x).square().sum().backward(create_graph=True)
        for param, gradient in zip(model.parameters(), expected):
            torch.testing.assert_close(param.grad, gradient / 4)
    finally:
        bucketer.close()
        model.zero_grad()  # the graph's reference cycle


def test_diloco_drops_a_synchronization_whose_average_is_not_finite():
    """One rank's overflow reaches every rank's average: no outer step on it (the outer
    momentum would keep the inf for good), every replica back at the synced weights;
    the next synchronization steps as usual. A world of one: the average is its own."""
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    model = mlp()
    strategy = sync.create("diloco", period=2, algorithm="ring")
    strategy.setup(model, comm)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    strategy.after_step(model, 1)
    with pytest.warns(RuntimeWarning, match="diloco: the average of fragment 0's outer "
                      "synchronization is not finite.*1 dropped so far"):
        strategy.after_step(model, 2)
    for p, start in zip(model.parameters(), before):
        assert torch.equal(p, start)
    assert all(not state for outer in strategy.outer for state in outer.state.values())
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1)
    strategy.after_step(model, 3)
    strategy.after_step(model, 4)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, start) for p, start in zip(model.parameters(), before))
