"""The same seeded program of torch.distributed calls on gloo and on the "collectives"
backend, every result checked against the true value; ours must never do worse.

    python tests/differential.py --seeds 50 --world-sizes 2,3 [--calls 150]

A program (`program(seed, world_size, calls)`) is drawn from the seed alone, so every
rank draws the same one: every collective (all_reduce, reduce, broadcast, all_gather
in both forms, reduce_scatter in both forms, all_to_all in both forms, gather,
scatter, barrier), every dtype and op (bool, complex, int16, integer avg, premul_sum,
NaN under max and min), 0-dim, empty, strided, transposed and size-1 odd-strided
tensors, tensors of one count in a shape of each rank's own ((3, 2), (6,), (3, 2, 1)),
on the whole world or a subgroup, some issued async and waited in another order on
each rank, and arguments gloo refuses, on every rank alike. Each rank also builds
every other rank's inputs from the seed, so it knows the true answer of each call.

Then a few calls refused on one rank alone (`lone_calls`: a float bitwise op, a short
list, outputs of another size or dtype, splits that do not add up, a root's list, a
scatter output whose elements share memory), each on a group of its own with a short
timeout, issued together: gloo's other ranks wait out that timeout, all at once.

Each call ends, on each rank and backend, as one of (best first):
    right     the true value (floats within their dtype's rounding)
    returned  no error, where this rank receives nothing (a barrier, a reduce's or a
              gather's other ranks), and the group still works afterwards
    refused   an error, and the group still does an all-reduce right afterwards
    wrong     a value that is not the true one, with no error
    broken    an error, or nothing received, after which the group no longer works
              (or a wait timed out)
(Before a group is tried, every rank's waits are over: a rank that refused alone never
sends a message that a peer's call, still waiting, could take for its own.)
Ours is worse when it ends lower than gloo on some rank, for some call. The run
prints, per world size, how many calls each backend got right, returned, refused, got
wrong or broke on (the program's calls, then those refused on one rank alone), and how
often ours was better and worse than gloo; the exit status is 1 if ours was ever
worse. tests/test_differential.py runs a few seeds of it.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

RANK_OF = {"right": 3, "returned": 3, "refused": 2, "wrong": 1, "broken": 0}
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor", "premul_sum")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "barrier")
LAYOUTS = ("contiguous", "contiguous", "transposed", "strided", "odd1", "zerodim", "empty")
MISTAKES = ("none",) * 20 + ("short_list", "wrong_dtype", "float_bitwise", "wrong_size",
                             "bad_splits", "shared_output")
# What a call refused on one rank alone can be: (collective, mistake, which rank makes
# it: any, the root, or another). Their dtype is int32 and their op a sum, which every
# rank but that one may issue.
LONE_KINDS = (("all_reduce", "float_bitwise", "any"), ("reduce", "float_bitwise", "any"),
              ("reduce_scatter_tensor", "float_bitwise", "any"),
              ("all_gather", "short_list", "any"),
              ("all_gather", "wrong_dtype", "any"),  # refused by torch, before the backend
              ("all_gather_into_tensor", "wrong_size", "any"),
              ("reduce_scatter", "short_list", "any"), ("all_to_all", "wrong_size", "any"),
              ("all_to_all_single", "bad_splits", "any"), ("gather", "short_list", "root"),
              ("scatter", "short_list", "root"), ("scatter", "shared_output", "other"))


class Call(NamedTuple):
    index: int
    collective: str
    dtype: torch.dtype
    op: str
    layout: str
    rows: int            # the first dimension (or the length) where it has one
    root: int            # in the group's ranks
    subgroup: bool       # on ranks 0..n-2 only (n > 2), else the whole world
    asynchronous: bool   # issued with async_op=True, waited later (batch of these)
    mistake: str         # an argument gloo refuses, or "none"
    reshaped: bool = False  # each rank's tensors in a shape of its own (one count)
    lone: int = -1       # the one rank that makes the mistake (-1: every rank)


def program(seed: int, world_size: int, calls: int) -> List[Call]:
    """The calls of one program: the same on every rank (drawn from the seed only)."""
    draw = random.Random(seed * 1000 + world_size)
    out = []
    for index in range(calls):
        collective = draw.choice(COLLECTIVES)
        subgroup = world_size > 2 and draw.random() < 0.2
        size = world_size - 1 if subgroup else world_size
        dtype, op, layout = draw.choice(DTYPES), draw.choice(OPS), draw.choice(LAYOUTS)
        rows, root = draw.randint(1, 3), draw.randrange(size)
        asynchronous, mistake = draw.random() < 0.25, draw.choice(MISTAKES)
        reshaped = layout == "contiguous" and draw.random() < 0.4
        out.append(Call(index, collective, dtype, op, layout, rows, root, subgroup,
                        asynchronous, mistake, reshaped))
    return out


def lone_calls(seed: int, world_size: int, count: int, first_index: int) -> List[Call]:
    """`count` calls each refused on one rank alone (LONE_KINDS), drawn from the seed."""
    draw = random.Random(seed * 7 + world_size * 1000 + 1)
    out = []
    for index in range(first_index, first_index + count):
        collective, mistake, who = draw.choice(LONE_KINDS)
        root = draw.randrange(world_size)
        lone = {"root": root, "other": (root + 1 + draw.randrange(world_size - 1))
                % world_size}.get(who, draw.randrange(world_size))
        out.append(Call(index, collective, torch.int32, "sum", "contiguous",
                        draw.randint(1, 3), root, False, True, mistake, False, lone))
    return out


# --- inputs every rank can build for every rank -------------------------------------------
def values(call: Call, rank: int, shape, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s values for `call`, contiguous: small integers (so every sum is exact
    in every dtype, and a product of 3 ranks fits int8), NaN now and then under max/min."""
    g = torch.Generator().manual_seed(call.index * 7919 + rank * 104729 + salt)
    dtype, op = call.dtype, call.op
    lo, hi = (1, 3) if op == "product" else (0, 30) if op in ("band", "bor", "bxor") \
        else (-9, 9)
    if dtype == torch.uint8 or dtype == torch.bool:
        lo = max(lo, 0)
    raw = torch.randint(lo, hi + 1, tuple(shape), generator=g).to(torch.float64)
    if dtype == torch.bool:
        return raw.remainder(2).bool()
    if dtype.is_complex:
        imaginary = torch.randint(lo, hi + 1, tuple(shape), generator=g).to(torch.float64)
        return torch.complex(raw, imaginary).to(dtype)
    if dtype.is_floating_point and op in ("max", "min") and raw.numel() and \
            torch.rand((), generator=g).item() < 0.2:
        raw.view(-1)[0] = float("nan")
    return raw.to(dtype)


