"""gloo and nccl through torch.distributed.

torch.distributed already runs a process group per backend; this transport is a thin
layer over its point-to-point calls. Two backend facts shape it:

- gloo moves CPU tensors over TCP; its send/recv do not take CUDA tensors, so those
  are staged through host memory by the base class.
- nccl moves CUDA tensors only, and a send and a receive must be issued together
  (`batch_isend_irecv`) or two ranks that both send first can deadlock.

A failed or timed-out wait is re-raised as PeerError naming the peer.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .base import Handle, PeerError, Transport

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "product": dist.ReduceOp.PRODUCT}


# The dtypes gloo's collectives take (int16, for one, is refused: "Invalid scalar type").
_GLOO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                torch.uint8, torch.int32, torch.int64)


class _TorchHandle(Handle):
    def __init__(self, work, what: str, timeout: timedelta):
        self.work, self.what, self.timeout = work, what, timeout

    def wait(self) -> None:
        try:
            self.work.wait(self.timeout)
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise PeerError(f"{self.what} failed: {first_line}") from error

    def test(self) -> bool:
        return self.work.is_completed()


class TorchDistTransport(Transport):
    """Point-to-point over an already initialised torch.distributed process group."""

    def __init__(self, backend: str, rank: int, world_size: int, local_rank: int,
                 device: torch.device, timeout: timedelta, group=None,
                 owns_group: bool = True):
        super().__init__(rank, world_size, local_rank, device, timeout)
        self.backend = backend
        self.device_tensors_ok = backend == "nccl"
        self.group = group  # None: the default process group
        # torch addresses peers by their rank in the default group; ours are group ranks
        self.global_ranks = (list(range(world_size)) if group is None
                             else dist.get_process_group_ranks(group))
        # A group the user's script made (adopted, see bootstrap.adopt_torch_group) is
        # theirs to destroy; one made by init() is ours.
        self.owns_group = owns_group

    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        if self.backend == "nccl":
            work = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor,
                                                      self.global_ranks[dst],
                                                      group=self.group)])[0]
        else:
            work = dist.isend(tensor, self.global_ranks[dst], group=self.group)
        return _TorchHandle(work, f"send to rank {dst}", self.timeout)

    def _irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        if self.backend == "nccl":
            work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor,
                                                      self.global_ranks[src],
                                                      group=self.group)])[0]
        else:
            work = dist.irecv(tensor, self.global_ranks[src], group=self.group)
        return _TorchHandle(work, f"receive from rank {src}", self.timeout)

    def sendrecv(self, send_tensor, dst, recv_tensor, src) -> None:
        if self.backend != "nccl":
            return super().sendrecv(send_tensor, dst, recv_tensor, src)
        # nccl: both directions in one batch, so neither side blocks the other.
        self.traffic.count_send(send_tensor)
        self.traffic.count_receive(recv_tensor)
        to, frm = self.global_ranks[dst], self.global_ranks[src]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send_tensor, to, group=self.group),
                                        dist.P2POp(dist.irecv, recv_tensor, frm, group=self.group)])
        for work in works:
            _TorchHandle(work, f"sendrecv with ranks {dst}/{src}", self.timeout).wait()

    def barrier(self) -> None:
        _TorchHandle(dist.barrier(group=self.group, async_op=True), "barrier", self.timeout).wait()

    def _native_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if op == "avg" and self.backend == "nccl" and tensor.is_floating_point():
            work = dist.all_reduce(tensor, dist.ReduceOp.AVG, group=self.group, async_op=True)
            return _TorchHandle(work, "native all_reduce", self.timeout).wait()
        work = dist.all_reduce(tensor, _TORCH_OPS["sum" if op == "avg" else op],
                               group=self.group, async_op=True)
        _TorchHandle(work, "native all_reduce", self.timeout).wait()
        if op == "avg":  # gloo has no AVG: sum, then divide (floor for integers)
            if tensor.is_floating_point():
                tensor.div_(self.world_size)
            else:
                tensor.floor_divide_(self.world_size)

    def _native_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.backend == "gloo" and tensor.dtype not in _GLOO_DTYPES:
            tensor = tensor.view(torch.uint8)  # a broadcast copies bytes: any dtype will do
        work = dist.broadcast(tensor, self.global_ranks[src], group=self.group, async_op=True)
        _TorchHandle(work, f"native broadcast from rank {src}", self.timeout).wait()

    def _duplicate(self) -> "TorchDistTransport":
        # Only this group's members call this (use_local_synchronization), so a
        # communicator over a subgroup can be duplicated without the other ranks.
        group = dist.new_group(self.global_ranks, backend=self.backend, timeout=self.timeout,
                               use_local_synchronization=True)
        return TorchDistTransport(self.backend, self.rank, self.world_size, self.local_rank,
                                  self.device, self.timeout, group, owns_group=False)

    def close(self) -> None:
        if self.group is not None or not self.owns_group:
            return  # a duplicate (its group goes with the default one), or the user's
        if dist.is_initialized():
            dist.destroy_process_group()
