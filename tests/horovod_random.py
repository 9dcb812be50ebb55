"""A randomized run of the Horovod face: seeded programs of calls, every result checked
against what each rank computes itself from the shared seed.

    python tests/horovod_random.py --seeds 200 --world-sizes 2,3

Each seed draws (the same on every rank) a program of steps: single collectives
(allreduce with every op and pre/postscale, allgather of first dimensions that differ
by rank, broadcast from any root, alltoall with drawn splits, reducescatter, and the
grouped forms), in every dtype and in 0 to 3 dimensions; named async batches that each
rank submits in its own order and synchronizes in another; collectives in a process
set (a set of ranks drawn per seed, added and removed); joins (one rank joins while
the others run allreduces, to which it adds zeros); and calls that must fail on every
rank, each followed by the same call made rightly:
- one rank's tensor of the same count in another shape ((2, 3) against (6,); past the
  first dimension for allgather and alltoall), which Horovod refuses on every rank
  ("Mismatched ... tensor shapes"): every rank's line says the ranks disagree on shape;
- one rank's arguments refused in its caller while the others' are right (alltoall
  splits past its rows, a bool tensor, a 0-dim tensor to scatter), in the job or in the
  process set: that rank raises its own line, every other rank a line naming it.
Each rank builds every rank's inputs from the seed, so it knows every result; it counts
the calls it checked (a refusal checked counts as one) and those that came out wrong:
a wrong result, or a refusal that was not one clear line on every rank. The retry
right after each refusal shows the engine usable and the next call paired. The run
prints both counts, per world size; exit status 1 if any was wrong.
tests/test_refusals.py runs a few seeds of it.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from typing import List, Optional

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int16, torch.int8, torch.uint8)
OPS = ("sum", "avg", "min", "max", "product")
SCALES = (1.0, 1.0, 1.0, 0.5, 1.5, 2.0)


def _hvd_op(hvd, op):
    return {"sum": hvd.Sum, "avg": hvd.Average, "min": hvd.Min, "max": hvd.Max,
            "product": hvd.Product}[op]


def tensor_for(seed: int, step: int, rank: int, dtype, shape, op: str = "sum",
               salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s input at `step`: small integers (exact in every dtype; products of
    3 ranks fit int8)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 17 + salt)
    lo, hi = (1, 3) if op == "product" else (-9, 9)
    if dtype == torch.uint8:
        lo = max(lo, 0)
    return torch.randint(lo, hi + 1, tuple(shape), generator=g).to(dtype)


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling: integers in float64, float16 / bfloat16 in float32, each
    rounded back (integers toward zero)."""
    if factor == 1.0:
        return t
    if not t.is_floating_point():
        return (t.double() * factor).to(t.dtype)
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t.float() * factor).to(t.dtype)
    return t * factor


def reduction(tensors: List[torch.Tensor], op: str, prescale: float, postscale: float,
              divide_by: int) -> torch.Tensor:
    """What Horovod's allreduce gives for these inputs (a joined rank's zeros included);
    averages divide by `divide_by` (the set's size), integers rounded toward zero."""
    dtype = tensors[0].dtype
    ts = [scaled(t, prescale) for t in tensors]
    if not dtype.is_floating_point:
        wide = [t.long() for t in ts]
        if op in ("sum", "avg"):
            total = sum(wide[1:], wide[0].clone())
            if op == "avg":
                if postscale == 1.0:
                    return torch.div(total, divide_by, rounding_mode="trunc").to(dtype)
                return (total.double() * (postscale / divide_by)).to(dtype)
            return scaled(total.to(dtype), postscale)
        out = wide[0]
        for t in wide[1:]:
            out = {"min": torch.minimum, "max": torch.maximum, "product": torch.mul}[op](out, t)
        return scaled(out.to(dtype), postscale)
    wide = [t.double() for t in ts]
    if op in ("sum", "avg"):
        out = sum(wide[1:], wide[0].clone())
        if op == "avg":
            out = out / divide_by
    else:
        out = wide[0]
        for t in wide[1:]:
            out = {"min": torch.minimum, "max": torch.maximum, "product": torch.mul}[op](out, t)
    return (out * postscale).to(dtype)


