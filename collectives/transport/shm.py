r"""Routed point-to-point: shared memory to ranks of this host, the backend to the rest.

Over loopback TCP every byte is copied twice by the kernel (into a socket buffer and
out again) and handled by the backend's I/O threads. Ranks on one host can do with
less: the sender copies a message into memory the receiver has mapped too, and the
receiver uses it where it lies. A receive that is reduced (`irecv_reduce`, as in the
ring's reduce-scatter) adds straight out of that memory, so the reduction costs no
extra copy. MPICH's shared-memory channel and NCCL's SHM transport work this way;
gloo has nothing like it, which is why an algorithm over this transport can beat
gloo's own all-reduce.

Every rank creates one segment, its inbox, and maps every peer's:

    rank 1's segment: a file in /dev/shm, mapped by every rank
    +---------+----------------------------------+----------------------------+---
    | pid     | channel from rank 0              | channel from rank 2        | ...
    | bell    | free filled | slot 0 | ... | slot K-1                        |
    | board   |                                  |                            |
    +---------+----------------------------------+----------------------------+---

A channel carries one direction between two ranks: K slots used in turn, and two
process-shared POSIX semaphores counting the free and the filled slots. A message
is cut into slot-sized pieces:

    sender:    wait(free)    copy a piece into the next slot          post(filled)
    receiver:  wait(filled)  copy (or reduce) the piece out of it     post(free)

and each side then rings the other's bell. The semaphores also order the memory:
what the sender wrote before post() is visible to the receiver after its wait().

A reduced receive can pass its sum on (`irecv_reduce(..., forward_to=dst)`, a ring's
reduce-scatter step): the incoming slot and our data are added straight into the
slot of the outgoing message, so receive, reduce and send are one pass over memory.

Progress: isend/irecv queue the message and move what they can at once; the rest
moves whenever this rank waits for anything. Each wait drives every queued message
of this communicator, as MPI's progress engine does, so a rank waiting on a receive
still drains its sends and a ring cannot deadlock. When nothing can move, the rank
sleeps on its bell (a semaphore its peers post after filling or freeing one of its
slots), so waiting ranks spin no CPU away from the ones working: that matters when
ranks outnumber cores.

Errors: a wait past the timeout raises PeerError, and so does a peer whose process
has exited (checked by pid ten times a second while asleep, so a dead peer is
caught in well under a second). A message of another size than the receive posted
for it raises PeerError naming both.

The call board: api.py checks that the ranks make the same call (collective, sizes,
dtype, op, root). Where the whole world is on one host it needs no message for it:
each rank writes its call's row into its own segment's board before the call's first
message (`announce_call`, the call's number written last) and reads the others' after
the call (`confirm_call`). A call whose every result depends on every rank (all-reduce)
cannot finish before every rank has announced it, so confirming costs a few reads;
a broadcast's root may wait there for the others to arrive. Calls that disagree may
exchange garbage or stall before they are confirmed: a rank waiting with nothing moving
reads the board at every nap, and every rank raises CallMismatch, which api.py turns
into one error naming both calls, within a nap or two. Each rank is at most one
confirmed call ahead of any other, so a board of 4 entries, used in turn, is never
overwritten before it is read.

Routes: a job that spans hosts keeps shared memory inside each host. Each peer is
reached by the best route: through a channel when it shares our host, through the
backend this transport wraps (gloo's TCP or MPI) when not. Algorithms above see one
transport and never know. Waiting on a message over the backend keeps the shared
memory moving: while any of our shared-memory messages is queued, a wait polls the
backend's request and drives progress() in turn (else a local peer could wait on us
while we wait on a remote one that waits on it). `traffic.routes` counts the bytes of
each route ("shm", "network").

Barrier and the native collectives go to the backend this transport wraps (gloo or
MPI). `connect()` adds shared memory where at least one host has two or more ranks and
every segment could be created and mapped; otherwise it returns the backend as it is.
Segments are allocated in full when created (about local ranks x 4 MiB each, so a host
of 8 ranks takes ~256 MiB of /dev/shm): a /dev/shm too small for them turns shared
memory off, with one warning line, instead of killing a rank with SIGBUS later.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import signal
import sys
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence

import torch

from .base import CallMismatch, DoneHandle, Handle, PeerError, Transport, nbytes, reduce_into

SLOT_BYTES = 1 << 20  # one piece of a message (measured: docs/benchmarks.md)
SLOTS = 4             # pieces in flight per channel
_LINE = 64            # shared fields sit on cache lines of their own; a sem_t fits in one
_SLOT_HEADER = 64     # message size, piece offset, piece size (3 int64)
_NAP_SECONDS = 0.1    # longest sleep on the bell before checking deadline and peers
_BOARD_ENTRIES = 4    # announced calls kept, used in turn (see the call board above)
_BOARD_WORDS = 32     # int64 per entry: the call's number, the row's length, the row
_HEADER = 2 * _LINE + _BOARD_ENTRIES * _BOARD_WORDS * 8  # pid, bell, board
# x86-64 makes stores visible to other cores in the order they were made (TSO), so an
# entry whose number is there is whole; elsewhere (aarch64) each entry read is checked.
_CHECK_ENTRIES = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")
_REMOTE_POLL_SECONDS = 0.0005  # a wait on the network checks it this often while shm is busy


# --- process-shared POSIX semaphores, through ctypes --------------------------------------
class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc():
    """The C library's semaphore calls, or None where there are none (not Linux)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("sem_init", "sem_post", "sem_trywait", "sem_timedwait"):
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.sem_post.argtypes = [ctypes.c_void_p]
    lib.sem_trywait.argtypes = [ctypes.c_void_p]
    lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    return lib


