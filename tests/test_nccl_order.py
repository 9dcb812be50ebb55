"""Every algorithm under NCCL's ordering rules, without a GPU (tests/nccl_order.py).

NCCL runs a rank's postings one after another; an algorithm that posts a receive ahead
of its step hangs there. Each algorithm runs here at worlds 2 to 4 on a simulated NCCL
world, a thread per rank, on real data: it must finish (a hang is raised as Deadlock)
and give every rank the right answer.
"""
import pytest
import torch

import collectives
from collectives.algorithms import halving_doubling, hierarchical, naive, pairwise, ring, tree
from collectives.algorithms.common import chunk_bounds
from collectives.transport.group import Group
from collectives.transport.topology import Topology
from nccl_order import Deadlock, run_ranks

SIZE = 37  # not a multiple of any world: chunks of unequal sizes, some ranks' smaller


def data_of(rank: int, numel: int = SIZE) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank),
                       dtype=torch.float64)


def total(world_size: int, numel: int = SIZE) -> torch.Tensor:
    return sum(data_of(rank, numel) for rank in range(world_size))


def all_reduced(algorithm):
    def run(comm):
        flat = data_of(comm.rank)
        algorithm(comm, flat, "sum")
        return flat
    return run


def on_two_hosts(comm):
    """Ranks 0..n/2-1 on one host, the rest on another: hierarchical's three phases."""
    half = (comm.world_size + 1) // 2
    comm.topology = Topology(tuple(0 if r < half else 1 for r in range(comm.world_size)))
    flat = data_of(comm.rank, 1 << 12)  # chunks for the pipeline
    hierarchical.all_reduce(comm, flat, "sum")
    return flat


def in_a_group(comm):
    """A ring on a Group whose ranks are the parent's in reverse: ranks translated."""
    group = Group(comm, list(reversed(range(comm.world_size))))
    flat = data_of(comm.rank)
    ring.all_reduce(group, flat, "sum")
    return flat


def reduce_scattered(comm):
    flat = data_of(comm.rank)
    ring.reduce_scatter(comm, flat, "sum")
    return flat


def gathered(comm):
    bounds = chunk_bounds(SIZE, comm.world_size)
    flat = torch.zeros(SIZE, dtype=torch.float64)
    flat[bounds[comm.rank]:bounds[comm.rank + 1]] = comm.rank + 1
    ring.all_gather(comm, flat)
    return flat


def broadcast_by(algorithm, root):
    def run(comm):
        flat = data_of(comm.rank)
        algorithm(comm, flat, root)
        return flat
    return run


def reduced_to_root(comm):
    flat = data_of(comm.rank)
    tree.reduce(comm, flat, "sum", root=comm.world_size - 1)
    return flat


def all_to_all(comm):
    n = comm.world_size
    inputs = [torch.full((p + comm.rank,), float(100 * comm.rank + p)) for p in range(n)]
    outputs = [torch.empty(comm.rank + p) for p in range(n)]
    pairwise.all_to_all(comm, outputs, inputs)
    return outputs


def public_calls(comm):
    """The public API on every algorithm, its argument checks included."""
    out = {}
    for algorithm in ("ring", "halving-doubling", "tree", "naive"):
        flat = data_of(comm.rank)
        collectives.all_reduce(flat, "sum", algorithm, comm=comm)
        out[algorithm] = flat
    scattered = torch.empty(SIZE)
    collectives.reduce_scatter(scattered, torch.ones(SIZE * comm.world_size), comm=comm)
    gathered_ = torch.empty(2 * comm.world_size)
    collectives.all_gather(gathered_, torch.full((2,), float(comm.rank)), comm=comm)
    out["reduce_scatter"], out["all_gather"] = scattered, gathered_
    return out


WORLDS = [2, 3, 4]
ALL_REDUCES = {"ring": ring.all_reduce, "halving-doubling": halving_doubling.all_reduce,
               "tree": tree.all_reduce, "naive": naive.all_reduce}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("name", sorted(ALL_REDUCES))
def test_every_all_reduce_finishes_and_sums(name, world_size):
    expected = total(world_size)
    for result in run_ranks(world_size, all_reduced(ALL_REDUCES[name])):
        torch.testing.assert_close(result, expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLDS)
def test_hierarchical_and_groups_finish_and_sum(world_size):
    expected = total(world_size, 1 << 12)
    for result in run_ranks(world_size, on_two_hosts):
        torch.testing.assert_close(result, expected)
    for result in run_ranks(world_size, in_a_group):
        torch.testing.assert_close(result, total(world_size))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLDS)
def test_ring_halves_broadcasts_reduce_and_all_to_all(world_size):
    n = world_size
    bounds = chunk_bounds(SIZE, n)
    expected = total(n)
    for rank, result in enumerate(run_ranks(n, reduce_scattered)):
        lo, hi = bounds[rank], bounds[rank + 1]
        torch.testing.assert_close(result[lo:hi], expected[lo:hi])
    gathered_expected = torch.cat([torch.full((bounds[r + 1] - bounds[r],), r + 1.0,
                                              dtype=torch.float64) for r in range(n)])
    for result in run_ranks(n, gathered):
        assert torch.equal(result, gathered_expected)
    for algorithm in (tree.broadcast, naive.broadcast):
        for result in run_ranks(n, broadcast_by(algorithm, n - 1)):
            assert torch.equal(result, data_of(n - 1))
    assert torch.allclose(run_ranks(n, reduced_to_root)[n - 1], expected)
    for rank, outputs in enumerate(run_ranks(n, all_to_all)):
        for src, piece in enumerate(outputs):
            assert torch.equal(piece, torch.full((rank + src,), float(100 * src + rank)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLDS)
def test_the_public_calls_finish_with_their_checks(world_size):
    for rank, out in enumerate(run_ranks(world_size, public_calls)):
        for algorithm in ("ring", "halving-doubling", "tree", "naive"):
            torch.testing.assert_close(out[algorithm], total(world_size))
        assert torch.equal(out["reduce_scatter"], torch.full((SIZE,), float(world_size)))
        assert torch.equal(out["all_gather"], torch.arange(world_size).repeat_interleave(2)
                           .float())


def receive_posted_ahead(comm):
    """What NCCL forbids: both ranks post their receive in a group of its own before
    their send; each stream stops at its receive."""
    peer = 1 - comm.rank
    receiving = comm.irecv(torch.empty(3), peer)
    sending = comm.isend(torch.ones(3), peer)
    receiving.wait()
    sending.wait()


@pytest.mark.timeout(60)
def test_the_simulator_sees_a_receive_posted_ahead_hang():
    with pytest.raises(Deadlock):
        run_ranks(2, receive_posted_ahead)
