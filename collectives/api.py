"""The public collectives, named as in torch.distributed.

    collectives.all_reduce(tensor, op="sum", algorithm="auto")      in place
    collectives.broadcast(tensor, src=0, algorithm="auto")          in place
    collectives.reduce_scatter(output, input, op="sum")             output = my chunk
    collectives.all_gather(output, input)                           output = all chunks
    collectives.all_to_all(outputs, inputs)                         outputs[p] from rank p

Each call checks its arguments, then runs inside its communicator's call check
(`comm.checked_call`, transport/calls.py): unless check=False, every rank learns every
other rank's call (its signature: collective, op, algorithm, dtype, numel, shape and
root). If they differ, every rank raises the same RuntimeError naming both sides,
instead of hanging or returning garbage as if nothing were wrong. The ranks compare
signatures on shared memory's call board where the whole world is on one host, and in
a handshake (one small all-reduce, `agree_on_call`) anywhere else. A call that left
the ranks out of step makes the communicator refuse every later one.

Debug mode (COLLECTIVES_DEBUG=DETAIL, like TORCH_DISTRIBUTED_DEBUG=DETAIL) runs the
handshake on every call, even check=False ones, with each rank's call count in it, so
the first call where the ranks diverge is named with its number.

A peer that dies or stalls surfaces as PeerError naming the collective, the algorithm,
the call's number and the rank that was being waited for.
"""
from __future__ import annotations

import contextlib
import functools
import os
import zlib
from typing import List, Optional, Sequence, Union

import torch

from . import algorithms
from . import trace
from .world import get_comm
from .transport import REDUCE_OPS, PeerError, Transport
from .transport.base import nbytes
from .transport.calls import Call

DEBUG = os.environ.get("COLLECTIVES_DEBUG", "").upper() == "DETAIL"

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
_COLLECTIVES = ("all_reduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all")
BITWISE_OPS = ("band", "bor", "bxor")  # integer tensors only
ALGORITHM_IDS = {name: i for i, name in enumerate(
    ["auto", "ring", "halving-doubling", "tree", "naive", "native", "hierarchical",
     "pairwise"])}


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} is a {tensor.layout} tensor: collectives move dense "
                        f"tensors only (call .to_dense() first)")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (call .contiguous() first)")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} has dtype {tensor.dtype}, which is not one of "
                        f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)}")


def _check_op(op: str, tensor: torch.Tensor, what: str) -> None:
    """A reduce op the tensor's dtype has, or a clear error before anything is sent:
    every rank checks the same arguments, so every rank refuses alike and the
    communicator stays usable (gloo refuses the bitwise ops on floats the same way)."""
    _check_choice(op, REDUCE_OPS, "reduce op")
    if op in BITWISE_OPS and tensor.is_floating_point():
        raise TypeError(f"{what}: op {op!r} is bitwise and takes integer tensors; "
                        f"{str(tensor.dtype).replace('torch.', '')} has no bits to combine")


def _check_choice(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}: choose from {', '.join(allowed)}")


_SHOWN_DIMS = 4  # the handshake carries this many dimensions, and a checksum of all


@functools.lru_cache(maxsize=256)
def _shape_fields(shape: tuple) -> List[int]:
    shown = list(shape[:_SHOWN_DIMS]) + [-1] * (_SHOWN_DIMS - min(len(shape), _SHOWN_DIMS))
    return [len(shape)] + shown + [zlib.crc32(repr(shape).encode())]


def _shape_text(fields: List[int]) -> str:
    ndim, dims = fields[0], fields[1:1 + min(fields[0], _SHOWN_DIMS)]
    inner = ", ".join(map(str, dims)) + (", ..." if ndim > _SHOWN_DIMS else "")
    return f"({inner}{',' if ndim == 1 else ''})"


