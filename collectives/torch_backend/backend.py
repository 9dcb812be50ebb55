"""The backend object torch.distributed calls: each of its collectives, mapped to ours.

torch.distributed calls these methods with its own argument shapes (lists of tensors,
an options object); each one here checks them (arguments.py), queues the collective on
the group's worker (work.py) and returns the Work. On the worker the collective runs
through the public API (api.py): the same check that makes ranks which disagree raise
on every rank, the same algorithms (`auto` unless COLLECTIVES_ALGORITHM names one).

What torch asks for that our algorithms do not do directly:

    reduce          an all-reduce into scratch memory on every rank but the root
    gather/scatter  the root receives from (sends to) each rank in turn, after a word
                    that says whether the call goes on (rooted.py)
    premul_sum      every rank scales its tensor by the factor, then a sum
    integer avg     rounded toward zero, as NCCL's (reductions.py)
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

Every tensor reaches our algorithms as a flat view (tensors.py), so the ranks compare a
call's collective, op, dtype and count, never its shape: one rank's (2, 3) meets
another's (6,) as on gloo.

Refusals. Arguments are checked on the caller's thread, before anything is queued or
sent: a call gloo refuses raises there, from the torch.distributed call itself, with
one line. Its peers may have gone ahead with the call (their arguments were fine), so a
refused call still takes its place in the group's sequence: the rank queues, where the
call would have run, a call that moves nothing (`refusing`). Where every rank refused,
those agree, and the group goes on. Where a peer went ahead, the peer's call meets this
one instead and both raise, naming both calls, at once; and no later call of this rank
pairs with the peer's. (The group then refuses the rest: where the ranks compare calls
on the shared call board, messages of the peer's call may be left behind.) What stands
in for the call:

    most collectives    an all-reduce of nothing (numel=0, uint8), which the peers'
                        error names
    gather, scatter     the root says REFUSED; another rank hears the root's word, and
                        takes a scatter's piece into scratch if the root went on
                        (rooted.py): the group goes on either way, but for a gather
                        whose input this rank could not give

A failure once the call runs (a peer lost, ranks that disagree) leaves the group
refusing the rest too (work.py). torch's own checks run before the backend is called:
a list of another dtype on one rank, say, is refused there by torch, and that rank's
peers fail at the group's timeout, as gloo's do.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import algorithms, api
from ..launch.exit import EXIT_GRACE_SECONDS
from ..transport import Transport
from . import rooted
from .arguments import (check_exchange, check_like, check_list, check_movable,
                        check_own_memory, check_reduction, check_root, check_total,
                        dtype_name, split_rows)
from .reductions import (all_reduce_coalesced, all_reduce_in_place, reduce_scatter_into,
                         sparse_all_reduce)
from .tensors import bytes_view, cut_rows, fresh, packed, unpack
from .work import Work, Worker

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


def _scatter_output(outputs) -> Optional[torch.Tensor]:
    """scatter's output, where it is one the backend could receive into (its size and
    dtype are known); else None."""
    try:
        check_list(outputs, 1, "scatter")
        check_movable(outputs[0], "scatter")
    except (TypeError, ValueError):
        return None
    return outputs[0]


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

    # --- refusals ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def refusing(self, collective: str, stand_in: Optional[Callable[[], None]] = None):
        """Check a call's arguments inside this block. A refusal (TypeError, ValueError)
        is raised to the caller at once, and `stand_in` (default: an all-reduce of
        nothing) is queued where the call would have run, so that this rank still
        makes a call at that point of the group's sequence (the module docstring)."""
        try:
            yield
        except (TypeError, ValueError):
            if self.worker is not None:
                self._submit(f"{collective} (refused on this rank)",
                             stand_in or self._nothing_reduced, [])
            raise

    def _nothing_reduced(self) -> None:
        """The call a refused one leaves in its place: it moves nothing, and its
        signature (all_reduce, numel=0, uint8) matches no peer's real call but another
        refusal's stand-in (or an all-reduce of nothing itself)."""
        api.all_reduce(torch.empty(0, dtype=torch.uint8), "sum", "auto", self.comm)

    # --- reductions ------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        with self.refusing("all_reduce"):
            op, factor = reduce_op(op_of(opts))
            sparse = any(t.is_sparse for t in tensors)
            if sparse and (op != "sum" or not all(t.is_sparse for t in tensors)):
                raise ValueError(f"all_reduce of sparse tensors sums them (as gloo's), all "
                                 f"sparse; op {op!r} on this list is not supported")
            for tensor in tensors:
                if sparse:
                    check_movable(tensor._values(), "all_reduce")
                else:
                    check_reduction(tensor, op, factor, "all_reduce")
        if sparse:
            gather = self.algorithm["all_gather"]
            return self._submit("all_reduce", lambda: [
                sparse_all_reduce(t, factor, gather, self.comm) for t in tensors],
                list(tensors), opts=opts)
        algorithm = self.algorithm["all_reduce"]
        return self._submit("all_reduce", lambda: [
            all_reduce_in_place(t, op, factor, algorithm, self.comm) for t in tensors],
            list(tensors), opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        with self.refusing("all_reduce_coalesced"):
            op, factor = reduce_op(op_of(opts))
            for tensor in tensors:
                check_reduction(tensor, op, factor, "all_reduce_coalesced")
        algorithm = self.algorithm["all_reduce"]
        return self._submit("all_reduce_coalesced", lambda: all_reduce_coalesced(
            tensors, op, factor, algorithm, self.comm), list(tensors), opts=opts)

    def reduce(self, tensors, opts):
        root = opts.rootRank
        with self.refusing("reduce"):
            op, factor = reduce_op(opts.reduceOp)
            check_root(root, self.comm.world_size, "reduce")
            for tensor in tensors:
                check_reduction(tensor, op, factor, "reduce")
        algorithm = self.algorithm["all_reduce"]

        def run():
            for tensor in tensors:
                target = tensor if self.comm.rank == root else fresh(tensor)
                all_reduce_in_place(target, op, factor, algorithm, self.comm)
        return self._submit("reduce", run, list(tensors), opts=opts)

    def _check_reduce_scatter(self, output, input, op, factor, what: str) -> None:
        check_reduction(output, op, factor, what)
        check_own_memory(output, what)
        check_reduction(input, op, factor, what)
        check_total(input, output, self.comm.world_size, what, "input", "output")

    def reduce_scatter(self, outputs, input_lists, opts=None):
        with self.refusing("reduce_scatter"):
            op, factor = reduce_op(op_of(opts))
            check_list(input_lists, len(outputs), "reduce_scatter")
            for output, inputs in zip(outputs, input_lists):
                check_reduction(output, op, factor, "reduce_scatter")
                check_own_memory(output, "reduce_scatter")
                check_list(inputs, self.comm.world_size, "reduce_scatter: input list")
                for input in inputs:
                    check_like(input, output, "reduce_scatter: input")
        algorithm = self.algorithm["reduce_scatter"]

        def run():
            for output, inputs in zip(outputs, input_lists):
                joined = torch.cat([t.reshape(-1) for t in inputs])  # a copy already
                reduce_scatter_into(output, joined, op, factor, algorithm, self.comm,
                                    copy=False)
        return self._submit("reduce_scatter", run, list(outputs), opts=opts,
                            inputs=[t for inputs in input_lists for t in inputs])

    def reduce_scatter_single(self, output, input, opts=None):
        with self.refusing("reduce_scatter_tensor"):
            op, factor = reduce_op(op_of(opts))
            self._check_reduce_scatter(output, input, op, factor, "reduce_scatter_tensor")
        algorithm = self.algorithm["reduce_scatter"]
        return self._submit("reduce_scatter_tensor", lambda: reduce_scatter_into(
            output, input, op, factor, algorithm, self.comm), [output], opts=opts,
            inputs=[input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        what = "reduce_scatter_tensor_coalesced"
        with self.refusing(what):
            op, factor = reduce_op(op_of(opts))
            check_list(inputs, len(outputs), what)
            for output, input in zip(outputs, inputs):
                self._check_reduce_scatter(output, input, op, factor, what)
        algorithm = self.algorithm["reduce_scatter"]
        return self._submit(what, lambda: [
            reduce_scatter_into(o, i, op, factor, algorithm, self.comm)
            for o, i in zip(outputs, inputs)], list(outputs), opts=opts)

    # --- data movement ----------------------------------------------------------------------
    def _broadcast_one(self, tensor: torch.Tensor, root: int) -> None:
        buffer = packed(tensor)
        api.broadcast(bytes_view(buffer), root, self.algorithm["broadcast"], self.comm)
        unpack(buffer, tensor)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        with self.refusing("broadcast"):
            check_root(root, self.comm.world_size, "broadcast")
            for tensor in tensors:
                check_movable(tensor, "broadcast")
        return self._submit("broadcast", lambda: [self._broadcast_one(t, root)
                                                  for t in tensors],
                            list(tensors), opts=opts)

    def _all_gather_list(self, outputs, input) -> None:
        """outputs[r] <- rank r's input: gathered into one flat buffer, then copied out
        (the ranks compare the input's count and dtype, not its shape)."""
        mine = bytes_view(packed(input))
        count = mine.numel()
        flat = mine.new_empty(self.comm.world_size * count)
        api.all_gather(flat, mine, self.algorithm["all_gather"], self.comm)
        for slot, output in enumerate(outputs):
            buffer = packed(output)
            bytes_view(buffer).copy_(flat[slot * count:(slot + 1) * count])
            unpack(buffer, output)

    def _check_gather_list(self, outputs, input, what: str) -> None:
        check_movable(input, what)
        check_list(outputs, self.comm.world_size, f"{what}: output list")
        for output in outputs:
            check_like(output, input, f"{what}: output")
            check_own_memory(output, f"{what}: output")

    def allgather(self, output_lists, input_list, opts=None):
        with self.refusing("all_gather"):
            check_list(output_lists, len(input_list), "all_gather")
            for outputs, input in zip(output_lists, input_list):
                self._check_gather_list(outputs, input, "all_gather")
        return self._submit("all_gather", lambda: [
            self._all_gather_list(outputs, input)
            for outputs, input in zip(output_lists, input_list)], list(output_lists), opts=opts,
            inputs=list(input_list))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][i] receives rank r's input_list[i]."""
        with self.refusing("all_gather_coalesced"):
            check_list(output_lists, self.comm.world_size, "all_gather_coalesced")
            for per_rank in output_lists:
                check_list(per_rank, len(input_list), "all_gather_coalesced: output list")
            for i, input in enumerate(input_list):
                self._check_gather_list([per_rank[i] for per_rank in output_lists], input,
                                        "all_gather_coalesced")
        return self._submit("all_gather_coalesced", lambda: [
            self._all_gather_list([per_rank[i] for per_rank in output_lists], input)
            for i, input in enumerate(input_list)], list(output_lists), opts=opts,
            inputs=list(input_list))

    def _check_gather_tensor(self, output, input, what: str) -> None:
        check_movable(output, what)
        check_own_memory(output, what)
        check_movable(input, what)
        check_total(output, input, self.comm.world_size, what, "output", "input")

    def _all_gather_tensor(self, output, input) -> None:
        buffer = packed(output)
        api.all_gather(bytes_view(buffer), bytes_view(packed(input)),
                       self.algorithm["all_gather"], self.comm)
        unpack(buffer, output)

    def all_gather_single(self, output, input, opts=None):
        with self.refusing("all_gather_into_tensor"):
            self._check_gather_tensor(output, input, "all_gather_into_tensor")
        return self._submit("all_gather_into_tensor",
                            lambda: self._all_gather_tensor(output, input), [output],
                            opts=opts, inputs=[input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        what = "all_gather_into_tensor_coalesced"
        with self.refusing(what):
            check_list(inputs, len(outputs), what)
            for output, input in zip(outputs, inputs):
                self._check_gather_tensor(output, input, what)
        return self._submit(what, lambda: [
            self._all_gather_tensor(o, i) for o, i in zip(outputs, inputs)], list(outputs),
            opts=opts, inputs=list(inputs))

    def gather(self, output_lists, input_list, opts):
        root, comm = opts.rootRank, self.comm
        with self.refusing("gather"):  # the root is every rank's argument alike
            check_root(root, comm.world_size, "gather")
        # the rest: the root's word tells the others (rooted.py)
        with self.refusing("gather", lambda: rooted.refused_here(comm, root, "gather")):
            check_list(input_list, 1, "gather: input list")
            check_movable(input_list[0], "gather")
            if comm.rank == root:  # the outputs are the root's alone
                check_list(output_lists, 1, "gather: output lists")
                self._check_gather_list(output_lists[0], input_list[0], "gather")
        outputs = output_lists[0] if comm.rank == root else None
        return self._submit("gather", lambda: rooted.gather(comm, root, outputs, input_list[0]),
                            list(outputs or []), opts=opts, inputs=list(input_list))

    def scatter(self, outputs, input_lists, opts):
        root, comm = opts.rootRank, self.comm
        with self.refusing("scatter"):
            check_root(root, comm.world_size, "scatter")
        with self.refusing("scatter", lambda: rooted.refused_here(
                comm, root, "scatter", _scatter_output(outputs))):
            check_list(outputs, 1, "scatter: output list")
            check_movable(outputs[0], "scatter")
            check_own_memory(outputs[0], "scatter")
            if comm.rank == root:  # the inputs are the root's alone
                check_list(input_lists, 1, "scatter: input lists")
                check_list(input_lists[0], comm.world_size, "scatter: input list")
                for input in input_lists[0]:
                    check_like(input, outputs[0], "scatter: input")
        inputs = input_lists[0] if comm.rank == root else None
        return self._submit("scatter", lambda: rooted.scatter(comm, root, outputs[0], inputs),
                            list(outputs), opts=opts)

    def alltoall(self, outputs, inputs, opts=None):
        with self.refusing("all_to_all"):
            check_exchange(outputs, inputs, self.comm.rank, self.comm.world_size,
                           "all_to_all")

        def run():
            buffers = [packed(t) for t in outputs]
            api.all_to_all([bytes_view(t) for t in buffers],
                           [bytes_view(packed(t)) for t in inputs], self.comm)
            for buffer, output in zip(buffers, outputs):
                unpack(buffer, output)
        return self._submit("all_to_all", run, list(outputs), opts=opts, inputs=list(inputs))

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        n, what = self.comm.world_size, "all_to_all_single"
        with self.refusing(what):
            # the splits are each rank's own: a rank that refuses them makes its stand-in
            # call where its peers make theirs, and those raise at once
            check_movable(output, what)
            check_movable(input, what)
            if output.dtype != input.dtype:
                raise ValueError(f"{what}: dtypes differ ({dtype_name(output)} and "
                                 f"{dtype_name(input)})")
            check_own_memory(output, what)
            output_rows = split_rows(output, list(output_splits), n, what)
            input_rows = split_rows(input, list(input_splits), n, what)
        buffer = packed(output)
        outs = cut_rows(bytes_view(buffer), output.shape[0], output_rows)
        ins = cut_rows(bytes_view(packed(input)), input.shape[0], input_rows)

        def run():
            api.all_to_all(outs, ins, self.comm)
            unpack(buffer, output)
        return self._submit(what, run, [output], opts=opts, inputs=[input])

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


__all__ = ["CollectivesBackend", "chosen_algorithms", "op_of", "reduce_op"]
