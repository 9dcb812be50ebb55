"""Horovod's training helpers: DistributedOptimizer, broadcasting parameters, optimizer
state and objects, and gradient compression.

`DistributedOptimizer` uses the same Bucketer as our DDP (bucketer.py): gradients are
averaged bucket by bucket on a comm thread while backward runs, and `optimizer.step()`
waits for them. Each bucket goes through the face's engine (engine.py) like any
allreduce, so a rank that has called `hvd.join()` stands in for it with zeros.
As in Horovod, a parameter without a gradient in a step takes part with zeros and gets
the averaged gradient, so ranks that used different parameters never wait on each other.

The optimizer stays the user's own object, of its own class (isinstance, param_groups,
state_dict() and LR schedulers see nothing new). What Horovod adds lives beside it, in
a DistributedGradients kept as `optimizer._distributed`:

    optimizer.step()              ->  DistributedGradients.step(): synchronize(), then
                                      the optimizer's own step
    optimizer.synchronize()       ->  wait for every bucket (Bucketer.finish)
    optimizer.skip_synchronize()  ->  step() without waiting, after synchronize()
    optimizer.zero_grad()         ->  the optimizer's own, refused while buckets fly
"""
from __future__ import annotations

import contextlib
import io
import types
import warnings
from typing import Dict, NamedTuple, Optional

import torch

from ..world import get_comm
from ..bucketer import Bucketer, BucketOptions
from .engine import engine
from .ops import (Adasum, Average, Sum, _submit_allreduce, allgather, broadcast_async_,
                  global_process_set, sparse_allreduce_async, synchronize)
from .process_sets import ProcessSet, Scope, scope


# --- compression, as Horovod's: compress(t) -> (t, ctx); decompress(t, ctx) -> t ---------
class NoneCompressor:
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Send floating-point tensors as float16 (half the bytes); restore the dtype after."""

    @staticmethod
    def compress(tensor):
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# --- broadcasting state -------------------------------------------------------------------
def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Broadcast a state_dict, a list of (name, tensor), or a list of tensors, from
    root_rank, in place (process_set: among its ranks only; Horovod's has no such
    argument).

    One flat buffer per dtype (not one message per tensor), named after its first
    tensor (`broadcast.parameters.float32.fc.bias`), named tensors in name order.
    """
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda item: item[0])
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
        if all(name is not None for name, _ in items):
            items.sort(key=lambda item: item[0])
    groups = {}
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor):
            groups.setdefault(tensor.dtype, []).append((name, tensor))
    for dtype, group in groups.items():
        first = group[0][0]
        name = None if first is None else \
            f"parameters.{str(dtype).replace('torch.', '')}.{first}"
        flat = torch.cat([t.detach().reshape(-1) for _, t in group])
        synchronize(broadcast_async_(flat, root_rank, name, process_set))
        offset = 0
        for _, tensor in group:
            tensor.detach().copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def _to_bytes(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor):
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def broadcast_object(obj, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set):
    """Any picklable object from root_rank to every rank (its length, then its bytes,
    under `<name>.sz` and `<name>.t` as Horovod names them; name defaults to "object",
    the same on every rank whatever each passes as obj)."""
    name = "object" if name is None else name
    rank = get_comm().rank
    payload = _to_bytes(obj) if rank == root_rank else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    synchronize(broadcast_async_(length, root_rank, f"{name}.sz", process_set))
    if rank != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    synchronize(broadcast_async_(payload, root_rank, f"{name}.t", process_set))
    return _from_bytes(payload)


