"""The same seeded program of torch.distributed calls on gloo and on the "collectives"
backend, every result checked against the true value; ours must never do worse.

    python tests/differential.py --seeds 50 --world-sizes 2,3 [--calls 150]

A program (`program(seed, world_size, calls)`) is drawn from the seed alone, so every
rank draws the same one: every collective (all_reduce, reduce, broadcast, all_gather
in both forms, reduce_scatter in both forms, all_to_all in both forms, gather,
scatter, barrier), every dtype and op (bool, complex, int16, integer avg, premul_sum,
NaN under max and min), 0-dim, empty, strided, transposed and size-1 odd-strided
tensors, on the whole world or a subgroup, some issued async and waited in another
order on each rank, and a few arguments gloo refuses. Each rank also builds every
other rank's inputs from the seed, so it knows the true answer of each call.

Each call ends, on each rank and backend, as one of (best first):
    right     the true value (floats within their dtype's rounding)
    refused   an error, and the group still does an all-reduce right afterwards
    wrong     a value that is not the true one, with no error
    broken    an error, after which the group no longer works (or a wait timed out)
Ours is worse when it ends lower than gloo on some rank, for some call. The run
prints, per world size, how many calls each backend got right, refused, got wrong or
broke on, and how often ours was better and worse than gloo; the exit status is 1 if
ours was ever worse. tests/test_differential.py runs a few seeds of it.
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

RANK_OF = {"right": 3, "refused": 2, "wrong": 1, "broken": 0}
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor", "premul_sum")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "barrier")
LAYOUTS = ("contiguous", "contiguous", "transposed", "strided", "odd1", "zerodim", "empty")
MISTAKES = ("none",) * 16 + ("short_list", "wrong_dtype", "float_bitwise")


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


def program(seed: int, world_size: int, calls: int) -> List[Call]:
    """The calls of one program: the same on every rank (drawn from the seed only)."""
    draw = random.Random(seed * 1000 + world_size)
    out = []
    for index in range(calls):
        collective = draw.choice(COLLECTIVES)
        subgroup = world_size > 2 and draw.random() < 0.2
        size = world_size - 1 if subgroup else world_size
        out.append(Call(index, collective, draw.choice(DTYPES), draw.choice(OPS),
                        draw.choice(LAYOUTS), draw.randint(1, 3), draw.randrange(size),
                        subgroup, draw.random() < 0.25, draw.choice(MISTAKES)))
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
    avg rounds down)."""
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
                else torch.div(out, len(ts), rounding_mode="floor")
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
    """One rank's side of a call about to be issued: its tensor, every rank's, and the
    mistake's changes (an op, a short list, a dtype of the wrong kind)."""
    call: Call
    group: object
    rank: int
    size: int
    shape: tuple
    mine: torch.Tensor
    everyone: List[torch.Tensor]
    op: str
    short: int
    odd_dtype: torch.dtype

    def root(self) -> int:
        return dist.get_global_rank(self.group, self.call.root)

    def zeros(self, shape, dtype=None) -> torch.Tensor:
        return laid_out(torch.zeros(shape, dtype=dtype or self.call.dtype), self.call.layout)

    def wrong_or_own_dtype(self) -> torch.dtype:
        return self.odd_dtype if self.call.mistake == "wrong_dtype" else self.call.dtype


