"""How one process group of the torch backend reaches its peers.

A group needs two channels:

- `comm`, a transport of ours (transport/), on which the group's worker runs our
  collective algorithms. Messages on it carry no tags and must be used by one thread.
- `p2p`, for the user's own send/recv: torch's point-to-point has tags and is called
  from the user's thread while the worker runs collectives, so it gets a channel of
  its own whose messages never mix with the algorithms'.

Two routes build them:

    gloo (backend "collectives"):  comm = gloo on an instance of ours, made from the
        store torch hands the backend, with shared memory between ranks of one host
        (world.with_routes); p2p = a second gloo instance, whose send/recv take tags.
    mpi (backend "mpi" after use_for_mpi()):  comm = MPI through mpi4py over a
        communicator of the group's ranks; p2p = a duplicate of that communicator, with
        MPI's own tags.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import List

import torch
import torch.distributed as dist

from ..world import with_routes
from ..transport import PeerError, Transport
from ..transport.mpi import MpiTransport, as_buffer, mpi, wait_until
from ..transport.torch_dist import TorchDistTransport


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", "0")))


class GlooPointToPoint:
    """The user's send/recv on a gloo instance of its own (gloo's Work objects raise
    on a dead peer and honour wait's timeout, so they are handed to torch as they are)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        self.gloo = TorchDistTransport.over_store(store, rank, size, _local_rank(), timeout,
                                                  "collectives-p2p").pg

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int):
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int):
        return self.gloo.recv(tensors, src, tag)

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        self.gloo.monitored_barrier(timeout, wait_all_ranks)


class MpiRequestWork(dist._Work):
    """A Work over an MPI request: MPI moves the message while wait() polls it."""

    def __init__(self, request, buffer, what: str, timeout: timedelta,
                 outputs: List[torch.Tensor]):
        super().__init__()
        self._request, self._buffer, self._what = request, buffer, what
        self._timeout, self._outputs = timeout, outputs
        self._future = torch.futures.Future()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = timeout if timeout > timedelta(0) else self._timeout
        if not self._future.done():
            wait_until(self._request, time.monotonic() + limit.total_seconds(), self._what)
            self._future.set_result(self._outputs)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class MpiPointToPoint:
    """The user's send/recv on a duplicate of the group's MPI communicator."""

    def __init__(self, comm, timeout: timedelta):
        self.comm, self.timeout = comm.Dup(), timeout

    def send(self, tensors, dst: int, tag: int):
        buffer = as_buffer(tensors[0])
        return MpiRequestWork(self.comm.Isend(buffer, dst, tag), buffer,
                              f"send to rank {dst}", self.timeout, tensors)

    def recv(self, tensors, src: int, tag: int):
        buffer = as_buffer(tensors[0])
        return MpiRequestWork(self.comm.Irecv(buffer, src, tag), buffer,
                              f"receive from rank {src}", self.timeout, tensors)

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        request = self.comm.Ibarrier()
        try:
            wait_until(request, time.monotonic() + timeout.total_seconds(), "monitored_barrier")
        except PeerError:
            raise RuntimeError(f"monitored_barrier: not every rank arrived within "
                               f"{timeout.total_seconds():g} s") from None


def gloo_channels(store, rank: int, size: int, timeout: timedelta):
    """(comm, p2p) for a group of the "collectives" backend."""
    comm: Transport = TorchDistTransport.over_store(store, rank, size, _local_rank(),
                                                    timeout, "collectives")
    comm = with_routes(comm)
    return comm, GlooPointToPoint(store, rank, size, timeout)


def mpi_channels(global_ranks: List[int], timeout: timedelta):
    """(comm, p2p) over MPI for the group of these ranks of MPI's world (all: [])."""
    world = mpi().COMM_WORLD
    parent = world
    if global_ranks and len(global_ranks) != world.Get_size():
        # Collective over the group's members only, as torch calls the creator.
        parent = world.Create_group(world.Get_group().Incl(list(global_ranks)))
    comm: Transport = MpiTransport(_local_rank(), torch.device("cpu"), timeout, parent=parent)
    comm = with_routes(comm)
    return comm, MpiPointToPoint(parent, timeout)
