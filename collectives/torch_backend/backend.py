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
from .work import Work, Worker

# Keyed by the RedOpType's .value, a plain int: on a machine whose cores are shared, the
# caches are cold at every call, and each read from torch's bound objects costs ~10 us
# (hashing the enum itself costs another read).
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


def _pieces(tensor: torch.Tensor, splits: List[int], n: int) -> List[torch.Tensor]:
    """A tensor cut along dim 0 into n flat pieces (equal when `splits` is empty)."""
    rows = tensor.shape[0] if tensor.dim() else 1
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
        if factor is not None:
            tensor.mul_(factor)
        api.all_reduce(tensor, op, algorithm, self.comm)

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
            return self._submit("all_reduce", lambda: [
                self._sparse_all_reduce(t, factor) for t in tensors], list(tensors), opts=opts)
        algorithm = self.algorithm["all_reduce"]
        return self._submit("all_reduce", lambda: [
            self._all_reduce_in_place(t, op, factor, algorithm) for t in tensors],
            list(tensors), opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        op, factor = reduce_op(op_of(opts))

        def run():
            if factor is not None:
                for tensor in tensors:
                    tensor.mul_(factor)
            api.all_reduce_coalesced(tensors, op, self.algorithm["all_reduce"], self.comm)
        return self._submit("all_reduce_coalesced", run, list(tensors), opts=opts)

    def reduce(self, tensors, opts):
        root = opts.rootRank
        op, factor = reduce_op(opts.reduceOp)
        algorithm = self.algorithm["all_reduce"]

        def run():
            for tensor in tensors:
                target = tensor if self.comm.rank == root else tensor.clone()
                self._all_reduce_in_place(target, op, factor, algorithm)
        return self._submit("reduce", run, list(tensors), opts=opts)

    def _reduce_scatter_one(self, output: torch.Tensor, input: torch.Tensor, torch_op,
                            copy: bool = True):
        op, factor = reduce_op(torch_op)
        # torch leaves the input as it was; ours uses it as scratch: work on a copy
        scratch = input.contiguous().clone() if copy else input
        if factor is not None:
            scratch.mul_(factor)
        api.reduce_scatter(output, scratch, op, self.algorithm["reduce_scatter"], self.comm)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = op_of(opts)

        def run():
            for output, inputs in zip(outputs, input_lists):
                joined = torch.cat([t.reshape(-1) for t in inputs])  # a copy already
                self._reduce_scatter_one(output, joined, op, copy=False)
        return self._submit("reduce_scatter", run, list(outputs), opts=opts,
                            inputs=[t for inputs in input_lists for t in inputs])

    def reduce_scatter_single(self, output, input, opts=None):
        op = op_of(opts)
        return self._submit("reduce_scatter_tensor",
                            lambda: self._reduce_scatter_one(output, input, op), [output],
                            opts=opts, inputs=[input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = op_of(opts)
        return self._submit("reduce_scatter_tensor_coalesced", lambda: [
            self._reduce_scatter_one(o, i, op) for o, i in zip(outputs, inputs)], list(outputs),
            opts=opts)

    # --- data movement ----------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        return self._submit("broadcast", lambda: [
            api.broadcast(_bytes_view(t), root, self.algorithm["broadcast"], self.comm)
            for t in tensors],
            list(tensors), opts=opts)

    def _all_gather_list(self, outputs, input) -> None:
        api.all_gather([_bytes_view(t) for t in outputs], _bytes_view(input.contiguous()),
                       self.algorithm["all_gather"], self.comm)

    def allgather(self, output_lists, input_list, opts=None):
        return self._submit("all_gather", lambda: [
            self._all_gather_list(outputs, input)
            for outputs, input in zip(output_lists, input_list)], list(output_lists), opts=opts,
            inputs=list(input_list))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][i] receives rank r's input_list[i]."""
        return self._submit("all_gather_coalesced", lambda: [
            self._all_gather_list([per_rank[i] for per_rank in output_lists], input)
            for i, input in enumerate(input_list)], list(output_lists), opts=opts,
            inputs=list(input_list))

    def all_gather_single(self, output, input, opts=None):
        return self._submit("all_gather_into_tensor", lambda: api.all_gather(
            _bytes_view(output), _bytes_view(input.contiguous()), self.algorithm["all_gather"],
            self.comm), [output], opts=opts, inputs=[input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._submit("all_gather_into_tensor_coalesced", lambda: [
            api.all_gather(_bytes_view(o), _bytes_view(i.contiguous()),
                           self.algorithm["all_gather"], self.comm)
            for o, i in zip(outputs, inputs)], list(outputs), opts=opts, inputs=list(inputs))

    def gather(self, output_lists, input_list, opts):
        root, comm = opts.rootRank, self.comm

        def run():
            input = _bytes_view(input_list[0].contiguous())
            if comm.rank != root:
                comm.send(input, root)
                return
            outputs = output_lists[0]
            if len(outputs) != comm.world_size:
                raise ValueError(f"gather: the root needs {comm.world_size} output tensors, "
                                 f"got {len(outputs)}")
            handles = [comm.irecv(_bytes_view(outputs[peer]), peer)
                       for peer in range(comm.world_size) if peer != root]
            _bytes_view(outputs[root]).copy_(input)
            for handle in handles:
                handle.wait()
        return self._submit("gather", run, list(output_lists[0]) if output_lists else [],
                            opts=opts, inputs=list(input_list))

    def scatter(self, outputs, input_lists, opts):
        root, comm = opts.rootRank, self.comm

        def run():
            if comm.rank != root:
                comm.recv(_bytes_view(outputs[0]), root)
                return
            inputs = [_bytes_view(t.contiguous()) for t in input_lists[0]]
            if len(inputs) != comm.world_size:
                raise ValueError(f"scatter: the root needs {comm.world_size} input tensors, "
                                 f"got {len(inputs)}")
            handles = [comm.isend(inputs[peer], peer) for peer in range(comm.world_size)
                       if peer != root]
            _bytes_view(outputs[0]).copy_(inputs[root])
            for handle in handles:
                handle.wait()
        return self._submit("scatter", run, list(outputs), opts=opts)

    def alltoall(self, outputs, inputs, opts=None):
        return self._submit("all_to_all", lambda: api.all_to_all(
            [_bytes_view(t) for t in outputs], [_bytes_view(t.contiguous()) for t in inputs],
            self.comm), list(outputs), opts=opts, inputs=list(inputs))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        n = self.comm.world_size
        outs = _pieces(_bytes_view(output), list(output_splits), n)
        ins = _pieces(_bytes_view(input.contiguous()), list(input_splits), n)
        return self._submit("all_to_all_single",
                            lambda: api.all_to_all(outs, ins, self.comm), [output], opts=opts,
                            inputs=[input])

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
