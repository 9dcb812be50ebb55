"""Never a silently wrong number: the checks behind tests/test_refusals.py, on every rank.

- Horovod's face: unnamed collectives stay paired through refusals, joins and
  disagreements, and a stalled unnamed one stops every rank's engine with one line;
  alltoall of a 0-dim tensor is refused in the caller; an integer reducescatter average
  with a postscale rounds once, as allreduce's.
- A sweep, one table of calls (`CASES`), each run through three faces on the same
  ranks: torch.distributed on gloo, torch.distributed on the "collectives" backend,
  and our own API (collectives.api). Every call is judged against the true value: ours
  must be right where gloo is, and otherwise right or refused on every rank with one
  line; and right after each, an all-reduce on the same face must be correct (the
  communicator survived the call). A list only the root holds is refused there alone
  (REFUSED_BY_THE_ROOT); splits that do not add up, refused on every rank alike, leave
  the group usable (BREAKS_THE_GROUP is empty).
- Splits refused on one rank alone: no rank gets a number from a stale message.

Each check returns plain data; the test compares it across ranks.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable, List, NamedTuple, Optional

import torch
import torch.distributed as dist

import collectives
import collectives.horovod as hvd
from collectives import api


def _equal(actual, expected, what):
    assert torch.equal(actual, expected), f"{what}: {actual.tolist()} != {expected.tolist()}"


# --- Horovod: unnamed collectives stay paired --------------------------------------------
def _three_unnamed_sums(size: int, what: str) -> None:
    """loss, acc, lr, each summed unnamed and async: any shift in pairing shows."""
    values = (1.0, 100.0, 0.5)
    handles = [hvd.allreduce_async(torch.tensor([v]), op=hvd.Sum) for v in values]
    got = [hvd.synchronize(h).item() for h in handles]
    assert got == [v * size for v in values], f"{what}: unnamed sums paired wrongly: {got}"


def _refused(call, *words) -> str:
    """Run call(), which must raise HorovodInternalError or ValueError with `words` in a
    one-line message; return the message."""
    try:
        call()
    except (hvd.HorovodInternalError, ValueError) as error:
        text = str(error)
        assert all(w in text for w in words), text
        assert "\n" not in text, f"more than one line: {text!r}"
        return text
    raise AssertionError(f"not refused (expected {words})")


def check_horovod_unnamed_stay_paired(comm):
    """Refusals while a rank is joined, a disagreement, arguments refused in the caller,
    then a stray unnamed call that stalls: pairing never shifts."""
    from collectives.horovod.engine import forget_engines
    hvd.init()
    rank, size, last = hvd.rank(), hvd.size(), hvd.size() - 1

    # While the last rank is joined, the others' broadcast, allgather and
    # add_process_set are refused (each used up an unnamed number there); after the
    # join, the next unnamed calls must pair.
    if rank == last:
        hvd.join()
    else:
        _refused(lambda: hvd.broadcast(torch.ones(2), 0), "join")
        _refused(lambda: hvd.allgather(torch.ones(2)), "join")
        _refused(lambda: hvd.add_process_set([0]), "join")
        hvd.join()
    _three_unnamed_sums(size, "after a join with refusals")
    # an unnamed allreduce while a rank is joined runs with its zeros, and counts there
    if rank == last:
        hvd.join()
    else:
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum)
        _equal(got, torch.full((2,), float(size - 1)), "allreduce while a rank is joined")
        hvd.join()
    _three_unnamed_sums(size, "after an allreduce run while a rank was joined")

    # the ranks disagree on an unnamed allreduce: refused on every rank, then in step
    _refused(lambda: hvd.allreduce(torch.ones(2 + rank)), "disagree on shape")
    _three_unnamed_sums(size, "after a disagreement")

    # refused in the caller, on every rank alike: a number used on every rank alike (the
    # refusal is announced under it), and the engine lives
    _refused(lambda: hvd.alltoall(torch.tensor(5.0), splits=[1] + [0] * (size - 1)),
             "rank-zero tensor")
    _refused(lambda: hvd.allreduce(torch.ones(2), op="bogus"), "unknown reduction op")
    _three_unnamed_sums(size, "after arguments refused in the caller")

    forget_engines()


def check_horovod_unnamed_stall_stops_every_rank(comm):
    """Rank 0 alone makes one unnamed call: at the stall timeout every rank's engine
    stops, with one line (rank 0's inspector shortened, after a barrier); engines
    started afresh pair again."""
    from collectives.horovod.engine import engine, forget_engines
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _three_unnamed_sums(size, "before")
    hvd.barrier()
    if rank == 0:
        engine().inspector.warn_after, engine().inspector.fail_after = 0.3, 1.5
        _refused(lambda: hvd.allreduce(torch.ones(1)), "shut down", "allreduce.noname.",
                 "stalled")
    else:  # waiting outside any collective (a call of its own could stall first)
        deadline = time.monotonic() + 30
        while engine().stopped is None and time.monotonic() < deadline:
            time.sleep(0.02)
    # every later call, named or not, on every rank: the same line
    stray = _refused(lambda: hvd.allreduce(torch.ones(1), name="after"), "shut down",
                     "allreduce.noname.", "stalled")
    _refused(lambda: hvd.allreduce(torch.ones(1)), "shut down", "allreduce.noname.")
    # a new engine on every rank (hvd.shutdown() and hvd.init() would make a new world
    # too): numbering starts afresh, and alike
    forget_engines()
    hvd.init()
    _three_unnamed_sums(size, "after the engines stopped and started again")
    forget_engines()
    return stray.split(":")[1].strip()  # the name, the same on every rank


def check_horovod_reducescatter_rounds_once(comm):
    """int32 [2 + 3 rank, 1, ...] averaged with postscale 2 (and 1.5): each rank's rows
    are trunc(sum * postscale / size), what allreduce gives for the same call."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = []
    for dtype in (torch.int32, torch.int8, torch.int64, torch.uint8):
        for postscale in (2.0, 1.5, 1.0):
            rows = torch.tensor([2 + 3 * rank] + [1 + r for r in range(1, size)], dtype=dtype)
            mine = hvd.reducescatter(rows, op=hvd.Average, postscale_factor=postscale)
            whole = hvd.allreduce(rows, op=hvd.Average, postscale_factor=postscale)
            total = [sum(2 + 3 * r for r in range(size))] + [(1 + k) * size
                                                             for k in range(1, size)]
            truth = torch.tensor([int(t * postscale / size) for t in total], dtype=dtype)
            _equal(whole, truth, f"allreduce {dtype} postscale {postscale}")
            _equal(mine, truth[rank:rank + 1], f"reducescatter {dtype} postscale {postscale}")
            results.append(mine.tolist())
    from collectives.horovod.engine import forget_engines
    forget_engines()
    return results


def check_splits_refused_on_one_rank(comm) -> List[str]:
    """[what all_to_all_single raised, what the all-reduce after it raised] on this rank,
    where rank 0 alone passes splits that do not add up (a group whose timeout is 2 s,
    made by both ranks together: its connections are made within that timeout too)."""
    comm.barrier()
    group = dist.new_group(backend="collectives", timeout=timedelta(seconds=2))
    rank, size = comm.rank, comm.world_size
    outcome = _outcomes(
        lambda: dist.all_to_all_single(
            torch.zeros(size), torch.ones(size) * (rank + 5), [1] * size,
            [2] + [1] * (size - 1) if rank == 0 else [1] * size, group=group),
        lambda: dist.all_reduce(torch.full((1,), rank + 1.0), group=group))
    comm.barrier()  # (rank 0 stays until rank 1 has waited out its timeout)
    return outcome


def _outcomes(*calls) -> List[str]:
    """Each call's outcome, in turn: "returned", or what it raised in one line."""
    outcome = []
    for call in calls:
        try:
            call()
            outcome.append("returned")
        except Exception as error:  # noqa: BLE001 -- the outcome is the result
            outcome.append(f"{type(error).__name__}: {error}")
    return outcome


def check_gather_list_torch_refuses_on_the_root(comm) -> List[str]:
    """[what gather raised, what the all-reduce after it did] on this rank, where the
    root (rank 0) alone passes a gather list of another dtype: torch refuses it before
    the backend is called (a group whose timeout is 2 s)."""
    comm.barrier()
    group = dist.new_group(backend="collectives", timeout=timedelta(seconds=2))
    rank, size = comm.rank, comm.world_size
    mine = torch.full((1,), rank + 5.0)
    total = torch.full((2,), rank + 1.0)
    outcome = _outcomes(
        lambda: dist.gather(mine, [torch.zeros(1, dtype=torch.int64)] * size
                            if rank == 0 else None, 0, group=group),
        lambda: dist.all_reduce(total, group=group))
    outcome.append(total.tolist())
    comm.barrier()  # (rank 0 stays until rank 1 has waited out its timeout)
    return outcome


# --- the sweep: one table, three faces ----------------------------------------------------
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _torch_op(op: str):
    if op.startswith("premul:"):
        return dist._make_nccl_premul_sum(float(op.split(":")[1]))
    return OPS[op]


class Unavailable(Exception):
    """This face has no such call (our API has no reduce, gather, scatter...)."""


class DistFace:
    """torch.distributed's calls on one group (gloo's, or the "collectives" backend's)."""

    def __init__(self, group):
        self.group = group

    def all_reduce(self, t, op="sum"):
        dist.all_reduce(t, _torch_op(op), group=self.group)
        return t

    def reduce(self, t, dst, op="sum"):
        dist.reduce(t, dst, _torch_op(op), group=self.group)
        return t

    def broadcast(self, t, src):
        dist.broadcast(t, src, group=self.group)
        return t

    def all_gather(self, outputs, t):
        dist.all_gather(outputs, t, group=self.group)
        return outputs

    def all_gather_into_tensor(self, out, t):
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out

    def reduce_scatter(self, out, inputs, op="sum"):
        dist.reduce_scatter(out, inputs, _torch_op(op), group=self.group)
        return out

    def reduce_scatter_tensor(self, out, t, op="sum"):
        dist.reduce_scatter_tensor(out, t, _torch_op(op), group=self.group)
        return out

    def all_to_all(self, outputs, inputs):
        dist.all_to_all(outputs, inputs, group=self.group)
        return outputs

    def all_to_all_single(self, out, t, out_splits=None, in_splits=None):
        dist.all_to_all_single(out, t, out_splits, in_splits, group=self.group)
        return out

    def gather(self, t, outputs, dst):
        dist.gather(t, outputs, dst, group=self.group)
        return outputs if outputs is not None else t

    def scatter(self, out, inputs, src):
        dist.scatter(out, inputs, src, group=self.group)
        return out

    def all_reduce_coalesced(self, tensors, op="sum"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(tensors, _torch_op(op), group=self.group)
        return tensors

    def broadcast_coalesced(self, tensors, src):
        raise Unavailable

    def all_finite(self, tensors):
        raise Unavailable


class ApiFace:
    """Our public API (collectives.api) on the world's communicator."""

    def __init__(self, comm):
        self.comm = comm

    def all_reduce(self, t, op="sum"):
        if op.startswith("premul:"):
            raise Unavailable
        return api.all_reduce(t, op, comm=self.comm)

    def broadcast(self, t, src):
        return api.broadcast(t, src, comm=self.comm)

    def all_gather(self, outputs, t):
        return api.all_gather(outputs, t, comm=self.comm)

    def all_gather_into_tensor(self, out, t):
        return api.all_gather(out, t, comm=self.comm)

    def reduce_scatter_tensor(self, out, t, op="sum"):
        if op.startswith("premul:"):
            raise Unavailable
        return api.reduce_scatter(out, t.clone() if isinstance(t, torch.Tensor) else t, op,
                                  comm=self.comm)

    def all_to_all(self, outputs, inputs):
        return api.all_to_all(outputs, inputs, comm=self.comm)

    def all_reduce_coalesced(self, tensors, op="sum"):
        if op.startswith("premul:"):
            raise Unavailable
        api.all_reduce_coalesced(tensors, op, comm=self.comm)
        return tensors

    def broadcast_coalesced(self, tensors, src):
        api.broadcast_coalesced(tensors, src, comm=self.comm)
        return tensors

    def all_finite(self, tensors):
        return torch.tensor(api.all_finite(tensors, comm=self.comm))

    def reduce(self, *args, **kwargs):
        raise Unavailable

    reduce_scatter = all_to_all_single = gather = scatter = reduce


def _values(rank: int, n: int = 4, dtype=torch.float32, shape=None) -> torch.Tensor:
    """Small integers, different per rank, exact in every dtype (bool: odd ones)."""
    base = torch.arange(n, dtype=torch.float64) + rank * 3 + 1
    if dtype == torch.bool:
        out = (base.long() % 2 == 1) if rank % 2 == 0 else (base.long() % 3 == 0)
    elif dtype.is_complex:
        out = torch.complex(base, -base).to(dtype)
    else:
        out = base.to(dtype)
    return out.view(shape) if shape is not None else out


def _everyone(size, **kwargs) -> List[torch.Tensor]:
    return [_values(r, **kwargs) for r in range(size)]


def _reduced(tensors: List[torch.Tensor], op: str) -> torch.Tensor:
    """The true reduction, in float64 / int64, cast back (integer avg rounds down, as
    ours; gloo has none)."""
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        wide = [t.long() for t in tensors]
        fold = {"sum": torch.maximum, "max": torch.maximum, "bor": torch.bitwise_or,
                "product": torch.minimum, "min": torch.minimum, "band": torch.bitwise_and,
                "bxor": torch.bitwise_xor}[op]
        out = wide[0]
        for t in wide[1:]:
            out = fold(out, t)
        return out.bool()
    wide = [t.to(torch.complex128 if dtype.is_complex else
                 torch.float64 if dtype.is_floating_point else torch.int64) for t in tensors]
    if op.startswith("premul:"):
        return (sum(wide) * float(op.split(":")[1])).to(dtype)
    if op == "avg":
        total = sum(wide)
        return (total / len(wide) if total.is_floating_point() or total.is_complex()
                else torch.div(total, len(wide), rounding_mode="floor")).to(dtype)
    fold = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum,
            "product": torch.mul, "band": torch.bitwise_and, "bor": torch.bitwise_or,
            "bxor": torch.bitwise_xor}[op]
    out = wide[0]
    for t in wide[1:]:
        out = fold(out, t)
    return out.to(dtype)


class Case(NamedTuple):
    """call(face, rank, size) -> result; truth(rank, size) -> what it must be (None:
    nothing to compare, any completion is right)."""
    name: str
    call: Callable
    truth: Callable


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (a transposed copy's transpose)."""
    if t.dim() == 0:
        return t
    grid = torch.stack([t, t]).t()  # (n, 2), non-contiguous columns
    return grid[:, 0] if t.dim() == 1 else grid


def _reduction_cases() -> List[Case]:
    cases = []
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
              torch.int64, torch.int8, torch.uint8, torch.int16, torch.bool,
              torch.complex64)
    ops = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor", "premul:2.0")
    for dtype in dtypes:
        for op in ops:
            cases.append(Case(
                f"all_reduce {str(dtype)[6:]} {op}",
                lambda f, r, n, d=dtype, o=op: f.all_reduce(_values(r, dtype=d), o),
                lambda r, n, d=dtype, o=op: _reduced(_everyone(n, dtype=d), o)))
    for dtype, op in ((torch.float32, "bxor"), (torch.bool, "sum"), (torch.complex64, "sum"),
                      (torch.complex64, "max"), (torch.int32, "premul:2.0"),
                      (torch.float32, "max")):
        name = f"{str(dtype)[6:]} {op}"
        cases += [
            Case(f"reduce {name}",
                 lambda f, r, n, d=dtype, o=op: f.reduce(_values(r, dtype=d), 0, o),
                 lambda r, n, d=dtype, o=op: _reduced(_everyone(n, dtype=d), o) if r == 0
                 else None),
            Case(f"reduce_scatter_tensor {name}",
                 lambda f, r, n, d=dtype, o=op: f.reduce_scatter_tensor(
                     torch.zeros(2, dtype=d), _values(r, 2 * n, dtype=d), o),
                 lambda r, n, d=dtype, o=op: _reduced(
                     [_values(k, 2 * n, dtype=d) for k in range(n)], o)[2 * r:2 * r + 2]),
            Case(f"reduce_scatter list {name}",
                 lambda f, r, n, d=dtype, o=op: f.reduce_scatter(
                     torch.zeros(2, dtype=d), list(_values(r, 2 * n, dtype=d).split(2)), o),
                 lambda r, n, d=dtype, o=op: _reduced(
                     [_values(k, 2 * n, dtype=d) for k in range(n)], o)[2 * r:2 * r + 2]),
            Case(f"all_reduce_coalesced {name}",
                 lambda f, r, n, d=dtype, o=op: f.all_reduce_coalesced(
                     [_values(r, dtype=d), _values(r, 2, dtype=d)], o),
                 lambda r, n, d=dtype, o=op: [_reduced(_everyone(n, dtype=d), o),
                                              _reduced(_everyone(n, n=2, dtype=d), o)]),
        ]
    return cases


def _layout_cases() -> List[Case]:
    """Non-contiguous and odd-strided tensors, 0-dim and empty ones."""
    odd = lambda r: torch.arange(2, dtype=torch.int64)[::2] + r + 1  # noqa: E731
    grid = lambda r: (torch.arange(6.0).view(2, 3) + r).t()  # noqa: E731
    return [
        Case("all_reduce non-contiguous", lambda f, r, n: f.all_reduce(grid(r)),
             lambda r, n: sum(grid(k) for k in range(n))),
        Case("all_reduce size-1 odd stride", lambda f, r, n: f.all_reduce(odd(r)),
             lambda r, n: sum(odd(k) for k in range(n))),
        Case("all_reduce 0-dim", lambda f, r, n: f.all_reduce(torch.tensor(r + 1.0)),
             lambda r, n: torch.tensor(n * (n + 1) / 2)),
        Case("all_reduce empty", lambda f, r, n: f.all_reduce(torch.empty(0, 3)),
             lambda r, n: torch.empty(0, 3)),
        Case("broadcast non-contiguous", lambda f, r, n: f.broadcast(grid(r), 1),
             lambda r, n: grid(1)),
        Case("broadcast size-1 odd stride", lambda f, r, n: f.broadcast(odd(r), 0),
             lambda r, n: odd(0)),
        Case("broadcast bool", lambda f, r, n: f.broadcast(_values(r, dtype=torch.bool), 1),
             lambda r, n: _values(1, dtype=torch.bool)),
        Case("reduce non-contiguous", lambda f, r, n: f.reduce(grid(r), 0),
             lambda r, n: sum(grid(k) for k in range(n)) if r == 0 else None),
        Case("reduce to the last, non-contiguous", lambda f, r, n: f.reduce(grid(r), n - 1),
             lambda r, n: sum(grid(k) for k in range(n)) if r == n - 1 else None),
        Case("all_gather list into non-contiguous outputs",
             lambda f, r, n: f.all_gather([torch.zeros(3, 2).t() for _ in range(n)],
                                          torch.ones(2, 3) * r),
             lambda r, n: [torch.ones(2, 3) * k for k in range(n)]),
        Case("all_gather list of a non-contiguous input",
             lambda f, r, n: f.all_gather([torch.zeros(3, 2) for _ in range(n)], grid(r)),
             lambda r, n: [grid(k) for k in range(n)]),
        Case("all_gather_into_tensor non-contiguous output",
             lambda f, r, n: f.all_gather_into_tensor(torch.zeros(2, 2 * n).t(),
                                                      torch.ones(2, 2) * r),
             lambda r, n: torch.cat([torch.ones(2, 2) * k for k in range(n)])),
        Case("all_gather_into_tensor complex",
             lambda f, r, n: f.all_gather_into_tensor(torch.zeros(2 * n, dtype=torch.complex64),
                                                      _values(r, 2, dtype=torch.complex64)),
             lambda r, n: torch.cat(_everyone(n, n=2, dtype=torch.complex64))),
        Case("scatter size-1 odd stride",
             lambda f, r, n: f.scatter(torch.zeros(1, dtype=torch.int64),
                                       [odd(k) for k in range(n)] if r == 0 else None, 0),
             lambda r, n: odd(r)),
        Case("scatter into a non-contiguous output",
             lambda f, r, n: f.scatter(torch.zeros(2, 3).t(),
                                       [grid(k) for k in range(n)] if r == 0 else None, 0),
             lambda r, n: grid(r)),
        Case("gather into non-contiguous outputs",
             lambda f, r, n: f.gather(torch.ones(2, 3) * r,
                                      [torch.zeros(3, 2).t() for _ in range(n)]
                                      if r == 0 else None, 0),
             lambda r, n: [torch.ones(2, 3) * k for k in range(n)] if r == 0
             else torch.ones(2, 3) * r),
        Case("all_to_all into non-contiguous outputs",
             lambda f, r, n: f.all_to_all([torch.zeros(3, 2).t() for _ in range(n)],
                                          [torch.ones(2, 3) * (10 * r + k) for k in range(n)]),
             lambda r, n: [torch.ones(2, 3) * (10 * k + r) for k in range(n)]),
        Case("all_to_all_single non-contiguous",
             lambda f, r, n: f.all_to_all_single(torch.zeros(3, n).t(),
                                                 (torch.arange(3.0 * n) + 10 * r).view(n, 3)),
             lambda r, n: torch.stack([torch.arange(3.0 * n)[3 * r:3 * r + 3] + 10 * k
                                       for k in range(n)])),
        Case("all_finite", lambda f, r, n: f.all_finite([torch.ones(2)]),
             lambda r, n: torch.tensor(True)),
        Case("broadcast_coalesced non-contiguous",
             lambda f, r, n: f.broadcast_coalesced([grid(r), torch.ones(2) * r], 1),
             lambda r, n: [grid(1), torch.ones(2)]),
    ]


def _argument_error_cases() -> List[Case]:
    """Arguments gloo refuses: wrong lengths, sizes and dtypes in list forms, 0-dim where
    rows are needed. Their truth is the right answer where a face does it anyway."""
    return [
        Case("all_gather list of another dtype",
             lambda f, r, n: f.all_gather([torch.zeros(2, dtype=torch.int32)
                                           for _ in range(n)], torch.ones(2) * 1.5), None),
        Case("all_gather list of another shape",
             lambda f, r, n: f.all_gather([torch.zeros(2, 1) for _ in range(n)],
                                          torch.ones(2)), None),
        Case("all_gather list one too long",
             lambda f, r, n: f.all_gather([torch.zeros(2) for _ in range(n + 1)],
                                          torch.ones(2)), None),
        Case("all_gather_into_tensor too small",
             lambda f, r, n: f.all_gather_into_tensor(torch.zeros(2 * n - 1), torch.ones(2)),
             None),
        Case("all_gather_into_tensor of another dtype",
             lambda f, r, n: f.all_gather_into_tensor(torch.zeros(2 * n, dtype=torch.int64),
                                                      torch.ones(2)), None),
        Case("reduce_scatter_tensor input too small",
             lambda f, r, n: f.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * n - 1)),
             None),
        Case("reduce_scatter list one too long",
             lambda f, r, n: f.reduce_scatter(torch.zeros(2), [torch.ones(2)] * (n + 1)), None),
        Case("reduce_scatter list of another shape",
             lambda f, r, n: f.reduce_scatter(torch.zeros(2), [torch.ones(3)] * n), None),
        Case("all_to_all_single 0-dim",
             lambda f, r, n: f.all_to_all_single(torch.tensor(0.0), torch.tensor(5.0)), None),
        Case("all_to_all_single splits that do not add up",
             lambda f, r, n: f.all_to_all_single(torch.zeros(n), torch.ones(n),
                                                 [1] * n, [2] + [1] * (n - 1)), None),
        Case("all_to_all one tensor short",
             lambda f, r, n: f.all_to_all([torch.zeros(1)] * (n - 1), [torch.ones(1)] * n),
             None),
        Case("all_to_all of two dtypes",
             lambda f, r, n: f.all_to_all([torch.zeros(1, dtype=torch.int64)
                                           for _ in range(n)], [torch.ones(1)] * n), None),
        Case("broadcast from a rank beyond the group",
             lambda f, r, n: f.broadcast(torch.ones(2), n), None),
        Case("all_reduce_coalesced of a float and a bool with bor",
             lambda f, r, n: f.all_reduce_coalesced(
                 [torch.ones(2), torch.ones(2, dtype=torch.bool)], "bor"), None),
        Case("all_reduce of a float8 tensor",
             lambda f, r, n: f.all_reduce(torch.ones(2).to(torch.float8_e4m3fn)), None),
    ]


