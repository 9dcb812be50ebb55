"""Horovod's collectives (allreduce, allgather, broadcast, alltoall, reducescatter, their
grouped, in-place and async forms), each a job on the engine (engine.py) that
negotiates and then runs our algorithms through `collectives.api`.

The synchronous forms are differentiable, as Horovod's are: the gradient of an
allreduce is the same allreduce of the gradient; of an allgather, this rank's slice of
the summed gradient; of a broadcast, the summed gradient on the root and zeros
elsewhere; of an alltoall, the alltoall back.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import api
from ..world import get_comm
from .engine import ALGORITHMS, OPS, Call, Engine, Rows

Average, Sum, Adasum, Min, Max, Product = "avg", "sum", "adasum", "min", "max", "product"

_engines: dict = {}


def engine() -> Engine:
    """The engine of the current communicator (made on first use)."""
    comm = get_comm()
    found = _engines.get(id(comm))
    if found is None or found.comm is not comm:
        found = _engines[id(comm)] = Engine(comm)
    return found


def forget_engines() -> None:
    """Stop every engine (hvd.shutdown())."""
    for each in _engines.values():
        each.close()
    _engines.clear()


class ProcessSet:
    """Horovod's process sets; only the global one (every rank) is provided."""

    def __init__(self, ranks=None):
        self.ranks = ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


def _global_only(process_set) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError("process sets other than hvd.global_process_set are not "
                                  "provided")


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


def _scale(tensor: torch.Tensor, factor: float) -> None:
    """tensor *= factor in place, as Horovod scales: integers in float64, float16 (on
    CPU) in float32, each rounded back to the tensor's dtype."""
    if factor == 1.0:
        return
    if not tensor.is_floating_point():
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))
    elif tensor.dtype in (torch.float16, torch.bfloat16):
        tensor.copy_((tensor.float() * factor).to(tensor.dtype))
    else:
        tensor.mul_(factor)


def _reduce_in_place(flat: torch.Tensor, op: str, prescale: float, postscale: float,
                     algorithm: str = "auto") -> None:
    """The allreduce itself (on the engine thread, after negotiation)."""
    comm = get_comm()
    _scale(flat, prescale)
    api.all_reduce(flat, op=op, algorithm=algorithm, comm=comm, check=False)
    _scale(flat, postscale)


def shadow_allreduce(row: List[int]) -> None:
    """A joined rank's part in another rank's allreduce: zeros of its dtype and size."""
    zeros = torch.zeros(row[6], dtype=api.SUPPORTED_DTYPES[row[2]])
    _reduce_in_place(zeros, OPS[row[7]], 1.0, 1.0, ALGORITHMS[row[9]])


# --- the jobs (each runs on the engine thread) -------------------------------------------
def allreduce_job(tensors: Sequence[torch.Tensor], op: str, prescale: float,
                  postscale: float, algorithm: str = "auto"):
    """Reduce a group of tensors in place, one flat buffer (and negotiation) per dtype."""
    def job():
        groups = {}
        for tensor in tensors:
            groups.setdefault(tensor.dtype, []).append(tensor)
        for group in groups.values():
            alone = len(group) == 1 and group[0].is_contiguous()
            # One contiguous tensor is reduced where it lies; a group goes through one
            # fused copy and back.
            flat = group[0].view(-1) if alone else torch.cat([t.reshape(-1) for t in group])
            rows = engine().negotiate(Call("allreduce", _shape_probe(group, flat), op,
                                           algorithm=algorithm))
            rows.check()
            _reduce_in_place(flat, op, prescale, postscale, algorithm)
            if alone:
                continue
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        return list(tensors)
    return job


def _shape_probe(group, flat):
    """What the negotiation row describes: the tensor itself, or a group's flat buffer."""
    return group[0] if len(group) == 1 else flat


def _allgather_job(tensor: torch.Tensor):
    def job():
        comm = get_comm()
        shaped = tensor if tensor.dim() else tensor.reshape(1)
        rows: Rows = engine().negotiate(Call("allgather", shaped))
        rows.check()
        counts = rows.first_dims()
        rest = tuple(shaped.shape[1:])
        per_row = shaped[0].numel() if shaped.shape[0] else int(torch.tensor(rest).prod())
        widest = max(counts)
        mine = torch.zeros(widest * per_row, dtype=shaped.dtype)
        mine[:shaped.numel()] = shaped.reshape(-1)
        gathered = torch.empty(comm.world_size * widest * per_row, dtype=shaped.dtype)
        api.all_gather(gathered, mine, comm=comm, check=False)
        pieces = [gathered[r * widest * per_row:(r * widest + counts[r]) * per_row]
                  for r in range(comm.world_size)]
        return torch.cat(pieces).view(sum(counts), *rest), counts
    return job