_libc = _load_libc()


def _sem_init(address: int, value: int) -> None:
    if _libc.sem_init(address, 1, value) != 0:  # 1: shared between processes
        raise OSError(ctypes.get_errno(), "sem_init failed")


def _sem_post(address: int) -> None:
    if _libc.sem_post(address) != 0:
        raise OSError(ctypes.get_errno(), "sem_post failed")


def _sem_trywait(address: int) -> bool:
    """Take one count if there is one; never blocks."""
    return _libc.sem_trywait(address) == 0


def _sem_nap(address: int, seconds: float) -> bool:
    """Take one count, sleeping up to `seconds` for it. False if none came."""
    when = time.time() + seconds  # sem_timedwait takes an absolute CLOCK_REALTIME time
    spec = _Timespec(int(when), int((when % 1) * 1e9))
    return _libc.sem_timedwait(address, ctypes.byref(spec)) == 0


# --- the memory -------------------------------------------------------------------------
def _layout(local_size: int, slots: int, slot_bytes: int):
    """Byte offsets of a segment: (channel size, segment size)."""
    channel = 2 * _LINE + slots * (_SLOT_HEADER + slot_bytes)
    return channel, _HEADER + local_size * channel


class _Segment:
    """One rank's inbox: a /dev/shm file with a header and one channel per rank of its
    host (indexed by local rank; its own is unused).

    The creator allocates every page of it at once. A file merely sized (ftruncate) is
    sparse: it maps fine however full /dev/shm is, and the first write to a page that
    the tmpfs has no room for kills the writer with SIGBUS, in the middle of a
    collective. Allocated up front, a /dev/shm too small (Docker's default is 64 MiB)
    is an OSError here, where connect() can still fall back to the backend.
    """

    def __init__(self, path: str, local_size: int, slots: int, slot_bytes: int, create: bool):
        self.path = path
        self.channel_bytes, size = _layout(local_size, slots, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS later
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(path)  # ours and of no use: leave nothing in /dev/shm
            raise
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self._anchor)  # for the semaphores
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pid = ctypes.c_int64.from_buffer(self.map, 0)
        self.bell = self.address + _LINE
        self.board = [(ctypes.c_int64 * _BOARD_WORDS).from_buffer(
            self.map, 2 * _LINE + i * _BOARD_WORDS * 8) for i in range(_BOARD_ENTRIES)]
        if create:
            self.pid.value = os.getpid()
            _sem_init(self.bell, 0)

    def channel_offset(self, src: int) -> int:
        return _HEADER + src * self.channel_bytes

    def close(self) -> None:
        self.bytes = self.pid = self.board = self._anchor = None  # views first, or the map can't close
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the map goes with it