def allgather_object(obj, name: Optional[str] = None, process_set=global_process_set) -> list:
    """Every rank's picklable object, in rank order (`<name>.sz` and `<name>.t`, name
    "object" by default)."""
    name = "object" if name is None else name
    payload = _to_bytes(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), f"{name}.sz",
                      process_set).tolist()
    gathered = allgather(payload, f"{name}.t", process_set)
    out, start = [], 0
    for size in sizes:
        out.append(_from_bytes(gathered[start:start + size]))
        start += size
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model=None,
                              process_set=global_process_set) -> None:
    """Make every rank's optimizer state and options rank root_rank's.

    As Horovod does, an optimizer that has no state yet (never stepped) is first given
    it: zero gradients and one local step, so there is state for the root's to fill.
    The zero gradients are sparse for SparseAdam, and for SGD on the parameters of
    `model`'s sparse embeddings (model: Horovod's argument, only for that).
    """
    if not optimizer.state_dict()["state"]:
        sparse = {id(p) for m in (model.modules() if model is not None else ())
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                            isinstance(optimizer, torch.optim.SGD) and id(param) in sparse):
                        param.grad = param.grad.to_sparse()
        _local_step(optimizer)
    optimizer.load_state_dict(broadcast_object(optimizer.state_dict(), root_rank,
                                               process_set=process_set))


def _local_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of the optimizer's own, without reducing gradients (a
    DistributedOptimizer's too)."""
    distributed = getattr(optimizer, "_distributed", None)
    (optimizer.step if distributed is None else distributed.local_step)()


# --- the optimizer ------------------------------------------------------------------------
def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set, *, sparse: bool = False,
                         bucket_cap_mb: float = 25.0, algorithm: str = "auto"):
    """Average gradients over ranks during backward; `optimizer.step()` waits for them.

    Horovod's arguments in Horovod's order. num_groups / groups (Horovod's fusion
    groups) are accepted: buckets of `bucket_cap_mb` do that fusion here.
    sparse_as_dense: sparse gradients (nn.Embedding(sparse=True)) are reduced as dense
    tensors and handed back sparse; without it, as Horovod does, by an allgather of
    each sparse gradient's indices and values (hvd.sparse_allreduce_async, under the
    parameter's name), started when the gradient is ready. Every rank must then have a
    sparse gradient for that parameter in the step, as in Horovod.
    sparse: older Horovod's name for sparse_as_dense; the same here.
    backward_passes_per_step=k: gradients accumulate locally over k backward passes and
    are averaged at step(): a gradient goes out on its k-th pass, one that came in fewer
    passes goes out at step() with what it accumulated; counts start afresh after each
    step() / synchronize(), and a (k+1)-th pass before it is an error, as in Horovod.

    Each bucket's allreduce is negotiated under a name made from its parameters' names
    (`allreduce.bucket0.fc.bias`), so the ranks need not launch buckets in the same
    order. Without named_parameters the parameters are named as Horovod names them,
    `allreduce.noname.<group>.<index>`; `optimizer._parameter_names` maps each parameter
    to its name, as Horovod's does.

    process_set: gradients are averaged over its ranks only; on a rank outside it the
    optimizer steps on its own gradients, as in Horovod.

    Returns the same optimizer object (so LR schedulers, isinstance checks,
    param_groups and state_dict() work as before) with step() and zero_grad() wrapped
    and synchronize() / skip_synchronize() added; what they share is a
    DistributedGradients, kept as `optimizer._distributed`. Wrapping the same optimizer
    again (after hvd.shutdown() and hvd.init(), say) replaces the first wrapping.
    """
    names = _parameter_names(optimizer, named_parameters)  # before init is needed
    if op == Adasum:
        raise NotImplementedError("Adasum is not provided; use hvd.Average or hvd.Sum")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    engine()  # made here, on every rank alike, if hvd.init() has not made it
    outside = isinstance(process_set, ProcessSet) and \
        process_set.process_set_id is not None and not process_set.included()
    where = None if outside else scope(process_set)  # (scope() says what is wrong, if any)
    distributed = DistributedGradients(
        optimizer, names, where, process_set, compression=compression, op=op,
        gradient_predivide_factor=gradient_predivide_factor, algorithm=algorithm)
    if where is not None:  # a rank outside the process set reduces nothing
        distributed.start_bucketing(bucket_cap_mb, backward_passes_per_step,
                                    sparse_as_dense or sparse)
    _attach(optimizer, distributed)
    return optimizer


