"""The backend object torch.distributed calls: each of its collectives, mapped to ours.

torch.distributed calls these methods with its own argument shapes (lists of tensors,
an options object); each one here unpacks them, queues the collective on the group's
worker (work.py) and returns the Work. On the worker the collective runs through the
public API (api.py): the same argument checks, the same check that makes ranks which
disagree raise on every rank (after which the group refuses further work), the same algorithms
(`auto` unless COLLECTIVES_ALGORITHM names one).

What torch asks for that our algorithms do not do directly:

    reduce          an all-reduce into scratch memory on every rank but the root
    gather/scatter  the root receives from (sends to) each rank in turn
    premul_sum      every rank scales its tensor by the factor, then a sum
    sparse          all_reduce of a sparse tensor (sum, as gloo's): every rank's
                    indices and values gathered, added up where they coincide
    reduce_scatter  torch leaves the input unchanged; ours uses it as scratch, so it
                    works on a copy
    send/recv       the user's channel (routes.py), with torch's tags; a receive
                    from any source (recv without src) is not offered
    bool, complex   moved as bytes / (real, imaginary) pairs; reduced as gloo reduces
                    them: bool as uint8 (sum and max are "or", product and min "and"),
                    complex sum and avg on its pairs (other ops refused, as gloo's)
    strided views   (non-contiguous, or a size-1 dimension with an odd stride) run on a
                    packed copy, copied back into the caller's tensor afterwards

Arguments are checked on the caller's thread, before the call is queued (`_check_*`
below): a call gloo refuses (a bitwise op on floats, premul_sum on integers, a list of
the wrong length, outputs of another dtype or shape, an output whose elements share
memory) raises there, from the torch.distributed call itself, with one line, and nothing
is sent. Where every rank holds the same arguments (the same call on every rank, as a
correct program makes) every rank refuses alike, and the group stays usable. Some
arguments are one rank's alone, and only that rank can refuse them:

    gather's outputs    the root's alone: it refuses, and its first message tells each
                        rank so (the others send only after it), which refuses too
                        (work.Refused); the group goes on
    scatter's inputs    the same: the root's first message says whether pieces follow
    all_to_all_single   each rank's own: the others may already be exchanging, and this
      splits            rank cannot know what they expect from it, so it refuses and
                        its group refuses every later call; the others fail at the
                        group's timeout (as gloo's), and no call reads a stale message

A failure once the call runs (a peer lost, ranks that disagree) leaves the group
refusing the rest too (work.py). torch's own checks run before the backend is called:
a gather or scatter list of another dtype, or none, on the root alone is refused
there, and the others, waiting for the root's first message, fail at the timeout, as
gloo's do. Out of reach: arguments that should be alike but are not, refused on some
ranks only (a float8 tensor on one rank): the ranks are then out of step.
"""
from __future__ import annotations

import atexit
import os
import weakref
from datetime import timedelta
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from .. import algorithms, api
from ..launch.exit import EXIT_GRACE_SECONDS
from ..transport import Transport
from .work import Refused, Work, Worker

# Keyed by the RedOpType's .value, a plain int: every call looks its op up here, and
# where cores are shared the caches are cold at every call, so each read from torch's
# bound objects is slow (hashing the enum itself would cost another read).
# Measured: docs/torch_backend.md, "Where the 4-rank gap goes: cold caches".
_OPS = {kind.value: name for kind, name in (
    (dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.PRODUCT, "product"),
    (dist.ReduceOp.BAND, "band"), (dist.ReduceOp.BOR, "bor"), (dist.ReduceOp.BXOR, "bxor"))}


def reduce_op(op) -> tuple:
    """(our op name, premul factor or None) for torch's ReduceOp."""
    kind = getattr(op, "op", op)  # a ReduceOp, or already its RedOpType
    name = _OPS.get(kind.value)   # the common case first: it runs on every call
    if name is not None:
        return name, None
    if kind == dist.ReduceOp.PREMUL_SUM:
        return "sum", op.factor
    raise ValueError(f"reduce op {kind} is not supported by the collectives backend")