def _describe(row: List[int]) -> str:
    collective, op, algorithm, dtype, numel, root, sequence = row[:7]
    parts = [_COLLECTIVES[collective]]
    if numel >= 0:  # (all_to_all's sizes are each rank's own: not in its row)
        parts += [f"numel={numel}", f"shape={_shape_text(row[7:])}"]
    parts.append("dtype=" + (str(SUPPORTED_DTYPES[dtype]).replace("torch.", "")
                             if dtype >= 0 else "mixed"))
    if op >= 0:
        parts.append(f"op={REDUCE_OPS[op]}")
    parts.append(f"algorithm={list(ALGORITHM_IDS)[algorithm]}")
    if root >= 0:
        parts.append(f"root={root}")
    if sequence >= 0:
        parts.insert(0, f"call #{sequence}:")
    return " ".join(parts)


def gather_rows(comm: Transport, row: List[int]) -> List[List[int]]:
    """Every rank's `row` of integers, in rank order (one small all-reduce)."""
    table = torch.zeros(comm.world_size, len(row), dtype=torch.int64)
    table[comm.rank] = torch.tensor(row, dtype=torch.int64)
    # Each rank fills its own row and the rows are summed: an all-gather. The message is
    # tiny, so it takes auto's small-message algorithm, not the backend's own (slower at
    # this size: docs/benchmarks.md, "The argument check").
    algorithm = _auto("all_reduce", table.numel() * 8, comm)
    try:
        algorithms.ALL_REDUCE[algorithm](comm, table.view(-1), "sum")
    except PeerError as error:
        raise PeerError(f"argument check ({algorithm} all_reduce): {error}") from error
    return table.tolist()


def call_signature(comm: Transport, collective: str, tensor: torch.Tensor,
                   op: Optional[str], algorithm: str, root: int) -> List[int]:
    """A call as a row of integers (with its number on this communicator in debug mode)."""
    return _signature(comm, collective, op, algorithm, tensor.dtype, tensor.numel(),
                      tuple(tensor.shape), root)


def _all_to_all_signature(comm: Transport, inputs: Sequence[torch.Tensor]) -> List[int]:
    """all_to_all's row. Its pieces are each rank's own size (only each pair's must
    match, which the exchange itself checks: a wrong one raises PeerError), so the row
    leaves numel and shape out (-1); every rank must still call all_to_all, with
    pieces of one dtype (-1 where this rank's are mixed)."""
    dtypes = {tensor.dtype for tensor in inputs}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return _signature(comm, "all_to_all", None, "pairwise", dtype, -1, (), -1)


def _signature(comm: Transport, collective: str, op: Optional[str], algorithm: str,
               dtype: Optional[torch.dtype], numel: int, shape: tuple, root: int) -> List[int]:
    """The row: collective, op, algorithm, dtype, numel, root, call number (-1: not
    in debug mode), then the shape's fields; -1 stands for "none" or "any"."""
    sequence = comm.calls.count if DEBUG else -1
    return [_COLLECTIVES.index(collective),
            REDUCE_OPS.index(op) if op else -1,
            ALGORITHM_IDS[algorithm],
            SUPPORTED_DTYPES.index(dtype) if dtype is not None else -1,
            numel, root, sequence] + _shape_fields(shape)


def _disagreement(collective: str, rows: List[Optional[List[int]]]) -> Optional[str]:
    """The error naming two ranks whose calls differ (the first rank that called and the
    first that called otherwise), or None if every rank's row agrees."""
    known = [(rank, row) for rank, row in enumerate(rows) if row is not None]
    first, row0 = known[0]
    for peer, row in known[1:]:
        if row != row0:
            return (f"{collective}: ranks disagree: rank {first} called {_describe(row0)}, "
                    f"rank {peer} called {_describe(row)}")
    return None


def agree_on_call(comm: Transport, collective: str, signature: List[int]) -> None:
    """Raise on every rank, naming both sides, if the ranks are not making the same call
    (`signature`, from call_signature): a handshake of its own, before the call."""
    rows = gather_rows(comm, signature)
    error = _disagreement(collective, rows)
    if error:
        raise RuntimeError(error)


# Algorithms that run on the communicator's own point-to-point messages, whose waits
# read the call board (transport/shm/board.py): they are checked after they ran. The others
# (the backend's own, the hierarchy's threads) are checked before they run.
_ON_THE_BOARD = ("ring", "tree", "halving-doubling", "naive")


