"""The transport: the one small interface every collective algorithm is written against.

A transport moves bytes between ranks and nothing else. It knows which backend is
underneath (gloo, nccl, mpi, or a world of one); nothing above it does. Algorithms use:

    comm.rank, comm.world_size, comm.local_rank, comm.backend, comm.device
    comm.send(t, dst)            comm.recv(t, src)            blocking point-to-point
    comm.isend(t, dst) -> h      comm.irecv(t, src) -> h      h.wait() completes it
    comm.sendrecv(send_t, dst, recv_t, src)                   one step of a ring
    comm.exchange(sends, receives)   one step: [(t, dst)...] and [(t, src)...] together
    comm.irecv_reduce(acc, src, op) -> h    receive and fold in: acc <- acc (op) message
                                            (forward_to=dst: and send the sum on)
    comm.barrier()
    comm.native_all_reduce(t, op)  comm.native_broadcast(t, src)   the backend's own

Messages between one pair of ranks arrive in the order they were sent (every backend
here guarantees it), so algorithms need no tags. On NCCL (`step_by_step`) a rank's
postings also run one after another, each to its end: an algorithm there posts each
step's sends and receives together with `exchange()` and posts nothing ahead. The same
ordering means two threads must not run send/recv-based collectives on one
communicator at the same time (one could take the other's messages): a second thread
uses its own, `comm.duplicate()`.
The backends' native collectives never match point-to-point messages.

Every transport counts the bytes it sends and receives in `comm.traffic`, so an
algorithm or a sync strategy can report what it cost on the wire.

Every public collective runs inside `comm.checked_call(call)` (calls.py): the ranks
compare what they are calling before or while it runs, and `comm.calls` counts the
calls and says whether the ranks are still in step (`comm.out_of_step`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# PeerError and CallMismatch live beside the calls they fail (calls.py); every
# transport takes them from here.
from .calls import Call, CallCheck, CallMismatch, PeerError  # noqa: F401
from .topology import Topology

REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")
# The ops an algorithm itself performs. "avg" is "sum" followed by one division,
# done once in api.py so that every algorithm divides the same way. band, bor and
# bxor (bitwise and, or, xor) take integer tensors only.
ALGORITHM_OPS = ("sum", "max", "min", "product", "band", "bor", "bxor")


@dataclass
class Traffic:
    """Bytes and messages this rank has sent and received since the last reset.

    Point-to-point messages are counted exactly. The backends do not report what their
    native collectives send, so those count what a bandwidth-optimal algorithm sends:
    2(n-1)/n of the buffer for all-reduce, the buffer once per receiver for broadcast.
    """
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    # Point-to-point bytes by route, where a transport has several (shm/): e.g.
    # {"shm": [sent, received], "network": [sent, received]}. Empty: one route.
    routes: dict = field(default_factory=dict)
    # a communicator and its duplicates share one Traffic, updated from several threads
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def reset(self) -> None:
        with self.lock:
            self.bytes_sent = self.bytes_received = 0
            self.messages_sent = self.messages_received = 0
            self.routes = {}

    def count_route(self, route: str, sent: int = 0, received: int = 0) -> None:
        with self.lock:
            both = self.routes.setdefault(route, [0, 0])
            both[0] += sent
            both[1] += received

    def count_send(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.bytes_sent += nbytes(tensor)
            self.messages_sent += 1

    def count_receive(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.bytes_received += nbytes(tensor)
            self.messages_received += 1

    def count_native(self, sent: float, received: float) -> None:
        with self.lock:
            self.bytes_sent += int(sent)
            self.bytes_received += int(received)

    def snapshot(self) -> "Traffic":
        with self.lock:
            return Traffic(self.bytes_sent, self.bytes_received, self.messages_sent,
                           self.messages_received, {k: list(v) for k, v in self.routes.items()})


class Handle:
    """A pending send or receive. `wait()` blocks until it completes (or times out);
    `test()` says, without blocking, whether wait() would return at once."""

    def wait(self) -> None:
        raise NotImplementedError

    def test(self) -> bool:
        raise NotImplementedError


class DoneHandle(Handle):
    """A handle for an operation that completed when it was started."""

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


class StagedRecvHandle(Handle):
    """A receive that landed in a staging buffer (host memory for gloo, the GPU for
    NCCL) and is copied into the caller's tensor on wait()."""

    def __init__(self, inner: Handle, staged: torch.Tensor, target: torch.Tensor):
        self.inner, self.staged, self.target = inner, staged, target

    def wait(self) -> None:
        self.inner.wait()
        self.target.copy_(self.staged)

    def test(self) -> bool:
        return self.inner.test()


