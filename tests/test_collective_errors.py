"""Mismatched calls raise on every rank naming both sides; a dead peer fails, not hangs."""
import os
import time

import pytest
import torch

import collectives
from distributed import run_world, run_world_collecting_errors


def call_with_numel_by_rank(comm):
    collectives.all_reduce(torch.ones(10 + comm.rank), algorithm="ring")


def call_with_dtype_by_rank(comm):
    dtype = torch.float32 if comm.rank == 0 else torch.float64
    collectives.all_reduce(torch.ones(10, dtype=dtype))


def call_with_root_by_rank(comm):
    collectives.broadcast(torch.ones(4), src=comm.rank % 2)


def call_unknown_algorithm(comm):
    collectives.all_reduce(torch.ones(4), algorithm="butterfly")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("function, words", [
    (call_with_numel_by_rank, ["rank 0 called all_reduce numel=10", "numel=11"]),
    (call_with_dtype_by_rank, ["dtype=float32", "dtype=float64"]),
    (call_with_root_by_rank, ["root=0", "root=1"]),
    (call_unknown_algorithm, ["unknown algorithm 'butterfly': choose from auto, ring"]),
])
def test_mismatch_raises_on_every_rank_naming_both_sides(function, words):
    results = run_world_collecting_errors(function, 3, timeout=90)
    for rank, (status, message) in enumerate(results):
        assert status == "raised", f"rank {rank} did not raise"
        for word in words:
            assert word in message, message


def die_before_all_reduce(comm):
    if comm.rank == 1:
        os._exit(3)  # a crashed rank: no goodbye
    started = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(1 << 16), algorithm="ring", check=False)
    except Exception as error:
        return ("raised", f"{type(error).__name__}: {error}", time.monotonic() - started)
    return ("returned", "", time.monotonic() - started)


@pytest.mark.timeout(120)
def test_dead_peer_fails_within_the_timeout():
    results = run_world(die_before_all_reduce, 3, timeout=90, init_timeout=10, may_die=(1,))
    for rank in (0, 2):
        status, message, seconds = results[rank]
        assert status == "raised", f"rank {rank} did not notice its peer died"
        assert "PeerError" in message and "rank" in message, message
        assert seconds < 15, f"rank {rank} took {seconds:.1f} s"


@pytest.mark.parametrize("tensor, error, words", [
    (torch.eye(3).to_sparse(), TypeError, "dense tensors only"),
    (torch.ones(4, 4).t(), ValueError, "contiguous"),
    (torch.ones(4, dtype=torch.complex64), TypeError, "dtype"),
])
def test_a_tensor_no_collective_can_move_is_refused_before_anything_is_sent(tensor, error,
                                                                           words):
    # checked in the caller, before any communicator is needed
    with pytest.raises(error, match=words):
        collectives.all_reduce(tensor)