def op_of(opts):
    """The ReduceOp in torch's options object; SUM when torch passed none."""
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def chosen_algorithms() -> Dict[str, str]:
    """Each collective's algorithm: the one COLLECTIVES_ALGORITHM names where that
    collective has it, else auto. Read once, when a group is made (as NCCL reads its
    NCCL_ALGO), so a bad value fails there and a call pays nothing for it."""
    wanted = os.environ.get("COLLECTIVES_ALGORITHM", "auto").strip() or "auto"
    if wanted not in algorithms.names("all_reduce"):
        raise ValueError(f"COLLECTIVES_ALGORITHM={wanted!r}: choose from "
                         f"{', '.join(algorithms.names('all_reduce'))}")
    return {collective: wanted if wanted in algorithms.names(collective) else "auto"
            for collective in algorithms.TABLES}


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor our collectives can move: complex as its (real, imaginary) pairs, bool
    as bytes. Moving data needs no arithmetic, so any reinterpretation is exact."""
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    return tensor


# The dtypes the backend moves (and, with the ops below, reduces): ours, and bool and
# complex through _bytes_view.
MOVABLE = tuple(api.SUPPORTED_DTYPES) + (torch.bool, torch.complex64, torch.complex128)
# bool reduced as uint8 0/1, op by op as gloo reduces bool ("or" and "and"); no avg
_BOOL_OPS = {"sum": "max", "max": "max", "bor": "bor", "product": "min", "min": "min",
             "band": "band", "bxor": "bxor"}
_COMPLEX_OPS = ("sum", "avg")  # complex (real, imaginary) pairs: ops that act on each


def _is_packed(tensor: torch.Tensor) -> bool:
    """Laid out as torch.empty(shape) would be: strides that a flat view and a byte view
    both accept. (is_contiguous() is True for a size-1 dimension of any stride,
    `arange(2)[::2]`, which a byte view refuses.)"""
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride())):
        if stride != expected and size != 0:
            return False
        expected *= size
    return True


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself where it is packed, else a packed copy (for an output: copy
    the result back with _unpack)."""
    if _is_packed(tensor):
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A packed copy, always: scratch memory the caller's tensor never sees."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _unpack(buffer: torch.Tensor, tensor: torch.Tensor) -> None:
    """The result in `buffer` copied back into the caller's tensor (unless it is it).
    An expand()ed tensor (a dimension of stride 0) holds one value for all of that
    dimension, and copy_ refuses to write it: it is written through index 0. Only an
    in-place call gets here with one (outputs like that are refused, _check_own_memory),
    and its copies of one element came out alike: one input, reduced or sent alike (a
    float sum perhaps added in another order: any of them is the sum)."""
    if buffer is tensor:
        return
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        if stride == 0 and size > 1:
            tensor, buffer = tensor.narrow(dim, 0, 1), buffer.narrow(dim, 0, 1)
    tensor.copy_(buffer)


def _overlapping(tensor: torch.Tensor) -> bool:
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


def _reducible(tensor: torch.Tensor, op: str):
    """(the view our algorithms reduce, the op they apply) for a packed tensor whose op
    _check_reduction accepted."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8), _BOOL_OPS[op]
    if tensor.is_complex():
        return torch.view_as_real(tensor), op
    return tensor, op


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def _check_movable(tensor, what: str) -> None:
    """A dense CPU tensor of a dtype the backend moves, or a one-line error."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what}: a {tensor.layout} tensor is not supported here")
    if tensor.dtype not in MOVABLE:
        raise TypeError(f"{what}: dtype {_dtype(tensor)} is not supported by the collectives "
                        f"backend (one of {', '.join(str(d).replace('torch.', '') for d in MOVABLE)})")


