"""Horovod's collectives (allreduce, allgather, broadcast, alltoall, reducescatter, their
grouped, in-place and async forms, sparse allreduce), each submitted to the engine
(engine.py) under its name with a Meta (negotiation.py), and run by our algorithms
through `collectives.api` once every rank has submitted that name.

Arguments are checked when a collective is submitted, so that nothing can fail on one
rank alone once the ranks have agreed to run it (its peers would wait inside it).

The synchronous forms are differentiable, with the gradients current Horovod computes:
of an allreduce, the same allreduce of the gradient; of an allgather, this rank's rows
of the gradient averaged over ranks; of a broadcast, the gradient averaged over ranks
on the root and zeros elsewhere; of an alltoall, the alltoall back; of a reducescatter,
the allgather of the gradient (times the number of ranks for a sum).

Every collective takes process_set= (process_sets.py): it then runs among that set's
ranks only, its gradient too.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .. import api
from ..transport import Transport
from ..world import get_comm
from .engine import Engine
from .negotiation import Meta
from . import process_sets
from .process_sets import ProcessSet, Scope, global_process_set, scope  # noqa: F401

Average, Sum, Adasum, Min, Max, Product = "avg", "sum", "adasum", "min", "max", "product"
OPS = (Sum, Average, Min, Max, Product)

_engines: dict = {}


def engine() -> Engine:
    """The engine of the current communicator, made on first use (hvd.init() makes it:
    making one is collective, every rank at the same point)."""
    comm = get_comm()
    found = _engines.get(id(comm))
    if found is None or found.parent is not comm:
        if found is not None:
            found.stop()
        found = _engines[id(comm)] = Engine(comm, shadow)
    return found


def forget_engines(wait_seconds: float = 10.0) -> None:
    """Stop every engine, telling the other ranks (hvd.shutdown()); the process sets
    added go with them."""
    for each in _engines.values():
        each.stop()
    for each in _engines.values():
        each.join(wait_seconds)
    _engines.clear()
    process_sets.forget()


def reduce_op(average: Optional[bool], op: Optional[str]) -> str:
    """Horovod's (average, op) pair as one op name; average=None and op=None: Average."""
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass only one of them")
    if op == Adasum:
        raise NotImplementedError("Adasum is not provided; use hvd.Average or hvd.Sum")
    if op is None:
        return Sum if average is False else Average
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Min, "
                         "hvd.Max or hvd.Product")
    return op


def _check(tensor, what: str) -> torch.Tensor:
    """A tensor the collectives can move, or a clear error now (not on one rank later)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what}: a {tensor.layout} tensor; use hvd.sparse_allreduce_async "
                         "for sparse tensors")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: tensors on {tensor.device} are not supported; this face "
                         "runs on CPU tensors")
    if tensor.dtype not in api.SUPPORTED_DTYPES:
        raise ValueError(f"{what}: dtype {tensor.dtype} is not supported")
    return tensor


def _scale(tensor: torch.Tensor, factor: float) -> None:
    """tensor *= factor in place, as Horovod scales: integers in float64, float16 (on
    CPU) in float32, each rounded back to the tensor's dtype (integers toward zero)."""
    if factor == 1.0:
        return
    if not tensor.is_floating_point():
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))
    elif tensor.dtype in (torch.float16, torch.bfloat16):
        tensor.copy_((tensor.float() * factor).to(tensor.dtype))
    else:
        tensor.mul_(factor)


def _reduce_in_place(flat: torch.Tensor, op: str, prescale: float, postscale: float,
                     algorithm: str, comm: Transport) -> None:
    """One flat buffer's allreduce, after negotiation.

    Floats average as `api.all_reduce(op="avg")` does (divided first, so a float16 sum
    cannot overflow). Integers average as Horovod does, the sum scaled by 1/size and
    rounded toward zero (-3 and 0 average to -1), but summed in int64 so that int8 or
    int16 sums do not wrap.
    """
    _scale(flat, prescale)
    if op == Average and not flat.is_floating_point():
        wide = flat.to(torch.int64, copy=True)
        api.all_reduce(wide, op=Sum, algorithm=algorithm, comm=comm, check=False)
        if postscale == 1.0:  # exact, even beyond float64's 2^53
            flat.copy_(torch.div(wide, comm.world_size, rounding_mode="trunc"))
        else:
            flat.copy_((wide.double() * (postscale / comm.world_size)).to(flat.dtype))
        return
    api.all_reduce(flat, op=op, algorithm=algorithm, comm=comm, check=False)
    _scale(flat, postscale)