def shape_of(call: Call, rows: Optional[int] = None):
    """The tensor's shape for its layout."""
    rows = call.rows if rows is None else rows
    return {"contiguous": (rows, 2), "transposed": (rows, 3), "strided": (rows * 2,),
            "odd1": (1,), "zerodim": (), "empty": (0, 2)}[call.layout]


def laid_out(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in the layout: transposed views, every other element, a size-1
    dimension with stride 2."""
    if layout == "transposed" and tensor.dim() == 2:
        return tensor.t().contiguous().t()
    if layout in ("strided", "odd1") and tensor.dim() == 1:
        spaced = torch.zeros(tensor.shape[0] * 2, dtype=tensor.dtype)
        spaced[::2] = tensor
        return spaced[::2]
    return tensor


def wide(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.long()
    if t.is_complex():
        return t.to(torch.complex128)
    return t.double() if t.is_floating_point() else t.long()


PREMUL = 2.0


def reduced(tensors: List[torch.Tensor], op: str) -> torch.Tensor:
    """The true reduction (bool: sum and max are "or", product and min "and"; integer
    avg rounds toward zero, as NCCL's: gloo has none)."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        op = {"sum": "max", "product": "min"}.get(op, op)
    ts = [wide(t) for t in tensors]
    if op in ("sum", "avg", "premul_sum"):
        out = sum(ts[1:], ts[0].clone())
        if op == "premul_sum":
            out = out * PREMUL
        if op == "avg":
            out = out / len(ts) if (out.is_floating_point() or out.is_complex()) \
                else torch.div(out, len(ts), rounding_mode="trunc")
    else:
        fold = {"max": torch.maximum, "min": torch.minimum, "product": torch.mul,
                "band": torch.bitwise_and, "bor": torch.bitwise_or,
                "bxor": torch.bitwise_xor}[op]
        out = ts[0]
        for t in ts[1:]:
            out = fold(out, t)
    return out.to(dtype) if dtype != torch.bool else out.bool()


def close(got, want) -> bool:
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and \
            all(close(a, b) for a, b in zip(got, want))
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.is_floating_point() or got.is_complex():
        tolerance = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(got.dtype, 1e-6)
        return torch.allclose(wide(got), wide(want), rtol=tolerance, atol=tolerance,
                              equal_nan=True)
    return torch.equal(got, want)


# --- one call on one backend -----------------------------------------------------------
def torch_op(op: str):
    if op == "premul_sum":
        return dist._make_nccl_premul_sum(PREMUL)
    return getattr(dist.ReduceOp, op.upper())


class Issued(NamedTuple):
    work: object          # the Work (async), or None
    result: object        # what to compare once done (filled in place)
    truth: object         # the true value, None: nothing to compare on this rank


@dataclass
class Prepared:
    """One rank's side of a call about to be issued: its tensor, every rank's, and its
    mistake's changes (an op, a short list, a dtype of the wrong kind), where this rank
    makes one."""
    call: Call
    group: object
    rank: int
    size: int
    shape: tuple
    mine: torch.Tensor
    everyone: List[torch.Tensor]
    op: str
    mistake: str         # this rank's: call.mistake, or "none" beside a lone mistake
    short: int
    odd_dtype: torch.dtype

    def root(self) -> int:
        return dist.get_global_rank(self.group, self.call.root)

    def zeros(self, shape, dtype=None) -> torch.Tensor:
        return laid_out(torch.zeros(shape, dtype=dtype or self.call.dtype), self.call.layout)

    def wrong_or_own_dtype(self) -> torch.dtype:
        return self.odd_dtype if self.mistake == "wrong_dtype" else self.call.dtype

    def output_rows(self) -> int:
        """The rows of an output: one too many for the mistake "wrong_size"."""
        return self.call.rows + (self.mistake == "wrong_size")

    def own(self, tensor):
        """The tensor (or each of a list) in this rank's own shape, where the call is
        reshaped: (r, 2) stays, becomes (2r,) or (r, 2, 1) by rank (dim 0 kept where it
        is cut, by all_to_all_single); the count is every rank's."""
        if isinstance(tensor, (list, tuple)):
            return [self.own(t) for t in tensor]
        if tensor is None or not self.call.reshaped or tensor.dim() == 0:
            return tensor
        return [tensor, tensor.reshape(-1), tensor.unsqueeze(-1)][self.rank % 3]


def issue(call: Call, group, rank: int, size: int) -> Issued:
    """Make this rank's tensors for `call` and issue it on `group` (rank/size within the
    group); raise whatever the backend raises when it is called."""
    shape = shape_of(call)
    mine = laid_out(values(call, rank, shape), call.layout)
    everyone = [values(call, r, shape) for r in range(size)]
    mistake = call.mistake if call.lone in (-1, rank) else "none"
    op = call.op
    if mistake == "float_bitwise" and call.collective in (
            "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        mine, everyone = mine.float(), [e.float() for e in everyone]
        op = "band"
    # (a list the root alone holds, too short, is refused there alone, by gloo too, and
    # gloo's others wait out the timeout: drawn only among the lone calls)
    short = 1 if mistake == "short_list" and (call.lone >= 0 or call.collective not in (
        "gather", "scatter")) else 0
    odd_dtype = torch.int64 if call.dtype != torch.int64 else torch.float32
    side = Prepared(call, group, rank, size, shape, mine, everyone, op, mistake, short,
                    odd_dtype)
    return _ISSUERS.get(call.collective, _issue_barrier)(side)


def _like(truth: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The true value in the output's shape, where it has the output's count (else as
    it is: an output of the wrong size can only be wrong)."""
    return truth.reshape(out.shape) if truth.numel() == out.numel() else truth


def _issue_all_reduce(p: Prepared) -> Issued:
    mine = p.own(p.mine)
    work = dist.all_reduce(mine, torch_op(p.op), group=p.group, async_op=p.call.asynchronous)
    return Issued(work, mine, p.own(reduced(p.everyone, p.op)))


def _issue_reduce(p: Prepared) -> Issued:
    mine = p.own(p.mine)
    work = dist.reduce(mine, p.root(), torch_op(p.op), group=p.group,
                       async_op=p.call.asynchronous)
    return Issued(work, mine, p.own(reduced(p.everyone, p.op)) if p.rank == p.call.root
                  else None)


def _issue_broadcast(p: Prepared) -> Issued:
    mine = p.own(p.mine)
    work = dist.broadcast(mine, p.root(), group=p.group, async_op=p.call.asynchronous)
    return Issued(work, mine, p.own(p.everyone[p.call.root]))


def _issue_all_gather(p: Prepared) -> Issued:
    outputs = p.own([p.zeros(shape_of(p.call, p.output_rows()), p.wrong_or_own_dtype())
                     for _ in range(p.size - p.short)])
    work = dist.all_gather(outputs, p.own(p.mine), group=p.group,
                           async_op=p.call.asynchronous)
    return Issued(work, outputs, p.own(p.everyone))


def _issue_all_gather_into_tensor(p: Prepared) -> Issued:
    shape = shape_of(p.call, p.output_rows())
    out = p.own(p.zeros((p.size * shape[0],) + tuple(shape[1:]) if shape else (p.size,),
                        p.wrong_or_own_dtype()))
    work = dist.all_gather_into_tensor(out, p.own(p.mine), group=p.group,
                                       async_op=p.call.asynchronous)
    return Issued(work, out, _like(torch.stack(p.everyone), out))


def _issue_reduce_scatter(p: Prepared) -> Issued:
    call = p.call
    inputs = p.own([laid_out(values(call, p.rank, p.shape, salt=q), call.layout)
                    for q in range(p.size - p.short)])
    out = p.own(p.zeros(p.shape, inputs[0].dtype if inputs else call.dtype))
    if p.mistake == "float_bitwise":
        inputs, out = [i.float() for i in inputs], out.float()
    work = dist.reduce_scatter(out, inputs, torch_op(p.op), group=p.group,
                               async_op=call.asynchronous)
    truth = reduced([values(call, r, p.shape, salt=p.rank) for r in range(p.size)], p.op)
    return Issued(work, out, p.own(truth.float() if p.mistake == "float_bitwise" else truth))


def _issue_reduce_scatter_tensor(p: Prepared) -> Issued:
    call, shape = p.call, p.shape
    rows = (shape[0] if shape else 1)
    big = (p.size * rows,) + tuple(shape[1:])
    full = [values(call, r, big) for r in range(p.size)]
    if p.mistake == "float_bitwise":
        full = [f.float() for f in full]
    mine = p.own(laid_out(full[p.rank], call.layout))
    out_shape = shape_of(call, p.output_rows())
    out = p.own(p.zeros(out_shape if out_shape else (1,), mine.dtype))
    work = dist.reduce_scatter_tensor(out, mine, torch_op(p.op), group=p.group,
                                      async_op=call.asynchronous)
    return Issued(work, out, _like(reduced(full, p.op)[p.rank * rows:(p.rank + 1) * rows],
                                   out))


def _issue_all_to_all(p: Prepared) -> Issued:
    call = p.call
    pieces = p.own([laid_out(values(call, p.rank, p.shape, salt=q), call.layout)
                    for q in range(p.size)])
    outputs = p.own([p.zeros(shape_of(call, p.output_rows()), p.wrong_or_own_dtype())
                     for _ in range(p.size - p.short)])
    work = dist.all_to_all(outputs, pieces, group=p.group, async_op=call.asynchronous)
    return Issued(work, outputs, p.own([values(call, q, p.shape, salt=p.rank)
                                        for q in range(p.size)]))


def _issue_all_to_all_single(p: Prepared) -> Issued:
    call, shape = p.call, p.shape
    rows = p.size * (shape[0] if shape else 1)
    big = (rows,) + tuple(shape[1:]) if shape else ()
    full = [values(call, r, big) for r in range(p.size)]
    mine = p.own(laid_out(full[p.rank], call.layout))
    out = p.own(p.zeros(big, p.wrong_or_own_dtype()))
    splits = {}
    if p.mistake == "bad_splits" and mine.dim():  # one row too many for the first rank
        share = mine.shape[0] // p.size
        splits = {"output_split_sizes": [share] * p.size,
                  "input_split_sizes": [share + 1] + [share] * (p.size - 1)}
    work = dist.all_to_all_single(out, mine, group=p.group, async_op=call.asynchronous,
                                  **splits)
    share = rows // p.size if rows else 0
    truth = torch.cat([full[q][p.rank * share:(p.rank + 1) * share] for q in range(p.size)]) \
        if big else None
    return Issued(work, out, p.own(truth))


def _issue_gather(p: Prepared) -> Issued:
    at_root = p.rank == p.call.root
    outputs = p.own([p.zeros(p.shape) for _ in range(p.size - p.short)]) if at_root else None
    work = dist.gather(p.own(p.mine), outputs, p.root(), group=p.group,
                       async_op=p.call.asynchronous)
    return Issued(work, outputs, p.own(p.everyone) if at_root else None)


def _issue_scatter(p: Prepared) -> Issued:
    call = p.call
    out = p.own(p.zeros(p.shape))
    if p.mistake == "shared_output" and out.dim():  # one place for all its elements
        # (in memory room enough for all of them: gloo writes them all, one after
        # another, and past a smaller allocation it would corrupt the heap)
        out = torch.zeros(out.numel(), dtype=out.dtype).as_strided(out.shape,
                                                                   (0,) * out.dim())
    inputs = p.own([laid_out(values(call, call.root, p.shape, salt=q), call.layout)
                    for q in range(p.size - p.short)]) if p.rank == call.root else None
    work = dist.scatter(out, inputs, p.root(), group=p.group, async_op=call.asynchronous)
    return Issued(work, out, p.own(values(call, call.root, p.shape, salt=p.rank)))


def _issue_barrier(p: Prepared) -> Issued:
    return Issued(dist.barrier(group=p.group, async_op=p.call.asynchronous), None, None)


_ISSUERS = {
    "all_reduce": _issue_all_reduce, "reduce": _issue_reduce, "broadcast": _issue_broadcast,
    "all_gather": _issue_all_gather, "all_gather_into_tensor": _issue_all_gather_into_tensor,
    "reduce_scatter": _issue_reduce_scatter,
    "reduce_scatter_tensor": _issue_reduce_scatter_tensor,
    "all_to_all": _issue_all_to_all, "all_to_all_single": _issue_all_to_all_single,
    "gather": _issue_gather, "scatter": _issue_scatter,
}


PROBE = 1024  # elements: more than any message of a call here, so that a message left
# by a call refused on one rank is never larger than what the probe is waiting for (gloo
# aborts the process when a message is larger than the buffer that receives it)


def works_all(groups, rank: int, sizes) -> List[bool]:
    """Whether each group still does an all-reduce right (all of them tried at once, so
    that groups which wait out their timeout wait together)."""
    probes = []
    for group in groups:
        t = torch.full((PROBE,), float(rank + 1))
        try:
            probes.append((t, dist.all_reduce(t, group=group, async_op=True)))
        except Exception:  # noqa: BLE001 -- the answer is the outcome
            probes.append((t, None))
    answers = []
    for (t, work), size in zip(probes, sizes):
        try:
            answers.append(work is not None and work.wait() is not False
                           and bool((t == size * (size + 1) / 2).all()))
        except Exception:  # noqa: BLE001
            answers.append(False)
    return answers


class Groups:
    """The groups one backend runs the program on: the world, and ranks 0..n-2."""

    def __init__(self, backend: str, world_size: int, timeout: timedelta):
        self.backend, self.world_size, self.timeout = backend, world_size, timeout
        self.make()

    def make(self):
        self.world = dist.new_group(backend=self.backend, timeout=self.timeout)
        self.sub = dist.new_group(list(range(self.world_size - 1)), backend=self.backend,
                                  timeout=self.timeout) if self.world_size > 2 else None

    def of(self, call: Call):
        return self.sub if call.subgroup else self.world


def _issue_all(batch: List[Call], group_of, rank: int, world_size: int, results: dict):
    """Issue each call of the batch on its group: {index: Issued}; a call refused when
    called, or one this rank is not in, goes to `results` at once."""
    pending = {}
    for call in batch:
        if call.subgroup and rank == world_size - 1:
            results[call.index] = "-"
            continue
        size = world_size - 1 if call.subgroup else world_size
        try:
            pending[call.index] = issue(call, group_of(call), rank, size)
        except Exception:  # noqa: BLE001 -- refused when called
            results[call.index] = "refused"
    return pending


def _wait_all(pending: dict, order: random.Random, results: dict) -> None:
    """Wait for every issued call, in this rank's own order, and judge each."""
    waiting = list(pending)
    order.shuffle(waiting)
    for index in waiting:
        issued = pending[index]
        try:
            if issued.work is not None:
                issued.work.wait()
        except Exception:  # noqa: BLE001
            results[index] = "refused"
            continue
        if issued.truth is None:
            results[index] = "returned"
        else:
            results[index] = "right" if close(issued.result, issued.truth) else "wrong"


def _judge(comm, batch: List[Call], groups, rank: int, sizes, results: dict) -> bool:
    """Each call's outcome, "broken" where a group it used no longer works on some
    rank (decided over our own communicator, so that all ranks agree); True if so.
    Tried only once every rank's waits are over: then no call of a peer's is still
    waiting for a message."""
    from collectives import api
    comm.barrier()
    alive = all(works_all(groups, rank, sizes))
    broken = torch.tensor([0 if alive else 1])
    api.all_reduce(broken, "max", comm=comm)
    for call in batch:
        if broken.item() and results[call.index] in ("refused", "returned"):
            results[call.index] = "broken"
    return bool(broken.item())


def run_program(comm, backend: str, calls: List[Call], timeout_seconds: float) -> List[str]:
    """This rank's outcome of each call on `backend`: right, refused, wrong, broken, or
    "-" where this rank is outside the call's group."""
    rank, world_size = comm.rank, comm.world_size
    groups = Groups(backend, world_size, timedelta(seconds=timeout_seconds))
    outcomes: List[str] = []
    order = random.Random(rank * 31 + len(calls))  # each rank waits in its own order
    position = 0
    while position < len(calls):
        batch = [calls[position]]
        while batch[-1].asynchronous and position + len(batch) < len(calls) \
                and calls[position + len(batch)].asynchronous and len(batch) < 4:
            batch.append(calls[position + len(batch)])
        position += len(batch)
        results = {}
        _wait_all(_issue_all(batch, groups.of, rank, world_size, results), order, results)
        used = [call for call in batch if not (call.subgroup and rank == world_size - 1)]
        if _judge(comm, batch, [groups.of(call) for call in used], rank,
                  [world_size - 1 if call.subgroup else world_size for call in used],
                  results):
            groups.make()  # a broken one is made anew on every rank
        outcomes += [results[call.index] for call in batch]
    return outcomes


def run_lone(comm, backend: str, calls: List[Call], timeout_seconds: float) -> List[str]:
    """This rank's outcome of each call refused on one rank alone, on `backend`: each on
    a group of its own with a timeout of `timeout_seconds`, all issued at once."""
    from collectives import api
    rank, size = comm.rank, comm.world_size
    timeout = timedelta(seconds=timeout_seconds)
    groups = {call.index: dist.new_group(backend=backend, timeout=timeout) for call in calls}
    results = {}
    _wait_all(_issue_all(calls, lambda call: groups[call.index], rank, size, results),
              random.Random(rank), results)
    comm.barrier()  # (as in _judge: every rank's waits are over)
    alive = works_all([groups[call.index] for call in calls], rank, [size] * len(calls))
    broken = torch.tensor([0 if fine else 1 for fine in alive])
    api.all_reduce(broken, "max", comm=comm)
    for call, lost in zip(calls, broken.tolist()):  # each judged by its own group
        if lost and results[call.index] in ("refused", "returned"):
            results[call.index] = "broken"
    return [results[call.index] for call in calls]


def run_both(comm, seed: int, calls: int, timeout_seconds: float, lone: int = 0,
             lone_timeout: float = 2.0):
    """One program on gloo, then on ours, then its lone calls on each: (gloo's
    outcomes, ours), on this rank."""
    import warnings
    warnings.simplefilter("ignore")  # torch's deprecation of the *_tensor names
    program_calls = program(seed, comm.world_size, calls)
    refused_alone = lone_calls(seed, comm.world_size, lone, calls)
    theirs = run_program(comm, "gloo", program_calls, timeout_seconds)
    ours = run_program(comm, "collectives", program_calls, timeout_seconds)
    theirs += run_lone(comm, "gloo", refused_alone, lone_timeout)
    ours += run_lone(comm, "collectives", refused_alone, lone_timeout)
    return theirs, ours


COUNTS = ("gloo", "collectives", "gloo lone", "collectives lone")


def compare(per_rank, calls: List[Call]):
    """(counts per backend, the program's calls and the lone ones apart (COUNTS),
    better, worse: the calls where ours ended lower than gloo)."""
    counts = {name: Counter() for name in COUNTS}
    better, worse = [], []
    for index, call in enumerate(calls):
        phase = " lone" if call.lone >= 0 else ""
        for rank, (theirs, ours) in enumerate(per_rank):
            if theirs[index] == "-":
                continue
            counts["gloo" + phase][theirs[index]] += 1
            counts["collectives" + phase][ours[index]] += 1
            if RANK_OF[ours[index]] < RANK_OF[theirs[index]]:
                worse.append((call, rank, theirs[index], ours[index]))
            elif RANK_OF[ours[index]] > RANK_OF[theirs[index]]:
                better.append((call, rank, theirs[index], ours[index]))
    return counts, better, worse


def run_seeds(seeds, world_size: int, calls: int, timeout_seconds: float = 30.0,
              world_timeout: float = 600.0, lone: int = 3, lone_timeout: float = 2.0):
    """Run each seed on `world_size` spawned ranks (`calls` calls, then `lone` refused
    on one rank alone); return (counts, better, worse)."""
    from distributed import run_world
    counts = {name: Counter() for name in COUNTS}
    better, worse = [], []
    for seed in seeds:
        per_rank = run_world(run_both, world_size,
                             (seed, calls, timeout_seconds, lone, lone_timeout),
                             timeout=world_timeout)
        c, b, w = compare(per_rank, program(seed, world_size, calls)
                          + lone_calls(seed, world_size, lone, calls))
        for name in counts:
            counts[name].update(c[name])
        better += b
        worse += [(seed,) + item for item in w]
    return counts, better, worse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10, help="how many seeds (0, 1, ...)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--world-sizes", default="2,3")
    p.add_argument("--calls", type=int, default=150, help="calls per program")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="each group's timeout, seconds: a call that waits longer is broken")
    p.add_argument("--lone-calls", type=int, default=3,
                   help="calls refused on one rank alone, after each program")
    p.add_argument("--lone-timeout", type=float, default=2.0,
                   help="the timeout of their groups, seconds")
    args = p.parse_args(argv)
    failed = False
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        started = time.monotonic()
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        counts, better, worse = run_seeds(seeds, world_size, args.calls, args.timeout,
                                          lone=args.lone_calls,
                                          lone_timeout=args.lone_timeout)
        total = sum(counts["gloo"].values()) + sum(counts["gloo lone"].values())
        print(f"{world_size} ranks, {len(seeds)} seeds x {args.calls} + {args.lone_calls} "
              f"calls ({total} calls over the ranks), {time.monotonic() - started:.0f} s")
        for name in COUNTS:
            print(f"  {name:16s} " + "  ".join(f"{k} {counts[name][k]}" for k in RANK_OF))
        print(f"  ours better than gloo: {len(better)}   ours worse: {len(worse)}")
        for seed, call, rank, theirs, ours in worse[:20]:
            print(f"    seed {seed} rank {rank}: gloo {theirs}, ours {ours}: {call}")
        failed |= bool(worse)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