def _shared_memory_cases() -> List[Case]:
    """Tensors whose elements share memory: in place, each copy of an element holds the
    same value, so the call is right as gloo's is; an output of another call would have
    to hold several values in one place, and is refused (gloo keeps one of them)."""
    expanded = lambda r, n=3: (torch.ones(1) * (r + 1)).expand(n)  # noqa: E731
    windows = lambda base: base.as_strided((3, 2), (1, 1))  # noqa: E731
    return [
        Case("all_reduce of an expand()ed tensor", lambda f, r, n: f.all_reduce(expanded(r)),
             lambda r, n: torch.full((3,), n * (n + 1) / 2)),
        Case("all_reduce of overlapping windows",
             lambda f, r, n: f.all_reduce(windows(torch.arange(4.0) + r)),
             lambda r, n: windows(sum(torch.arange(4.0) + k for k in range(n)))),
        Case("broadcast of an expand()ed tensor", lambda f, r, n: f.broadcast(expanded(r), 1),
             lambda r, n: torch.full((3,), 2.0)),
        Case("reduce of an expand()ed tensor", lambda f, r, n: f.reduce(expanded(r), 0),
             lambda r, n: torch.full((3,), n * (n + 1) / 2) if r == 0 else None),
        Case("all_reduce_coalesced with an expand()ed tensor",
             lambda f, r, n: f.all_reduce_coalesced([torch.ones(2) * (r + 1), expanded(r)]),
             lambda r, n: [torch.full((2,), n * (n + 1) / 2), torch.full((3,), n * (n + 1) / 2)]),
        Case("all_reduce_coalesced premul_sum with an expand()ed tensor",
             lambda f, r, n: f.all_reduce_coalesced([expanded(r)], "premul:2.0"),
             lambda r, n: [torch.full((3,), n * (n + 1.0))]),
        Case("broadcast_coalesced with an expand()ed tensor",
             lambda f, r, n: f.broadcast_coalesced([expanded(r), torch.ones(2) * r], 1),
             lambda r, n: [torch.full((3,), 2.0), torch.ones(2)]),
        Case("all_gather_into_tensor into an expand()ed output",
             lambda f, r, n: f.all_gather_into_tensor(torch.zeros(1).expand(n),
                                                      torch.ones(1) * (r + 1)),
             lambda r, n: torch.arange(1.0, n + 1)),
        Case("reduce_scatter_tensor into an expand()ed output",
             lambda f, r, n: f.reduce_scatter_tensor(torch.zeros(1).expand(2),
                                                     _values(r, 2 * n)),
             lambda r, n: _reduced(_everyone(n, n=2 * n), "sum")[2 * r:2 * r + 2]),
        Case("all_gather list into an expand()ed output",
             lambda f, r, n: f.all_gather([torch.zeros(1).expand(2) for _ in range(n)],
                                          torch.ones(2) * r),
             lambda r, n: [torch.ones(2) * k for k in range(n)]),
        Case("scatter into an expand()ed output",
             lambda f, r, n: f.scatter(torch.zeros(1).expand(2),
                                       [torch.arange(2.0) + k for k in range(n)]
                                       if r == 0 else None, 0),
             lambda r, n: torch.arange(2.0) + r),
    ]


