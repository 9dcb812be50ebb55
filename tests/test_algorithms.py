"""Every algorithm, op, dtype and world size 1-4 and 6 against numpy, on gloo; and every
dtype near its limits, where a sum overflows and an average must not.

The world sizes give each algorithm every shape it has: one rank; two (each rank's one
peer is both its neighbours); 3, odd (halving-doubling folds one rank into a core of 2;
a binomial tree cut short); 4, a power of two (no fold); 6 (two ranks folded into a
core of 4, a tree cut short elsewhere). 5 has no shape of its own: one rank folded into
a core of 4 is 3's fold and 6's core.

Ranks of one host talk through shared memory by default; the gloo-over-TCP path
(what ranks on different hosts use) runs the same checks at 3 ranks. (The algorithms
call the transport alike on both paths; the TCP transport itself, at 2 ranks too, where
a rank's one peer is both its left and its right, is test_transport.py's.)"""
import pytest

from checks_algorithms import (check_all_reduce, check_broadcast_gather_scatter,
                               check_near_limits, check_product,
                               check_public_calls_on_a_group, check_ring_segments)
from distributed import run_world


def run_checks(comm):
    return (check_all_reduce(comm), check_ring_segments(comm),
            check_broadcast_gather_scatter(comm), check_product(comm), check_near_limits(comm))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,shm", [(1, None), (2, None), (3, None), (4, None),
                                            (6, None), (3, "off")])
def test_every_algorithm_matches_numpy_and_ranks_agree_bitwise(world_size, shm):
    results = run_world(run_checks, world_size, timeout=280, shm=shm)
    all_reduce_digests = results[0][0]
    assert len(all_reduce_digests) > 100
    for rank, (all_reduce, segments, reduce_scatter, product, limits) in enumerate(results):
        assert all_reduce == all_reduce_digests, f"rank {rank} differs from rank 0"
        assert segments == results[0][1], f"rank {rank} differs from rank 0 (segmented ring)"
        assert product == results[0][3], f"rank {rank} differs from rank 0 (product)"
        assert limits == results[0][4], f"rank {rank} differs from rank 0 (near limits)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", [None, "off"])
def test_the_public_calls_on_some_ranks_take_point_to_point_algorithms(shm):
    results = run_world(check_public_calls_on_a_group, 3, timeout=100, shm=shm)
    assert results[0] == results[2] == [4.0] * 5 and results[1] is None, results
