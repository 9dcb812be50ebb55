"""A channel: one direction between two ranks of a host, and the messages it carries.

A channel lives in the receiver's segment (segment.py): K slots used in turn, and two
process-shared semaphores counting the free and the filled slots. A message is cut into
slot-sized pieces:

    sender:    wait(free)    copy a piece into the next slot          post(filled)
    receiver:  wait(filled)  copy (or reduce) the piece out of it     post(free)

and each side then rings the other's bell (a semaphore the other sleeps on when it has
nothing to do). The semaphores also order the memory: what the sender wrote before
post() is visible to the receiver after its wait(). Neither side ever blocks here: it
tries (`semaphores.trywait`) and leaves the piece for later when no slot is ready;
transport.py's progress engine comes back to it.

Each side keeps its own count of the slots it has used, so slot `used % K` is always the
next one: the two counts agree because every piece is taken in order. Messages queue per
channel, in the order they were posted, and the receiver checks each piece's header (the
message's size, the piece's offset) against the receive it posted: a message of another
size raises PeerError naming both.

A reduced receive (`irecv_reduce`, as in the ring's reduce-scatter) adds straight out of
the slot, so the reduction costs no extra copy. It can also pass its sum on
(`forward_to`, a ring's reduce-scatter step): the incoming slot and our data are added
straight into the slot of the outgoing message, so receive, reduce and send are one
pass over memory. Such a relay waits in two queues, the inbox it reads and the outbox
it writes:

    rank r-1 --[inbox slot]--> (+ our chunk) --[outbox slot]--> rank r+1
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Optional, Protocol, Sequence

import torch

from ..base import DoneHandle, Handle, PeerError
from . import semaphores
from .segment import Segment

SLOT_BYTES = 1 << 20  # one piece of a message (measured: docs/benchmarks.md)
SLOTS = 4             # pieces in flight per channel


class Channel:
    """One direction between two ranks: the slots of the channel from local rank `src`
    in `segment` (the receiver's), the semaphores guarding them and the messages queued
    for them. `bell_to_ring` is the other side's bell; `peer` the other side's rank."""

    def __init__(self, segment: Segment, src: int, bell_to_ring: int, peer: int,
                 create: bool = False):
        self.free, self.filled = segment.channel_semaphores(src)
        self.bell_to_ring = bell_to_ring
        self.peer = peer
        self.slots, self.slot_bytes = segment.slots, segment.slot_bytes
        self.headers, self.data = [], []
        for index in range(self.slots):
            header, data = segment.slot(src, index)
            self.headers.append(header)
            self.data.append(data)
        self.used = 0
        self.queue: Deque["Message"] = deque()  # messages waiting for this channel, in order
        if create:
            semaphores.init(self.free, self.slots)
            semaphores.init(self.filled, 0)

    @property
    def next_slot(self) -> int:
        return self.used % self.slots

    # --- the sender's side -------------------------------------------------------------
    def push(self) -> bool:
        """Send pieces of the queued messages while free slots last. True if any moved.

        A relay heading the queue sends only what it has received and summed so far;
        the rest goes out as it arrives (see pull)."""
        moved = False
        while self.queue:
            message = self.queue[0]
            relay = message.relay_to is self
            while (message.sent < message.offset) if relay else not message.done:
                if not semaphores.trywait(self.free):
                    return moved
                start = message.sent if relay else message.offset
                size = min(self.slot_bytes, message.size - start)
                self.publish(message.size, start, size, message.data[start:start + size])
                if relay:
                    message.sent += size
                else:
                    message.offset += size
                moved = True
            if relay and message.sent < message.size:
                return moved  # the rest is still to arrive
            self.queue.popleft()
        return moved

    def publish(self, total: int, offset: int, size: int,
                data: Optional[torch.Tensor]) -> None:
        """Fill the next slot, whose free count we hold (copy `data` unless the caller
        already wrote it there), and hand it to the receiver."""
        slot = self.next_slot
        if data is not None:
            self.data[slot][:size].copy_(data)
        self.headers[slot][:] = [total, offset, size]
        semaphores.post(self.filled)
        semaphores.post(self.bell_to_ring)
        self.used += 1

    # --- the receiver's side -----------------------------------------------------------
    def pull(self) -> bool:
        """Take the pieces that have arrived for the queued receives. True if any did.

        A relay's piece is summed straight into its outgoing slot when the relay heads
        that outbox, has sent everything before this piece and a slot there is free;
        otherwise into its own buffer, which push() sends from later."""
        moved = False
        while self.queue:
            message = self.queue[0]
            outbox = message.relay_to
            while message.offset < message.size:
                if not semaphores.trywait(self.filled):
                    return moved
                slot = self.next_slot
                total, offset, size = self.headers[slot]
                if total != message.size or offset != message.offset:
                    raise PeerError(f"{message.what}: rank {self.peer} sent a message of "
                                    f"{total} bytes where this rank expected {message.size}")
                if outbox is None:
                    message.take(self.data[slot], offset, size)
                elif (message.sent == offset and outbox.queue[0] is message
                      and semaphores.trywait(outbox.free)):  # sum straight into the outgoing slot
                    message.take(self.data[slot], offset, size, outbox.data[outbox.next_slot])
                    outbox.publish(message.size, offset, size, None)
                    message.sent += size
                else:
                    message.take(self.data[slot], offset, size)  # sent later by push
                self._hand_back()
                message.offset += size
                moved = True
            self.queue.popleft()
        return moved

    def _hand_back(self) -> None:
        """The slot just read is free again: tell the sender."""
        semaphores.post(self.free)
        semaphores.post(self.bell_to_ring)
        self.used += 1

    def close(self) -> None:
        """Drop the views of the segment, so that it can be unmapped."""
        self.headers = self.data = None


class Engine(Protocol):
    """What moves messages: the transport's progress engine (transport.py)."""

    def progress(self) -> bool:
        """Move what can move now, on every channel; True if anything did."""

    def wait_for(self, message: "Message", finished: Callable[[], bool],
                 watch: Optional[Callable[[], Sequence[int]]] = None) -> None:
        """Drive progress until `finished()`, or raise if `watch()`'s ranks exit."""


class Message(Handle):
    """A queued send or receive, moved piece by piece by its channel's push or pull.

    A relay (a receive whose sum is sent on) waits in two queues, the inbox it reads
    and the outbox it writes. A piece that arrives while the relay heads the outbox
    and a slot there is free is summed straight into that slot. Otherwise it is summed
    into the accumulator and sent from there once a slot frees: when every rank's
    outgoing slots are full, that is what keeps a ring of relays from waiting on itself.
    """
    forward: Handle = DoneHandle()  # a relay's is a Forward

    def __init__(self, engine: Engine, data: torch.Tensor, peer: int, what: str,
                 take: Optional[Callable[..., None]] = None,
                 relay_to: Optional[Channel] = None):
        self.engine = engine  # waits and tests drive it
        self.data = data  # the message's bytes (uint8, 1-D)
        self.size = data.numel()
        self.offset = 0   # bytes moved so far (relays: received)
        self.sent = 0     # relays: bytes passed on
        self.peer, self.what = peer, what
        self.take = take  # receives: what to do with a piece that arrived
        self.relay_to = relay_to  # relays: the outbox the result goes to

    @property
    def done(self) -> bool:
        """Moved: sent, or received (a relay's forward may still be going out)."""
        return self.offset >= self.size

    def wait(self) -> None:
        self.engine.wait_for(self, lambda: self.done)

    def test(self) -> bool:
        self.engine.progress()
        return self.done


class Forward(Handle):
    """The send half of a relay: done once every piece of the sum has gone out."""

    def __init__(self, relay: Message):
        self.relay = relay

    def wait(self) -> None:
        relay = self.relay
        # the sum waits on both neighbours: pieces from the source (until all have come:
        # then the source may finish and exit, no longer needing us), free slots from the
        # rank it goes to; an exit of either while we still need it ends the wait
        relay.engine.wait_for(
            relay, lambda: relay.sent >= relay.size,
            watch=lambda: ((relay.relay_to.peer,) if relay.done
                           else (relay.peer, relay.relay_to.peer)))

    def test(self) -> bool:
        self.relay.engine.progress()
        return self.relay.sent >= self.relay.size