def _by_dtype(items: Sequence) -> Dict[str, list]:
    """Indices of items grouped by dtype, in the order each dtype first appears (the
    same on every rank, and for a joined rank's zeros: see shadow)."""
    groups: Dict[str, list] = {}
    for index, dtype in enumerate(items):
        groups.setdefault(str(dtype).replace("torch.", ""), []).append(index)
    return groups


def _allreduce_run(tensors: List[torch.Tensor], op: str, prescale: float, postscale: float,
                   algorithm: str = "auto"):
    """Reduce a group of tensors in place: one flat buffer per dtype."""
    def run(metas, comm):
        for indices in _by_dtype([t.dtype for t in tensors]).values():
            group = [tensors[i] for i in indices]
            alone = len(group) == 1 and group[0].is_contiguous()
            # One contiguous tensor is reduced where it lies; a group goes through one
            # fused copy and back.
            flat = group[0].view(-1) if alone else torch.cat([t.reshape(-1) for t in group])
            _reduce_in_place(flat, op, prescale, postscale, algorithm, comm)
            if not alone:
                offset = 0
                for tensor in group:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
        return tensors
    return run


def shadow(meta: Meta, comm: Transport) -> None:
    """A joined rank's part in what the others run: zeros for an allreduce (one buffer
    per dtype, as _allreduce_run makes them); nothing for a barrier."""
    if meta.kind != "allreduce":
        return
    sizes = [int(torch.Size(shape).numel()) for shape in meta.shapes]
    for dtype, indices in _by_dtype(meta.dtypes).items():
        zeros = torch.zeros(sum(sizes[i] for i in indices), dtype=getattr(torch, dtype))
        _reduce_in_place(zeros, meta.op, meta.prescale, meta.postscale, meta.algorithm, comm)


def _allgather_run(tensors: List[torch.Tensor]):
    """Gather each tensor (at least 1-D) along its first dimension, which may differ
    between ranks: every rank's rows padded to the widest, one all-gather per tensor.
    Returns [(gathered, rows of each rank)] per tensor."""
    def run(metas, comm):
        results = []
        for index, tensor in enumerate(tensors):
            counts = [metas[r].shapes[index][0] for r in range(comm.world_size)]
            rest = tuple(tensor.shape[1:])
            per_row = int(torch.Size(rest).numel())
            widest = max(counts)
            mine = torch.zeros(widest * per_row, dtype=tensor.dtype)
            mine[:tensor.numel()] = tensor.reshape(-1)
            gathered = torch.empty(comm.world_size * widest * per_row, dtype=tensor.dtype)
            api.all_gather(gathered, mine, comm=comm, check=False)
            pieces = [gathered[r * widest * per_row:(r * widest + counts[r]) * per_row]
                      for r in range(comm.world_size)]
            results.append((torch.cat(pieces).view(sum(counts), *rest), counts))
        return results
    return run


def _broadcast_run(tensor: torch.Tensor, root_rank: int):
    def run(metas, comm):
        flat = tensor.reshape(-1).clone() if not tensor.is_contiguous() else tensor.view(-1)
        api.broadcast(flat, src=root_rank, comm=comm, check=False)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor
    return run


def _alltoall_run(tensor: torch.Tensor, splits: List[int]):
    """Send splits[p] rows to rank p (rows past their sum stay here, as in Horovod);
    the result: (rows received, concatenated in rank order; how many from each rank)."""
    def run(metas, comm):
        received = [metas[peer].splits[comm.rank] for peer in range(comm.world_size)]
        rest = tuple(tensor.shape[1:])
        inputs = list(torch.split(tensor.contiguous()[:sum(splits)], splits))
        outputs = [tensor.new_empty((count,) + rest) for count in received]
        api.all_to_all(outputs, [i.contiguous() for i in inputs], comm=comm)
        return torch.cat(outputs), received
    return run