class KeepAliveHandle(Handle):
    """A send from a temporary staging copy, kept alive until the send completes."""

    def __init__(self, inner: Handle, staged: torch.Tensor):
        self.inner, self.staged = inner, staged

    def wait(self) -> None:
        self.inner.wait()

    def test(self) -> bool:
        return self.inner.test()


class ReduceOnWaitHandle(Handle):
    """A receive into scratch memory, folded into an accumulator on wait() and, when
    asked, sent on: `forward` is then the handle of that send."""

    def __init__(self, transport: "Transport", inner: Handle, accumulator: torch.Tensor,
                 scratch: torch.Tensor, op: str, forward_to: Optional[int]):
        self.transport, self.inner = transport, inner
        self.accumulator, self.scratch, self.op = accumulator, scratch, op
        self.forward_to = forward_to
        self.forward: Handle = DoneHandle()

    def wait(self) -> None:
        self.inner.wait()
        reduce_into(self.accumulator, self.scratch, self.op)
        if self.forward_to is not None:
            self.forward = self.transport.isend(self.accumulator, self.forward_to)

    def test(self) -> bool:
        return self.inner.test()  # the reduction itself never waits


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# Each op's out-of-place torch function: reduce_into writes into the accumulator, or
# (shared memory) straight into an outgoing message.
COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum,
           "product": torch.mul, "band": torch.bitwise_and, "bor": torch.bitwise_or,
           "bxor": torch.bitwise_xor}


def reduce_into(accumulator: torch.Tensor, incoming: torch.Tensor, op: str,
                out: Optional[torch.Tensor] = None) -> None:
    """out <- accumulator (op) incoming, elementwise; `out` defaults to the accumulator."""
    if op not in COMBINE:
        raise ValueError(f"reduce op {op!r} is not one of {ALGORITHM_OPS}")
    COMBINE[op](accumulator, incoming, out=accumulator if out is None else out)