class BucketReduction(NamedTuple):
    """How each bucket of gradients is reduced over the process set's ranks."""
    op: str           # what the engine runs: "sum" for an average (the scales divide)
    prescale: float   # before the sum: part of the division, so float16 cannot overflow
    postscale: float  # after the sum: the rest of it


def bucket_reduction(op: str, gradient_predivide_factor: float,
                     size: Optional[int]) -> BucketReduction:
    """Horovod's average of gradients as a sum between two scales: divided by the
    number of ranks before the sum, or, with gradient_predivide_factor f, by f before
    and by size / f after. Other ops (and a rank outside the set: size None) as they
    are."""
    if op != Average or size is None:
        return BucketReduction(op, 1.0, 1.0)
    if gradient_predivide_factor == 1.0:
        return BucketReduction(Sum, 1.0 / size, 1.0)
    return BucketReduction(Sum, 1.0 / gradient_predivide_factor,
                           gradient_predivide_factor / size)


class DistributedGradients:
    """What DistributedOptimizer adds to an optimizer: a Bucketer that reduces its
    gradients over ranks during backward, each bucket an allreduce of the engine, and
    the two flags that step() reads.

    step() waits for every bucket (synchronize()), then runs the optimizer's own step;
    after an explicit synchronize() (to clip the averaged gradients, say) the step goes
    inside skip_synchronize(), or it warns and does not reduce twice.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict, where: Optional[Scope],
                 process_set, *, compression, op: str, gradient_predivide_factor: float,
                 algorithm: str):
        previous = getattr(optimizer, "_distributed", None)
        if isinstance(previous, DistributedGradients):  # wrapped again: this one replaces it
            self.local_step, self.local_zero_grad = previous.local_step, previous.local_zero_grad
            previous.close()
        else:  # the optimizer's own methods, from before
            self.local_step, self.local_zero_grad = optimizer.step, optimizer.zero_grad
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.names = names                      # parameter -> its name (Horovod's rules)
        self.where, self.process_set = where, process_set  # None: outside the set
        self.compression, self.op, self.algorithm = compression, op, algorithm
        self.reduction = bucket_reduction(op, gradient_predivide_factor,
                                          None if where is None else where.size)
        self.bucketer: Optional[Bucketer] = None  # made by start_bucketing()
        self.bucket_names: Dict[int, str] = {}    # id(bucket buffer) -> its allreduce's name
        self.skipping = False      # inside skip_synchronize(): step() does not wait
        self.synchronized = False  # synchronize() ran since the last step()

    def start_bucketing(self, bucket_cap_mb: float, passes_per_step: int,
                        sparse_as_dense: bool) -> None:
        """Make the Bucketer (its hooks go on the parameters) and name every bucket
        after its index and first parameter: `bucket0.fc.bias`, the same on every rank."""
        ids = {id(p): name for p, name in self.names.items()}
        options = BucketOptions.horovod(bucket_cap_mb, passes_per_step, sparse_as_dense,
                                        self.reduce_sparse)
        self.bucketer = Bucketer(self.params, self.reduce_bucket, get_comm(), options,
                                 names=ids)
        # The Bucketer hands reduce_bucket each bucket's own buffer, the one tensor it
        # keeps for that bucket: the buffer object finds the bucket's name.
        self.bucket_names = {id(bucket.buffer): f"bucket{bucket.index}."
                             f"{ids[id(bucket.params[0])]}" for bucket in self.bucketer.buckets}

    def close(self) -> None:
        """Take the bucketer's hooks off the parameters and end its thread (after the
        buckets already handed to it)."""
        if self.bucketer is not None:
            self.bucketer.close()
            self.bucketer = None

    # --- during backward, on the Bucketer's communication thread ----------------------
    def reduce_bucket(self, flat: torch.Tensor) -> None:
        """One bucket's allreduce through the engine, compressed on the way."""
        sent, ctx = self.compression.compress(flat)
        op, prescale, postscale = self.reduction
        synchronize(_submit_allreduce([sent], op, prescale, postscale,
                                      self.bucket_names[id(flat)], self.where,
                                      self.algorithm))
        if sent is not flat:
            flat.copy_(self.compression.decompress(sent, ctx))

    def reduce_sparse(self, param: torch.Tensor, grad: torch.Tensor):
        """Start a sparse gradient's reduction (hvd.sparse_allreduce_async, under the
        parameter's name); the Bucketer calls what it returns to wait for it."""
        if self.op not in (Average, Sum):
            raise NotImplementedError(f"sparse gradients are summed or averaged; op "
                                      f"{self.op!r} needs sparse_as_dense=True")
        return sparse_allreduce_async(grad, self.names[param], self.op, self.process_set)

    # --- what the optimizer's methods do ------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (all of them: those that got no gradient
        this step take part with zeros)."""
        if self.bucketer is not None:
            self.bucketer.finish(always=True)
        self.synchronized = True

    def step(self, closure=None):
        """Wait for the gradients, unless inside skip_synchronize(); then the
        optimizer's own step."""
        if not self.skipping:
            if self.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). The gradients were "
                              "already averaged; they are not averaged again.")
            else:
                self.synchronize()
        self.synchronized = False
        return self.local_step(closure) if closure is not None else self.local_step()

    def zero_grad(self, *args, **kwargs):
        """The optimizer's own zero_grad(), refused while buckets are in flight (their
        results would land in the gradients just cleared)."""
        if self.bucketer is not None and self.bucketer.in_flight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(); the "
                                 "gradients are still being averaged")
        return self.local_zero_grad(*args, **kwargs)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() without waiting: for when synchronize() was called already (clipping,
        AMP)."""
        self.skipping = True
        try:
            yield
        finally:
            self.skipping = False


# Horovod's methods, as the optimizer gets them: bound to the optimizer, each calling
# into its DistributedGradients. Bound to the optimizer (not to the DistributedGradients)
# because torch's LR schedulers rebind optimizer.step's function to the optimizer when
# they wrap it.
def _step(optimizer, closure=None):
    return optimizer._distributed.step(closure)


def _zero_grad(optimizer, *args, **kwargs):
    return optimizer._distributed.zero_grad(*args, **kwargs)


def _synchronize(optimizer) -> None:
    optimizer._distributed.synchronize()


def _skip_synchronize(optimizer):
    return optimizer._distributed.skip_synchronize()


def _attach(optimizer: torch.optim.Optimizer, distributed: DistributedGradients) -> None:
    """Give the user's optimizer object Horovod's methods: its class, param_groups and
    state are left as they were."""
    optimizer._distributed = distributed
    optimizer._parameter_names = distributed.names  # Horovod's: parameter -> name
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)
    optimizer.synchronize = types.MethodType(_synchronize, optimizer)
    optimizer.skip_synchronize = types.MethodType(_skip_synchronize, optimizer)


def _parameter_names(optimizer: torch.optim.Optimizer, named_parameters) -> dict:
    """parameter -> name, by Horovod's rules: (name, parameter) tuples with unique names
    covering every parameter of the optimizer; without named_parameters, Horovod's
    names `allreduce.noname.<group>.<index>`."""
    if named_parameters is None:
        pairs = [(f"allreduce.noname.{i}.{j}", p)
                 for i, group in enumerate(optimizer.param_groups)
                 for j, p in enumerate(group["params"])]
    else:
        pairs = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, "
                         "as model.named_parameters() gives")
    seen = set()
    duplicates = sorted({name for name, _ in pairs if name in seen or seen.add(name)})
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; repeated: "
                         f"{', '.join(duplicates[:5])}")
    named = {id(p) for _, p in pairs}
    unnamed = [p for group in optimizer.param_groups for p in group["params"]
               if id(p) not in named]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameter(s) are missing from "
                         "named_parameters")
    return {p: name for name, p in sorted(pairs, key=lambda pair: pair[0])}
