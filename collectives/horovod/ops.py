"""Horovod's collectives (allreduce, allgather, broadcast, alltoall, reducescatter, their
grouped, in-place and async forms, sparse allreduce), each submitted to the engine
(engine.py) under its name with a Meta (negotiation.py), and run by our algorithms
(runs.py) once every rank has submitted that name.

Arguments are checked when a collective is submitted (`_checked`, `_check_splits`), so
that nothing can fail on one rank alone once the ranks have agreed to run it (its peers
would wait inside it). What the checks refuse is announced under the call's name all
the same (engine.Engine.refusing): some arguments are each rank's own (alltoall's
splits, a tensor's dtype), and a call refused on one rank alone then fails on every
rank, with a line naming that rank and why, instead of leaving its peers' calls to
pair with that rank's next one. The rank that refused raises its own error at once.

The synchronous forms are differentiable, with the gradients current Horovod computes:
of an allreduce, the same allreduce of the gradient; of an allgather, this rank's rows
of the gradient averaged over ranks; of a broadcast, the gradient averaged over ranks
on the root and zeros elsewhere; of an alltoall, the alltoall back; of a reducescatter,
the allgather of the gradient (times the number of ranks for a sum).

Every collective takes process_set= (process_sets.py): it then runs among that set's
ranks only, its gradient too.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import api
from ..world import get_comm
from .engine import engine
from .negotiation import Meta
from .process_sets import ProcessSet, Scope, global_process_set, scope  # noqa: F401
from .runs import (OPS, Adasum, Average, Max, Min, Product, Sum,  # noqa: F401
                   allgather_run, allreduce_run, alltoall_run, broadcast_run,
                   reducescatter_run)


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


REDUCTIONS = ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter")


def _checked(kind: str, name, where: Scope, tensors, average=None, op=None,
             root_rank=None) -> Optional[str]:
    """Check one call's arguments on the caller's thread: each tensor (_check), a
    reduction's (average, op), a reducescatter's first dimension, a broadcast's root.
    Returns the reduction op (None for the others). A refusal is announced under the
    call's name before it is raised here (engine.Engine.refusing): the call fails on
    every rank, and the next calls pair as before."""
    with engine().refusing(kind, name, where.id):
        reduce = reduce_op(average, op) if kind in REDUCTIONS else None
        for tensor in tensors:
            _check(tensor, kind)
            if kind.endswith("reducescatter") and tensor.dim() == 0:
                raise ValueError(f"{kind}: a scalar has no first dimension to scatter")
        if kind == "broadcast" and (not isinstance(root_rank, int)
                                    or root_rank not in where.ranks):
            raise ValueError(f"broadcast: root_rank {root_rank!r} is not a rank of the "
                             f"process set (ranks {list(where.ranks)})")
        return reduce


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


# --- submitting ---------------------------------------------------------------------------
# Each returns a handle number; `then` turns the engine's result into what
# synchronize(handle) returns (the caller's own tensor for the in-place forms). `where`
# is the Scope (process_sets.py) the collective runs in. The public functions have
# checked the arguments (_checked); the tensors are checked again here for the callers
# that come straight here (DistributedOptimizer, the backward passes), whose tensors
# are their own.
def _submit_allreduce(tensors, op, prescale, postscale, name, where: Scope,
                      algorithm="auto", kind="allreduce", then=None) -> int:
    """Reduce `tensors` (this rank's, in place) under `name`."""
    for tensor in tensors:
        _check(tensor, kind)
    meta = Meta.of("allreduce", tensors, op=op, prescale=prescale, postscale=postscale,
                   algorithm=algorithm, process_set=where.id)
    return engine().submit(kind, name, meta, allreduce_run(list(tensors), op, prescale,
                                                           postscale, algorithm), then)


def _submit_allgather(tensors, name, where: Scope, kind="allgather", then=None) -> int:
    """Gather tensors under one name; the result: [(gathered, rows per rank)] per tensor."""
    shaped = []
    for tensor in tensors:
        tensor = _check(tensor, kind).detach().contiguous()
        shaped.append(tensor if tensor.dim() else tensor.reshape(1))
    return engine().submit(kind, name, Meta.of("allgather", shaped, process_set=where.id),
                           allgather_run(shaped), then)


def _submit_broadcast(tensor, root_rank, name, where: Scope, then=None) -> int:
    """Broadcast from root_rank, a rank of the job (as in Horovod) that is in the set."""
    _check(tensor, "broadcast")
    meta = Meta.of("broadcast", [tensor], root=root_rank, process_set=where.id)
    return engine().submit("broadcast", name, meta,
                           broadcast_run(tensor, where.ranks.index(root_rank)), then)


def _submit_alltoall(tensor, splits: List[int], name, where: Scope, then=None) -> int:
    """The result: (rows received, how many from each rank)."""
    _check(tensor, "alltoall")
    meta = Meta.of("alltoall", [tensor], splits=tuple(splits), process_set=where.id)
    return engine().submit("alltoall", name, meta, alltoall_run(tensor, splits), then)


def _submit_reducescatter(tensors, op, prescale, postscale, name, where: Scope,
                          kind="reducescatter", then=None) -> int:
    """The result: this rank's rows of each tensor's reduction."""
    tensors = [_check(t, kind).detach().contiguous() for t in tensors]
    meta = Meta.of("reducescatter", tensors, op=op, prescale=prescale, postscale=postscale,
                   process_set=where.id)
    return engine().submit(kind, name, meta,
                           reducescatter_run(tensors, op, prescale, postscale), then)


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
    where = scope(process_set)
    reduce = _checked("allreduce", name, where, [tensor], average, op)
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
    where = scope(process_set)
    reduce = _checked("allreduce", name, where, [tensor], average, op)
    copy = tensor.detach().clone()
    return _submit_allreduce([copy], reduce, prescale_factor, postscale_factor, name, where,
                             then=lambda _: copy)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing `tensor` in place; synchronize(handle) returns it."""
    where = scope(process_set)
    reduce = _checked("allreduce", name, where, [tensor], average, op)
    return _submit_allreduce([tensor.detach()], reduce, prescale_factor, postscale_factor,
                             name, where, then=lambda _: tensor)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduce a list of tensors together (one fused buffer per dtype); new tensors."""
    tensors, where = list(tensors), scope(process_set)
    reduce = _checked("grouped_allreduce", name, where, tensors, average, op)
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
    tensors, where = list(tensors), scope(process_set)
    reduce = _checked("grouped_allreduce", name, where, tensors, average, op)
    copies = [t.detach().clone() for t in tensors]
    return _submit_allreduce(copies, reduce, prescale_factor, postscale_factor, name, where,
                             kind="grouped_allreduce", then=lambda _: copies)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    tensors, where = list(tensors), scope(process_set)
    reduce = _checked("grouped_allreduce", name, where, tensors, average, op)
    return _submit_allreduce([t.detach() for t in tensors], reduce, prescale_factor,
                             postscale_factor, name, where, kind="grouped_allreduce",
                             then=lambda _: tensors)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor, concatenated along the first dimension (which may differ)."""
    where = scope(process_set)
    _checked("allgather", name, where, [tensor])
    return _Allgather.apply(tensor, name, where)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    where = scope(process_set)
    _checked("allgather", name, where, [tensor])
    return _submit_allgather([tensor], name, where, then=_gathered_tensor)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Several allgathers negotiated as one, under one name; differentiable."""
    tensors, where = list(tensors), scope(process_set)
    _checked("grouped_allgather", name, where, tensors)
    return list(_GroupedAllgather.apply(name, where, *tensors))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    tensors, where = list(tensors), scope(process_set)
    _checked("grouped_allgather", name, where, tensors)
    return _submit_allgather(tensors, name, where, "grouped_allgather",
                             then=lambda results: [gathered for gathered, _ in results])


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank root_rank's tensor, as a new tensor on every rank (root_rank is a rank of
    the job, hvd.rank(), also in a process set)."""
    where = scope(process_set)
    _checked("broadcast", name, where, [tensor], root_rank=root_rank)
    return _Broadcast.apply(tensor, root_rank, name, where)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite `tensor` with rank root_rank's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    where = scope(process_set)
    _checked("broadcast", name, where, [tensor], root_rank=root_rank)
    copy = tensor.detach().clone()
    return _submit_broadcast(copy, root_rank, name, where, then=lambda _: copy)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    where = scope(process_set)
    _checked("broadcast", name, where, [tensor], root_rank=root_rank)
    return _submit_broadcast(tensor.detach(), root_rank, name, where, then=lambda _: tensor)


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
    with engine().refusing("alltoall", name, where.id):  # splits: this rank's own
        counts = _check_splits(tensor, splits, where.size)
    return _Alltoall.apply(tensor, counts, name, splits is not None, where)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; synchronize(handle) returns (rows received, received splits)
    with or without splits, as Horovod's does."""
    where = scope(process_set)
    with engine().refusing("alltoall", name, where.id):
        counts = _check_splits(tensor, splits, where.size)
    return _submit_alltoall(tensor.detach(), counts, name, where,
                            then=lambda result: (result[0], torch.tensor(
                                result[1], dtype=torch.int32)))