class _Collective(Call):
    """A call of this module's, as the communicator's call check sees it
    (transport/calls.py): its signature is a row of _signature's, worded by _describe."""

    __slots__ = ()

    def agree(self, comm: Transport) -> None:
        agree_on_call(comm, self.collective, self.signature)

    def disagreement(self, rows: List[Optional[List[int]]]) -> str:
        """Named after the first rank's collective, so that it reads the same on
        every rank."""
        first = next((row for row in rows if row is not None), None)
        named = _COLLECTIVES[first[0]] if first else self.collective
        return (_disagreement(named, rows)
                or f"{named}: ranks disagree: they announced different calls")


def _call(comm: Transport, collective: str, algorithm: str, runs: str, tensor: torch.Tensor,
          op: Optional[str] = None, root: int = -1, check: bool = True) -> Call:
    """`collective` on `tensor`, running `runs` (auto's choice, perhaps), for its check:
    signed when checked, and in debug mode always."""
    signature = (call_signature(comm, collective, tensor, op, algorithm, root)
                 if check or DEBUG else None)
    return _Collective(collective, algorithm, runs, signature, runs in _ON_THE_BOARD, DEBUG)


def _traced(call: Call, size: int):
    """The call's span on the timeline (`size` bytes): the collective and the algorithm
    that runs."""
    return trace.span(f"{call.collective} {call.runs}", cat="comm", bytes=size)


@contextlib.contextmanager
def _on_host(comm: Transport, flat: torch.Tensor, copy_in: bool = True,
             copy_out: bool = True, own_slot: Optional[slice] = None):
    """Yield the buffer a collective on `flat` runs on: `flat` itself, or, where the
    transport moves host memory only (gloo, MPI, shared memory) and `flat` is on a GPU,
    one copy of it in pinned host memory, copied back once the call succeeded. One copy
    each way for the whole call, as gloo does for DDP, rather than one per message
    (a ring's every step, each waiting for the GPU); the reductions then run on the
    host's cores. Both copies end before the call returns. `own_slot`: only that part
    is copied in (an all-gather's own piece)."""
    if flat.device.type == "cpu" or comm.staging_device(flat) != torch.device("cpu"):
        yield flat
        return
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
    if own_slot is not None:
        host[own_slot].copy_(flat[own_slot])
    elif copy_in:
        host.copy_(flat)
    try:
        yield host
    except BaseException:
        # a receive may still be writing into it: never handed to another call
        comm.abandoned_buffers.append(host)
        raise
    if copy_out:
        flat.copy_(host)


def _run_reduction(comm: Transport, function, flat: torch.Tensor, op: str, *args) -> None:
    """Run an algorithm for sum/max/min/...; avg is a sum arranged so that it cannot
    overflow where the average fits (algorithms/average.py)."""
    if op != "avg":
        function(comm, flat, op, *args)
        return

    def sum_in_place(buffer: torch.Tensor) -> None:  # a float32 or int64 copy, perhaps
        function(comm, buffer, "sum", *args)
    algorithms.average(flat, comm.world_size, sum_in_place)


# What `auto` takes instead of "native" on a communicator without native collectives
# (some ranks of another, transport/group.py): built from point-to-point messages.
WITHOUT_NATIVE = {"all_reduce": "tree", "broadcast": "tree", "reduce_scatter": "ring",
                  "all_gather": "ring"}


def _auto(collective: str, nbytes: int, comm: Transport) -> str:
    """auto's choice for `collective` of `nbytes` on `comm` (algorithms/auto.py),
    remembered on `comm` for its transport, placement and table: working it out again
    at every call costs more Python than small calls can spare (measured:
    docs/benchmarks.md, "auto against the quickest fixed algorithm")."""
    basis = comm.auto_choices_for  # what the remembered choices were made for
    if not (basis and basis[0] == comm.name and basis[1] is comm.topology
            and basis[2] is comm.tuning):  # the objects themselves: they are held here
        comm.auto_choices = {}
        comm.auto_choices_for = (comm.name, comm.topology, comm.tuning)
    chosen = comm.auto_choices.get((collective, nbytes))
    if chosen is None:
        chosen = auto_choice(collective, nbytes, comm, comm.tuning)
        comm.auto_choices[(collective, nbytes)] = chosen
    return chosen