def _broadcast_job(tensor: torch.Tensor, root_rank: int):
    def job():
        comm = get_comm()
        if not 0 <= root_rank < comm.world_size:
            raise ValueError(f"root_rank {root_rank} is not a rank of {comm.world_size}")
        engine().negotiate(Call("broadcast", tensor, root=root_rank)).check()
        flat = tensor.reshape(-1).clone() if not tensor.is_contiguous() else tensor.view(-1)
        api.broadcast(flat, src=root_rank, comm=comm, check=False)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor
    return job


def _alltoall_job(tensor: torch.Tensor, splits: List[int]):
    def job():
        comm = get_comm()
        engine().negotiate(Call("alltoall", tensor)).check()
        matrix = api.gather_rows(comm, splits)  # matrix[a][b]: rows a sends to b
        received = [matrix[peer][comm.rank] for peer in range(comm.world_size)]
        rest = tuple(tensor.shape[1:])
        inputs = list(torch.split(tensor.contiguous(), splits))
        outputs = [tensor.new_empty((count,) + rest) for count in received]
        api.all_to_all(outputs, inputs, comm=comm)
        return torch.cat(outputs), received
    return job


def reducescatter_rows(first_dim: int, world_size: int) -> List[int]:
    """How Horovod splits the first dimension: the first (dim % n) ranks get one more."""
    base, extra = divmod(first_dim, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def _reducescatter_job(tensor: torch.Tensor, op: str, prescale: float, postscale: float):
    def job():
        comm = get_comm()
        shaped = tensor if tensor.dim() else tensor.reshape(1)
        engine().negotiate(Call("reducescatter", shaped, op)).check()
        rows = reducescatter_rows(shaped.shape[0], comm.world_size)
        per_row = shaped[0].numel() if shaped.shape[0] else 0
        widest = max(rows)
        # Each rank's share padded to the widest, so the ring's equal chunks line up.
        padded = shaped.new_zeros(comm.world_size * widest * per_row)
        start = 0
        for rank, count in enumerate(rows):
            padded[rank * widest * per_row:(rank * widest + count) * per_row] = \
                shaped[start:start + count].reshape(-1)
            start += count
        _scale(padded, prescale)
        out = shaped.new_empty(widest * per_row)
        api.reduce_scatter(out, padded, op=op, comm=comm, check=False)
        _scale(out, postscale)
        mine = rows[comm.rank]
        return out[:mine * per_row].view((mine,) + tuple(shaped.shape[1:]))
    return job


# --- autograd ---------------------------------------------------------------------------
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name):
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        out = tensor.detach().clone()
        engine().run(allreduce_job([out], op, prescale, postscale), name, "allreduce")
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        engine().run(allreduce_job([out], ctx.op, ctx.prescale, ctx.postscale))
        return out, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, name, *tensors):
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        outs = [t.detach().clone() for t in tensors]
        engine().run(allreduce_job(outs, op, prescale, postscale), name, "allreduce")
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        outs = [g.contiguous().clone() for g in grads]
        engine().run(allreduce_job(outs, ctx.op, ctx.prescale, ctx.postscale))
        return (None, None, None, None, *outs)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        gathered, counts = engine().run(_allgather_job(tensor.detach().contiguous()), name, "allgather")
        ctx.counts, ctx.rank = counts, get_comm().rank
        return gathered

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        engine().run(allreduce_job([summed], Sum, 1.0, 1.0))
        start = sum(ctx.counts[:ctx.rank])
        return summed[start:start + ctx.counts[ctx.rank]], None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        out = tensor.detach().clone()
        return engine().run(_broadcast_job(out, root_rank), name, "broadcast")

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        engine().run(allreduce_job([summed], Sum, 1.0, 1.0))
        if get_comm().rank != ctx.root_rank:
            summed.zero_()
        return summed, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, received = engine().run(_alltoall_job(tensor.detach(), splits), name, "alltoall")
        ctx.received = received
        return out

    @staticmethod
    def backward(ctx, grad):
        back, _ = engine().run(_alltoall_job(grad.contiguous(), ctx.received))
        return back, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name):
        ctx.op, ctx.scale = op, prescale * postscale
        return engine().run(_reducescatter_job(tensor.detach().contiguous(), op, prescale,
                                               postscale), name, "reducescatter")

    @staticmethod
    def backward(ctx, grad):
        gathered, _ = engine().run(_allgather_job(grad.contiguous()))
        if ctx.op == Average:
            gathered = gathered / get_comm().world_size
        return gathered * ctx.scale, None, None, None, None


# --- the public functions ----------------------------------------------------------------
def _returning(job, value):
    """The job, returning `value` (the caller's own tensor, for the in-place forms)."""
    def run():
        job()
        return value
    return run


