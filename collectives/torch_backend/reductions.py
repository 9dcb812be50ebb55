"""The reductions torch asks for, as the group's worker runs them on our public API.

Each takes arguments that arguments.py already accepted, and the group's transport:

    all_reduce_in_place   premul_sum (scaled first), bool and complex (tensors.reducible),
                          strided tensors (a packed copy), integer avg toward zero
    reduce_scatter_into   the same for a reduce-scatter; the input is left as it was
    all_reduce_coalesced  one flat copy per dtype, reduced as above
    sparse_all_reduce     every rank's non-zeros gathered and added where they coincide

Integer avg. gloo refuses it ("result type Float can't be cast to ... Long"); NCCL, the
one torch backend that has it, sums and divides in C, which rounds toward zero: -3 and
0 average to -1. Our API's avg rounds down, as `//` (-2), and never overflows. The
backend takes ours, then moves each element rounded down where the exact average was
negative and not whole up by one (algorithms/average.py, `toward_zero`): NCCL's answer,
without NCCL's overflow (two int8 100s average to 100, not -28). What tells where the
average was not whole is the sum of each rank's x mod n: a second call, of int64s.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import api
from ..algorithms.average import toward_zero
from ..transport import Transport
from .tensors import fresh, packed, reducible, unpack

_SIGNED_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64)


def _rounds_toward_zero(flat: torch.Tensor, op: str) -> bool:
    """Where our avg (rounded down) and NCCL's (toward zero) can differ."""
    return op == "avg" and flat.dtype in _SIGNED_INTEGERS


def _residues(flat: torch.Tensor, n: int) -> torch.Tensor:
    """Each element's x mod n, in [0, n), as int64 (n of them sum without overflow)."""
    return flat.to(torch.int64, copy=True).remainder_(n)


def all_reduce_in_place(tensor: torch.Tensor, op: str, factor: Optional[float],
                        algorithm: str, comm: Transport) -> None:
    """tensor <- its reduction over the group (op and factor as backend.reduce_op
    gives them)."""
    buffer = packed(tensor)
    if factor is not None:
        buffer.mul_(factor)
    flat, op = reducible(buffer, op)
    if _rounds_toward_zero(flat, op):
        residues = _residues(flat, comm.world_size)
        api.all_reduce(flat, "avg", algorithm, comm)
        # the same on every rank: the call before was checked, and this one follows it
        api.all_reduce(residues, "sum", algorithm, comm, check=False)
        toward_zero(flat, residues, comm.world_size)
    else:
        api.all_reduce(flat, op, algorithm, comm)
    unpack(buffer, tensor)


def all_reduce_coalesced(tensors, op: str, factor: Optional[float], algorithm: str,
                         comm: Transport) -> None:
    """Each tensor <- its reduction, through one flat copy per dtype (in the order each
    dtype first appears, the same on every rank): one checked call each, compared by
    its op, dtype and count. The copies are scaled (premul_sum), so an expand()ed tensor
    among them, whose one place stands for several elements, is scaled once; its result
    is written back through that place."""
    groups: Dict[torch.dtype, list] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    for group in groups.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        all_reduce_in_place(flat, op, factor, algorithm, comm)
        offset = 0
        for tensor in group:
            unpack(flat[offset:offset + tensor.numel()].view(tensor.shape), tensor)
            offset += tensor.numel()


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, op: str,
                        factor: Optional[float], algorithm: str, comm: Transport,
                        copy: bool = True) -> None:
    """output <- this rank's share of the reduction of every rank's `input` (n x
    output's elements). torch leaves the input as it was; ours uses it as scratch, so
    it works on a copy (copy=False: `input` is a copy already)."""
    scratch = fresh(input) if copy else input
    if factor is not None:
        scratch.mul_(factor)
    buffer = packed(output)
    into, op = reducible(buffer, op)
    scratch = reducible(scratch, op)[0]
    if _rounds_toward_zero(into, op):
        n = comm.world_size
        residues = _residues(scratch, n)
        api.reduce_scatter(into, scratch, "avg", algorithm, comm)
        summed = torch.empty(into.numel(), dtype=torch.int64)
        api.reduce_scatter(summed, residues, "sum", algorithm, comm, check=False)
        toward_zero(into, summed, n)
    else:
        api.reduce_scatter(into, scratch, op, algorithm, comm)
    unpack(buffer, output)


def sparse_all_reduce(tensor: torch.Tensor, factor: Optional[float], algorithm: str,
                      comm: Transport) -> None:
    """A sparse COO tensor summed over ranks (each share times `factor` for
    PREMUL_SUM, None for SUM), in place, as gloo sums one: every rank's non-zeros
    gathered (their count first, then the indices and the values, padded to the most
    any rank has), then added where they coincide. Moves only the non-zeros: nnz x
    (sparse dims x 8 bytes + a value's bytes) per rank. `algorithm`: all_gather's."""
    local = tensor.coalesce()
    counts = [row[0] for row in api.gather_rows(comm, [local._nnz()])]
    widest, n = max(counts), comm.world_size
    pieces = []
    values = local.values()
    for mine in (local.indices().t(), torch.view_as_real(values) if values.is_complex()
                 else values.view(torch.uint8) if values.dtype == torch.bool else values):
        padded = mine.new_zeros((widest,) + tuple(mine.shape[1:]))
        padded[:len(mine)] = mine
        gathered = padded.new_empty((n * widest,) + tuple(mine.shape[1:]))
        api.all_gather(gathered.view(-1), padded.contiguous().view(-1), algorithm, comm)
        pieces.append(torch.cat([gathered[r * widest:r * widest + counts[r]]
                                 for r in range(n)]))
    indices, summed_values = pieces
    if values.is_complex():
        summed_values = torch.view_as_complex(summed_values)
    elif values.dtype == torch.bool:
        summed_values = summed_values.view(torch.bool)
    summed = torch.sparse_coo_tensor(indices.t(), summed_values, tensor.shape,
                                     check_invariants=True).coalesce()
    if factor is not None:  # PREMUL_SUM: each rank's share scaled, so the sum too
        summed = summed * factor
    tensor.copy_(summed)