def _check_reduction(tensor, op: str, factor, what: str) -> None:
    """What gloo refuses, refused alike (or better: premul_sum and avg where ours has
    them); the error reads as one line."""
    _check_movable(tensor, what)
    if factor is not None and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{what}: premul_sum multiplies by a float factor; it takes "
                         f"floating-point or complex tensors, not {_dtype(tensor)}")
    if tensor.dtype == torch.bool and op not in _BOOL_OPS:
        raise ValueError(f"{what}: op {op} is not defined for bool tensors")
    if tensor.is_complex() and op not in _COMPLEX_OPS:
        raise ValueError(f"{what} does not support op {op} on complex tensors (sum and avg "
                         "only, as gloo)")
    if op in api.BITWISE_OPS and tensor.is_floating_point():
        raise ValueError(f"{what}: cannot use op {op} with non-integral dtype {_dtype(tensor)}")


def _check_own_memory(output: torch.Tensor, what: str) -> None:
    """An output whose elements are each a place of their own: one that shares places
    (an expand()ed view) could not hold a different value in each, and gloo writes one
    of them over the other. The layout is the caller's alone, alike on every rank."""
    if _overlapping(output):
        raise ValueError(f"{what}: elements of this output share memory (an expand()ed "
                         f"or overlapping view, strides {tuple(output.stride())}), so it "
                         "cannot hold a value for each: pass a tensor of its own (.clone())")


def _check_like(tensor, reference: torch.Tensor, what: str) -> None:
    """A tensor of the reference's dtype and shape (a list form's each entry)."""
    _check_movable(tensor, what)
    if tensor.dtype != reference.dtype:
        raise ValueError(f"{what}: dtype {_dtype(tensor)} differs from {_dtype(reference)}")
    if tensor.shape != reference.shape:
        raise ValueError(f"{what}: invalid tensor size {tuple(tensor.shape)} (expected "
                         f"{tuple(reference.shape)})")


def _check_list(tensors, n: int, what: str) -> None:
    if not isinstance(tensors, (list, tuple)) or len(tensors) != n:
        count = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{what}: invalid tensor list (expected {n} tensors, got {count})")


def _check_root(root: int, n: int, what: str) -> None:
    if not 0 <= root < n:
        raise ValueError(f"{what}: root {root} is not a rank of a group of {n}")