def allreduce(tensor, average=None, name=None, compression=None, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduction of `tensor` over ranks, as a new tensor (Average by default)."""
    _global_only(process_set)
    reduce = reduce_op(average, op)
    if compression is None:
        return _Allreduce.apply(tensor, reduce, prescale_factor, postscale_factor, name)
    sent, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(sent, reduce, prescale_factor, postscale_factor, name)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduce `tensor` over ranks in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a copy of `tensor`; synchronize(handle) returns the result."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing `tensor` in place; synchronize(handle) returns it."""
    _global_only(process_set)
    job = allreduce_job([tensor.detach()], reduce_op(average, op), prescale_factor,
                        postscale_factor)
    return engine().submit(_returning(job, tensor), name, "allreduce")


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduce a list of tensors together (one fused buffer per dtype); new tensors."""
    _global_only(process_set)
    reduce = reduce_op(average, op)
    if compression is None:
        return list(_GroupedAllreduce.apply(reduce, prescale_factor, postscale_factor, name,
                                            *tensors))
    sent = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(reduce, prescale_factor, postscale_factor, name,
                                      *[s for s, _ in sent])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, sent)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    _global_only(process_set)
    job = allreduce_job([t.detach() for t in tensors], reduce_op(average, op),
                        prescale_factor, postscale_factor)
    return engine().submit(_returning(job, list(tensors)), name, "allreduce")


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor, concatenated along the first dimension (which may differ)."""
    _global_only(process_set)
    return _Allgather.apply(tensor, name)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    _global_only(process_set)
    job = _allgather_job(tensor.detach().contiguous())
    return engine().submit(lambda: job()[0], name, "allgather")


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return [allgather(t, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    _global_only(process_set)
    jobs = [_allgather_job(t.detach().contiguous()) for t in tensors]
    return engine().submit(lambda: [job()[0] for job in jobs], name, "allgather")


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank root_rank's tensor, as a new tensor on every rank."""
    _global_only(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite `tensor` with rank root_rank's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    _global_only(process_set)
    job = _broadcast_job(tensor.detach(), root_rank)
    return engine().submit(_returning(job, tensor), name, "broadcast")


def _check_splits(tensor: torch.Tensor, splits) -> List[int]:
    """Horovod's alltoall splits: int32, one per rank, summing to the first dimension."""
    size = get_comm().world_size
    first = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if first % size:
            raise ValueError(f"alltoall: the first dimension ({first}) is not divisible by "
                             f"the number of ranks ({size}); pass splits")
        return [first // size] * size
    if not isinstance(splits, torch.Tensor) or splits.dtype != torch.int32:
        raise ValueError("alltoall: splits must be a torch.int32 tensor")
    values = splits.tolist()
    if len(values) != size or any(v < 0 for v in values) or sum(values) != first:
        raise ValueError(f"alltoall: splits {values} must hold {size} non-negative counts "
                         f"that sum to the first dimension ({first})")
    return values


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send splits[p] rows of `tensor` to rank p (equal parts by default); returns the
    rows received from every rank, concatenated in rank order."""
    _global_only(process_set)
    return _Alltoall.apply(tensor, _check_splits(tensor, splits), name)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    _global_only(process_set)
    job = _alltoall_job(tensor.detach(), _check_splits(tensor, splits))
    return engine().submit(lambda: job()[0], name, "alltoall")


def reducescatter(tensor, op=Average, name=None, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce `tensor` over ranks and give each rank its part of the first dimension
    (the first dim % size ranks get one row more)."""
    _global_only(process_set)
    return _Reducescatter.apply(tensor, reduce_op(None, op), prescale_factor,
                                postscale_factor, name)


def reducescatter_async(tensor, op=Average, name=None, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    _global_only(process_set)
    return engine().submit(_reducescatter_job(tensor.detach().contiguous(),
                                              reduce_op(None, op), prescale_factor,
                                              postscale_factor), name, "reducescatter")


def grouped_reducescatter(tensors, op=Average, name=None, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    return [reducescatter(t, op, None, process_set, prescale_factor, postscale_factor)
            for t in tensors]


def poll(handle: int) -> bool:
    """True once the operation behind `handle` has finished (never blocks)."""
    return engine().poll(handle)


def synchronize(handle: int):
    """Wait for the operation behind `handle`; return its output (raise its error)."""
    return engine().synchronize(handle)


def join(device: int = -1) -> int:
    """This rank is out of work: take part in the others' allreduces with zeros until
    every rank has joined. Returns the rank that joined last."""
    each = engine()
    return each.run(lambda: each.join(shadow_allreduce))


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank reaches the barrier."""
    _global_only(process_set)

    def job():
        engine().negotiate(Call("barrier")).check()
        get_comm().barrier()
    engine().run(job)


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    raise NotImplementedError("sparse allreduce is not provided; use "
                              "DistributedOptimizer(sparse_as_dense=True)")
