"""ShmTransport: each peer reached by its best route, and the progress engine.

Routes: a job that spans hosts keeps shared memory inside each host. Each peer is
reached through a channel (channel.py) when it shares our host, through the backend
this transport wraps (gloo's TCP or MPI) when not:

    host A: rank 0 <==shm==> rank 1          host B: rank 2 <==shm==> rank 3
                               |                       |
                               +--- backend (TCP, MPI) +

Algorithms above see one transport and never know. `traffic.routes` counts the bytes
of each route ("shm", "network"). Barrier and the native collectives go to the backend.

Progress: isend/irecv queue the message on its channel and move what they can at once;
the rest moves whenever this rank waits for anything. Each wait drives every queued
message of this communicator, as MPI's progress engine does, so a rank waiting on a
receive still drains its sends and a ring cannot deadlock. When nothing can move, the
rank sleeps on its bell (a semaphore its peers post after filling or freeing one of its
slots), so waiting ranks spin no CPU away from the ones working: that matters when
ranks outnumber cores.

Waiting on a message over the backend keeps the shared memory moving: while any of our
shared-memory messages is queued, a wait polls the backend's request and drives
progress() in turn (else a local peer could wait on us while we wait on a remote one
that waits on it).

Errors: a wait past the timeout raises PeerError, and so does a peer whose process has
exited (checked by pid ten times a second while asleep, so a dead peer is caught in
well under a second). A rank stalled in a call reads the call board (board.py) at
every nap, so ranks that made different calls raise instead of waiting out the timeout.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..base import Handle, PeerError, Transport, nbytes, reduce_into
from . import semaphores
from .board import CallBoard
from .channel import SLOT_BYTES, SLOTS, Channel, Forward, Message
from .connect import open_segments
from .segment import Segment, alive

_NAP_SECONDS = 0.1  # longest sleep on the bell before checking deadline and peers
_REMOTE_POLL_SECONDS = 0.0005  # a wait on the network checks it this often while shm is busy


class ShmTransport(Transport):
    """Point-to-point through shared memory; barrier and native collectives via `inner`."""

    device_tensors_ok = False  # CUDA tensors are staged through host memory by the base

    def __init__(self, inner: Transport, segments: Dict[int, Segment], slots: int,
                 slot_bytes: int, watch_pids: bool):
        super().__init__(inner.rank, inner.world_size, inner.local_rank, inner.device,
                         inner.timeout)
        self.inner = inner
        self.backend = inner.backend
        self.traffic = inner.traffic
        self.topology = inner.topology
        self.segments = segments  # by rank, for the ranks of this host; ours is our inbox
        self.slots, self.slot_bytes = slots, slot_bytes
        me = self.rank
        local = self.topology.local_ranks(me)
        self.bell = segments[me].bell
        self.outboxes = {p: Channel(segments[p], local.index(me), segments[p].bell, p)
                         for p in local if p != me}
        self.inboxes = {p: Channel(segments[me], local.index(p), segments[p].bell, p)
                        for p in local if p != me}
        self.pids = {p: segments[p].pid.value for p in local if p != me}
        self.watch_pids = watch_pids
        self.remote: List[_Remote] = []  # messages over the backend not yet seen done
        # every rank's board, where the whole world shares this host (else None)
        self.board = (CallBoard([segments[rank].board for rank in range(self.world_size)],
                                me, self.pids if watch_pids else None)
                      if len(segments) == self.world_size else None)

    @property
    def name(self) -> str:
        return f"{self.backend}+shm"

    @classmethod
    def connect(cls, inner: Transport, slots: int = SLOTS,
                slot_bytes: int = SLOT_BYTES) -> Transport:
        """Shared memory between the ranks of each host, over `inner`; `inner` itself
        when no host has two ranks or shared memory cannot be set up (connect.py).

        Collective: every rank calls it and all come to the same answer."""
        opened = open_segments(inner, slots, slot_bytes)
        if opened is None:
            return inner
        segments, watch_pids = opened
        return cls(inner, segments, slots, slot_bytes, watch_pids)

    # --- point to point: a channel where there is one, else the backend ---------------
    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        self._refuse_if_out_of_step()
        if dst not in self.outboxes:
            return self._over_network(self.inner._isend(tensor, dst), tensor, dst,
                                      f"send to rank {dst}", sent=True)
        self.traffic.count_route("shm", sent=nbytes(tensor))
        return self._queue(self.outboxes[dst],
                           Message(self, _as_bytes(tensor), dst, f"send to rank {dst}"))

    def _irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        self._refuse_if_out_of_step()
        if src not in self.inboxes:
            return self._over_network(self.inner._irecv(tensor, src), tensor, src,
                                      f"receive from rank {src}", sent=False)
        self.traffic.count_route("shm", received=nbytes(tensor))
        target = _as_bytes(tensor)

        def copy_out(piece: torch.Tensor, offset: int, size: int) -> None:
            target[offset:offset + size].copy_(piece[:size])

        return self._queue(self.inboxes[src],
                           Message(self, target, src, f"receive from rank {src}", copy_out))

    def irecv_reduce(self, accumulator: torch.Tensor, src: int, op: str,
                     scratch: Optional[torch.Tensor] = None,
                     forward_to: Optional[int] = None) -> Handle:
        """Reduce each piece straight out of the slot it arrived in: no scratch copy.

        With forward_to, the sum goes straight into the slot of the outgoing message
        and `accumulator` is only read: one pass over memory for receive, reduce, send.
        """
        self._refuse_if_out_of_step()
        if (accumulator.device.type != "cpu" or src not in self.inboxes
                or (forward_to is not None and forward_to not in self.outboxes)):
            return super().irecv_reduce(accumulator, src, op, scratch, forward_to)
        self._check_peer(accumulator, src, "irecv_reduce")
        self.traffic.count_receive(accumulator)
        self.traffic.count_route("shm", received=nbytes(accumulator))
        target = _as_bytes(accumulator)
        dtype = accumulator.dtype
        what = f"receive from rank {src}"

        def fold(piece: torch.Tensor, offset: int, size: int,
                 outgoing: Optional[torch.Tensor] = None) -> None:
            """Add a piece into our buffer, or (a relay's) into the outgoing slot."""
            out = None if outgoing is None else outgoing[:size].view(dtype)
            reduce_into(target[offset:offset + size].view(dtype), piece[:size].view(dtype),
                        op, out)

        if forward_to is None:
            return self._queue(self.inboxes[src], Message(self, target, src, what, fold))
        self._check_peer(accumulator, forward_to, "irecv_reduce")
        self.traffic.count_send(accumulator)
        self.traffic.count_route("shm", sent=nbytes(accumulator))
        outbox = self.outboxes[forward_to]
        relay = Message(self, target, src, f"{what} (passed on to rank {forward_to})",
                        fold, relay_to=outbox)
        relay.forward = Forward(relay)
        if relay.size:
            outbox.queue.append(relay)  # holds our place in the order of sends to forward_to
        return self._queue(self.inboxes[src], relay)

    def _over_network(self, inner: Handle, tensor: torch.Tensor, peer: int, what: str,
                      sent: bool) -> Handle:
        self.traffic.count_route("network", **{"sent" if sent else "received": nbytes(tensor)})
        handle = _Remote(self, inner, peer, what)
        self.remote.append(handle)
        return handle

    def _queue(self, channel: Channel, message: Message) -> Handle:
        if not message.done:  # an empty message moves nothing
            channel.queue.append(message)
            self.progress()
        return message

    # --- the progress engine ----------------------------------------------------------
    def progress(self) -> bool:
        """Move every queued piece that can move now, without blocking. True if any did.

        Messages over the backend are polled too: MPI moves a message only while the
        process is inside an MPI call, and testing is such a call.
        """
        moved = False
        for channel in self.outboxes.values():
            moved |= channel.push()
        for channel in self.inboxes.values():
            moved |= channel.pull()
        if self.remote:
            self.remote = [handle for handle in self.remote if not handle.test()]
        return moved

    def _shm_busy(self) -> bool:
        return any(c.queue for c in self.outboxes.values()) or any(
            c.queue for c in self.inboxes.values())

    def wait_for(self, message: Message, finished: Callable[[], bool],
                 watch: Optional[Callable[[], Sequence[int]]] = None) -> None:
        """Drive progress until `finished()`; sleep on our bell when nothing moves.

        watch: the ranks whose exit now means `finished()` never comes, asked afresh at
        each check (default the message's peer; a relay's send half waits on its
        source while pieces are due, and on its target).
        """
        timeout = self.timeout.total_seconds()
        deadline = time.monotonic() + timeout
        watch = watch or (lambda: (message.peer,))
        while not finished():
            if self.progress():
                continue
            if semaphores.nap(self.bell, _NAP_SECONDS):
                continue  # a peer filled or freed a slot of ours: try again
            if time.monotonic() > deadline:
                raise PeerError(f"{message.what} timed out after {timeout:g} s")
            if self.board is not None:  # stalled: perhaps the ranks made different calls
                self.board.raise_if_calls_differ(timeout)
            for peer in watch() if self.watch_pids else ():
                if not alive(self.pids[peer]):
                    raise PeerError(f"{message.what} failed: rank {peer} "
                                    f"(pid {self.pids[peer]}) has exited")

    def wait_remote(self, handle: _Remote) -> None:
        """Wait for a message over the backend; keep shared memory moving meanwhile."""
        timeout = self.timeout.total_seconds()
        deadline = time.monotonic() + timeout
        while self._shm_busy() and not handle.test():
            if not self.progress():
                semaphores.nap(self.bell, _REMOTE_POLL_SECONDS)
            if time.monotonic() > deadline:
                raise PeerError(f"{handle.what} timed out after {timeout:g} s")
        handle.inner.wait()  # done, or nothing of ours is queued: the backend's own wait

    # --- the call check, on the board where the whole world is on this host -----------
    def announce_call(self, row: List[int]) -> bool:
        if self.board is None or not self.board.fits(row):
            return False  # peers on other hosts cannot read our board: the handshake
        self._refuse_if_out_of_step()
        self.board.announce(row)
        return True

    def confirm_call(self, timeout: Optional[float] = None) -> None:
        if self.board is not None:
            self.board.confirm(self.timeout.total_seconds() if timeout is None else timeout)

    def forget_call(self) -> None:
        if self.board is not None:
            self.board.forget()

    def _refuse_if_out_of_step(self) -> None:
        if self.out_of_step:
            raise PeerError(f"refused: an earlier call left the ranks out of step "
                            f"({self.out_of_step})")

    # --- the rest goes to the backend ---------------------------------------------------
    def barrier(self) -> None:
        self._refuse_if_out_of_step()
        self.inner.barrier()

    def _native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        self._refuse_if_out_of_step()
        self.inner._native_all_reduce(tensor, op)

    def _native_broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._refuse_if_out_of_step()
        self.inner._native_broadcast(tensor, src)

    def _duplicate(self) -> Transport:
        return ShmTransport.connect(self.inner.duplicate(), self.slots, self.slot_bytes)

    def close(self) -> None:
        self.board = None  # views of the segments: gone before they close
        for channel in [*self.outboxes.values(), *self.inboxes.values()]:
            channel.close()
        for segment in self.segments.values():
            segment.close()
        self.segments = {}
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()  # the network's connections first: peers learn at once
        self.close()


class _Remote(Handle):
    """A message over the backend; waiting on it keeps our shared memory moving."""

    def __init__(self, transport: ShmTransport, inner: Handle, peer: int, what: str):
        self.transport, self.inner, self.peer, self.what = transport, inner, peer, what

    def wait(self) -> None:
        self.transport.wait_remote(self)

    def test(self) -> bool:
        return self.inner.test()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