def reducescatter(tensor, name=None, compression=None, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` over ranks and give each rank its part of the first dimension
    (the first dim % size ranks get one row more). Horovod's arguments, in its order."""
    where = scope(process_set)
    reduce = _checked("reducescatter", name, where, [tensor], None, op)
    sent, ctx = (tensor, None) if compression is None else compression.compress(tensor)
    [out] = _Reducescatter.apply("reducescatter", reduce, prescale_factor, postscale_factor,
                                 name, where, sent)
    return out if compression is None else compression.decompress(out, ctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    where = scope(process_set)
    reduce = _checked("reducescatter", name, where, [tensor], None, op)
    return _submit_reducescatter([tensor], reduce, prescale_factor, postscale_factor, name,
                                 where, then=_first)


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Several reducescatters negotiated as one, under one name; differentiable."""
    tensors, where = list(tensors), scope(process_set)
    reduce = _checked("grouped_reducescatter", name, where, tensors, None, op)
    sent = [(t, None) if compression is None else compression.compress(t) for t in tensors]
    outs = _Reducescatter.apply("grouped_reducescatter", reduce, prescale_factor,
                                postscale_factor, name, where, *[s for s, _ in sent])
    return [out if compression is None else compression.decompress(out, ctx)
            for out, (_, ctx) in zip(outs, sent)]


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> int:
    tensors, where = list(tensors), scope(process_set)
    reduce = _checked("grouped_reducescatter", name, where, tensors, None, op)
    return _submit_reducescatter(tensors, reduce, prescale_factor, postscale_factor, name,
                                 where, kind="grouped_reducescatter")


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse tensor as Horovod does: an allgather of every rank's
    indices and one of its values, under `<name>.indices` and `<name>.values`. Returns
    a function that waits and gives the reduced sparse tensor: the gathered entries,
    duplicates summed only when the result is coalesced (values divided by the number
    of ranks for hvd.Average). A dense allreduce of the same tensors gives the same
    values; this moves only the non-zeros."""
    where = scope(process_set)
    # refused: both of its allgathers, on every rank
    with engine().refusing("allgather", f"{name}.indices", where.id), \
            engine().refusing("allgather", f"{name}.values", where.id):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
            raise ValueError("sparse_allreduce_async takes a sparse COO tensor")
        op = reduce_op(None, op)
        if op not in (Sum, Average):
            raise ValueError(f"sparse allreduce sums or averages; op {op!r} is not provided")
        _check(tensor._indices(), "allgather")  # here, while a refusal fails both names:
        _check(tensor._values(), "allgather")   # not after the first allgather has gone
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
