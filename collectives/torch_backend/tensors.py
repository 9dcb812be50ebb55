"""The caller's tensors as our algorithms move them: flat, packed, of a dtype they know.

torch hands the backend tensors of any layout (transposed, every other element, a
size-1 dimension with an odd stride, an expand()ed view) and of dtypes our algorithms do
not reduce (bool, complex). Our algorithms take one packed buffer of a dtype in
api.SUPPORTED_DTYPES. What sits between:

    _packed / _fresh   the tensor itself where it is packed, else a packed copy
    _unpack            the result copied back into the caller's tensor
    bytes_view         bool as uint8, complex as (real, imaginary) pairs, flat: moving
                       data needs no arithmetic, so any reinterpretation is exact
    reducible          the same for a reduction, with the op that gives gloo's answer
                       on it (bool sum is "or": max on 0/1)
    overlapping        whether two elements are one place in memory

Every view here is flat (one dimension): the ranks compare what they move by its count
and dtype, as gloo does, never by its shape (one rank's (2, 3) meets another's (6,)).
"""
from __future__ import annotations

import torch

# bool reduced as uint8 0/1, op by op as gloo reduces bool ("or" and "and"); no avg
BOOL_OPS = {"sum": "max", "max": "max", "bor": "bor", "product": "min", "min": "min",
            "band": "band", "bxor": "bxor"}
COMPLEX_OPS = ("sum", "avg")  # complex (real, imaginary) pairs: ops that act on each


def bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view our collectives can move, of a packed tensor: complex as its (real,
    imaginary) pairs, bool as bytes, the rest as it is."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    elif tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return tensor.view(-1)


def reducible(tensor: torch.Tensor, op: str):
    """(the flat view our algorithms reduce, the op they apply) for a packed tensor
    whose op arguments.check_reduction accepted."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8).view(-1), BOOL_OPS[op]
    return bytes_view(tensor), op


def is_packed(tensor: torch.Tensor) -> bool:
    """Laid out as torch.empty(shape) would be: strides that a flat view and a byte view
    both accept. (is_contiguous() is True for a size-1 dimension of any stride,
    `arange(2)[::2]`, which a byte view refuses.)"""
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride())):
        if stride != expected and size != 0:
            return False
        expected *= size
    return True


def packed(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself where it is packed, else a packed copy (for an output: copy
    the result back with unpack)."""
    if is_packed(tensor):
        return tensor
    return fresh(tensor)


def fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A packed copy, always: scratch memory the caller's tensor never sees."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def unpack(buffer: torch.Tensor, tensor: torch.Tensor) -> None:
    """The result in `buffer` copied back into the caller's tensor (unless it is it).
    An expand()ed tensor (a dimension of stride 0) holds one value for all of that
    dimension, and copy_ refuses to write it: it is written through index 0. Only an
    in-place call gets here with one (outputs like that are refused,
    arguments.check_own_memory), and its copies of one element came out alike: one
    input, reduced or sent alike (a float sum perhaps added in another order: any of
    them is the sum)."""
    if buffer is tensor:
        return
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        if stride == 0 and size > 1:
            tensor, buffer = tensor.narrow(dim, 0, 1), buffer.narrow(dim, 0, 1)
    tensor.copy_(buffer)


def overlapping(tensor: torch.Tensor) -> bool:
    """Whether two elements of the tensor are one place in memory (an expand()ed view,
    overlapping as_strided windows)."""
    verdict = torch._debug_has_internal_overlap(tensor)  # 0 no, 1 yes, 2 torch can't tell
    if verdict != 2:
        return verdict == 1
    # Apart when each dimension, taken by stride, steps past all the smaller ones reach
    # (true of every slice and permutation); else count the places.
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride())
                  if size > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    span = 1 + sum((size - 1) * stride for stride, size in dims)
    places = torch.arange(span).as_strided(tensor.shape, tensor.stride())
    return places.unique().numel() < tensor.numel()


def cut_rows(flat: torch.Tensor, rows: int, counts) -> list:
    """A flat view of a tensor with `rows` rows along dim 0, cut into consecutive pieces
    of counts[i] rows each (all_to_all_single's splits)."""
    row = flat.numel() // rows if rows else 0
    pieces, start = [], 0
    for count in counts:
        pieces.append(flat[start * row:(start + count) * row])
        start += count
    return pieces