def _pieces(tensor: torch.Tensor, splits: List[int], n: int) -> List[torch.Tensor]:
    """A tensor cut along dim 0 into n flat pieces (equal when `splits` is empty)."""
    if tensor.dim() == 0:
        raise ValueError("all_to_all_single: a 0-dim tensor has no dimension 0 to split")
    rows = tensor.shape[0]
    if not splits:
        if rows % n:
            raise ValueError(f"all_to_all_single: dim 0 ({rows}) does not divide into "
                             f"{n} equal splits")
        splits = [rows // n] * n
    if len(splits) != n or sum(splits) != rows:
        raise ValueError(f"all_to_all_single: splits {list(splits)} do not cut dim 0 "
                         f"({rows}) into {n} pieces")
    row = tensor.numel() // rows if rows else 0
    flat, pieces, start = tensor.view(-1), [], 0
    for count in splits:
        pieces.append(flat[start * row:(start + count) * row])
        start += count
    return pieces


# Scatter's first message to each rank says whether the root sends its piece: the
# inputs are the root's alone, and a root that refuses them tells every rank, which then
# refuses too, in step. (One byte more per rank; the piece follows it at once.)
_GOES_ON, _REFUSED = 1, 0  # the root's first message of a gather or scatter


def _failing(text: str) -> Callable[[], None]:
    """A job that fails with `text`: after it, the group refuses every later call."""
    def run() -> None:
        raise ValueError(text)
    return run


class CollectivesBackend(dist._Backend):
    """One process group of the "collectives" backend (or of "mpi", see use_for_mpi)."""

    def __init__(self, rank: int, size: int, comm: Transport, p2p, timeout: timedelta,
                 algorithm: Dict[str, str], name: str = "collectives"):
        """algorithm: chosen_algorithms(), read before the channels were built."""
        super().__init__(rank, size)
        self.comm, self.p2p, self.timeout, self.backend_name = comm, p2p, timeout, name
        self.algorithm = algorithm
        self.worker = Worker(f"{name} backend, group of {size}", timeout)
        _live.add(self)

    def getBackendName(self) -> str:
        return self.backend_name

    # torch reads these on any backend; left undefined on a subclass they recurse
    supports_coalescing = property(lambda self: False)
    supports_splitting = property(lambda self: False)
    supports_tensor_alloc = property(lambda self: False)
    supports_time_estimate = property(lambda self: False)
    supports_window = property(lambda self: False)
    supports_shrinking = property(lambda self: False)
    supports_reconfigure = property(lambda self: False)

    def _submit(self, what: str, run: Callable[[], None], outputs: List[torch.Tensor],
                opts=None, inputs=None) -> Work:
        """Hand `run` to the worker; a blocking call (opts.asyncOp False) may run here.
        inputs: the tensors torch's profiler is shown (default: the outputs, in place)."""
        if self.worker is None:
            raise RuntimeError(f"{what}: this process group was destroyed")
        inline = not getattr(opts, "asyncOp", True)
        if torch.autograd._profiler_enabled():
            run, inline = self._profiled(what, run, outputs if inputs is None else inputs), False
        return self.worker.submit(what, run, outputs, inline=inline)

    def _profiled(self, what: str, run: Callable[[], None], inputs) -> Callable[[], None]:
        """Under torch's profiler, an event "BACKEND:collective" with the inputs' shapes,
        from the call to the end of the job on the worker (an async event, as torch's
        own backends record)."""
        record = torch._C._autograd._record_function_with_args_enter(
            f"{self.backend_name}:{what}", *inputs)

        def run_and_record():
            try:
                run()
            finally:
                torch._C._autograd._record_function_with_args_exit(record)
        return run_and_record

    # --- reductions ------------------------------------------------------------------------
    def _all_reduce_in_place(self, tensor: torch.Tensor, op: str, factor, algorithm: str):
        """tensor <- its reduction over the group (checked by _check_reduction)."""
        buffer = _packed(tensor)
        if factor is not None:
            buffer.mul_(factor)
        view, op = _reducible(buffer, op)
        api.all_reduce(view, op, algorithm, self.comm)
        _unpack(buffer, tensor)

    def _sparse_all_reduce(self, tensor: torch.Tensor, factor) -> None:
        """A sparse COO tensor summed over ranks (each share times `factor` for
        PREMUL_SUM, None for SUM), in place, as gloo sums one: every
        rank's non-zeros gathered (their count first, then the indices and the values,
        padded to the most any rank has), then added where they coincide. Moves only
        the non-zeros: nnz x (sparse dims x 8 bytes + a value's bytes) per rank."""
        local = tensor.coalesce()
        counts = [row[0] for row in api.gather_rows(self.comm, [local._nnz()])]
        widest, n = max(counts), self.comm.world_size
        pieces = []
        for mine in (local.indices().t(), _bytes_view(local.values())):
            padded = mine.new_zeros((widest,) + tuple(mine.shape[1:]))
            padded[:len(mine)] = mine
            gathered = padded.new_empty((n * widest,) + tuple(mine.shape[1:]))
            api.all_gather(gathered, padded.contiguous(), self.algorithm["all_gather"],
                           self.comm)
            pieces.append(torch.cat([gathered[r * widest:r * widest + counts[r]]
                                     for r in range(n)]))
        indices, values = pieces
        if local.values().is_complex():
            values = torch.view_as_complex(values)
        elif local.values().dtype == torch.bool:
            values = values.view(torch.bool)
        summed = torch.sparse_coo_tensor(indices.t(), values, tensor.shape,
                                         check_invariants=True).coalesce()
        if factor is not None:  # PREMUL_SUM: each rank's share scaled, so the sum too
            summed = summed * factor
        tensor.copy_(summed)

    def allreduce(self, tensors, opts=None):
        op, factor = reduce_op(op_of(opts))  # a bad op fails in the caller, not on the worker
        if any(t.is_sparse for t in tensors):
            if op != "sum" or not all(t.is_sparse for t in tensors):
                raise ValueError(f"all_reduce of sparse tensors sums them (as gloo's), all "
                                 f"sparse; op {op!r} on this list is not supported")
            for tensor in tensors:
                _check_movable(tensor._values(), "all_reduce")
            return self._submit("all_reduce", lambda: [
                self._sparse_all_reduce(t, factor) for t in tensors], list(tensors), opts=opts)
        for tensor in tensors:
            _check_reduction(tensor, op, factor, "all_reduce")
        algorithm = self.algorithm["all_reduce"]
        return self._submit("all_reduce", lambda: [
            self._all_reduce_in_place(t, op, factor, algorithm) for t in tensors],
            list(tensors), opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = reduce_op(op_of(opts))
        for tensor in tensors:
            _check_reduction(tensor, op, factor, "all_reduce_coalesced")
        algorithm = self.algorithm["all_reduce"]

        def run():
            # in one flat buffer, scaled where they lie; with bool or complex among them,
            # or a tensor whose elements share memory (scaled there, a place shared by
            # two would be scaled twice): each on its own (the same on every rank)
            if all(t.dtype in api.SUPPORTED_DTYPES and not _overlapping(t) for t in tensors):
                if factor is not None:
                    for tensor in tensors:
                        tensor.mul_(factor)
                api.all_reduce_coalesced(tensors, op, algorithm, self.comm)
            else:
                for tensor in tensors:
                    self._all_reduce_in_place(tensor, op, factor, algorithm)
        return self._submit("all_reduce_coalesced", run, list(tensors), opts=opts)

    def reduce(self, tensors, opts):
        root = opts.rootRank
        op, factor = reduce_op(opts.reduceOp)
        _check_root(root, self.comm.world_size, "reduce")
        for tensor in tensors:
            _check_reduction(tensor, op, factor, "reduce")
        algorithm = self.algorithm["all_reduce"]

        def run():
            for tensor in tensors:
                target = tensor if self.comm.rank == root else _fresh(tensor)
                self._all_reduce_in_place(target, op, factor, algorithm)
        return self._submit("reduce", run, list(tensors), opts=opts)

    def _reduce_scatter_one(self, output: torch.Tensor, input: torch.Tensor, op: str,
                            factor, copy: bool = True):
        # torch leaves the input as it was; ours uses it as scratch: work on a copy
        scratch = _fresh(input) if copy else input
        if factor is not None:
            scratch.mul_(factor)
        buffer = _packed(output)
        into, reduce = _reducible(buffer, op)
        api.reduce_scatter(into, _reducible(scratch, op)[0], reduce,
                           self.algorithm["reduce_scatter"], self.comm)
        _unpack(buffer, output)

    def _check_reduce_scatter(self, output, input, op, factor, what: str) -> None:
        _check_reduction(output, op, factor, what)
        _check_own_memory(output, what)
        _check_reduction(input, op, factor, what)
        n = self.comm.world_size
        if input.dtype != output.dtype or input.numel() != n * output.numel():
            raise ValueError(f"{what}: the input must hold the group's size ({n}) x the "
                             f"output's elements ({output.numel()}) of its dtype "
                             f"({_dtype(output)}); got {input.numel()} of {_dtype(input)}")

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op, factor = reduce_op(op_of(opts))
        _check_list(input_lists, len(outputs), "reduce_scatter")
        for output, inputs in zip(outputs, input_lists):
            _check_reduction(output, op, factor, "reduce_scatter")
            _check_own_memory(output, "reduce_scatter")
            _check_list(inputs, self.comm.world_size, "reduce_scatter: input list")
            for input in inputs:
                _check_like(input, output, "reduce_scatter: input")

        def run():
            for output, inputs in zip(outputs, input_lists):
                joined = torch.cat([t.reshape(-1) for t in inputs])  # a copy already
                self._reduce_scatter_one(output, joined, op, factor, copy=False)
        return self._submit("reduce_scatter", run, list(outputs), opts=opts,
                            inputs=[t for inputs in input_lists for t in inputs])

    def reduce_scatter_single(self, output, input, opts=None):
        op, factor = reduce_op(op_of(opts))
        self._check_reduce_scatter(output, input, op, factor, "reduce_scatter_tensor")
        return self._submit("reduce_scatter_tensor",
                            lambda: self._reduce_scatter_one(output, input, op, factor),
                            [output], opts=opts, inputs=[input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op, factor = reduce_op(op_of(opts))
        _check_list(inputs, len(outputs), "reduce_scatter_tensor_coalesced")
        for output, input in zip(outputs, inputs):
            self._check_reduce_scatter(output, input, op, factor,
                                       "reduce_scatter_tensor_coalesced")
        return self._submit("reduce_scatter_tensor_coalesced", lambda: [
            self._reduce_scatter_one(o, i, op, factor) for o, i in zip(outputs, inputs)],
            list(outputs), opts=opts)

    # --- data movement ----------------------------------------------------------------------
    def _broadcast_one(self, tensor: torch.Tensor, root: int) -> None:
        buffer = _packed(tensor)
        api.broadcast(_bytes_view(buffer), root, self.algorithm["broadcast"], self.comm)
        _unpack(buffer, tensor)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        _check_root(root, self.comm.world_size, "broadcast")
        for tensor in tensors:
            _check_movable(tensor, "broadcast")
        return self._submit("broadcast", lambda: [self._broadcast_one(t, root)
                                                  for t in tensors],
                            list(tensors), opts=opts)

    def _all_gather_list(self, outputs, input) -> None:
        api.all_gather([_bytes_view(t) for t in outputs], _bytes_view(_packed(input)),
                       self.algorithm["all_gather"], self.comm)

    def _check_gather_list(self, outputs, input, what: str) -> None:
        _check_movable(input, what)
        _check_list(outputs, self.comm.world_size, f"{what}: output list")
        for output in outputs:
            _check_like(output, input, f"{what}: output")
            _check_own_memory(output, f"{what}: output")

    def allgather(self, output_lists, input_list, opts=None):
        _check_list(output_lists, len(input_list), "all_gather")
        for outputs, input in zip(output_lists, input_list):
            self._check_gather_list(outputs, input, "all_gather")
        return self._submit("all_gather", lambda: [
            self._all_gather_list(outputs, input)
            for outputs, input in zip(output_lists, input_list)], list(output_lists), opts=opts,
            inputs=list(input_list))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][i] receives rank r's input_list[i]."""
        _check_list(output_lists, self.comm.world_size, "all_gather_coalesced")
        for per_rank in output_lists:
            _check_list(per_rank, len(input_list), "all_gather_coalesced: output list")
        for i, input in enumerate(input_list):
            self._check_gather_list([per_rank[i] for per_rank in output_lists], input,
                                    "all_gather_coalesced")
        return self._submit("all_gather_coalesced", lambda: [
            self._all_gather_list([per_rank[i] for per_rank in output_lists], input)
            for i, input in enumerate(input_list)], list(output_lists), opts=opts,
            inputs=list(input_list))

    def _check_gather_tensor(self, output, input, what: str) -> None:
        _check_movable(output, what)
        _check_own_memory(output, what)
        _check_movable(input, what)
        n = self.comm.world_size
        if output.dtype != input.dtype or output.numel() != n * input.numel():
            raise ValueError(f"{what}: the output must hold the group's size ({n}) x the "
                             f"input's elements ({input.numel()}) of its dtype "
                             f"({_dtype(input)}); got {output.numel()} of {_dtype(output)}")

    def _all_gather_tensor(self, output, input) -> None:
        buffer = _packed(output)
        api.all_gather(_bytes_view(buffer), _bytes_view(_packed(input)),
                       self.algorithm["all_gather"], self.comm)
        _unpack(buffer, output)

    def all_gather_single(self, output, input, opts=None):
        self._check_gather_tensor(output, input, "all_gather_into_tensor")
        return self._submit("all_gather_into_tensor",
                            lambda: self._all_gather_tensor(output, input), [output],
                            opts=opts, inputs=[input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        _check_list(inputs, len(outputs), "all_gather_into_tensor_coalesced")
        for output, input in zip(outputs, inputs):
            self._check_gather_tensor(output, input, "all_gather_into_tensor_coalesced")
        return self._submit("all_gather_into_tensor_coalesced", lambda: [
            self._all_gather_tensor(o, i) for o, i in zip(outputs, inputs)], list(outputs),
            opts=opts, inputs=list(inputs))

    def gather(self, output_lists, input_list, opts):
        root, comm = opts.rootRank, self.comm
        _check_root(root, comm.world_size, "gather")
        _check_list(input_list, 1, "gather: input list")
        _check_movable(input_list[0], "gather")
        if comm.rank == root:
            try:  # the outputs are the root's alone: only the root can refuse them
                _check_list(output_lists, 1, "gather: output lists")
                self._check_gather_list(output_lists[0], input_list[0], "gather")
            except (TypeError, ValueError):
                # The others send only once the root says it takes their pieces
                # (_root_says): it says no, and they refuse too.
                self._submit("gather", lambda: self._root_says(root, _REFUSED),
                             [], opts=opts, inputs=list(input_list))
                raise

        def run():
            input = _bytes_view(_packed(input_list[0]))
            if comm.rank != root:
                self._hear_root(root, "gather", "output lists")
                comm.send(input, root)
                return
            outputs = output_lists[0]
            buffers = [_packed(t) for t in outputs]
            handles = [comm.irecv(_bytes_view(buffers[peer]), peer)
                       for peer in range(comm.world_size) if peer != root]
            handles += self._root_says(root, _GOES_ON, wait=False)
            _bytes_view(buffers[root]).copy_(input)
            for handle in handles:
                handle.wait()
            for buffer, output in zip(buffers, outputs):
                _unpack(buffer, output)
        return self._submit("gather", run, list(output_lists[0]) if output_lists else [],
                            opts=opts, inputs=list(input_list))

    def scatter(self, outputs, input_lists, opts):
        root, comm = opts.rootRank, self.comm
        _check_root(root, comm.world_size, "scatter")
        _check_list(outputs, 1, "scatter: output list")
        _check_movable(outputs[0], "scatter")
        _check_own_memory(outputs[0], "scatter")
        if comm.rank == root:
            try:
                _check_list(input_lists, 1, "scatter: input lists")
                _check_list(input_lists[0], comm.world_size, "scatter: input list")
                for input in input_lists[0]:
                    _check_like(input, outputs[0], "scatter: input")
            except (TypeError, ValueError):
                self._submit("scatter", lambda: self._root_says(root, _REFUSED), [],
                             opts=opts)
                raise

        def run():
            buffer = _packed(outputs[0])
            if comm.rank != root:
                self._hear_root(root, "scatter", "input list")
                comm.recv(_bytes_view(buffer), root)
            else:
                inputs = [_bytes_view(_packed(t)) for t in input_lists[0]]
                handles = self._root_says(root, _GOES_ON, wait=False)
                handles += [comm.isend(inputs[peer], peer) for peer in range(comm.world_size)
                            if peer != root]
                _bytes_view(buffer).copy_(inputs[root])
                for handle in handles:
                    handle.wait()
            _unpack(buffer, outputs[0])
        return self._submit("scatter", run, list(outputs), opts=opts)

    def _hear_root(self, root: int, collective: str, what: str) -> None:
        """A gather's or scatter's first message, from the root: whether it goes on."""
        word = torch.empty(1, dtype=torch.uint8)
        self.comm.recv(word, root)
        if word.item() != _GOES_ON:
            raise Refused(f"{collective}: the root (rank {root}) refused its {what}; "
                          "nothing was sent")

    def _root_says(self, root: int, word: int, wait: bool = True):
        """The root's first message of a gather or scatter, `word`, to every other
        rank: they send (gather) or receive (scatter) only after it, so a root that
        refused, here or in torch's own checks before the backend is called, leaves
        no message of theirs behind for a later call to read."""
        comm, message = self.comm, torch.tensor([word], dtype=torch.uint8)
        handles = [comm.isend(message, peer) for peer in range(comm.world_size)
                   if peer != root]
        if not wait:
            return handles
        for handle in handles:
            handle.wait()

    def alltoall(self, outputs, inputs, opts=None):
        n = self.comm.world_size
        _check_list(outputs, n, "all_to_all: output list")
        _check_list(inputs, n, "all_to_all: input list")
        for output, input in zip(outputs, inputs):
            _check_movable(output, "all_to_all: output")
            _check_own_memory(output, "all_to_all: output")
            _check_movable(input, "all_to_all: input")
            if output.dtype != input.dtype:
                raise ValueError(f"all_to_all: dtypes differ ({_dtype(output)} and "
                                 f"{_dtype(input)})")

        def run():
            buffers = [_packed(t) for t in outputs]
            api.all_to_all([_bytes_view(t) for t in buffers],
                           [_bytes_view(_packed(t)) for t in inputs], self.comm)
            for buffer, output in zip(buffers, outputs):
                _unpack(buffer, output)
        return self._submit("all_to_all", run, list(outputs), opts=opts, inputs=list(inputs))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        n = self.comm.world_size
        _check_movable(output, "all_to_all_single")
        _check_movable(input, "all_to_all_single")
        if output.dtype != input.dtype:
            raise ValueError(f"all_to_all_single: dtypes differ ({_dtype(output)} and "
                             f"{_dtype(input)})")
        _check_own_memory(output, "all_to_all_single")
        buffer = _packed(output)
        try:
            outs = _pieces(_bytes_view(buffer), list(output_splits), n)
            ins = _pieces(_bytes_view(_packed(input)), list(input_splits), n)
        except ValueError as error:
            if output_splits or input_splits:
                # Splits are each rank's own: the others may be sending already, and
                # this rank cannot know what they expect from it. Refused, and the
                # group then refuses every later call (in the group's order), so that
                # no later call reads their messages: they fail at their timeout.
                self._submit("all_to_all_single", _failing(str(error)), [output],
                             opts=opts)
            raise

        def run():
            api.all_to_all(outs, ins, self.comm)
            _unpack(buffer, output)
        return self._submit("all_to_all_single", run, [output], opts=opts, inputs=[input])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._submit("barrier", self.comm.barrier, [], opts=opts)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        timeout = getattr(opts, "timeout", None)
        if timeout is None or timeout < timedelta(0):  # torch's "unset" is -1 ms; 0 is 0
            timeout = self.timeout
        # After everything queued before it (waiting only on this rank's own queue),
        # then gloo's (or MPI's) barrier that names the ranks that did not arrive.
        self._submit("monitored_barrier", lambda: None, []).wait()
        self.p2p.monitored_barrier(timeout, wait_all_ranks)

    # --- the user's point-to-point ---------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        return self.p2p.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self.p2p.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        # torch asks the returned Work for the sender (Work._source_rank), and torch
        # 2.14 does not pass that question on to a backend written in Python: the
        # answer would be lost, so say so (nccl has no receive from any source either).
        raise NotImplementedError("the collectives backend cannot receive from any "
                                  "source: pass src= to recv/irecv")

    # --- the end --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Finish what is queued (a few seconds at most), then release the channels:
        destroy_process_group() calls this, and so does the exit for a script that did
        not. Left to the interpreter's own teardown, the gloo instances would be
        destroyed with their threads running, and the process would abort after the
        script had finished (torch does the same for its own groups)."""
        if self.worker is None:
            return
        self.worker.stop()
        self.worker.join(EXIT_GRACE_SECONDS)
        if self.worker.thread.is_alive():
            return  # still inside a collective with a peer that is gone: leave it be
        self.comm.close()
        self.comm = self.p2p = self.worker = None


_live: "weakref.WeakSet[CollectivesBackend]" = weakref.WeakSet()


@atexit.register
def _shut_down_at_exit() -> None:
    for backend in list(_live):
        backend.shutdown()
