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


def call_with_op_by_rank(comm):  # the same messages: the exchange itself completes
    collectives.all_reduce(torch.ones(1000), op="sum" if comm.rank == 0 else "max",
                           algorithm="ring")


def call_with_collective_by_rank(comm):  # messages that never come: a stall
    if comm.rank == 0:
        collectives.broadcast(torch.ones(1000), src=0, algorithm="tree")
    else:
        collectives.all_reduce(torch.ones(1000), algorithm="ring")


def call_with_collective_by_rank_each_its_algorithm(comm):  # native against the board's
    if comm.rank == 0:
        collectives.broadcast(torch.ones(1000), src=0, algorithm="native")
    else:
        collectives.all_reduce(torch.ones(1000))


def call_all_to_all_against_all_reduce(comm):
    if comm.rank == 0:
        collectives.all_to_all([torch.zeros(10) for _ in range(comm.world_size)],
                               [torch.ones(10) for _ in range(comm.world_size)])
    else:
        collectives.all_reduce(torch.ones(1000), algorithm="ring")


def call_all_to_all_with_dtype_by_rank(comm):
    dtype = torch.float32 if comm.rank == 0 else torch.float64
    collectives.all_to_all([torch.zeros(10, dtype=dtype) for _ in range(comm.world_size)],
                           [torch.ones(10, dtype=dtype) for _ in range(comm.world_size)])


# shm "on": the whole world on one host, checked on the call board (no message of its
# own; a disagreement is caught during or after the exchange); "off": the handshake.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["on", "off"])
@pytest.mark.parametrize("function, words", [
    (call_with_numel_by_rank, ["rank 0 called all_reduce numel=10", "numel=11"]),
    (call_with_dtype_by_rank, ["dtype=float32", "dtype=float64"]),
    (call_with_root_by_rank, ["root=0", "root=1"]),
    (call_unknown_algorithm, ["unknown algorithm 'butterfly': choose from auto, ring"]),
    (call_with_op_by_rank, ["rank 0 called all_reduce", "op=sum", "op=max"]),
    (call_with_collective_by_rank, ["rank 0 called broadcast", "rank 1 called all_reduce"]),
    (call_with_collective_by_rank_each_its_algorithm,
     ["rank 0 called broadcast", "algorithm=native", "rank 1 called all_reduce"]),
    (call_all_to_all_against_all_reduce, ["rank 0 called all_to_all", "rank 1 called all_reduce"]),
    (call_all_to_all_with_dtype_by_rank, ["called all_to_all dtype=float32", "dtype=float64"]),
])
def test_mismatch_raises_on_every_rank_naming_both_sides(function, words, shm):
    results = run_world_collecting_errors(function, 3, timeout=90, shm=shm)
    messages = set()
    for rank, (status, message) in enumerate(results):
        assert status == "raised", f"rank {rank} did not raise"
        for word in words:
            assert word in message, message
        messages.add(message.split("ranks disagree")[-1])
    assert len(messages) == 1, messages  # every rank names the same two calls


def count_messages_of_checked_and_unchecked_calls(comm):
    sent = []
    for check in (True, False):
        before = comm.traffic.snapshot().messages_sent
        collectives.all_reduce(torch.ones(1 << 12), algorithm="ring", check=check)
        sent.append(comm.traffic.snapshot().messages_sent - before)
    return sent


@pytest.mark.timeout(120)
def test_a_checked_call_on_one_host_sends_no_message_of_its_own():
    on_board = run_world(count_messages_of_checked_and_unchecked_calls, 3, shm="on")
    assert all(checked == unchecked > 0 for checked, unchecked in on_board), on_board
    # without shared memory the check is a handshake: messages of its own
    handshake = run_world(count_messages_of_checked_and_unchecked_calls, 3, shm="off")
    assert all(checked > unchecked for checked, unchecked in handshake), handshake


def disagree_then_call_again(comm):
    try:
        call_with_op_by_rank(comm)
    except RuntimeError:
        pass
    refusals = []
    for call in (lambda: collectives.all_reduce(torch.ones(4)),
                 lambda: collectives.all_reduce(torch.ones(4), check=False),
                 lambda: collectives.all_to_all([torch.ones(1)] * 3, [torch.ones(1)] * 3),
                 lambda: comm.send(torch.ones(1), (comm.rank + 1) % 3)):
        try:
            call()
            refusals.append("returned")
        except RuntimeError as error:  # PeerError is one
            refusals.append(str(error))
    return refusals


@pytest.mark.timeout(120)
def test_after_a_disagreement_caught_on_the_board_the_communicator_refuses_calls():
    # the exchange ran before the disagreement was seen: messages of it may be left
    # half read, so every later call is refused, checked or not, collective or not
    for refusals in run_world(disagree_then_call_again, 3, shm="on"):
        for message in refusals:
            assert "refused" in message and "op=sum" in message, message


def die_before_all_reduce(comm, algorithm="ring", check=False):
    if comm.rank == 1:
        os._exit(3)  # a crashed rank: no goodbye
    started = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(1 << 16), algorithm=algorithm, check=check)
    except Exception as error:
        return ("raised", f"{type(error).__name__}: {error}", time.monotonic() - started)
    return ("returned", "", time.monotonic() - started)


# checked on one host: the ring is checked on the call board after it ran, the
# backend's own before it runs (waiting there for the dead rank's entry)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm, check", [("ring", False), ("ring", True),
                                              ("native", True)])
def test_dead_peer_fails_within_the_timeout(algorithm, check):
    results = run_world(die_before_all_reduce, 3, (algorithm, check), timeout=90,
                        init_timeout=10, may_die=(1,))
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