class Transport:
    """Base class: bookkeeping shared by all transports. Subclasses move the bytes."""

    backend: str = "?"
    # The message size that pipelines best on this transport: algorithms cut big
    # messages into segments of about this size (see ring.py). Smaller ones cost more
    # in each message's fixed cost than their pipelining buys, except on a slow link
    # between hosts: segment_for_link. Measured: docs/benchmarks.md, "Shared memory:
    # slot and segment sizes" and "Ring segment size over TCP".
    segment_bytes: int = 4 << 20

    @staticmethod
    def segment_for_link(rate: float) -> int:
        """The segment for a network of `rate` bytes/s each way: what it moves in about
        40 ms (a power of two, from 64 KiB to the 4 MiB default). A segment is forwarded
        only once all of it has arrived, so on a slow link a big one leaves the next
        link waiting (measured on the emulated cluster: docs/benchmarks.md, "Ring
        segment size over TCP")."""
        wanted = max(64 << 10, min(Transport.segment_bytes, int(rate * 0.04)))
        return 1 << (wanted.bit_length() - 1)
    # Whether _isend/_irecv (and the native collectives) take tensors on an accelerator
    # directly. When False, device tensors are staged through host memory (one copy
    # each way).
    device_tensors_ok: bool = False
    # Whether they take CPU tensors. NCCL moves GPU memory only: the small CPU tensors
    # of argument checks and flags are then staged through this rank's GPU.
    cpu_tensors_ok: bool = True
    # Whether point-to-point must go one step at a time (NCCL): every posting of a rank
    # runs after the one before it has ended, so a receive posted ahead of a step blocks
    # all that is posted after it, the sends its sender waits for included. Algorithms
    # then post each step's sends and receives together (`exchange`) and nothing ahead.
    step_by_step: bool = False
    # Whether the backend's own collectives (native_all_reduce, native_broadcast,
    # barrier) exist here. Some ranks of a communicator (group.py) have none.
    native_collectives: bool = True
    # auto's tuning table for this world (algorithms/tuning.py), which every rank agreed
    # on at init, and where auto's choice comes from, in words; None: the cost model.
    tuning = None
    tuning_source: str = "the cost model"

    def __init__(self, rank: int, world_size: int, local_rank: int,
                 device: torch.device, timeout: timedelta):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.timeout = timeout
        self.traffic = Traffic()
        # host copies of a collective that failed, which a receive may still be writing
        # (api._on_host): kept, never handed to another call
        self.abandoned_buffers: List[torch.Tensor] = []
        # Which ranks share a host. init() exchanges it (Topology.exchange); until then
        # every rank is taken to be on this one.
        self.topology = Topology.one_host(world_size)
        self._workspace: Dict[tuple, torch.Tensor] = {}  # see workspace()
        # auto's choices so far by (collective, size), and the (transport name,
        # topology, tuning table) they were made for (api._auto).
        self.auto_choices: Dict[tuple, str] = {}
        self.auto_choices_for: tuple = ()
        self.calls = CallCheck()  # how many calls, and whether the ranks are in step

    # --- point to point: subclasses implement _isend/_irecv ---------------------------
    def isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        """Start sending `tensor` to rank `dst`; the tensor must not change until wait()."""
        moved = self._outgoing(tensor, dst, "isend")
        handle = self._isend(moved, dst)
        return handle if moved is tensor else KeepAliveHandle(handle, moved)

    def irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        """Start receiving into `tensor` from rank `src`; read it only after wait()."""
        buffer = self._incoming(tensor, src, "irecv")
        handle = self._irecv(buffer, src)
        return handle if buffer is tensor else StagedRecvHandle(handle, buffer, tensor)

    def _outgoing(self, tensor: torch.Tensor, dst: int, what: str) -> torch.Tensor:
        """A send checked and counted: the tensor the backend moves (a staged copy
        where it cannot move `tensor` itself)."""
        self._check_peer(tensor, dst, what)
        self.traffic.count_send(tensor)
        stage = self.staging_device(tensor)
        return tensor if stage is None else tensor.to(stage)

    def _incoming(self, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """A receive checked and counted: the buffer the backend writes (a staging
        buffer, to be copied into `tensor`, where it cannot write `tensor` itself)."""
        self._check_peer(tensor, src, what)
        self.traffic.count_receive(tensor)
        stage = self.staging_device(tensor)
        return tensor if stage is None else torch.empty_like(tensor, device=stage)

    def staging_device(self, tensor: torch.Tensor) -> Optional[torch.device]:
        """Where a copy of `tensor` must go for this transport to move it; None: it
        moves as it is (see device_tensors_ok and cpu_tensors_ok). A device tensor on
        another device than this rank's (another GPU) goes through this rank's."""
        if tensor.device.type == "cpu":
            return None if self.cpu_tensors_ok else self.device
        if not self.device_tensors_ok:
            return torch.device("cpu")
        return None if tensor.device == self.device else self.device

    def irecv_reduce(self, accumulator: torch.Tensor, src: int, op: str,
                     scratch: Optional[torch.Tensor] = None,
                     forward_to: Optional[int] = None) -> Handle:
        """Start receiving a message shaped like `accumulator` and fold it in with `op`.

        accumulator <- accumulator (op) message, once wait() returns. Here the message
        lands in `scratch` (allocated when not given) and is reduced on wait(); a
        transport whose receive buffer the receiver can read in place (shared memory)
        reduces straight out of it and never touches `scratch`.

        forward_to: also send the reduced message on to that rank (a step of a ring's
        reduce-scatter; NCCL calls it recvReduceSend). Then `accumulator` is left
        undefined: shared memory writes the sum straight into the outgoing message and
        never stores it. After wait(), `handle.forward` is the send's handle.
        """
        if scratch is None:
            scratch = torch.empty_like(accumulator)
        return ReduceOnWaitHandle(self, self.irecv(scratch, src), accumulator, scratch, op,
                                  forward_to)

    def recv_reduce(self, accumulator: torch.Tensor, src: int, op: str,
                    scratch: Optional[torch.Tensor] = None) -> None:
        self.irecv_reduce(accumulator, src, op, scratch).wait()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.irecv(tensor, src).wait()

    def sendrecv(self, send_tensor: torch.Tensor, dst: int,
                 recv_tensor: torch.Tensor, src: int) -> None:
        """Send to `dst` and receive from `src` at the same time: one step of a ring.

        Both are posted before either is waited on, so a ring where every rank calls
        sendrecv(to the right, from the left) cannot deadlock.
        """
        self.exchange([(send_tensor, dst)], [(recv_tensor, src)])

    def exchange(self, sends: Sequence[Tuple[torch.Tensor, int]],
                 receives: Sequence[Tuple[torch.Tensor, int]]) -> None:
        """One step of an algorithm: send each (tensor, dst) and receive into each
        (tensor, src), all posted before any is waited on; returns when all are done.

        Here the receives are posted first, then the sends. On NCCL (step_by_step) they
        go as one group (torch_dist.py), as NCCL asks of a step's sends and receives.
        """
        handles = ([self.irecv(tensor, src) for tensor, src in receives]
                   + [self.isend(tensor, dst) for tensor, dst in sends])
        for handle in handles:
            handle.wait()

    def workspace(self, name: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A buffer of `numel` elements of `like`'s dtype and device, for an algorithm's
        scratch during one call, kept from call to call: the same name, dtype and
        device give the same memory (grown when a call needs more, kept while the
        communicator lives). Fresh memory is not free where a receive writes it: the
        kernel maps and zeroes its pages on first touch (what that cost, measured:
        docs/benchmarks.md, "The same code before and after"). Only one call at a time
        may use it, which the communicator's rule already asks: one thread's send/recv
        collectives at a time, on it and its groups together (a group's workspace is
        its parent's); another thread takes a duplicate, whose workspace is its own."""
        key = (name, like.dtype, like.device)
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):  # usable outside inference mode too
                buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace[key] = buffer
        return buffer[:numel]

    def release_workspace(self) -> None:
        """Forget the workspace: a call that failed may have left receives that still
        write into it, so the next call gets fresh memory (the call check calls this on
        a PeerError, calls.py)."""
        self._workspace = {}

    def _check_peer(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"{what}: peer {peer} is not another rank of a world of "
                             f"{self.world_size} (this is rank {self.rank})")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous")

    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        raise NotImplementedError

    def _irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        raise NotImplementedError

    # --- the rest: subclasses implement ---------------------------------------------------
    def barrier(self) -> None:
        raise NotImplementedError

    def native_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """The backend's own all-reduce, in place: the baseline ours are measured against."""
        n = self.world_size
        share = 2 * (n - 1) / n * nbytes(tensor)
        self.traffic.count_native(share, share)
        self._staged(tensor, lambda moved: self._native_all_reduce(moved, op))

    def native_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """The backend's own broadcast, in place."""
        if self.rank == src:
            self.traffic.count_native(nbytes(tensor) * (self.world_size - 1), 0)
        else:
            self.traffic.count_native(0, nbytes(tensor))
        self._staged(tensor, lambda moved: self._native_broadcast(moved, src))

    def reduce_metadata(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """The backend's own all-reduce of a small CPU tensor of bookkeeping (a table
        of hosts, a vote), in place and not counted as traffic. It goes wherever this
        transport moves CPU tensors: gloo beside NCCL, or staged through the GPU where
        the group has only NCCL."""
        self._staged(tensor, lambda moved: self._native_all_reduce(moved, op))

    def broadcast_metadata(self, tensor: torch.Tensor, src: int = 0) -> None:
        """The backend's own broadcast of a small CPU tensor of bookkeeping, like
        reduce_metadata."""
        self._staged(tensor, lambda moved: self._native_broadcast(moved, src))

    def _staged(self, tensor: torch.Tensor, run) -> None:
        """run(tensor) in place, on a staging copy where the backend cannot move it."""
        stage = self.staging_device(tensor)
        if stage is None:
            run(tensor)
            return
        staged = tensor.to(stage)
        run(staged)
        tensor.copy_(staged)

    def _native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _native_broadcast(self, tensor: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def enter_thread(self) -> None:
        """Called first by each thread of ours that communicates on this transport (the
        hierarchy's network thread, the Horovod engine; the bucketer's CommWorker is
        given the device): a new thread starts on GPU 0, and NCCL and CUDA's memory go by
        the thread's current GPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def duplicate(self) -> "Transport":
        """A second communicator over the same ranks whose messages never mix with ours.

        Collective: every rank must call it, in the same order. A background thread that
        communicates while the training thread does too needs its own communicator,
        just as MPI codes use MPI_Comm_dup. The duplicate counts its bytes into this
        communicator's `traffic`: it is still this rank's traffic.
        """
        twin = self._duplicate()
        twin.traffic = self.traffic
        twin.topology = self.topology
        twin.tuning, twin.tuning_source = self.tuning, self.tuning_source
        return twin

    def _duplicate(self) -> "Transport":
        raise NotImplementedError

    # --- the call check (calls.py) ------------------------------------------------------
    def checked_call(self, call: Call):
        """The context every public collective runs in (api.py): refused once the ranks
        are out of step, `call`'s signature compared across ranks, the call counted,
        and a PeerError inside named after it (calls.py)."""
        return self.calls.checked(self, call)

    @property
    def out_of_step(self) -> Optional[str]:
        """Why this communicator refuses every call (an earlier one may have left
        messages behind), or None while its ranks are in step; shm/ refuses its
        messages too."""
        return self.calls.out_of_step

    # The call board: a check without a message of its own, where a transport has one.
    def announce_call(self, row: List[int]) -> bool:
        """Publish this rank's next checked call (a row of integers) where every peer
        can read it without a message; False where this transport cannot (then the
        ranks exchange the rows in a handshake). shm/board.py can when the whole world is on
        one host. After announcing, the call runs, and then confirm_call()."""
        return False

    def confirm_call(self, timeout: Optional[float] = None) -> None:
        """After an announced call (or before it runs, for algorithms that do not wait
        on this transport's own messages): return once every rank has announced its
        own, or raise CallMismatch if any differs (PeerError if a rank has not within
        `timeout` seconds, by default the communicator's)."""
        raise NotImplementedError

    def forget_call(self) -> None:
        """The announced call ended without being confirmed (it raised)."""

    def close(self) -> None:
        """Release the backend's resources. The transport cannot be used afterwards."""

    def abort(self) -> None:
        """Give up on the communicator after a failure: like close(), but without the
        courtesies a clean end keeps, so that peers still waiting on this rank learn at
        once that it has gone (gloo closes its connections). Messages in flight may be
        lost: only for a communicator no one will use again."""
        self.close()

    @property
    def name(self) -> str:
        """The backend, plus how point-to-point bytes travel when not the backend's way
        ("gloo+shm"). Reports and `auto`'s thresholds go by it."""
        return self.backend

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.name!r}, rank={self.rank}, "
                f"world_size={self.world_size}, local_rank={self.local_rank}, "
                f"device={self.device})")