def reducescatter_rows(first_dim: int, world_size: int) -> List[int]:
    """How Horovod splits the first dimension: the first (dim % n) ranks get one more."""
    base, extra = divmod(first_dim, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def _reducescatter_run(tensors: List[torch.Tensor], op: str, prescale: float,
                       postscale: float):
    """Reduce each tensor over ranks and keep this rank's rows of it (Horovod's split:
    reducescatter_rows); the result: one tensor per input."""
    def run(metas, comm):
        return [_reducescatter_one(t, op, prescale, postscale, comm) for t in tensors]
    return run


def _reducescatter_one(tensor: torch.Tensor, op: str, prescale: float, postscale: float,
                       comm: Transport) -> torch.Tensor:
    rows = reducescatter_rows(tensor.shape[0], comm.world_size)
    per_row = tensor[0].numel() if tensor.shape[0] else 0
    widest = max(rows)
    # Each rank's share padded to the widest, so the ring's equal chunks line up.
    padded = tensor.new_zeros(comm.world_size * widest * per_row)
    start = 0
    for rank, count in enumerate(rows):
        padded[rank * widest * per_row:(rank * widest + count) * per_row] = \
            tensor[start:start + count].reshape(-1)
        start += count
    _scale(padded, prescale)
    out = tensor.new_empty(widest * per_row)
    if op == Average and not tensor.is_floating_point():
        # Summed in int64, then scaled once by postscale / size and rounded toward zero,
        # as allreduce's (_reduce_in_place): dividing first and scaling after would
        # round twice (2 + 5 averaged with postscale 2: 6, where trunc(7 * 2 / 2) is 7).
        wide = torch.empty(widest * per_row, dtype=torch.int64)
        api.reduce_scatter(wide, padded.to(torch.int64), op=Sum, comm=comm, check=False)
        if postscale == 1.0:  # exact, even beyond float64's 2^53
            out.copy_(torch.div(wide, comm.world_size, rounding_mode="trunc"))
        else:
            out.copy_((wide.double() * (postscale / comm.world_size)).to(out.dtype))
    else:
        api.reduce_scatter(out, padded, op=op, comm=comm, check=False)
        _scale(out, postscale)
    mine = rows[comm.rank]
    return out[:mine * per_row].view((mine,) + tuple(tensor.shape[1:]))


# --- submitting ---------------------------------------------------------------------------
# Each returns a handle number; `then` turns the engine's result into what
# synchronize(handle) returns (the caller's own tensor for the in-place forms). `where`
# is the Scope (process_sets.py) the collective runs in.
def _submit_allreduce(tensors, op, prescale, postscale, name, where: Scope,
                      algorithm="auto", kind="allreduce", then=None) -> int:
    """Reduce `tensors` (this rank's, in place) under `name`."""
    for tensor in tensors:
        _check(tensor, kind)
    meta = Meta.of("allreduce", tensors, op=op, prescale=prescale, postscale=postscale,
                   algorithm=algorithm, process_set=where.id)
    return engine().submit(kind, name, meta, _allreduce_run(list(tensors), op, prescale,
                                                            postscale, algorithm), then)


def _submit_allgather(tensors, name, where: Scope, kind="allgather", then=None) -> int:
    """Gather tensors under one name; the result: [(gathered, rows per rank)] per tensor."""
    shaped = []
    for tensor in tensors:
        tensor = _check(tensor, kind).detach().contiguous()
        shaped.append(tensor if tensor.dim() else tensor.reshape(1))
    return engine().submit(kind, name, Meta.of("allgather", shaped, process_set=where.id),
                           _allgather_run(shaped), then)


def _submit_broadcast(tensor, root_rank, name, where: Scope, then=None) -> int:
    """Broadcast from root_rank, a rank of the job (as in Horovod) that is in the set."""
    _check(tensor, "broadcast")
    if not isinstance(root_rank, int) or root_rank not in where.ranks:
        raise ValueError(f"broadcast: root_rank {root_rank!r} is not a rank of the process "
                         f"set (ranks {list(where.ranks)})")
    meta = Meta.of("broadcast", [tensor], root=root_rank, process_set=where.id)
    return engine().submit("broadcast", name, meta,
                           _broadcast_run(tensor, where.ranks.index(root_rank)), then)


def _submit_alltoall(tensor, splits: List[int], name, where: Scope, then=None) -> int:
    """The result: (rows received, how many from each rank)."""
    _check(tensor, "alltoall")
    meta = Meta.of("alltoall", [tensor], splits=tuple(splits), process_set=where.id)
    return engine().submit("alltoall", name, meta, _alltoall_run(tensor, splits), then)


def _submit_reducescatter(tensors, op, prescale, postscale, name, where: Scope,
                          kind="reducescatter", then=None) -> int:
    """The result: this rank's rows of each tensor's reduction."""
    tensors = [_check(t, kind).detach().contiguous() for t in tensors]
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{kind}: a scalar has no first dimension to scatter")
    meta = Meta.of("reducescatter", tensors, op=op, prescale=prescale, postscale=postscale,
                   process_set=where.id)
    return engine().submit(kind, name, meta,
                           _reducescatter_run(tensors, op, prescale, postscale), then)


def _gathered_tensor(results):
    return results[0][0]


def _first(results):
    return results[0]


# --- autograd ---------------------------------------------------------------------------
# Each forward gets the Scope of its process set; backward runs in the same set.
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, where):
        ctx.op, ctx.prescale, ctx.postscale, ctx.where = op, prescale, postscale, where
        out = tensor.detach().clone()
        synchronize(_submit_allreduce([out], op, prescale, postscale, name, where))
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        synchronize(_submit_allreduce([out], ctx.op, ctx.prescale, ctx.postscale, None,
                                      ctx.where))
        return out, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, name, where, *tensors):
        ctx.op, ctx.prescale, ctx.postscale, ctx.where = op, prescale, postscale, where
        outs = [t.detach().clone() for t in tensors]
        synchronize(_submit_allreduce(outs, op, prescale, postscale, name, where,
                                      kind="grouped_allreduce"))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        outs = [g.contiguous().clone() for g in grads]
        synchronize(_submit_allreduce(outs, ctx.op, ctx.prescale, ctx.postscale, None,
                                      ctx.where, kind="grouped_allreduce"))
        return (None, None, None, None, None, *outs)


