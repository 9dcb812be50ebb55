"""Horovod's PyTorch API on our engine: `import collectives.horovod as hvd`.

Horovod's PyTorch MNIST example runs with that one import changed. Underneath:

    hvd.init()                           collectives.init()
    hvd.DistributedOptimizer(opt, ...)   the same Bucketer as our DDP: each bucket is
                                         compressed, averaged and decompressed on the comm
                                         thread during backward; opt.step() waits for them
    hvd.broadcast_parameters(...)        one coalesced broadcast per dtype
    hvd.broadcast_optimizer_state(...)   rank 0's optimizer state_dict, pickled and broadcast
    hvd.allreduce(tensor, name=...)      collectives.all_reduce on a copy

Not provided: Adasum, process sets, elastic training, the TensorFlow/Keras APIs.
"""
from __future__ import annotations

import contextlib
import io
from typing import Optional

import torch

from . import api
from .bootstrap import get_comm
from .bootstrap import init as _init_comm
from .bucketer import Bucketer
from .launch import detect_launch

Average, Sum, Min, Max = "avg", "sum", "min", "max"
Adasum = "adasum"


# --- compression, as Horovod's torch/compression.py: compress(t) -> (t, ctx) -------------
class NoneCompressor:
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Send floating-point tensors as float16 (half the bytes), restore the dtype after."""

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


# --- the process ----------------------------------------------------------------------
def init(backend: str = "auto", timeout=None):
    _init_comm(backend=backend, timeout=timeout)


def rank() -> int:
    return get_comm().rank


def size() -> int:
    return get_comm().world_size


def local_rank() -> int:
    return get_comm().local_rank


def local_size() -> int:
    return detect_launch().local_world_size or size()


def is_initialized() -> bool:
    from . import bootstrap
    return bootstrap._default is not None


def nccl_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def mpi_threads_supported() -> bool:
    return True


def shutdown() -> None:
    from .bootstrap import destroy
    destroy()


# --- collectives ------------------------------------------------------------------------
def _op_of(average: Optional[bool], op: Optional[str]) -> str:
    if op is not None and average is not None:
        raise ValueError("pass either average= or op=, not both")
    if op == Adasum:
        raise NotImplementedError("Adasum is not provided; use hvd.Average or hvd.Sum")
    if op is not None:
        return op
    return Sum if average is False else Average


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               compression=Compression.none, op: Optional[str] = None) -> torch.Tensor:
    """Reduce `tensor` over ranks in place (average by default, as Horovod)."""
    reduce_op = _op_of(average, op)
    sent, ctx = compression.compress(tensor.detach())
    sent = sent.contiguous()
    api.all_reduce(sent, op=reduce_op, comm=get_comm())
    tensor.detach().copy_(compression.decompress(sent, ctx))
    return tensor


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression=Compression.none, op: Optional[str] = None) -> torch.Tensor:
    """The reduction of `tensor` over ranks, as a new tensor."""
    return allreduce_(tensor.detach().clone(), average, name, compression, op)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None):
    api.broadcast(tensor.detach(), src=root_rank, comm=get_comm())
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None):
    return broadcast_(tensor.detach().clone(), root_rank, name)


def broadcast_parameters(params, root_rank: int) -> None:
    """Broadcast a state_dict, or a list of (name, tensor), from `root_rank` in place."""
    items = params.items() if isinstance(params, dict) else params
    tensors = [t for _, t in sorted(items, key=lambda item: item[0])
               if isinstance(t, torch.Tensor)]
    api.broadcast_coalesced(tensors, src=root_rank, comm=get_comm())


def broadcast_object(obj, root_rank: int = 0, name: Optional[str] = None):
    """Any picklable object from `root_rank` to every rank (length, then bytes)."""
    comm = get_comm()
    payload = torch.empty(0, dtype=torch.uint8)
    if comm.rank == root_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    api.broadcast(length, src=root_rank, comm=comm)
    if comm.rank != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    api.broadcast(payload, src=root_rank, comm=comm)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state (momentum buffers, step counts) rank root's."""
    optimizer.load_state_dict(broadcast_object(optimizer.state_dict(), root_rank))


# --- the optimizer ----------------------------------------------------------------------
def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         bucket_cap_mb: float = 25.0, algorithm: str = "auto"):
    """Average gradients over ranks during backward; `optimizer.step()` waits for them.

    Returns the same optimizer object (so LR schedulers and isinstance checks still
    work) with `step` wrapped and `synchronize()` added.
    """
    if op == Adasum:
        raise NotImplementedError("Adasum is not provided; use hvd.Average or hvd.Sum")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    comm = get_comm()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {}
    if named_parameters is not None:
        names = {id(p): name for name, p in named_parameters}
        unnamed = [p for p in params if id(p) not in names]
        if unnamed:
            raise ValueError(f"{len(unnamed)} optimizer parameter(s) are missing from "
                             "named_parameters")

    def reduce_bucket(flat: torch.Tensor) -> None:
        sent, ctx = compression.compress(flat)
        if op == Average:  # divide (at least partly) first: a float16 sum must not overflow
            sent.div_(comm.world_size if gradient_predivide_factor == 1.0
                      else gradient_predivide_factor)
        api.all_reduce(sent, op="sum" if op == Average else op, comm=comm,
                       algorithm=algorithm, check=False)
        if op == Average and gradient_predivide_factor != 1.0:
            sent.mul_(gradient_predivide_factor / comm.world_size)
        if sent is not flat:
            flat.copy_(compression.decompress(sent, ctx))

    # Like Horovod, parameters without a gradient in a step are tolerated.
    bucketer = Bucketer(params, reduce_bucket, comm, bucket_cap_mb=bucket_cap_mb,
                        finish_after_backward=False, names=names, find_unused_parameters=True,
                        passes_per_sync=backward_passes_per_step)
    local_step = optimizer.step
    skipping = [False]

    def step(closure=None):
        if not skipping[0]:
            bucketer.finish()
        return local_step(closure) if closure is not None else local_step()

    @contextlib.contextmanager
    def skip_synchronize():
        """step() without waiting: for when synchronize() was called already (AMP)."""
        skipping[0] = True
        try:
            yield
        finally:
            skipping[0] = False

    optimizer.step = step
    optimizer.synchronize = bucketer.finish
    optimizer.skip_synchronize = skip_synchronize
    optimizer._collectives_bucketer = bucketer
    return optimizer
