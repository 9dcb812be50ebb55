"""Horovod's training helpers: DistributedOptimizer, broadcasting parameters, optimizer
state and objects, and gradient compression.

`DistributedOptimizer` uses the same Bucketer as our DDP (bucketer.py): gradients are
averaged bucket by bucket on a comm thread while backward runs, and `optimizer.step()`
waits for them. Each bucket goes through the face's engine (engine.py) like any
allreduce, so a rank that has called `hvd.join()` stands in for it with zeros.
As in Horovod, a parameter without a gradient in a step takes part with zeros and gets
the averaged gradient, so ranks that used different parameters never wait on each other.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from typing import Optional

import torch

from ..world import get_comm
from ..bucketer import Bucketer
from .ops import (Adasum, Average, Sum, _submit_allreduce, allgather, broadcast_async_,
                  engine, global_process_set, sparse_allreduce_async, synchronize)
from .process_sets import ProcessSet, scope


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
        getattr(optimizer, "_local_step", optimizer.step)()
    optimizer.load_state_dict(broadcast_object(optimizer.state_dict(), root_rank,
                                               process_set=process_set))


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

    Returns the same optimizer object (so LR schedulers and isinstance checks still work)
    with step() wrapped and synchronize() / skip_synchronize() added.
    """
    names = _parameter_names(optimizer, named_parameters)  # before init is needed
    if op == Adasum:
        raise NotImplementedError("Adasum is not provided; use hvd.Average or hvd.Sum")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    comm = get_comm()
    engine()  # made here, on every rank alike, if hvd.init() has not made it
    outside = isinstance(process_set, ProcessSet) and \
        process_set.process_set_id is not None and not process_set.included()
    where = None if outside else scope(process_set)  # (scope() says what is wrong, if any)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    if op == Average and where is not None:  # divide (at least partly) first: a float16
        prescale = 1.0 / gradient_predivide_factor if gradient_predivide_factor != 1.0 \
            else 1.0 / where.size                        # sum must not overflow
        postscale = gradient_predivide_factor / where.size \
            if gradient_predivide_factor != 1.0 else 1.0
        reduce = "sum"
    else:
        prescale, postscale, reduce = 1.0, 1.0, op

    def reduce_bucket(flat: torch.Tensor) -> None:
        name = bucket_names[flat.data_ptr()]
        sent, ctx = compression.compress(flat)
        synchronize(_submit_allreduce([sent], reduce, prescale, postscale, name, where,
                                      algorithm))
        if sent is not flat:
            flat.copy_(compression.decompress(sent, ctx))

    def reduce_sparse(param: torch.Tensor, grad: torch.Tensor):
        if op not in (Average, Sum):
            raise NotImplementedError(f"sparse gradients are summed or averaged; op {op!r} "
                                      "needs sparse_as_dense=True")
        return sparse_allreduce_async(grad, names[param], op, process_set)

    ids = {id(p): name for p, name in names.items()}
    bucketer, bucket_names = None, {}
    if where is not None:  # a rank outside the process set reduces nothing
        bucketer = Bucketer(params, reduce_bucket, comm, bucket_cap_mb=bucket_cap_mb,
                            finish_after_backward=False, names=ids, unused="zeros",
                            passes_per_sync=backward_passes_per_step,
                            sparse_as_dense=sparse_as_dense or sparse,
                            sparse_reduce=reduce_sparse)
        bucket_names = {bucket.buffer.data_ptr():
                        f"bucket{bucket.index}.{ids[id(bucket.params[0])]}"
                        for bucket in bucketer.buckets}
    local_step, local_zero_grad = optimizer.step, optimizer.zero_grad
    state = {"skipping": False, "synchronized": False}

    def synchronize_gradients() -> None:
        """Wait for every gradient's allreduce (all of them: those that got no gradient
        this step take part with zeros)."""
        if bucketer is not None:
            bucketer.finish(always=True)
        state["synchronized"] = True

    def step(closure=None):
        if not state["skipping"]:
            if state["synchronized"]:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). The gradients were "
                              "already averaged; they are not averaged again.")
            else:
                synchronize_gradients()
        state["synchronized"] = False
        return local_step(closure) if closure is not None else local_step()

    def zero_grad(*args, **kwargs):
        if bucketer is not None and bucketer.in_flight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(); the "
                                 "gradients are still being averaged")
        return local_zero_grad(*args, **kwargs)

    @contextlib.contextmanager
    def skip_synchronize():
        """step() without waiting: for when synchronize() was called already (clipping, AMP)."""
        state["skipping"] = True
        try:
            yield
        finally:
            state["skipping"] = False

    optimizer.step = step
    optimizer.zero_grad = zero_grad
    optimizer.synchronize = synchronize_gradients
    optimizer.skip_synchronize = skip_synchronize
    optimizer._local_step = local_step
    optimizer._parameter_names = names
    optimizer._collectives_bucketer = bucketer
    return optimizer


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