def auto_choice(collective: str, nbytes: int, comm: Transport, table) -> str:
    """What auto runs for `collective` of `nbytes` on `comm` following `table` (a
    tuning.Table; None: the cost model), worked out afresh."""
    chosen = algorithms.AUTO_CHOICE[collective](nbytes, comm.world_size, comm.name,
                                                comm.topology, table=table)
    if chosen == "native" and not comm.native_collectives:
        return WITHOUT_NATIVE[collective]
    return chosen


def _pick(collective: str, algorithm: str, tensor: torch.Tensor, comm: Transport) -> str:
    _check_choice(algorithm, algorithms.names(collective), "algorithm")
    if algorithm == "native" and not comm.native_collectives:
        raise ValueError(f"{collective}: algorithm 'native' needs the backend's own "
                         f"collectives, which {type(comm).__name__} has not (some ranks of "
                         "a communicator); use 'auto' or an algorithm built from "
                         "point-to-point")
    if algorithm != "auto":
        return algorithm
    return _auto(collective, tensor.numel() * tensor.element_size(), comm)


def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
               comm: Optional[Transport] = None, check: bool = True) -> torch.Tensor:
    """Reduce `tensor` over all ranks, in place; every rank gets the bitwise same result.

    op: "sum", "avg", "max", "min", "product", "band", "bor" or "bxor". avg never
        overflows where the average fits (a float16 or an int8 average is taken in a
        wider type); integer avg rounds down, as //.
    algorithm: "auto", "ring", "halving-doubling", "tree", "naive", "hierarchical" or
        "native".
    """
    comm = comm or get_comm()
    _check_tensor(tensor, "all_reduce: tensor")
    _check_op(op, tensor, "all_reduce")
    chosen = _pick("all_reduce", algorithm, tensor, comm)
    if comm.world_size == 1:
        return tensor
    call = _call(comm, "all_reduce", algorithm, chosen, tensor, op, check=check)
    with comm.checked_call(call), _traced(call, nbytes(tensor)):
        if tensor.numel():
            with _on_host(comm, tensor.view(-1)) as flat:
                _run_reduction(comm, algorithms.ALL_REDUCE[chosen], flat, op)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, algorithm: str = "auto",
              comm: Optional[Transport] = None, check: bool = True) -> torch.Tensor:
    """Copy rank `src`'s tensor to every rank, in place."""
    comm = comm or get_comm()
    _check_tensor(tensor, "broadcast: tensor")
    if not 0 <= src < comm.world_size:
        raise ValueError(f"broadcast: src={src} is not a rank of a world of {comm.world_size}")
    chosen = _pick("broadcast", algorithm, tensor, comm)
    if comm.world_size == 1:
        return tensor
    call = _call(comm, "broadcast", algorithm, chosen, tensor, root=src, check=check)
    with comm.checked_call(call), _traced(call, nbytes(tensor)):
        if tensor.numel():
            with _on_host(comm, tensor.view(-1), copy_in=comm.rank == src,
                          copy_out=comm.rank != src) as flat:
                algorithms.BROADCAST[chosen](comm, flat, src)
    return tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                   algorithm: str = "auto", comm: Optional[Transport] = None,
                   check: bool = True) -> torch.Tensor:
    """Reduce `input` (world_size x output.numel() elements) over ranks; rank r's
    `output` receives chunk r of the result. `input` is used as scratch."""
    comm = comm or get_comm()
    _check_tensor(output, "reduce_scatter: output")
    _check_tensor(input, "reduce_scatter: input")
    _check_op(op, input, "reduce_scatter")
    if input.numel() != output.numel() * comm.world_size or input.dtype != output.dtype:
        raise ValueError(f"reduce_scatter: input must have world_size ({comm.world_size}) x "
                         f"output's numel ({output.numel()}) elements of output's dtype; got "
                         f"{input.numel()} of {input.dtype}")
    chosen = _pick("reduce_scatter", algorithm, input, comm)
    if comm.world_size > 1:
        call = _call(comm, "reduce_scatter", algorithm, chosen, input, op, check=check)
        with comm.checked_call(call), _traced(call, nbytes(input)):
            if input.numel():
                with _on_host(comm, input.view(-1)) as flat:
                    _run_reduction(comm, algorithms.REDUCE_SCATTER[chosen], flat, op)
    mine = input.view(-1)[comm.rank * output.numel():(comm.rank + 1) * output.numel()]
    output.view(-1).copy_(mine)
    return output