def _average_over_ranks(grad: torch.Tensor, where: Scope) -> torch.Tensor:
    out = grad.contiguous().clone()
    synchronize(_submit_allreduce([out], Average, 1.0, 1.0, None, where))
    return out


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, where):
        [(gathered, counts)] = synchronize(_submit_allgather([tensor], name, where))
        ctx.counts, ctx.where = counts, where
        return gathered

    @staticmethod
    def backward(ctx, grad):
        averaged = _average_over_ranks(grad, ctx.where)
        start = sum(ctx.counts[:ctx.where.rank])
        return averaged[start:start + ctx.counts[ctx.where.rank]], None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, where):
        ctx.root_rank, ctx.where = root_rank, where
        return synchronize(_submit_broadcast(tensor.detach().clone(), root_rank, name, where))

    @staticmethod
    def backward(ctx, grad):
        averaged = _average_over_ranks(grad, ctx.where)
        if get_comm().rank != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, where, *tensors):
        results = synchronize(_submit_allgather(list(tensors), name, where,
                                                "grouped_allgather"))
        ctx.counts, ctx.where = [counts for _, counts in results], where
        return tuple(gathered for gathered, _ in results)

    @staticmethod
    def backward(ctx, *grads):
        mine, rank = [], ctx.where.rank
        for grad, counts in zip(grads, ctx.counts):
            averaged = _average_over_ranks(grad, ctx.where)
            start = sum(counts[:rank])
            mine.append(averaged[start:start + counts[rank]])
        return (None, None, *mine)


class _Alltoall(torch.autograd.Function):
    """Returns the rows received, and (when splits were given, as Horovod returns
    them) how many came from each rank, an int32 tensor that has no gradient."""

    @staticmethod
    def forward(ctx, tensor, splits, name, with_splits, where):
        out, received = synchronize(_submit_alltoall(tensor.detach(), splits, name, where))
        ctx.received, ctx.rows, ctx.where = received, tensor.shape[0], where
        if not with_splits:
            return out
        received = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_no_gradient_for_splits):
        back, _ = synchronize(_submit_alltoall(grad.contiguous(), ctx.received, None,
                                               ctx.where))
        if back.shape[0] < ctx.rows:  # rows past the splits' sum were not sent
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0],)
                                                   + tuple(back.shape[1:]))])
        return back, None, None, None, None


class _Reducescatter(torch.autograd.Function):
    """One or several tensors (grouped_reducescatter) under one name."""

    @staticmethod
    def forward(ctx, kind, op, prescale, postscale, name, where, *tensors):
        ctx.op, ctx.scale, ctx.where = op, prescale * postscale, where
        return tuple(synchronize(_submit_reducescatter(tensors, op, prescale, postscale,
                                                       name, where, kind)))

    @staticmethod
    def backward(ctx, *grads):
        # As current Horovod: the gradient, times the number of ranks for a sum, times
        # the scale factors, gathered from every rank of the set.
        factor = ctx.scale * (ctx.where.size if ctx.op == Sum else 1)
        results = synchronize(_submit_allgather([g * factor for g in grads], None,
                                                ctx.where, "grouped_allgather"))
        return (None, None, None, None, None, None, *[gathered for gathered, _ in results])


