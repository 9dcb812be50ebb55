"""Buckets sized for the link (collectives/bucket_sizes.py): the replay and the choice
against hand-worked cases."""
import pytest

from collectives.bucket_sizes import MiB, StepProfile, choose, cut, exposed, fit_link


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