def _root_only_cases() -> List[Case]:
    """A list only the root holds (gather's outputs, scatter's inputs), refused there
    alone: the others' messages must not be left for the next call to read (rank 1's
    3 floats, the size of the all-reduce that follows each case, read by rank 0's
    all-reduce gave 7 for 3, on both ranks, with no error)."""
    mine = lambda r: torch.ones(3) * (r + 5)  # noqa: E731
    return [
        Case("gather: the root's output list one too long",
             lambda f, r, n: f.gather(mine(r), [torch.zeros(3) for _ in range(n + 1)]
                                      if r == 0 else None, 0), None),
        Case("gather: the root's outputs of another shape",
             lambda f, r, n: f.gather(mine(r), [torch.zeros(1, 3) for _ in range(n)]
                                      if r == 0 else None, 0), None),
        Case("gather: the root's outputs share memory",
             lambda f, r, n: f.gather(mine(r), [torch.zeros(1).expand(3) for _ in range(n)]
                                      if r == 0 else None, 0), None),
        Case("scatter: the root's input list one too long",
             lambda f, r, n: f.scatter(torch.zeros(3), [mine(k) for k in range(n + 1)]
                                       if r == 0 else None, 0), None),
        Case("scatter: the root's inputs of another shape",
             lambda f, r, n: f.scatter(torch.zeros(3), [torch.ones(1, 3) for _ in range(n)]
                                       if r == 0 else None, 0), None),
    ]


