"""The communicator of an elastic job, built again for every generation.

    world = ElasticWorld("10.0.0.1", 29400, min_ranks=2)
    comm = world.join(expected=4)      # generation 0: the 4 ranks the launcher started
    ...                                # a peer dies: every survivor's call raises PeerError
    comm = world.join()                # generation 1: the survivors, ranks 0..2

Each generation gets gloo of its own (a ProcessGroupGloo that meets under the
generation's prefix in the membership store), then the routes every communicator gets:
which ranks share a host (with_routes in collectives/world.py, where the job's first
communicator is built). Shared memory between them is off by default here: a
shared-memory wait learns that a peer is gone from its pid, and a peer that has moved
on to the next generation is alive, so a survivor blocked on it would wait out its
whole timeout; over gloo the peer's closed connection ends the wait. The old
communicator is dropped first, and the new one becomes the default
(`collectives.get_comm()`).

Only the membership needs the store: a generation that runs talks rank to rank, so a
lost store stops the next change, not the training.
"""
from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..transport import PeerError, Transport
from ..transport.torch_dist import TorchDistTransport
from .. import world as _world
from ..world import set_comm, with_routes
from .membership import Membership, MembershipError, View


MEETING_SECONDS = 30.0  # how long a new generation's ranks wait for each other to connect


def default_member_id() -> str:
    """host/pid: unique among the job's live processes, and says where each one runs."""
    return f"{socket.gethostname()}/{os.getpid()}"


class ElasticWorld:
    """One rank's way into every generation of the job (see the module docstring)."""

    def __init__(self, store_host: str, store_port: int, min_ranks: int = 1,
                 max_ranks: Optional[int] = None, timeout: float = 300.0,
                 member_id: Optional[str] = None, shm=False, **membership_options):
        self.timeout = timedelta(seconds=timeout)
        self.shm = shm
        self.membership = Membership(store_host, store_port, member_id or default_member_id(),
                                     min_ranks=min_ranks, max_ranks=max_ranks,
                                     timeout=timeout, **membership_options)
        self.comm: Optional[Transport] = None
        self.view: Optional[View] = None

    def join(self, expected: Optional[int] = None) -> Transport:
        """Leave the current generation (if any), wait for the next one's members, and
        build its communicator. Collective over the new generation's members. A member
        that fails while the communicator is built makes every other one raise
        PeerError here: join again."""
        self.drop()
        view = self.membership.join(expected)
        # gloo's rendezvous waits with the group's timeout: a listed member that died
        # before it connects costs `meeting`, not the whole training timeout; the group
        # then takes the training timeout for its calls
        meeting = timedelta(seconds=min(self.timeout.total_seconds(), MEETING_SECONDS))
        try:
            store = dist.TCPStore(self.membership.host, self.membership.port,
                                  is_master=False, timeout=meeting)
        except RuntimeError as error:
            raise MembershipError(f"the membership store at {self.membership.host}:"
                                  f"{self.membership.port} does not answer: {error}") from None
        try:  # local rank 0: on CPU, gloo does not use it
            comm: Transport = TorchDistTransport.over_store(
                store, view.rank, view.world_size, 0, meeting,
                prefix=f"generation {view.generation}/gloo")
        except RuntimeError as error:  # the rendezvous, with a member that is gone
            raise PeerError(f"generation {view.generation}: building the communicator of "
                            f"{view.world_size} failed: {str(error).splitlines()[0]}") from None
        comm.pg.set_timeout(self.timeout)
        comm.timeout = self.timeout
        comm = with_routes(comm, self.shm)  # its failures are PeerError already
        self.comm, self.view = comm, view
        set_comm(comm)
        return comm

    def newcomers(self) -> bool:
        """Collective: whether someone waits to join, the same answer on every rank
        (rank 0 asks the store and says). Call it at a step boundary."""
        import torch
        from .. import api
        waiting = torch.zeros(1, dtype=torch.int64)
        if self.comm.rank == 0:
            waiting[0] = self.membership.newcomers()
        api.broadcast(waiting, src=0, comm=self.comm)
        return bool(waiting.item())

    def drop(self, failed: bool = False) -> None:
        """Let go of the current communicator. After a failure (`failed`) its
        connections are closed at once (Transport.abort), so that the peers still
        waiting on this rank learn that it has moved on now, not at their timeout, even
        while something still refers to the communicator. Otherwise they close once
        nothing refers to its gloo group."""
        if self.comm is not None:
            if _world._default is self.comm:  # ours as the default: no longer
                set_comm(None)
            try:
                self.comm.abort() if failed else self.comm.close()
            except Exception:  # a transport half torn down by a dead peer
                pass
            self.comm = None
            # What trained over it (a DDP's hooks and buckets, a strategy) may still hold
            # it in reference cycles, which only the collector frees. A thread still
            # inside one of its calls holds it too, and keeps it: nothing is closed under it.
            gc.collect()

    def finish(self) -> None:
        """The job is done: newcomers are turned away (see Membership.finish). Best
        effort: a store that does not answer changes nothing for the job that ended."""
        try:
            self.membership.finish()
        except MembershipError:
            pass

    def leave(self) -> None:
        """This rank is done: drop the communicator, stop the heartbeat."""
        self.drop()
        self.membership.leave()


__all__ = ["ElasticWorld", "MembershipError", "default_member_id"]
