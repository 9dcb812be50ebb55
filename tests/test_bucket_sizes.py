"""Buckets sized for the link (collectives/bucket_sizes.py): the replay and the choice
against hand-worked cases."""
import pytest

from collectives.bucket_sizes import (MiB, NEAR_TIE, NEAR_TIE_S, StepProfile, choose,
                                      cpu_per_bucket, cut, exposed, fit_link)


def test_the_link_is_fitted_from_the_measured_buckets():
    a, b = 2e-3, 1e-8  # 2 ms a reduction, 100 MB/s
    buckets = [(size, a + b * size) for size in (1 * MiB, 25 * MiB, 19 * MiB)]
    assert fit_link(buckets) == pytest.approx((a, b))
    # timings that fall with size are noise: all of it fixed cost
    assert fit_link([(1 * MiB, 0.02), (8 * MiB, 0.01)]) == pytest.approx((0.015, 0.0))


def test_buckets_are_cut_as_ddp_cuts_them():
    sizes = [MiB // 2] * 6
    assert cut(sizes, cap_bytes=MiB, first_bytes=MiB // 2) == [[0], [1, 2], [3, 4], [5]]


def test_one_bucket_waits_for_the_last_gradient_then_for_all_of_it():
    profile = StepProfile(param_bytes=[MiB] * 4, ready_s=[0.0, 0.1, 0.2, 0.3], buckets=[])
    seconds, count = exposed(profile, cap_bytes=64 * MiB, first_bytes=64 * MiB, a=0.01, b=1e-7)
    assert count == 1 and seconds == pytest.approx(0.01 + 4 * MiB * 1e-7)


def test_buckets_reduced_while_backward_computes_leave_only_the_last():
    # each 1 MiB bucket takes 0.01 + 0.0105 s, less than the 0.1 s to the next gradient:
    # only the last one's reduction is left when backward ends
    profile = StepProfile(param_bytes=[MiB] * 4, ready_s=[0.0, 0.1, 0.2, 0.3], buckets=[])
    seconds, count = exposed(profile, cap_bytes=MiB, first_bytes=MiB, a=0.01, b=1e-8)
    assert count == 4 and seconds == pytest.approx(0.01 + MiB * 1e-8)


def test_a_slow_link_cuts_more_buckets_than_a_link_that_costs_latency():
    ready = [i * 0.05 for i in range(40)]  # 40 MiB of gradients over 2 s of backward
    # 100 Mbit/s-like: 1 MiB takes 80 ms, a reduction 1 ms more; starting early pays
    slow = StepProfile([MiB] * 40, ready, buckets=[(MiB, 0.081), (25 * MiB, 2.001)])
    first, cap, details = choose(slow)
    ddp, _ = exposed(slow, 25 * MiB, 1 * MiB, details["a"], details["b"])
    assert details["buckets"] > 3 and cap < 25 and details["exposed_s"] < ddp
    assert details["a"] == pytest.approx(0.001) and details["b"] == pytest.approx(0.08 / MiB)
    # a fast link whose every reduction costs 50 ms whatever its size: one bucket
    fixed = StepProfile([MiB] * 40, ready, buckets=[(MiB, 0.05), (25 * MiB, 0.05)])
    first, cap, details = choose(fixed)
    assert details["buckets"] == 1 and cap * MiB >= 40 * MiB


def test_cpu_a_bucket_costs_on_shared_cores_buys_fewer_buckets():
    # Small buckets leave the least exposed time, but each reduction also costs 3 ms of
    # CPU whatever its size; on 4 ranks sharing 2 cores (weight 2) that is 6 ms of step
    # a bucket, and the choice goes to fewer, bigger ones. With cores to spare (weight
    # 0) the CPU costs the step nothing and the choice is the one made without it.
    ready = [i * 0.02 for i in range(40)]  # 40 MiB of gradients over 0.8 s of backward
    timings = [(MiB, 0.0015), (9 * MiB, 0.0095), (25 * MiB, 0.0255)]  # 1 ms/MiB + 0.5 ms
    cpu = [0.003 + 0.0002 * size / MiB for size, _ in timings]
    profile = StepProfile([MiB] * 40, ready, buckets=timings, bucket_cpu_s=cpu)
    assert cpu_per_bucket(profile) == pytest.approx(0.003)
    spare = choose(profile, cpu_weight=0.0)
    without = choose(StepProfile([MiB] * 40, ready, buckets=timings))
    assert spare[:2] == without[:2]  # the same layout, found the same way
    assert {k: spare[2][k] for k in ("exposed_s", "buckets", "best_s")} == \
        {k: without[2][k] for k in ("exposed_s", "buckets", "best_s")}
    assert spare[2]["cpu_per_bucket_s"] == pytest.approx(0.003)  # measured, not weighed
    shared = choose(profile, cpu_weight=2.0)
    assert shared[2]["buckets"] < spare[2]["buckets"], (spare, shared)
    assert shared[2]["cpu_per_bucket_s"] == pytest.approx(0.003)
    # the cost it minimised: exposed time plus the CPU of its buckets, on the step
    cost = shared[2]["exposed_s"] + shared[2]["buckets"] * 0.003 * 2.0
    best = shared[2]["best_s"]
    assert best <= cost <= max(best * (1 + NEAR_TIE), best + NEAR_TIE_S)