def rows_of(first: int, n: int) -> List[int]:
    base, extra = divmod(first, n)
    return [base + (1 if r < extra else 0) for r in range(n)]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return False
    if got.is_floating_point():
        tolerance = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(got.dtype, 1e-5)
        return torch.allclose(got.double(), want.double(), rtol=tolerance, atol=tolerance)
    return torch.equal(got, want)


class Checker:
    def __init__(self):
        self.calls, self.wrong, self.refusals = 0, [], 0

    def check(self, what: str, got, want) -> None:
        self.calls += 1
        if isinstance(want, (list, tuple)):
            ok = len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
        else:
            ok = same(got, want)
        if not ok:
            self.wrong.append(f"{what}: got {got}, want {want}")

    def refused(self, what: str, error: Optional[str], *words: str) -> None:
        """A call that had to fail: `error` (its message, None if it did not fail) is
        one line holding every one of `words`."""
        self.calls += 1
        self.refusals += 1
        if error is None:
            self.wrong.append(f"{what}: not refused")
        elif "\n" in error or not all(word in error for word in words):
            self.wrong.append(f"{what}: want one line with {words}, got {error!r}")


def same_count_other_shape(shape, kind: str):
    """A shape with as many elements as `shape` (at least one dimension), not the same:
    past the first dimension for allgather and alltoall, whose first may differ."""
    count = 1
    for size in shape[1:]:
        count *= size
    if kind in ("allgather", "grouped_allgather", "alltoall"):
        return shape[:1] + ((count,) if len(shape) > 2 else tuple(shape[1:]) + (1,))
    return (1,) + tuple(shape) if len(shape) == 1 else (shape[0] * count,)


