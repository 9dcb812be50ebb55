"""What each of Horovod's collectives does once every rank has asked for it.

A collective of the face is submitted in two halves (ops.py): its arguments, checked
and described by a Meta that the ranks negotiate (negotiation.py), and a `run(metas,
comm)` that the engine calls on its thread once the name is ready (engine.py). This
file holds the second halves: each moves this rank's tensors with our algorithms
(`collectives.api`) over `comm`, the engine's communicator or a group of a process
set's ranks, and returns what synchronize(handle) will hand back.

    allreduce      one flat buffer per dtype, reduced in place, then copied back
    allgather      every rank's rows padded to the widest, one all-gather per tensor
    broadcast      in place from the root
    alltoall       splits[p] rows to rank p, rows received in rank order
    reducescatter  padded to equal shares, reduce-scattered, this rank's rows kept

`shadow` is a joined rank's part in an allreduce the others run: zeros, fused exactly as
`allreduce_run` fuses the others' tensors, so that the buffers line up.

Horovod's reduction ops are the names our algorithms take (`hvd.Sum` is "sum"), and
scaling follows Horovod's arithmetic: integers scaled in float64, float16 in float32,
integer averages rounded toward zero.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .. import api
from ..transport import Transport
from .negotiation import Meta

# Horovod's ops (hvd.Average, hvd.Sum, ...), spelled as api.all_reduce spells them
Average, Sum, Adasum, Min, Max, Product = "avg", "sum", "adasum", "min", "max", "product"
OPS = (Sum, Average, Min, Max, Product)  # Adasum is named, but not provided


def scale(tensor: torch.Tensor, factor: float) -> None:
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


def _integer_average(out: torch.Tensor, wide: torch.Tensor, postscale: float,
                     world_size: int) -> None:
    """out = the int64 sum `wide` times postscale / world_size, rounded toward zero
    once (Horovod's integer average; dividing first and scaling after would round
    twice: 2 + 5 averaged with postscale 2 would give 6, where trunc(7 * 2 / 2) is 7)."""
    if postscale == 1.0:  # exact, even beyond float64's 2^53
        out.copy_(torch.div(wide, world_size, rounding_mode="trunc"))
    else:
        out.copy_((wide.double() * (postscale / world_size)).to(out.dtype))


def _reduce_in_place(flat: torch.Tensor, op: str, prescale: float, postscale: float,
                     algorithm: str, comm: Transport) -> None:
    """One flat buffer's allreduce, after negotiation.

    Floats average as `api.all_reduce(op="avg")` does (divided first, so a float16 sum
    cannot overflow). Integers average as Horovod does, the sum scaled by 1/size and
    rounded toward zero (-3 and 0 average to -1), but summed in int64 so that int8 or
    int16 sums do not wrap.
    """
    scale(flat, prescale)
    if op == Average and not flat.is_floating_point():
        wide = flat.to(torch.int64, copy=True)
        api.all_reduce(wide, op=Sum, algorithm=algorithm, comm=comm, check=False)
        _integer_average(flat, wide, postscale, comm.world_size)
        return
    api.all_reduce(flat, op=op, algorithm=algorithm, comm=comm, check=False)
    scale(flat, postscale)


def _by_dtype(items: Sequence) -> Dict[str, list]:
    """Indices of items grouped by dtype, in the order each dtype first appears (the
    same on every rank, and for a joined rank's zeros: see shadow)."""
    groups: Dict[str, list] = {}
    for index, dtype in enumerate(items):
        groups.setdefault(str(dtype).replace("torch.", ""), []).append(index)
    return groups


def allreduce_run(tensors: List[torch.Tensor], op: str, prescale: float, postscale: float,
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
    per dtype, as allreduce_run makes them); nothing for a barrier."""
    if meta.kind != "allreduce":
        return
    sizes = [int(torch.Size(shape).numel()) for shape in meta.shapes]
    for dtype, indices in _by_dtype(meta.dtypes).items():
        zeros = torch.zeros(sum(sizes[i] for i in indices), dtype=getattr(torch, dtype))
        _reduce_in_place(zeros, meta.op, meta.prescale, meta.postscale, meta.algorithm, comm)


def allgather_run(tensors: List[torch.Tensor]):
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


def broadcast_run(tensor: torch.Tensor, root_rank: int):
    """Overwrite `tensor` with root_rank's (its rank in `comm`), in place; a tensor that
    is not contiguous goes through a flat copy and back."""
    def run(metas, comm):
        flat = tensor.reshape(-1).clone() if not tensor.is_contiguous() else tensor.view(-1)
        api.broadcast(flat, src=root_rank, comm=comm, check=False)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor
    return run


def alltoall_run(tensor: torch.Tensor, splits: List[int]):
    """Send splits[p] rows to rank p (rows past their sum stay here, as in Horovod);
    the result: (rows received, concatenated in rank order; how many from each rank)."""
    def run(metas, comm):
        received = [metas[peer].splits[comm.rank] for peer in range(comm.world_size)]
        rest = tuple(tensor.shape[1:])
        inputs = list(torch.split(tensor.contiguous()[:sum(splits)], splits))
        outputs = [tensor.new_empty((count,) + rest) for count in received]
        api.all_to_all(outputs, [i.contiguous() for i in inputs], comm=comm, check=False)
        return torch.cat(outputs), received
    return run


def reducescatter_rows(first_dim: int, world_size: int) -> List[int]:
    """How Horovod splits the first dimension: the first (dim % n) ranks get one more."""
    base, extra = divmod(first_dim, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def reducescatter_run(tensors: List[torch.Tensor], op: str, prescale: float,
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
    scale(padded, prescale)
    out = tensor.new_empty(widest * per_row)
    if op == Average and not tensor.is_floating_point():
        # Summed in int64, then scaled once, as allreduce's integer average
        wide = torch.empty(widest * per_row, dtype=torch.int64)
        api.reduce_scatter(wide, padded.to(torch.int64), op=Sum, comm=comm, check=False)
        _integer_average(out, wide, postscale, comm.world_size)
    else:
        api.reduce_scatter(out, padded, op=op, comm=comm, check=False)
        scale(out, postscale)
    mine = rows[comm.rank]
    return out[:mine * per_row].view((mine,) + tuple(tensor.shape[1:]))
