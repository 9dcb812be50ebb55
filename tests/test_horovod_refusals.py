"""A Horovod call refused on one rank alone fails on every rank, and the ranks stay in step.

Some arguments of a Horovod call are each rank's own, and no rank sees another's:
alltoall's splits, a tensor's dtype. A rank whose own arguments are wrong refuses the
call in its caller, while its peers' calls, right on their side, are already in the
engine. The refusal still takes the call's name (its number, for an unnamed one) and
is negotiated like any call: every rank's call under that name fails with one line
naming the rank and its reason, and the next calls pair as before, so a program that
skips a failed call on every rank goes on with the right data. (Once, the refusing
rank's next call took the refused one's number and paired with its peers' refused
call: they got the rows of a later call, and every later unnamed call was one off.)

The rank bodies are here, at module level, so that the spawned ranks can import them.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_world


def _outcome(call):
    """("ok", what call() returned, as a list) or (the error's type, its message)."""
    import collectives.horovod as hvd
    try:
        return ("ok", call().tolist())
    except (hvd.HorovodInternalError, ValueError, TypeError) as error:
        return (type(error).__name__, str(error))


def _unnamed_sums(size):
    """Three unnamed async sums: any shift in pairing shows."""
    import collectives.horovod as hvd
    handles = [hvd.allreduce_async(torch.tensor([value]), op=hvd.Sum)
               for value in (1.0, 100.0, 0.5)]
    return [hvd.synchronize(h).item() for h in handles]


def check_a_refusal_on_one_rank(comm):
    """Rank 1 alone refuses a call that its peers make rightly (bad alltoall splits,
    unnamed, named and async; a bool tensor in an allreduce), then every rank makes the
    call again, rightly (rank 1's, under the same name, waits until the table has
    settled its refusal). Returns {step: this rank's outcome}."""
    import collectives.horovod as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    good = [1] * size
    mine = [size + 1] + [0] * (size - 1) if rank == 1 else good  # more rows than it has

    def rows(attempt):  # one row for each rank: 10 * attempt + this rank
        return torch.full((size,), float(10 * attempt + rank))

    report = {}
    report["unnamed"] = _outcome(lambda: hvd.alltoall(rows(1), splits=mine)[0])
    report["unnamed again"] = _outcome(lambda: hvd.alltoall(rows(2), splits=good)[0])
    report["sums after unnamed"] = _unnamed_sums(size)

    report["named"] = _outcome(lambda: hvd.alltoall(rows(3), splits=mine, name="rows")[0])
    report["named again"] = _outcome(lambda: hvd.alltoall(rows(4), splits=good,
                                                          name="rows")[0])
    report["sums after named"] = _unnamed_sums(size)

    def started_then_synchronized():
        handle = hvd.alltoall_async(rows(5), splits=mine)
        return hvd.synchronize(handle)[0]
    report["async"] = _outcome(started_then_synchronized)
    report["async again"] = _outcome(lambda: hvd.alltoall(rows(6), splits=good)[0])

    mask = torch.ones(3, dtype=torch.bool) if rank == 1 else torch.ones(3)
    report["dtype"] = _outcome(lambda: hvd.allreduce(mask, op=hvd.Sum))
    report["dtype again"] = _outcome(lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum))
    report["sums at the end"] = _unnamed_sums(size)
    from collectives.horovod.engine import forget_engines
    forget_engines()
    return report


def test_the_table_fails_a_name_one_rank_refused_on_every_rank():
    """Ranks 0 and 2 submit a right alltoall, rank 1 its refusal: the name waits for
    every rank, then fails on all three with one line naming rank 1 and its reason."""
    from collectives.horovod.negotiation import Message, Meta, Table
    name, table = "alltoall.noname.1", Table(3)
    right = Meta.of("alltoall", [torch.ones(3)], splits=(1, 1, 1))
    why = "alltoall: splits [4, 0, 0] must hold 3 non-negative counts"
    refused = Meta("alltoall", refused=why)
    first = table.apply([Message([(name, right)]), Message([(name, refused)]), Message()],
                        0.0)
    assert not first.ready and not first.errors, first
    then = table.apply([Message(), Message(), Message([(name, right)])], 0.0)
    assert not then.ready and len(then.errors) == 1, then
    failed, ranks, line = then.errors[0]
    assert failed == name and ranks == {0, 1, 2}, then.errors
    assert "refused on rank 1" in line and why in line and "\n" not in line, line
    assert not table.entries


@pytest.mark.timeout(90)
def test_a_call_refused_on_one_rank_fails_everywhere_and_the_next_pairs(monkeypatch):
    """On 3 ranks, rank 1 alone refuses: its peers' calls fail with a line naming it,
    and the calls made again right after give every rank the right rows."""
    # a call that never pairs fails within the test's time instead of after 300 s
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "10")
    world_size = 3
    reports = run_world(check_a_refusal_on_one_rank, world_size, timeout=70)
    sums = [1.0 * world_size, 100.0 * world_size, 0.5 * world_size]
    for step, attempt, reason in (("unnamed", 2, "splits"), ("named", 4, "splits"),
                                  ("async", 6, "splits"), ("dtype", None, "torch.bool")):
        for rank, report in enumerate(reports):
            kind, text = report[step]
            # refused on every rank, in one line; the peers' line names rank 1 and why
            assert kind != "ok", f"rank {rank}, {step}: not refused, got {text}"
            assert "\n" not in text and reason in text, f"rank {rank}, {step}: {text!r}"
            if rank != 1:
                assert kind == "HorovodInternalError" and "refused on rank 1" in text, \
                    f"rank {rank}, {step}: {kind}: {text}"
            # the next call pairs with the peers' next call, not with a refused one
            expected = ([float(10 * attempt + r) for r in range(world_size)]
                        if attempt is not None else [float(world_size)] * 3)
            assert report[f"{step} again"] == ("ok", expected), \
                f"rank {rank}, {step} again: {report[f'{step} again']}"
    for report in reports:
        for step in ("sums after unnamed", "sums after named", "sums at the end"):
            assert report[step] == sums, f"{step}: {report[step]}"