class Draw:
    """One collective drawn from the program's generator, submitted on this rank and
    checked against the truth."""

    def __init__(self, draw: random.Random, seed: int, step: int, members: List[int],
                 kinds=("allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                        "grouped_allreduce", "grouped_allgather", "grouped_reducescatter")):
        self.seed, self.step, self.members = seed, step, members
        # set on one rank only, to make it submit what must fail on every rank:
        self.reshaped = False   # its tensors: the same count, another shape
        self.refusal = None     # "splits", "dtype" or "scalar": refused in its caller
        self.kind = draw.choice(kinds)
        self.dtype = draw.choice(DTYPES)
        self.op = draw.choice(OPS)
        self.prescale, self.postscale = draw.choice(SCALES), draw.choice(SCALES)
        dims = draw.randint(0, 3)
        self.shape = tuple(draw.randint(1, 3) for _ in range(dims))
        self.count = draw.randint(1, 3)  # tensors of a grouped form
        self.root = draw.choice(members)
        n = len(members)
        # alltoall: each member's splits to each member, from a first dim of 1 to 6
        self.rows = {r: draw.randint(1, 6) for r in members}
        self.splits = {}
        for r in members:
            left, cuts = self.rows[r], []
            for _ in range(n):
                cuts.append(draw.randint(0, left))
                left -= cuts[-1]
            self.splits[r] = cuts
        if self.kind in ("reducescatter", "grouped_reducescatter"):
            self.op = draw.choice(("sum", "avg"))
            self.shape = (draw.randint(0, 2 * n + 1),) + self.shape[1:]
            if self.shape[0] == 0:
                self.shape = (n,) + self.shape[1:]

    def input(self, rank: int, index: int = 0, shape=None) -> torch.Tensor:
        return tensor_for(self.seed, self.step, rank, self.dtype,
                          self.shape if shape is None else shape, self.op, salt=index)

    def own(self, rank: int, index: int = 0, shape=None) -> torch.Tensor:
        """This rank's input as it submits it (reshaped, or of a refused kind, where the
        step says so); input() stays the truth's."""
        mine = self.input(rank, index, shape)
        if self.reshaped:
            return mine.reshape(same_count_other_shape(tuple(mine.shape), self.kind))
        if self.refusal == "dtype":
            return mine.to(torch.bool)
        if self.refusal == "scalar":
            return mine.reshape(-1)[0]
        return mine

    def gather_shape(self, rank: int):
        """allgather: the first dimension differs by rank (0-dim inputs become (1,))."""
        if not self.shape:
            return ()
        return (1 + (rank + self.step) % 3,) + self.shape[1:]

    def submit(self, hvd, rank: int, name, process_set):
        """The handle, and a function of the synchronized result that checks it."""
        n, me = len(self.members), self.members.index(rank)
        kind, op = self.kind, _hvd_op(hvd, self.op)
        scale = dict(prescale_factor=self.prescale, postscale_factor=self.postscale)
        where = dict(process_set=process_set)
        if kind in ("allreduce", "grouped_allreduce"):
            count = 1 if kind == "allreduce" else self.count
            mine = [self.own(rank, i) for i in range(count)]
            truth = [reduction([self.input(r, i) for r in self.members], self.op,
                               self.prescale, self.postscale, n) for i in range(count)]
            if kind == "allreduce":
                return (hvd.allreduce_async(mine[0], name=name, op=op, **scale, **where),
                        lambda got: [got], truth)
            return (hvd.grouped_allreduce_async(mine, name=name, op=op, **scale, **where),
                    list, truth)
        if kind in ("allgather", "grouped_allgather"):
            count = 1 if kind == "allgather" else self.count
            mine = [self.own(rank, i, self.gather_shape(rank)) for i in range(count)]
            truth = [torch.cat([self.input(r, i, self.gather_shape(r)).reshape(
                (-1,) + tuple(self.shape[1:])) for r in self.members]) for i in range(count)]
            if kind == "allgather":
                return (hvd.allgather_async(mine[0], name=name, **where), lambda g: [g], truth)
            return (hvd.grouped_allgather_async(mine, name=name, **where), list, truth)
        if kind == "broadcast":
            return (hvd.broadcast_async(self.own(rank), self.root, name=name, **where),
                    lambda g: [g], [self.input(self.root)])
        if kind == "alltoall":
            shape = (self.rows[rank],) + tuple(self.shape[1:])
            mine = self.own(rank, shape=shape)
            splits = list(self.splits[rank])
            if self.refusal == "splits":  # one row more than it holds
                splits[0] = self.rows[rank] + 1
            received, pieces = [], []
            for sender in self.members:
                sent = self.input(sender, shape=(self.rows[sender],) + tuple(self.shape[1:]))
                start = sum(self.splits[sender][:me])
                pieces.append(sent[start:start + self.splits[sender][me]])
                received.append(self.splits[sender][me])
            truth = [torch.cat(pieces), torch.tensor(received, dtype=torch.int32)]
            return (hvd.alltoall_async(mine, splits=splits, name=name, **where),
                    lambda g: [g[0], g[1]], truth)
        count = 1 if kind == "reducescatter" else self.count
        mine = [self.own(rank, i) for i in range(count)]
        rows = rows_of(self.shape[0], n)
        start = sum(rows[:me])
        truth = [reduction([self.input(r, i) for r in self.members], self.op, self.prescale,
                           self.postscale, n)[start:start + rows[me]] for i in range(count)]
        if kind == "reducescatter":
            return (hvd.reducescatter_async(mine[0], name=name, op=op, **scale, **where),
                    lambda g: [g], truth)
        return (hvd.grouped_reducescatter_async(mine, name=name, op=op, **scale, **where),
                list, truth)


def _error_of(hvd, call: Draw, rank: int, name, process_set) -> Optional[str]:
    """Submit and synchronize `call`: the message of the error it raised, or None."""
    try:
        handle, unpack, _ = call.submit(hvd, rank, name, process_set)
        unpack(hvd.synchronize(handle))
    except (hvd.HorovodInternalError, ValueError, TypeError) as error:
        return str(error)
    return None


def _fails_then_runs(hvd, call: Draw, rank: int, name, process_set, checker: Checker,
                     what: str, *words: str) -> None:
    """`call` must fail on this rank with one line holding `words`; then every rank
    makes it again rightly (under the same name, or the next unnamed number), and the
    result must be right: the engine lives, and the next call pairs with the next."""
    checker.refused(what, _error_of(hvd, call, rank, name, process_set), *words)
    call.reshaped, call.refusal = False, None
    handle, unpack, truth = call.submit(hvd, rank, name, process_set)
    checker.check(f"{what}, then made rightly", unpack(hvd.synchronize(handle)), truth)


def _same_count_other_shape(hvd, draw: random.Random, seed: int, step: int, rank: int,
                            everyone: List[int], checker: Checker) -> None:
    """One rank's tensors hold as many elements as the others', in another shape: every
    rank fails the call (the ranks disagree on shape), then makes it rightly."""
    call = Draw(draw, seed, step, everyone)
    if not call.shape:
        call.shape = (2,)
    odd = draw.choice(everyone)
    name = f"shape{seed}.{step}" if draw.random() < 0.5 else None
    call.reshaped = rank == odd
    _fails_then_runs(hvd, call, rank, name, hvd.global_process_set, checker,
                     f"seed {seed} step {step} {call.kind} reshaped on rank {odd}",
                     "disagree on shape")


REFUSALS = {"splits": ("alltoall",),
            "dtype": ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                      "grouped_allreduce", "grouped_allgather", "grouped_reducescatter"),
            "scalar": ("alltoall", "reducescatter", "grouped_reducescatter")}


def _refused_on_one_rank(hvd, draw: random.Random, seed: int, step: int, rank: int,
                         members: List[int], process_set, checker: Checker) -> None:
    """One member's own arguments are refused in its caller, the others' are right:
    that member raises its line, every other member a line naming it; then every
    member makes the call rightly."""
    refusal = draw.choice(sorted(REFUSALS))
    call = Draw(draw, seed, step, members, kinds=REFUSALS[refusal])
    if refusal == "scalar" and not call.shape:
        call.shape = (len(members),)  # the others' tensors have a first dimension
    odd = draw.choice(members)
    name = f"refused{seed}.{step}" if draw.random() < 0.5 else None
    if rank not in members:
        return
    call.refusal = refusal if rank == odd else None
    why = {"splits": "splits", "dtype": "torch.bool", "scalar": "dimension"}[refusal]
    words = (why,) if rank == odd else (f"refused on rank {odd}", why)
    _fails_then_runs(hvd, call, rank, name, process_set, checker,
                     f"seed {seed} step {step} {call.kind} with a {refusal} refused on "
                     f"rank {odd} of {members}", *words)


def run_seed(hvd, seed: int, checker: Checker, steps: int = 24) -> None:
    rank, size = hvd.rank(), hvd.size()
    draw = random.Random(seed)
    mine = random.Random(seed * 7 + rank)  # this rank's own orders
    everyone = list(range(size))
    subset = sorted(draw.sample(everyone, draw.randint(1, size)))
    in_set = None
    if subset != everyone:
        in_set = hvd.add_process_set(subset)
    for step in range(steps):
        what = draw.random()
        if what < 0.3:  # one unnamed collective on every rank
            call = Draw(draw, seed, step, everyone)
            handle, unpack, truth = call.submit(hvd, rank, None, hvd.global_process_set)
            checker.check(f"seed {seed} step {step} {call.kind} {call.dtype} {call.op}",
                          unpack(hvd.synchronize(handle)), truth)
        elif what < 0.6:  # a named batch, submitted and synchronized in orders of its own
            batch = [Draw(draw, seed, step * 100 + k, everyone)
                     for k in range(draw.randint(2, 5))]
            order = list(range(len(batch)))
            mine.shuffle(order)
            handles = {k: batch[k].submit(hvd, rank, f"s{seed}.{step}.{k}",
                                          hvd.global_process_set) for k in order}
            mine.shuffle(order)
            for k in order:
                handle, unpack, truth = handles[k]
                checker.check(f"seed {seed} step {step} batch {k} {batch[k].kind} "
                              f"{batch[k].dtype} {batch[k].op}",
                              unpack(hvd.synchronize(handle)), truth)
        elif what < 0.66:  # the same count in another shape on one rank
            _same_count_other_shape(hvd, draw, seed, step, rank, everyone, checker)
        elif what < 0.74:  # refused in one rank's caller, in the job or in the set
            in_the_set = in_set is not None and draw.random() < 0.4
            _refused_on_one_rank(hvd, draw, seed, step, rank,
                                 subset if in_the_set else everyone,
                                 in_set if in_the_set else hvd.global_process_set, checker)
        elif what < 0.87 and in_set is not None:  # in the process set: its ranks only
            call = Draw(draw, seed, step, subset)
            named = draw.random() < 0.5
            if rank in subset:
                handle, unpack, truth = call.submit(hvd, rank,
                                                    f"set{seed}.{step}" if named else None,
                                                    in_set)
                checker.check(f"seed {seed} step {step} in set {subset} {call.kind} "
                              f"{call.dtype} {call.op}", unpack(hvd.synchronize(handle)), truth)
        else:  # one rank joins while the others run allreduces; it adds zeros
            joined = draw.randrange(size)
            calls = [Draw(draw, seed, step * 100 + k, everyone, kinds=("allreduce",))
                     for k in range(draw.randint(1, 3))]
            if rank == joined:
                hvd.join()
                continue
            for k, call in enumerate(calls):
                zeros = torch.zeros(call.shape, dtype=call.dtype)
                inputs = [call.input(r) if r != joined else zeros for r in everyone]
                got = hvd.allreduce(call.input(rank), op=_hvd_op(hvd, call.op),
                                    prescale_factor=call.prescale,
                                    postscale_factor=call.postscale)
                checker.check(f"seed {seed} step {step} joined {joined} allreduce "
                              f"{call.dtype} {call.op}", got,
                              reduction(inputs, call.op, call.prescale, call.postscale, size))
            hvd.join()
    if in_set is not None:
        hvd.remove_process_set(in_set)


def run_seeds(comm, seeds, steps: int = 24):
    """Every seed on this rank; (calls checked, the wrong ones)."""
    import os
    import collectives.horovod as hvd
    # a call that would never pair fails within the run, instead of the default 300 s
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "60")
    hvd.init()
    checker = Checker()
    for seed in seeds:
        run_seed(hvd, seed, checker, steps)
    from collectives.horovod.engine import forget_engines
    forget_engines()
    return checker.calls, checker.wrong, checker.refusals


def run(world_size: int, seeds, steps: int = 24, timeout: float = 3000.0):
    """(calls checked over every rank, the wrong ones, how many of the calls checked
    were refusals) for `seeds` on spawned ranks."""
    from distributed import run_world
    results = run_world(run_seeds, world_size, (list(seeds), steps), timeout=timeout)
    return (sum(calls for calls, _, _ in results),
            [w for _, wrong, _ in results for w in wrong],
            sum(refusals for _, _, refusals in results))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--world-sizes", default="2,3")
    p.add_argument("--steps", type=int, default=24, help="steps per seed")
    args = p.parse_args(argv)
    wrong_anywhere = False
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        started = time.monotonic()
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        calls, wrong, refusals = run(world_size, seeds, args.steps)
        print(f"{world_size} ranks, {len(seeds)} seeds x {args.steps} steps: {calls} calls "
              f"checked over the ranks ({refusals} of them refusals), {len(wrong)} wrong "
              f"({time.monotonic() - started:.0f} s)")
        for line in wrong[:20]:
            print("   ", line)
        wrong_anywhere |= bool(wrong)
    return 1 if wrong_anywhere else 0


if __name__ == "__main__":
    sys.exit(main())