# Refused by the root alone; the others have nothing to refuse (gather) or are told
# (scatter). gloo's others wait out the timeout, so gloo does not run them here.
REFUSED_BY_THE_ROOT = tuple(case.name for case in _root_only_cases())
# Cases that end the group. None: a refusal still takes the call's place in the group's
# sequence (an all-reduce of nothing), so splits refused on every rank alike meet and the
# group goes on; refused on one rank alone, the others meet it and raise at once.
BREAKS_THE_GROUP: tuple = ()

CASES = (_reduction_cases() + _layout_cases() + _argument_error_cases()
         + _shared_memory_cases() + _root_only_cases())


def _as_list(value):
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def _right(result, truth) -> bool:
    for got, want in zip(_as_list(result), _as_list(truth)):
        if got.dtype != want.dtype or got.shape != want.shape:
            return False
        if got.is_floating_point() or got.is_complex():
            tolerance = {torch.float16: 1e-2, torch.bfloat16: 1e-1}.get(got.dtype, 1e-5)
            if not torch.allclose(got.to(torch.complex128 if got.is_complex() else
                                         torch.float64),
                                  want.to(torch.complex128 if want.is_complex() else
                                          torch.float64), rtol=tolerance, atol=tolerance,
                                  equal_nan=True):
                return False
        elif not torch.equal(got, want):
            return False
    return len(_as_list(result)) == len(_as_list(truth))


