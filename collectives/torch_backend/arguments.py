"""What the backend takes and refuses, checked on the caller's thread before anything is sent.

gloo refuses some calls in the caller (a bitwise op on floats, a list of the wrong
length, outputs of another dtype or size); the backend refuses those alike, and a few
more that gloo would get wrong (an output whose elements share memory). Each check
raises one line, a ValueError or TypeError, from the torch.distributed call itself.

What the ranks compare with each other is another matter, and less: gloo moves bytes
and never looks at a shape, so one rank's all_reduce of a (2, 3) tensor meets another's
of (6,) and both get the sum. The backend hands our algorithms flat views
(tensors.bytes_view), so the call check compares what gloo's messages depend on: the
collective, the op, the dtype and the count (and the root), never the shape. Where
gloo would pair calls that differ in those (a sum with a max, float32 with int32) and
return nonsense or abort, ours raises on every rank, naming both calls.

A refusal here is the caller's alone: its peers may well have gone ahead with the
call. How the backend keeps them in step: backend.py, `refusing`.
"""
from __future__ import annotations

from typing import List

import torch

from .. import api
from .tensors import BOOL_OPS, COMPLEX_OPS, overlapping

# The dtypes the backend moves (and, with the ops in tensors.py, reduces): ours, and
# bool and complex through tensors.bytes_view.
MOVABLE = tuple(api.SUPPORTED_DTYPES) + (torch.bool, torch.complex64, torch.complex128)


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def check_movable(tensor, what: str) -> None:
    """A dense CPU tensor of a dtype the backend moves, or a one-line error."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what}: a {tensor.layout} tensor is not supported here")
    if tensor.dtype not in MOVABLE:
        raise TypeError(f"{what}: dtype {dtype_name(tensor)} is not supported by the "
                        f"collectives backend (one of "
                        f"{', '.join(str(d).replace('torch.', '') for d in MOVABLE)})")


def check_reduction(tensor, op: str, factor, what: str) -> None:
    """What gloo refuses, refused alike (or better: premul_sum and avg where ours has
    them); the error reads as one line."""
    check_movable(tensor, what)
    if factor is not None and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{what}: premul_sum multiplies by a float factor; it takes "
                         f"floating-point or complex tensors, not {dtype_name(tensor)}")
    if tensor.dtype == torch.bool and op not in BOOL_OPS:
        raise ValueError(f"{what}: op {op} is not defined for bool tensors")
    if tensor.is_complex() and op not in COMPLEX_OPS:
        raise ValueError(f"{what} does not support op {op} on complex tensors (sum and avg "
                         "only, as gloo)")
    if op in api.BITWISE_OPS and tensor.is_floating_point():
        raise ValueError(f"{what}: cannot use op {op} with non-integral dtype "
                         f"{dtype_name(tensor)}")


def check_own_memory(output: torch.Tensor, what: str) -> None:
    """An output whose elements are each a place of their own: one that shares places
    (an expand()ed view) could not hold a different value in each, and gloo writes one
    of them over the other. The layout is the caller's alone, alike on every rank."""
    if overlapping(output):
        raise ValueError(f"{what}: elements of this output share memory (an expand()ed "
                         f"or overlapping view, strides {tuple(output.stride())}), so it "
                         "cannot hold a value for each: pass a tensor of its own (.clone())")


def check_like(tensor, reference: torch.Tensor, what: str) -> None:
    """A tensor of the reference's dtype and shape (a list form's each entry, which
    torch's gloo also wants alike within one rank's list)."""
    check_movable(tensor, what)
    if tensor.dtype != reference.dtype:
        raise ValueError(f"{what}: dtype {dtype_name(tensor)} differs from "
                         f"{dtype_name(reference)}")
    if tensor.shape != reference.shape:
        raise ValueError(f"{what}: invalid tensor size {tuple(tensor.shape)} (expected "
                         f"{tuple(reference.shape)})")


def check_list(tensors, n: int, what: str) -> None:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != n:
        count = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{what}: invalid tensor list (expected {n} tensors, got {count})")


def check_root(root: int, n: int, what: str) -> None:
    if not 0 <= root < n:
        raise ValueError(f"{what}: root {root} is not a rank of a group of {n}")


def check_total(holder: torch.Tensor, piece: torch.Tensor, n: int, what: str,
                holder_name: str, piece_name: str) -> None:
    """`holder` has n x `piece`'s elements of its dtype (all_gather_into_tensor's
    output, reduce_scatter_tensor's input), in any shape."""
    if holder.dtype != piece.dtype or holder.numel() != n * piece.numel():
        raise ValueError(f"{what}: the {holder_name} must hold the group's size ({n}) x "
                         f"the {piece_name}'s elements ({piece.numel()}) of its dtype "
                         f"({dtype_name(piece)}); got {holder.numel()} of "
                         f"{dtype_name(holder)}")


def check_exchange(outputs, inputs, rank: int, n: int, what: str) -> None:
    """all_to_all's lists: n tensors each, of one dtype pairwise, and this rank's own
    piece (the one it keeps) as large as the place that receives it. The other
    pieces' sizes are each pair's to agree on (a rank can send a peer fewer or more
    elements than to another, as with NCCL); a pair that disagrees fails in the
    exchange, naming both sizes."""
    check_list(outputs, n, f"{what}: output list")
    check_list(inputs, n, f"{what}: input list")
    for output, input in zip(outputs, inputs):
        check_movable(output, f"{what}: output")
        check_own_memory(output, f"{what}: output")
        check_movable(input, f"{what}: input")
        if output.dtype != input.dtype:
            raise ValueError(f"{what}: dtypes differ ({dtype_name(output)} and "
                             f"{dtype_name(input)})")
    if outputs[rank].numel() != inputs[rank].numel():
        raise ValueError(f"{what}: this rank's own piece has {inputs[rank].numel()} "
                         f"elements and its place in the outputs {outputs[rank].numel()}: "
                         "each output must hold what its peer sends")


def split_rows(tensor: torch.Tensor, splits: List[int], n: int, what: str) -> List[int]:
    """all_to_all_single: how many rows (along dim 0) of `tensor` go to each of the n
    ranks; equal shares where `splits` is empty."""
    if tensor.dim() == 0:
        raise ValueError(f"{what}: a 0-dim tensor has no dimension 0 to split")
    rows = tensor.shape[0]
    if not splits:
        if rows % n:
            raise ValueError(f"{what}: dim 0 ({rows}) does not divide into {n} equal "
                             "splits")
        return [rows // n] * n
    if len(splits) != n or sum(splits) != rows:
        raise ValueError(f"{what}: splits {list(splits)} do not cut dim 0 ({rows}) into "
                         f"{n} pieces")
    return list(splits)