def all_gather(output: Union[torch.Tensor, List[torch.Tensor]], input: torch.Tensor,
               algorithm: str = "auto", comm: Optional[Transport] = None,
               check: bool = True):
    """Gather every rank's `input` into `output`: one tensor of world_size x input's
    elements (rank r's at slot r), or a list of world_size tensors of input's dtype and
    shape (as torch's: a list that differs is refused, never converted)."""
    comm = comm or get_comm()
    _check_tensor(input, "all_gather: input")
    n, count = comm.world_size, input.numel()
    if isinstance(output, (list, tuple)):
        if len(output) != n:
            raise ValueError(f"all_gather: output list has {len(output)} tensors, "
                             f"the world has {n} ranks")
        for slot, tensor in enumerate(output):
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                raise TypeError(f"all_gather: output {slot} must be a dense torch.Tensor")
            if tensor.dtype != input.dtype or tensor.shape != input.shape:
                raise ValueError(
                    f"all_gather: output {slot} is {str(tensor.dtype).replace('torch.', '')} "
                    f"{tuple(tensor.shape)}; every output must have input's dtype and shape "
                    f"({str(input.dtype).replace('torch.', '')} {tuple(input.shape)})")
        flat = input.new_empty(n * count)
    else:
        _check_tensor(output, "all_gather: output")
        if output.numel() != n * count or output.dtype != input.dtype:
            raise ValueError(f"all_gather: output must have world_size ({n}) x input's numel "
                             f"({count}) elements of input's dtype; got {output.numel()} "
                             f"of {output.dtype}")
        flat = output.view(-1)
    flat[comm.rank * count:(comm.rank + 1) * count].copy_(input.view(-1))
    chosen = _pick("all_gather", algorithm, flat, comm)
    if n > 1:
        call = _call(comm, "all_gather", algorithm, chosen, input, check=check)
        with comm.checked_call(call), _traced(call, nbytes(input)):
            if count:
                with _on_host(comm, flat, own_slot=slice(comm.rank * count,
                                                         (comm.rank + 1) * count)) as staged:
                    algorithms.ALL_GATHER[chosen](comm, staged)
    if isinstance(output, (list, tuple)):
        for slot, tensor in enumerate(output):  # (copy_ writes strided outputs too)
            tensor.copy_(flat[slot * count:(slot + 1) * count].view(input.shape))
    return output


def all_to_all(outputs: List[torch.Tensor], inputs: List[torch.Tensor],
               comm: Optional[Transport] = None, check: bool = True) -> List[torch.Tensor]:
    """Rank r sends inputs[p] to rank p; outputs[p] receives rank p's inputs[r].

    Pieces may differ in size (as torch's all_to_all), but each pair must agree:
    outputs[p] on rank r has the size of inputs[r] on rank p. Pairwise exchange
    (algorithms/pairwise.py). A wrong size surfaces as PeerError, not as garbage; the
    check (check=True) makes sure that every rank is calling all_to_all, with pieces
    of one dtype.
    """
    comm = comm or get_comm()
    n = comm.world_size
    if len(outputs) != n or len(inputs) != n:
        raise ValueError(f"all_to_all: need {n} output and {n} input tensors, got "
                         f"{len(outputs)} and {len(inputs)}")
    for what, tensors in (("output", outputs), ("input", inputs)):
        for peer, tensor in enumerate(tensors):
            _check_tensor(tensor, f"all_to_all: {what} {peer}")
    if any(o.dtype != i.dtype for o, i in zip(outputs, inputs)):
        raise ValueError("all_to_all: outputs and inputs must share one dtype")
    flat_outputs, flat_inputs = [o.view(-1) for o in outputs], [i.view(-1) for i in inputs]
    if n == 1:
        algorithms.pairwise.all_to_all(comm, flat_outputs, flat_inputs)  # a copy
        return outputs
    signature = _all_to_all_signature(comm, inputs) if check or DEBUG else None
    call = _Collective("all_to_all", "pairwise", "pairwise", signature,
                       waits_read_board=True, handshake_always=DEBUG)  # as the ring's
    with comm.checked_call(call), _traced(call, sum(nbytes(i) for i in inputs)):
        algorithms.pairwise.all_to_all(comm, flat_outputs, flat_inputs)
    return outputs