def _survives(face, rank: int, size: int) -> str:
    """'ok' when an all-reduce right after gives the right sum; else what happened."""
    try:
        t = face.all_reduce(torch.full((3,), float(rank + 1)))
    except Exception as error:  # noqa: BLE001 -- the outcome is the result
        return f"raised {type(error).__name__}: {str(error)[:200]}"
    return "ok" if t.tolist() == [size * (size + 1) / 2] * 3 else f"wrong {t.tolist()}"


def _judge(face, case: Case, rank: int, size: int) -> tuple:
    """(outcome, one-line text, survives): outcome 'right' | 'wrong' | 'refused'
    | 'unavailable'."""
    try:
        result = case.call(face, rank, size)
    except Unavailable:
        return ("unavailable", "", "ok")
    except Exception as error:  # noqa: BLE001
        text = f"{type(error).__name__}: {error}"
        return ("refused", text, _survives(face, rank, size))
    truth = case.truth(rank, size) if case.truth is not None else None
    if case.truth is None:  # an argument error done anyway: no value to compare
        outcome = "done"
    elif truth is None:
        outcome = "right"  # (a rank with nothing to receive)
    else:
        outcome = "right" if _right(result, truth) else "wrong"
    text = "" if outcome != "wrong" else \
        f"got {[t.tolist() for t in _as_list(result)]} want {[t.tolist() for t in _as_list(truth)]}"
    return (outcome, text, _survives(face, rank, size))