class _Channel:
    """One direction between two ranks: SLOTS slots and the semaphores guarding them.

    Each side keeps its own count of the slots it has used, so slot `used % SLOTS` is
    always the next one: the two counts agree because every piece is taken in order.
    """

    def __init__(self, segment: _Segment, src: int, slots: int, slot_bytes: int,
                 bell_to_ring: int, peer: int, create: bool):
        start = segment.channel_offset(src)
        self.free = segment.address + start
        self.filled = self.free + _LINE
        self.bell_to_ring = bell_to_ring  # the other side's bell
        self.peer = peer
        self.slot_bytes = slot_bytes
        self.headers, self.data = [], []
        for i in range(slots):
            at = start + 2 * _LINE + i * (_SLOT_HEADER + slot_bytes)
            self.headers.append((ctypes.c_int64 * 3).from_buffer(segment.map, at))
            self.data.append(segment.bytes[at + _SLOT_HEADER:at + _SLOT_HEADER + slot_bytes])
        self.used = 0
        self.queue: Deque["_Message"] = deque()  # messages waiting for this channel, in order
        if create:
            _sem_init(self.free, slots)
            _sem_init(self.filled, 0)

    def release(self) -> None:
        self.headers = self.data = None


class _Message(Handle):
    """A queued send or receive, moved piece by piece by its transport's progress().

    A relay (a receive whose sum is sent on) waits in two queues, the inbox it reads
    and the outbox it writes. A piece that arrives while the relay heads the outbox
    and a slot there is free is summed straight into that slot. Otherwise it is summed
    into the accumulator and sent from there once a slot frees: when every rank's
    outgoing slots are full, that is what keeps a ring of relays from waiting on itself.
    """
    forward: Handle = DoneHandle()  # a relay's is a _Forward

    def __init__(self, transport: "ShmTransport", data: torch.Tensor, peer: int, what: str,
                 take: Optional[Callable[..., None]] = None,
                 relay_to: Optional["_Channel"] = None):
        self.transport = transport
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
        self.transport.wait_for(self, lambda: self.done)

    def test(self) -> bool:
        self.transport.progress()
        return self.done


class _Forward(Handle):
    """The send half of a relay: done once every piece of the sum has gone out."""

    def __init__(self, relay: _Message):
        self.relay = relay

    def wait(self) -> None:
        relay = self.relay
        # the sum waits on both neighbours: pieces from the source (until all have come:
        # then the source may finish and exit, no longer needing us), free slots from the
        # rank it goes to; an exit of either while we still need it ends the wait
        relay.transport.wait_for(
            relay, lambda: relay.sent >= relay.size,
            watch=lambda: ((relay.relay_to.peer,) if relay.done
                           else (relay.peer, relay.relay_to.peer)))

    def test(self) -> bool:
        self.relay.transport.progress()
        return self.relay.sent >= self.relay.size


_warned = False  # this process has said that shared memory is off