# --- the public functions ----------------------------------------------------------------
# process_set=: the ranks the collective runs among (process_sets.py); every rank of the
# set must submit it, and only they may.
def allreduce(tensor, average=None, name=None, compression=None, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction of `tensor` over ranks, as a new tensor (Average by default)."""
    where, reduce = scope(process_set), reduce_op(average, op)
    if compression is None:
        return _Allreduce.apply(tensor, reduce, prescale_factor, postscale_factor, name, where)
    sent, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(sent, reduce, prescale_factor, postscale_factor, name, where)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduce `tensor` over ranks in place; returns it."""
    synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                 postscale_factor, process_set))
    return tensor


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a copy of `tensor`; synchronize(handle) returns the result."""
    return allreduce_async_(_check(tensor, "allreduce").detach().clone(), average, name, op,
                            prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing `tensor` in place; synchronize(handle) returns it."""
    return _submit_allreduce([tensor.detach()], reduce_op(average, op), prescale_factor,
                             postscale_factor, name, scope(process_set),
                             then=lambda _: tensor)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduce a list of tensors together (one fused buffer per dtype); new tensors."""
    where, reduce = scope(process_set), reduce_op(average, op)
    if compression is None:
        return list(_GroupedAllreduce.apply(reduce, prescale_factor, postscale_factor, name,
                                            where, *tensors))
    sent = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(reduce, prescale_factor, postscale_factor, name,
                                      where, *[s for s, _ in sent])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, sent)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    return grouped_allreduce_async_([_check(t, "grouped_allreduce").detach().clone()
                                     for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    tensors = list(tensors)
    return _submit_allreduce([t.detach() for t in tensors], reduce_op(average, op),
                             prescale_factor, postscale_factor, name, scope(process_set),
                             kind="grouped_allreduce", then=lambda _: tensors)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor, concatenated along the first dimension (which may differ)."""
    return _Allgather.apply(tensor, name, scope(process_set))


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    return _submit_allgather([tensor], name, scope(process_set), then=_gathered_tensor)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Several allgathers negotiated as one, under one name; differentiable."""
    return list(_GroupedAllgather.apply(name, scope(process_set), *tensors))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    return _submit_allgather(list(tensors), name, scope(process_set), "grouped_allgather",
                             then=lambda results: [gathered for gathered, _ in results])


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank root_rank's tensor, as a new tensor on every rank (root_rank is a rank of
    the job, hvd.rank(), also in a process set)."""
    return _Broadcast.apply(tensor, root_rank, name, scope(process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite `tensor` with rank root_rank's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return broadcast_async_(_check(tensor, "broadcast").detach().clone(), root_rank, name,
                            process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return _submit_broadcast(tensor.detach(), root_rank, name, scope(process_set),
                             then=lambda _: tensor)


def _check_splits(tensor: torch.Tensor, splits, size: int) -> List[int]:
    """Horovod's alltoall splits: None (or empty) for equal parts; else int32 (a list is
    taken as int32), one count per rank of the set, summing to at most the first
    dimension (rows past the sum are not sent)."""
    if _check(tensor, "alltoall").dim() == 0:
        # Horovod's words; refused here, on the caller's thread, so the engine never
        # meets a tensor it cannot cut into rows
        raise ValueError("alltoall: tried to alltoall a rank-zero tensor; it needs a first "
                         "dimension to split (reshape it to (1,))")
    first = tensor.shape[0]
    if splits is not None and not isinstance(splits, torch.Tensor):
        splits = torch.tensor(list(splits), dtype=torch.int32)
    if splits is None or splits.numel() == 0:
        if first % size:
            raise ValueError(f"alltoall: the first dimension ({first}) is not divisible by "
                             f"the number of ranks ({size}); pass splits")
        return [first // size] * size
    if splits.dtype != torch.int32 or splits.dim() != 1:
        raise ValueError(f"alltoall: splits must be a 1-D torch.int32 tensor, got "
                         f"{splits.dtype} of shape {tuple(splits.shape)}")
    values = splits.tolist()
    if len(values) != size or any(v < 0 for v in values) or sum(values) > first:
        raise ValueError(f"alltoall: splits {values} must hold {size} non-negative counts "
                         f"that sum to at most the first dimension ({first})")
    return values


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send splits[p] rows of `tensor` to the set's p-th rank (equal parts by default).
    Returns the rows received from every rank, concatenated in rank order; when splits
    are given, as current Horovod, (those rows, an int32 tensor of how many came from
    each rank). Differentiable: the gradient is the alltoall back."""
    where = scope(process_set)
    return _Alltoall.apply(tensor, _check_splits(tensor, splits, where.size), name,
                           splits is not None, where)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; synchronize(handle) returns (rows received, received splits)
    with or without splits, as Horovod's does."""
    where = scope(process_set)
    return _submit_alltoall(tensor.detach(), _check_splits(tensor, splits, where.size), name,
                            where, then=lambda result: (result[0], torch.tensor(
                                result[1], dtype=torch.int32)))


def reducescatter(tensor, name=None, compression=None, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` over ranks and give each rank its part of the first dimension
    (the first dim % size ranks get one row more). Horovod's arguments, in its order."""
    where, reduce = scope(process_set), reduce_op(None, op)
    sent, ctx = (tensor, None) if compression is None else compression.compress(tensor)
    [out] = _Reducescatter.apply("reducescatter", reduce, prescale_factor, postscale_factor,
                                 name, where, sent)
    return out if compression is None else compression.decompress(out, ctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    return _submit_reducescatter([tensor], reduce_op(None, op), prescale_factor,
                                 postscale_factor, name, scope(process_set), then=_first)


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Several reducescatters negotiated as one, under one name; differentiable."""
    where, reduce = scope(process_set), reduce_op(None, op)
    sent = [(t, None) if compression is None else compression.compress(t) for t in tensors]
    outs = _Reducescatter.apply("grouped_reducescatter", reduce, prescale_factor,
                                postscale_factor, name, where, *[s for s, _ in sent])
    return [out if compression is None else compression.decompress(out, ctx)
            for out, (_, ctx) in zip(outs, sent)]


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> int:
    return _submit_reducescatter(list(tensors), reduce_op(None, op), prescale_factor,
                                 postscale_factor, name, scope(process_set),
                                 kind="grouped_reducescatter")


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse tensor as Horovod does: an allgather of every rank's
    indices and one of its values, under `<name>.indices` and `<name>.values`. Returns
    a function that waits and gives the reduced sparse tensor: the gathered entries,
    duplicates summed only when the result is coalesced (values divided by the number
    of ranks for hvd.Average). A dense allreduce of the same tensors gives the same
    values; this moves only the non-zeros."""
    where = scope(process_set)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async takes a sparse COO tensor")
    op = reduce_op(None, op)
    if op not in (Sum, Average):
        raise ValueError(f"sparse allreduce sums or averages; op {op!r} is not provided")
    # allgather joins along the first dimension: one row per non-zero, so the indices
    # (sparse_dim x nnz) go transposed and come back transposed.
    indices_handle = allgather_async(tensor._indices().t().contiguous(), f"{name}.indices",
                                     process_set)
    values_handle = allgather_async(tensor._values().contiguous(), f"{name}.values",
                                    process_set)

    def wait():
        try:  # both handles end, whatever either raises: their names are free again
            values = synchronize(values_handle)
        finally:
            indices = synchronize(indices_handle)
        if op == Average:
            values = values / where.size
        return torch.sparse_coo_tensor(indices.t(), values, tensor.size(),
                                       check_invariants=True)
    return wait


# --- handles --------------------------------------------------------------------------------
def poll(handle: int) -> bool:
    """True once the operation behind `handle` has finished (never blocks)."""
    return engine().poll(handle)


def synchronize(handle: int):
    """Wait for the operation behind `handle`; return its output (raise its error)."""
    return engine().synchronize(handle)


def join(device: int = -1) -> int:
    """This rank is out of work: take part in the others' allreduces with zeros until
    every rank has joined. Returns the rank that joined last. Like any collective, it
    fails (HorovodInternalError, naming the ranks that have not joined) once it has
    waited the stall timeout with no other rank joining and nothing running."""
    return synchronize(engine().submit_join())


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set reaches the barrier: a collective with nothing
    to move, ready once every rank of the set has submitted it."""
    meta = Meta("barrier", process_set=scope(process_set).id)
    synchronize(engine().submit("barrier", "noname", meta, lambda metas, comm: None))