# gloo aborts the whole process on these (a failed CHECK in ProcessGroupGloo.cpp), or
# its other ranks wait out the timeout: its outcome is known, and not run here
GLOO_ABORTS = ("reduce_scatter_tensor input too small",)
GLOO_SKIPS = GLOO_ABORTS + REFUSED_BY_THE_ROOT


def _fresh_groups_where_broken(comm, faces, row, timeout) -> None:
    """A group that did not survive a case on some rank is made anew on every rank (the
    decision taken over our own communicator, so every rank takes it alike)."""
    for name in ("gloo", "backend"):
        broken = torch.tensor([0 if row[name][2] == "ok" else 1])
        api.all_reduce(broken, "max", comm=comm)
        if broken.item():
            faces[name] = DistFace(dist.new_group(backend="gloo" if name == "gloo"
                                                  else "collectives", timeout=timeout))


def check_sweep(comm, timeout_seconds: float = 20.0, names=None):
    """Every case on gloo, on the "collectives" backend and through our API; returns
    {case: {face: (outcome, text, survives)}} for this rank."""
    import warnings
    warnings.simplefilter("ignore")  # torch's deprecation of the *_tensor names
    rank, size = comm.rank, comm.world_size
    timeout = timedelta(seconds=timeout_seconds)
    faces = {"gloo": DistFace(dist.new_group(backend="gloo", timeout=timeout)),
             "backend": DistFace(dist.new_group(backend="collectives", timeout=timeout)),
             "api": ApiFace(comm)}
    report = {}
    for case in CASES:
        if names is not None and case.name not in names:
            continue
        row = {}
        for name, face in faces.items():
            if name == "gloo" and case.name in GLOO_SKIPS:
                row[name] = ("refused", "(gloo aborts the process, or its others wait "
                             "out the timeout)", "ok")
                continue
            row[name] = _judge(face, case, rank, size)
        report[case.name] = row
        _fresh_groups_where_broken(comm, faces, row, timeout)
    return report