def _warn_fallback(backend: str, reason: str) -> None:
    """Say, once per process, that point-to-point goes through the backend after all.

    One line on stderr: a rank that runs slower than it could should say why, but a job
    of many ranks must not print a screenful (connect() has one rank say it)."""
    global _warned
    if not _warned:
        _warned = True
        print(f"collectives: warning: shared memory off, point-to-point goes through "
              f"{backend}: {reason}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _terminate_runs_finally():
    """While the block runs, SIGTERM raises SystemExit (exit status 143) instead of
    ending the process on the spot, so the block's `finally` still removes its files.

    A launcher stops the survivors of a failed job with SIGTERM (torchrun does, at once,
    when one rank fails during start-up); by default that ends a process without
    unwinding, and a segment created a moment before would stay in /dev/shm. Only where
    SIGTERM has its default action and only on the main thread (the one Python delivers
    signals to); a handler of the program's own is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def exit_unwinding(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, exit_unwinding)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class _Remote(Handle):
    """A message over the backend; waiting on it keeps our shared memory moving."""

    def __init__(self, transport: "ShmTransport", inner: Handle, peer: int, what: str):
        self.transport, self.inner, self.peer, self.what = transport, inner, peer, what

    def wait(self) -> None:
        self.transport.wait_remote(self)

    def test(self) -> bool:
        return self.inner.test()


class ShmTransport(Transport):
    """Point-to-point through shared memory; barrier and native collectives via `inner`."""

    device_tensors_ok = False  # CUDA tensors are staged through host memory by the base

    def __init__(self, inner: Transport, segments: Dict[int, _Segment], slots: int,
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
        self.outboxes = {p: _Channel(segments[p], local.index(me), slots, slot_bytes,
                                     segments[p].bell, p, create=False)
                         for p in local if p != me}
        self.inboxes = {p: _Channel(segments[me], local.index(p), slots, slot_bytes,
                                    segments[p].bell, p, create=False)
                        for p in local if p != me}
        self.pids = {p: segments[p].pid.value for p in local if p != me}
        self.watch_pids = watch_pids
        self.remote: List[_Remote] = []  # messages over the backend not yet seen done
        self.announced = 0  # checked calls announced on our board
        self.call: Optional[tuple] = None  # (number, digest) of the call not yet confirmed
        # every rank's board, where the whole world shares this host (else None)
        self.boards = ([segments[rank].board for rank in range(self.world_size)]
                       if len(segments) == self.world_size else None)

    @property
    def name(self) -> str:
        return f"{self.backend}+shm"

    # --- setting up: collective over `inner` ------------------------------------------
    @classmethod
    def connect(cls, inner: Transport, slots: int = SLOTS,
                slot_bytes: int = SLOT_BYTES) -> Transport:
        """Shared memory between the ranks of each host, over `inner`; `inner` itself
        when no host has two ranks or shared memory cannot be set up.

        Collective: every rank calls it and all come to the same answer. Each rank
        creates its segment, the ranks of its host map it, and the files are removed at
        once: the mappings stay, and nothing is left in /dev/shm if a rank dies later.
        Where any rank cannot create or map a segment (/dev/shm too small, say), every
        rank falls back to `inner`, and the lowest such rank prints one warning saying why.
        """
        def first_failing(ok: bool) -> Optional[int]:  # the lowest rank where `ok` is False
            vote = torch.tensor([inner.world_size if ok else inner.rank])
            inner.reduce_metadata(vote, "min")
            return None if vote.item() == inner.world_size else int(vote.item())

        def everyone(flag: bool) -> bool:  # True when it holds on every rank
            return first_failing(flag) is None

        def given_up(problem: Optional[str]) -> bool:  # agree; the first to fail says why
            failed = first_failing(problem is None)
            if failed == inner.rank:
                _warn_fallback(inner.backend, problem)
            return failed is not None

        topology = inner.topology
        if topology.one_rank_per_host or not everyone(_libc is not None):
            return inner  # nothing to share, or no POSIX semaphores somewhere
        token = torch.tensor([secrets.randbits(48)])
        inner.broadcast_metadata(token, 0)
        me = inner.rank
        local = topology.local_ranks(me)
        paths = {rank: f"/dev/shm/collectives-{token.item():x}-{rank}" for rank in local}
        segments: Dict[int, _Segment] = {}
        connected = False
        # The files below go whatever happens, a launcher's SIGTERM included.
        with _terminate_runs_finally():
            try:
                problem = None
                try:
                    segments[me] = _Segment(paths[me], len(local), slots, slot_bytes, True)
                    for index, src in enumerate(local):  # our inbox's semaphores
                        if src != me:
                            _Channel(segments[me], index, slots, slot_bytes, 0, src,
                                     create=True).release()
                except OSError as error:
                    mib = _layout(len(local), slots, slot_bytes)[1] / 2**20
                    problem = (f"rank {me} could not create its {mib:.1f} MiB segment "
                               f"in /dev/shm ({error.strerror or error}); its host's "
                               f"{len(local)} ranks need {mib * len(local):.0f} MiB free there")
                if given_up(problem):
                    return inner
                try:
                    for rank in local:
                        if rank != me:
                            segments[rank] = _Segment(paths[rank], len(local), slots,
                                                      slot_bytes, False)
                except OSError as error:
                    problem = f"rank {me} could not map a peer's segment: {error}"
                if given_up(problem):
                    return inner
                watch_pids = everyone(all(_alive(s.pid.value) for s in segments.values()))
                connected = True
                return cls(inner, segments, slots, slot_bytes, watch_pids)
            finally:
                if me in segments:
                    os.unlink(paths[me])  # every rank has mapped it (or given up) by now
                if not connected:
                    for segment in segments.values():
                        segment.close()

    # --- point to point ---------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        self._refuse_if_out_of_step()
        if dst not in self.outboxes:
            return self._over_network(self.inner._isend(tensor, dst), tensor, dst,
                                      f"send to rank {dst}", sent=True)
        self.traffic.count_route("shm", sent=nbytes(tensor))
        return self._queue(self.outboxes[dst],
                           _Message(self, _as_bytes(tensor), dst, f"send to rank {dst}"))

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
                           _Message(self, target, src, f"receive from rank {src}", copy_out))

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
            return self._queue(self.inboxes[src], _Message(self, target, src, what, fold))
        self._check_peer(accumulator, forward_to, "irecv_reduce")
        self.traffic.count_send(accumulator)
        self.traffic.count_route("shm", sent=nbytes(accumulator))
        outbox = self.outboxes[forward_to]
        relay = _Message(self, target, src, f"{what} (passed on to rank {forward_to})",
                         fold, relay_to=outbox)
        relay.forward = _Forward(relay)
        if relay.size:
            outbox.queue.append(relay)  # holds our place in the order of sends to forward_to
        return self._queue(self.inboxes[src], relay)

    def _over_network(self, inner: Handle, tensor: torch.Tensor, peer: int, what: str,
                      sent: bool) -> Handle:
        self.traffic.count_route("network", **{"sent" if sent else "received": nbytes(tensor)})
        handle = _Remote(self, inner, peer, what)
        self.remote.append(handle)
        return handle

    def _queue(self, channel: _Channel, message: _Message) -> Handle:
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
            moved |= self._push(channel)
        for channel in self.inboxes.values():
            moved |= self._pull(channel)
        if self.remote:
            self.remote = [handle for handle in self.remote if not handle.test()]
        return moved

    def _shm_busy(self) -> bool:
        return any(c.queue for c in self.outboxes.values()) or any(
            c.queue for c in self.inboxes.values())

    def _push(self, channel: _Channel) -> bool:
        moved = False
        while channel.queue:
            message = channel.queue[0]
            relay = message.relay_to is channel
            while (message.sent < message.offset) if relay else not message.done:
                if not _sem_trywait(channel.free):
                    return moved
                start = message.sent if relay else message.offset
                size = min(self.slot_bytes, message.size - start)
                self._publish(channel, message.size, start, size,
                              message.data[start:start + size])
                if relay:
                    message.sent += size
                else:
                    message.offset += size
                moved = True
            if relay and message.sent < message.size:
                return moved  # the rest is still to arrive
            channel.queue.popleft()
        return moved

    def _publish(self, channel: _Channel, total: int, offset: int, size: int,
                 data: Optional[torch.Tensor]) -> None:
        """Fill the next slot of a channel whose free slot we hold (copy `data` unless
        the caller already wrote it there) and hand it to the receiver."""
        slot = channel.used % self.slots
        if data is not None:
            channel.data[slot][:size].copy_(data)
        channel.headers[slot][:] = [total, offset, size]
        _sem_post(channel.filled)
        _sem_post(channel.bell_to_ring)
        channel.used += 1

    def _pull(self, channel: _Channel) -> bool:
        moved = False
        while channel.queue:
            message = channel.queue[0]
            outbox = message.relay_to
            while message.offset < message.size:
                if not _sem_trywait(channel.filled):
                    return moved
                slot = channel.used % self.slots
                total, offset, size = channel.headers[slot]
                if total != message.size or offset != message.offset:
                    raise PeerError(f"{message.what}: rank {channel.peer} sent a message of "
                                    f"{total} bytes where this rank expected {message.size}")
                if outbox is None:
                    message.take(channel.data[slot], offset, size)
                elif (message.sent == offset and outbox.queue[0] is message
                      and _sem_trywait(outbox.free)):  # sum straight into the outgoing slot
                    message.take(channel.data[slot], offset, size,
                                 outbox.data[outbox.used % self.slots])
                    self._publish(outbox, message.size, offset, size, None)
                    message.sent += size
                else:
                    message.take(channel.data[slot], offset, size)  # sent later by _push
                _sem_post(channel.free)
                _sem_post(channel.bell_to_ring)
                channel.used += 1
                message.offset += size
                moved = True
            channel.queue.popleft()
        return moved

    def wait_for(self, message: _Message, finished: Callable[[], bool],
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
            if _sem_nap(self.bell, _NAP_SECONDS):
                continue  # a peer filled or freed a slot of ours: try again
            if time.monotonic() > deadline:
                raise PeerError(f"{message.what} timed out after {timeout:g} s")
            if self.call is not None:  # stalled: perhaps the ranks made different calls
                self._raise_if_calls_differ()
            for peer in watch() if self.watch_pids else ():
                if not _alive(self.pids[peer]):
                    raise PeerError(f"{message.what} failed: rank {peer} "
                                    f"(pid {self.pids[peer]}) has exited")

    def wait_remote(self, handle: _Remote) -> None:
        """Wait for a message over the backend; keep shared memory moving meanwhile."""
        timeout = self.timeout.total_seconds()
        deadline = time.monotonic() + timeout
        while self._shm_busy() and not handle.test():
            if not self.progress():
                _sem_nap(self.bell, _REMOTE_POLL_SECONDS)
            if time.monotonic() > deadline:
                raise PeerError(f"{handle.what} timed out after {timeout:g} s")
        handle.inner.wait()  # done, or nothing of ours is queued: the backend's own wait

    # --- the call board -----------------------------------------------------------------
    # An entry: [call number, digest of the row, the row's length, the row ...]. Peers
    # compare digests; rows are read to name a disagreement (and, where stores may
    # become visible out of order, to check that an entry is whole).
    def announce_call(self, row: List[int]) -> bool:
        if self.boards is None or len(row) > _BOARD_WORDS - 3:
            return False  # peers on other hosts cannot read our board: the handshake
        self._refuse_if_out_of_step()
        self.announced += 1
        digest = hash((self.announced, *row))  # ints hash alike in every process
        entry = self.boards[self.rank][self.announced % _BOARD_ENTRIES]
        entry[0] = -1  # being written
        entry[1] = digest
        entry[2] = len(row)
        entry[3:3 + len(row)] = row
        entry[0] = self.announced  # last: the entry is complete
        self.call = (self.announced, digest)
        return True

    def _entry(self, rank: int, number: int, whole: bool = False) -> Optional[tuple]:
        """(digest, row or None) of `rank`'s entry for call `number`; None if it has not
        announced it. `whole`: read the row too, and take the entry only if it is
        complete (its row matches its digest, its number did not change meanwhile)."""
        entry = self.boards[rank][number % _BOARD_ENTRIES]
        if entry[0] != number:
            return None
        digest = entry[1]
        if not (whole or _CHECK_ENTRIES):
            return digest, None
        length = entry[2]
        row = entry[3:3 + length] if 0 <= length <= _BOARD_WORDS - 3 else None
        # the number is in the digest: an older call's entry seen under it cannot pass
        if row is None or hash((number, *row)) != digest or entry[0] != number:
            return None  # being written: not announced yet
        return digest, row

    def _raise_if_calls_differ(self, timeout: Optional[float] = None) -> None:
        """Raise CallMismatch if a rank announced another call than ours. Every rank
        raises the same one: it first waits for every rank's entry (until `timeout`,
        by default the communicator's, or a missing rank's exit)."""
        number, mine = self.call
        entries = [self._entry(rank, number) for rank in range(self.world_size)]
        if all(entry is None or entry[0] == mine for entry in entries):
            return
        timeout = self.timeout.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            entries = [self._entry(rank, number, whole=True) for rank in range(self.world_size)]
            missing = [rank for rank, entry in enumerate(entries) if entry is None]
            if (not missing or time.monotonic() > deadline or self.watch_pids
                    and not all(_alive(self.pids[rank]) for rank in missing)):
                break
            time.sleep(0.01)
        self.call = None
        raise CallMismatch([None if entry is None else entry[1] for entry in entries])

    def confirm_call(self, timeout: Optional[float] = None) -> None:
        if self.call is None:
            return  # already confirmed, or given up on (a PeerError raised below)
        number, mine = self.call
        at = number % _BOARD_ENTRIES
        if not _CHECK_ENTRIES and all(board[at][0] == number and board[at][1] == mine
                                      for board in self.boards):
            self.call = None  # the usual case: every rank announced the same call
            return
        timeout = self.timeout.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pause = 5e-5
        while True:
            entries = [self._entry(rank, number) for rank in range(self.world_size)]
            if any(entry is not None and entry[0] != mine for entry in entries):
                self._raise_if_calls_differ(timeout)
            if None not in entries:
                self.call = None
                return
            missing = entries.index(None)
            if time.monotonic() > deadline:
                raise PeerError(f"rank {missing} did not make call #{number} "
                                f"within {timeout:g} s")
            if self.watch_pids and not _alive(self.pids[missing]):
                raise PeerError(f"rank {missing} (pid {self.pids[missing]}) has exited")
            time.sleep(pause)  # a broadcast's root, waiting for the others to arrive
            pause = min(2 * pause, 0.01)

    def forget_call(self) -> None:
        self.call = None

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
        self.boards = None  # views of the segments: gone before they close
        for channel in [*self.outboxes.values(), *self.inboxes.values()]:
            channel.release()
        for segment in self.segments.values():
            segment.close()
        self.segments = {}
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()  # the network's connections first: peers learn at once
        self.close()


def want_shm(setting: Optional[str]) -> Optional[bool]:
    """Read the shm setting: True (required), False (off) or None (use it when possible).

    From init(shm=...) or else the COLLECTIVES_SHM variable: "auto" (default), "1"/"on",
    "0"/"off".
    """
    value = setting if setting is not None else os.environ.get("COLLECTIVES_SHM", "auto")
    value = str(value).strip().lower()
    if value in ("auto", ""):
        return None
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"shm setting {value!r}: use auto, on or off")
