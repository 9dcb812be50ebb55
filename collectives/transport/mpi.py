"""mpi through mpi4py: our own mpi backend (torch's PyPI builds have none).

Tensors go to MPI as zero-copy buffers: a CPU tensor's memory is viewed as a numpy
array (no copy) and handed to mpi4py's buffer-protocol calls. numpy has no bfloat16,
so float16 and bfloat16 travel as raw 16-bit words (an int16 view): point-to-point and
broadcast only move bytes, so the reinterpretation is exact.

CUDA tensors go to MPI directly when the library is CUDA-aware (asked through
MPIX_Query_cuda_support, which MPICH and Open MPI both export), else the base class
stages them through host memory.

MPI's blocking calls have no timeout, so every wait here polls a nonblocking request
against a deadline and raises PeerError naming the peer when it passes. A dead peer
is usually caught sooner: mpirun tears the job down when a rank dies.
"""
from __future__ import annotations

import ctypes
import time
from datetime import timedelta

import torch

from ..launch.lazy_mpi import mpi
from .base import Handle, PeerError, Transport


def mpi_is_cuda_aware() -> bool:
    """True when the loaded MPI library says it can read and write CUDA memory."""
    try:
        query = ctypes.CDLL(mpi().__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


def as_buffer(tensor: torch.Tensor):
    """A zero-copy view of a contiguous tensor that mpi4py accepts as a buffer."""
    flat = tensor.reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.view(torch.int16)  # raw 16-bit words: exact for moving bytes
    if flat.is_cuda:
        return flat  # CUDA-aware MPI reads __cuda_array_interface__
    return flat.numpy()


def wait_until(request, deadline: float, what: str) -> None:
    """Poll an MPI request until it completes or the deadline passes.

    Polling yields the CPU between tests, which matters when ranks outnumber cores.
    """
    tries = 0
    while not request.Test():
        tries += 1
        if tries > 64:
            if time.monotonic() > deadline:
                raise PeerError(f"{what} timed out")
            time.sleep(0)


class _MpiHandle(Handle):
    def __init__(self, request, what: str, timeout: timedelta, keep_alive=None):
        self.request, self.what = request, what
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.keep_alive = keep_alive  # the buffer must outlive the request

    def wait(self) -> None:
        wait_until(self.request, self.deadline, self.what)

    def test(self) -> bool:
        return self.request.Test()  # also lets MPI move the message along


_MPI_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PROD",
            "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


class MpiTransport(Transport):
    backend = "mpi"

    def __init__(self, local_rank: int, device: torch.device, timeout: timedelta, parent=None):
        world = parent if parent is not None else mpi().COMM_WORLD
        super().__init__(world.Get_rank(), world.Get_size(), local_rank, device, timeout)
        # A communicator of our own, so our messages never mix with the user's MPI traffic.
        self.comm = world.Dup()
        self.device_tensors_ok = device.type == "cuda" and mpi_is_cuda_aware()

    def _handle(self, request, what: str, buffer=None) -> Handle:
        return _MpiHandle(request, what, self.timeout, buffer)

    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        buffer = as_buffer(tensor)
        return self._handle(self.comm.Isend(buffer, dst), f"send to rank {dst}", buffer)

    def _irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        buffer = as_buffer(tensor)
        return self._handle(self.comm.Irecv(buffer, src), f"receive from rank {src}", buffer)

    def barrier(self) -> None:
        self._handle(self.comm.Ibarrier(), "barrier").wait()

    def _native_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """MPI_Allreduce in place. MPI has no 16-bit float type: those reduce in float32."""
        work = tensor
        if tensor.dtype in (torch.float16, torch.bfloat16):
            work = tensor.float()
        buffer = as_buffer(work)
        request = self.comm.Iallreduce(mpi().IN_PLACE, buffer, getattr(mpi(), _MPI_OPS[op]))
        self._handle(request, "native all_reduce", buffer).wait()
        if op == "avg":
            if work.is_floating_point():
                work.div_(self.world_size)
            else:
                work.floor_divide_(self.world_size)
        if work is not tensor:
            tensor.copy_(work)

    def _native_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        buffer = as_buffer(tensor)
        self._handle(self.comm.Ibcast(buffer, src), f"native broadcast from rank {src}",
                     buffer).wait()

    def _duplicate(self) -> "MpiTransport":
        return MpiTransport(self.local_rank, self.device, self.timeout, parent=self.comm)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