def _through_flat_buffers(tensors: Sequence[torch.Tensor], run) -> None:
    """Call run(flat) on one flat copy per (dtype, device) group, then copy back.

    An expand()ed tensor (a dimension of stride 0) holds one value for all of that
    dimension, and copy_ refuses to write it: it is written through index 0. The calls
    that come here work in place, so the copies of one element came out alike (a float
    sum perhaps added in another order: any of them is the sum)."""
    groups = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        run(flat)
        offset = 0
        for tensor in group:
            target = tensor.detach()
            result = flat[offset:offset + tensor.numel()].view_as(tensor)
            for dim, (size, stride) in enumerate(zip(target.shape, target.stride())):
                if stride == 0 and size > 1:
                    target, result = target.narrow(dim, 0, 1), result.narrow(dim, 0, 1)
            target.copy_(result)
            offset += tensor.numel()


def _check_each(tensors: Sequence[torch.Tensor], what: str) -> Sequence[torch.Tensor]:
    """Every tensor of a coalesced call checked before the first flat buffer is sent,
    so that a bad one is refused on every rank with nothing moved (any layout of a
    dense tensor is fine: each is copied into a flat buffer and back)."""
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"{what}: tensor {index} must be a dense torch.Tensor")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{what}: tensor {index} has dtype {tensor.dtype}, which is not "
                            f"one of {', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)}")
    return tensors


def _as_moved_bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` seen as a dtype the collectives move, sharing its memory: bool as bytes
    (uint8), complex as pairs of its real and imaginary parts (view_as_real). A
    broadcast only copies bits, so writing the view writes the tensor: buffers of every
    dtype torch's DDP broadcasts (a causal mask, rotary frequencies) travel. Anything
    else comes back as it is, for _check_each to judge."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return tensor
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_complex() and not tensor.is_conj():  # (a conjugate view has no such view)
        return torch.view_as_real(tensor)
    return tensor


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0,
                        comm: Optional[Transport] = None) -> None:
    """Broadcast many tensors in place with one message per dtype (not one per tensor).

    Any dtype of SUPPORTED_DTYPES, and bool and complex too (moved as bytes and as
    float pairs: _as_moved_bits)."""
    comm = comm or get_comm()
    tensors = _check_each([_as_moved_bits(tensor) for tensor in tensors],
                          "broadcast_coalesced")
    if not 0 <= src < comm.world_size:
        raise ValueError(f"broadcast_coalesced: src={src} is not a rank of a world of "
                         f"{comm.world_size}")
    if comm.world_size > 1:
        _through_flat_buffers(tensors, lambda flat: broadcast(flat, src, "native", comm,
                                                              check=False))


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: str = "avg",
                         algorithm: str = "auto", comm: Optional[Transport] = None) -> None:
    """All-reduce many tensors in place through one flat buffer per dtype."""
    comm = comm or get_comm()
    for tensor in _check_each(tensors, "all_reduce_coalesced"):
        _check_op(op, tensor, "all_reduce_coalesced")
    _check_choice(algorithm, algorithms.names("all_reduce"), "algorithm")
    if comm.world_size > 1:
        _through_flat_buffers(tensors, lambda flat: all_reduce(flat, op, algorithm, comm,
                                                               check=False))


def all_finite(tensors: Sequence[Optional[torch.Tensor]], comm: Optional[Transport] = None) -> bool:
    """True when every tensor on every rank is finite: one tiny all-reduce, so all ranks
    get the same answer and can skip a step together without diverging."""
    comm = comm or get_comm()
    local_bad = any(t is not None and not bool(torch.isfinite(t).all()) for t in tensors)
    flag = torch.tensor([1 if local_bad else 0], dtype=torch.int32)
    if comm.world_size > 1:
        all_reduce(flag, op="max", algorithm="auto", comm=comm, check=False)
    return flag.item() == 0