def issue(call: Call, group, rank: int, size: int) -> Issued:
    """Make this rank's tensors for `call` and issue it on `group` (rank/size within the
    group); raise whatever the backend raises when it is called."""
    shape = shape_of(call)
    mine = laid_out(values(call, rank, shape), call.layout)
    everyone = [values(call, r, shape) for r in range(size)]
    op = call.op
    if call.mistake == "float_bitwise" and call.collective in (
            "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        mine, everyone = mine.float(), [e.float() for e in everyone]
        op = "band"
    # (a list the root alone holds, too short, is refused there alone, by gloo too, and
    # the others wait out the timeout: not drawn)
    short = 1 if call.mistake == "short_list" and call.collective not in ("gather",
                                                                           "scatter") else 0
    odd_dtype = torch.int64 if call.dtype != torch.int64 else torch.float32
    side = Prepared(call, group, rank, size, shape, mine, everyone, op, short, odd_dtype)
    return _ISSUERS.get(call.collective, _issue_barrier)(side)


def _issue_all_reduce(p: Prepared) -> Issued:
    work = dist.all_reduce(p.mine, torch_op(p.op), group=p.group, async_op=p.call.asynchronous)
    return Issued(work, p.mine, reduced(p.everyone, p.op))


def _issue_reduce(p: Prepared) -> Issued:
    work = dist.reduce(p.mine, p.root(), torch_op(p.op), group=p.group,
                       async_op=p.call.asynchronous)
    return Issued(work, p.mine, reduced(p.everyone, p.op) if p.rank == p.call.root else None)


def _issue_broadcast(p: Prepared) -> Issued:
    work = dist.broadcast(p.mine, p.root(), group=p.group, async_op=p.call.asynchronous)
    return Issued(work, p.mine, p.everyone[p.call.root])


def _issue_all_gather(p: Prepared) -> Issued:
    outputs = [p.zeros(p.shape, p.wrong_or_own_dtype()) for _ in range(p.size - p.short)]
    work = dist.all_gather(outputs, p.mine, group=p.group, async_op=p.call.asynchronous)
    return Issued(work, outputs, p.everyone)


def _issue_all_gather_into_tensor(p: Prepared) -> Issued:
    shape = p.shape
    out = p.zeros((p.size * shape[0],) + tuple(shape[1:]) if shape else (p.size,),
                  p.wrong_or_own_dtype())
    work = dist.all_gather_into_tensor(out, p.mine, group=p.group,
                                       async_op=p.call.asynchronous)
    return Issued(work, out, torch.stack(p.everyone).view(out.shape) if shape
                  else torch.stack(p.everyone))


def _issue_reduce_scatter(p: Prepared) -> Issued:
    call = p.call
    inputs = [laid_out(values(call, p.rank, p.shape, salt=q), call.layout)
              for q in range(p.size - p.short)]
    out = p.zeros(p.shape, inputs[0].dtype if inputs else call.dtype)
    if call.mistake == "float_bitwise":
        inputs, out = [i.float() for i in inputs], out.float()
    work = dist.reduce_scatter(out, inputs, torch_op(p.op), group=p.group,
                               async_op=call.asynchronous)
    truth = reduced([values(call, r, p.shape, salt=p.rank) for r in range(p.size)], p.op)
    return Issued(work, out, truth.float() if call.mistake == "float_bitwise" else truth)


def _issue_reduce_scatter_tensor(p: Prepared) -> Issued:
    call, shape = p.call, p.shape
    rows = (shape[0] if shape else 1)
    big = (p.size * rows,) + tuple(shape[1:])
    full = [values(call, r, big) for r in range(p.size)]
    if call.mistake == "float_bitwise":
        full = [f.float() for f in full]
    mine = laid_out(full[p.rank], call.layout)
    out = p.zeros(shape if shape else (1,), mine.dtype)
    work = dist.reduce_scatter_tensor(out, mine, torch_op(p.op), group=p.group,
                                      async_op=call.asynchronous)
    return Issued(work, out, reduced(full, p.op)[p.rank * rows:(p.rank + 1) * rows]
                  .view(out.shape))


def _issue_all_to_all(p: Prepared) -> Issued:
    call = p.call
    pieces = [laid_out(values(call, p.rank, p.shape, salt=q), call.layout)
              for q in range(p.size)]
    outputs = [p.zeros(p.shape, p.wrong_or_own_dtype()) for _ in range(p.size - p.short)]
    work = dist.all_to_all(outputs, pieces, group=p.group, async_op=call.asynchronous)
    return Issued(work, outputs, [values(call, q, p.shape, salt=p.rank) for q in range(p.size)])


def _issue_all_to_all_single(p: Prepared) -> Issued:
    call, shape = p.call, p.shape
    rows = p.size * (shape[0] if shape else 1)
    big = (rows,) + tuple(shape[1:]) if shape else ()
    full = [values(call, r, big) for r in range(p.size)]
    mine = laid_out(full[p.rank], call.layout)
    out = p.zeros(big, p.wrong_or_own_dtype())
    work = dist.all_to_all_single(out, mine, group=p.group, async_op=call.asynchronous)
    share = rows // p.size if rows else 0
    truth = torch.cat([full[q][p.rank * share:(p.rank + 1) * share] for q in range(p.size)]) \
        if big else None
    return Issued(work, out, truth)


def _issue_gather(p: Prepared) -> Issued:
    at_root = p.rank == p.call.root
    outputs = [p.zeros(p.shape) for _ in range(p.size - p.short)] if at_root else None
    work = dist.gather(p.mine, outputs, p.root(), group=p.group, async_op=p.call.asynchronous)
    return Issued(work, outputs, p.everyone if at_root else None)


def _issue_scatter(p: Prepared) -> Issued:
    call = p.call
    out = p.zeros(p.shape)
    inputs = [laid_out(values(call, call.root, p.shape, salt=q), call.layout)
              for q in range(p.size - p.short)] if p.rank == call.root else None
    work = dist.scatter(out, inputs, p.root(), group=p.group, async_op=call.asynchronous)
    return Issued(work, out, values(call, call.root, p.shape, salt=p.rank))


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


def works(group, rank: int, size: int) -> bool:
    """Whether the group still does an all-reduce right."""
    t = torch.full((2,), float(rank + 1))
    try:
        dist.all_reduce(t, group=group)
    except Exception:  # noqa: BLE001 -- the answer is the outcome
        return False
    return t.tolist() == [size * (size + 1) / 2] * 2


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


def run_program(comm, backend: str, calls: List[Call], timeout_seconds: float) -> List[str]:
    """This rank's outcome of each call on `backend`: right, refused, wrong, broken, or
    "-" where this rank is outside the call's group."""
    from collectives import api
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
        pending = {}
        results = {}
        for call in batch:
            if call.subgroup and rank == world_size - 1:
                results[call.index] = "-"
                continue
            size = world_size - 1 if call.subgroup else world_size
            try:
                pending[call.index] = issue(call, groups.of(call), rank, size)
            except Exception:  # noqa: BLE001 -- refused when called
                results[call.index] = "refused"
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
            right = issued.truth is None or close(issued.result, issued.truth)
            results[index] = "right" if right else "wrong"
        # every group used by the batch must still work; a broken one is made anew on
        # every rank (decided over our own communicator, so that all ranks agree)
        alive = all([works(groups.of(call), rank, world_size - 1 if call.subgroup
                           else world_size)
                     for call in batch if not (call.subgroup and rank == world_size - 1)])
        broken = torch.tensor([0 if alive else 1])
        api.all_reduce(broken, "max", comm=comm)
        for call in batch:
            outcome = results[call.index]
            if broken.item() and outcome == "refused":
                outcome = "broken"
            outcomes.append(outcome)
        if broken.item():
            groups.make()
    return outcomes


def run_both(comm, seed: int, calls: int, timeout_seconds: float):
    """One program on gloo, then on ours: (gloo's outcomes, ours), on this rank."""
    import warnings
    warnings.simplefilter("ignore")  # torch's deprecation of the *_tensor names
    program_calls = program(seed, comm.world_size, calls)
    theirs = run_program(comm, "gloo", program_calls, timeout_seconds)
    ours = run_program(comm, "collectives", program_calls, timeout_seconds)
    return theirs, ours


def compare(per_rank, calls: List[Call]):
    """(counts per backend, better, worse: the calls where ours ended lower than gloo)."""
    counts = {"gloo": Counter(), "collectives": Counter()}
    better, worse = [], []
    for index, call in enumerate(calls):
        for rank, (theirs, ours) in enumerate(per_rank):
            if theirs[index] == "-":
                continue
            counts["gloo"][theirs[index]] += 1
            counts["collectives"][ours[index]] += 1
            if RANK_OF[ours[index]] < RANK_OF[theirs[index]]:
                worse.append((call, rank, theirs[index], ours[index]))
            elif RANK_OF[ours[index]] > RANK_OF[theirs[index]]:
                better.append((call, rank, theirs[index], ours[index]))
    return counts, better, worse


def run_seeds(seeds, world_size: int, calls: int, timeout_seconds: float = 30.0,
              world_timeout: float = 600.0):
    """Run each seed on `world_size` spawned ranks; return (counts, better, worse)."""
    from distributed import run_world
    counts = {"gloo": Counter(), "collectives": Counter()}
    better, worse = [], []
    for seed in seeds:
        per_rank = run_world(run_both, world_size, (seed, calls, timeout_seconds),
                             timeout=world_timeout)
        c, b, w = compare(per_rank, program(seed, world_size, calls))
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
    args = p.parse_args(argv)
    failed = False
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        started = time.monotonic()
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        counts, better, worse = run_seeds(seeds, world_size, args.calls, args.timeout)
        total = sum(counts["gloo"].values())
        print(f"{world_size} ranks, {len(seeds)} seeds x {args.calls} calls ({total} calls "
              f"over the ranks), {time.monotonic() - started:.0f} s")
        for name in ("gloo", "collectives"):
            print(f"  {name:12s} " + "  ".join(f"{k} {counts[name][k]}" for k in RANK_OF))
        print(f"  ours better than gloo: {len(better)}   ours worse: {len(worse)}")
        for seed, call, rank, theirs, ours in worse[:20]:
            print(f"    seed {seed} rank {rank}: gloo {theirs}, ours {ours}: {call}")
        failed |= bool(worse)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
