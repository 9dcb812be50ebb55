"""NCCL's ordering rules, simulated on the CPU: find the algorithms that would hang on GPUs.

NCCL runs each rank's postings in order on one stream: every `batch_isend_irecv` is one
NCCL group, and a group starts only once the one before it on that rank has ended. A
send or receive of the running group completes when its partner (the k-th receive of
`dst` from `src` for the k-th send of `src` to `dst`) is in the group running on the
partner's rank; a group ends when all of its operations have. Nothing is buffered: a
send waits for its receive, as a large NCCL message does.

    world = OrderedWorld(4)
    comms = [SimulatedNccl(world, rank) for rank in range(4)]   # one thread each

An algorithm that posts a receive ahead of its step (its group then blocks the
stream, and with it the send the peer is waiting for) stops making progress: when
every thread still running (the ranks' and those they start) is waiting and
nothing can complete, `wait()` raises Deadlock on every rank instead of hanging. Data moves for real (copied when the
operations meet), so results can be checked too. A duplicate is a communicator of its
own: another NCCL communicator, with its own stream.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from datetime import timedelta
from typing import Dict, List, Tuple

import torch

from collectives.transport.base import Handle, PeerError, Transport


class Deadlock(PeerError):
    """Every rank still running waits, and no posted operation can complete."""


class _Op:
    def __init__(self, kind: str, rank: int, peer: int, tensor: torch.Tensor, number: int):
        self.kind, self.rank, self.peer, self.tensor = kind, rank, peer, tensor
        self.number = number  # the k-th of its kind between these two ranks, this way
        self.done = False

    def partner_of(self, other: "_Op") -> bool:
        return (other.kind != self.kind and other.rank == self.peer
                and other.peer == self.rank and other.number == self.number)


class _Group:
    def __init__(self, ops: List[_Op]):
        self.ops = ops
        self.done = False


class OrderedWorld:
    """The streams of one communicator (and, through `twin`, of its duplicates)."""

    def __init__(self, world_size: int, threads: "ThreadCount" = None):
        self.world_size = world_size
        self.streams: List[deque] = [deque() for _ in range(world_size)]
        self.numbers: Dict[Tuple[str, int, int], int] = defaultdict(int)
        self.threads = threads or ThreadCount(world_size)
        self.twins: Dict[int, "OrderedWorld"] = {}
        self.lock = self.threads.lock  # one lock over every stream of every duplicate

    def twin(self, index: int) -> "OrderedWorld":
        """The index-th duplicate (every rank asks in the same order)."""
        with self.lock:
            if index not in self.twins:
                self.twins[index] = OrderedWorld(self.world_size, self.threads)
                self.threads.worlds.append(self.twins[index])
            return self.twins[index]

    def post(self, rank: int, ops: List[Tuple[str, int, torch.Tensor]]) -> _Group:
        with self.lock:
            self.threads.register()
            self.threads.last_change = time.monotonic()
            numbered = []
            for kind, peer, tensor in ops:
                key = (kind, rank, peer)
                numbered.append(_Op(kind, rank, peer, tensor, self.numbers[key]))
                self.numbers[key] += 1
            group = _Group(numbered)
            self.streams[rank].append(group)
            self.threads.progress()
            return group

    def progress(self) -> bool:
        """Complete what can complete; True if anything did."""
        moved = False
        for rank, stream in enumerate(self.streams):
            if not stream:
                continue
            for op in stream[0].ops:
                if op.done or not self.streams[op.peer]:
                    continue
                partner = next((other for other in self.streams[op.peer][0].ops
                                if not other.done and op.partner_of(other)), None)
                if partner is None:
                    continue
                send, recv = (op, partner) if op.kind == "send" else (partner, op)
                if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
                    raise AssertionError(f"rank {send.rank} sends {tuple(send.tensor.shape)} "
                                         f"{send.tensor.dtype} where rank {recv.rank} receives "
                                         f"{tuple(recv.tensor.shape)} {recv.tensor.dtype}")
                recv.tensor.copy_(send.tensor)
                op.done = partner.done = True
                moved = True
        for stream in self.streams:
            while stream and all(op.done for op in stream[0].ops):
                stream.popleft().done = True
                moved = True
        return moved


class ThreadCount:
    """The threads that post (every rank's, and any a rank starts, such as hierarchical's
    network thread), over every duplicate: who is still running, who waits.

    Stuck means: every such thread that is alive waits, none of the groups they wait
    on is done, and nothing has changed for a while (a thread between its last wait
    and its next post is alive and not waiting, so it counts as running)."""

    QUIET_SECONDS = 0.5

    def __init__(self, world_size: int):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.threads: List[threading.Thread] = []  # every thread that has posted
        self.waiting: Dict[threading.Thread, _Group] = {}
        self.finished_ranks = 0
        self.worlds: List[OrderedWorld] = []
        self.deadlock = None
        self.last_change = time.monotonic()

    def register(self) -> None:
        """The calling thread posts: count it (rank threads register as they start)."""
        with self.lock:
            me = threading.current_thread()
            if me not in self.threads:
                self.threads.append(me)

    def progress(self) -> None:
        while any([world.progress() for world in self.worlds]):
            self.last_change = time.monotonic()
        self.changed.notify_all()

    def _stuck(self) -> bool:
        alive = [thread for thread in self.threads if thread.is_alive()]
        return (all(thread in self.waiting for thread in alive)
                and not any(group.done for group in self.waiting.values())
                and time.monotonic() - self.last_change > self.QUIET_SECONDS)

    def wait(self, group: _Group, rank: int, what: str) -> None:
        me = threading.current_thread()
        with self.lock:
            self.register()
            self.waiting[me] = group
            self.last_change = time.monotonic()
            try:
                while True:
                    self.progress()
                    if group.done:
                        return
                    if self.deadlock is None and self._stuck():
                        self.deadlock = (f"deadlock: every running thread waits and no "
                                         f"operation can complete (rank {rank}: {what})")
                        self.changed.notify_all()
                    if self.deadlock:
                        raise Deadlock(self.deadlock)
                    self.changed.wait(timeout=0.1)
            finally:
                del self.waiting[me]
                self.last_change = time.monotonic()

    def finished(self) -> None:
        """A rank's thread has ended: it posts nothing more."""
        with self.lock:
            self.last_change = time.monotonic()
            self.changed.notify_all()


class _SimHandle(Handle):
    def __init__(self, world: OrderedWorld, group: _Group, rank: int, what: str):
        self.world, self.group, self.rank, self.what = world, group, rank, what

    def wait(self) -> None:
        self.world.threads.wait(self.group, self.rank, self.what)

    def test(self) -> bool:
        with self.world.lock:
            self.world.threads.progress()
            return self.group.done


class SimulatedNccl(Transport):
    """A rank of an OrderedWorld: point-to-point under NCCL's ordering, nothing native."""

    backend = "nccl"
    device_tensors_ok = True
    step_by_step = True
    native_collectives = False

    def __init__(self, world: OrderedWorld, rank: int):
        super().__init__(rank, world.world_size, rank, torch.device("cpu"),
                         timedelta(seconds=60))
        self.world = world
        self.duplicates = 0

    @property
    def name(self) -> str:
        return "simulated-nccl"

    def _post(self, ops, what: str) -> Handle:
        return _SimHandle(self.world, self.world.post(self.rank, ops), self.rank, what)

    def _isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        return self._post([("send", dst, tensor)], f"send to {dst}")

    def _irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        return self._post([("recv", src, tensor)], f"receive from {src}")

    def exchange(self, sends, receives) -> None:
        ops = ([("recv", src, self._incoming(t, src, "exchange")) for t, src in receives]
               + [("send", dst, self._outgoing(t, dst, "exchange")) for t, dst in sends])
        if ops:
            self._post(ops, "exchange").wait()

    def _duplicate(self) -> "SimulatedNccl":
        self.duplicates += 1
        return SimulatedNccl(self.world.twin(self.duplicates), self.rank)


def run_ranks(world_size: int, function, *args) -> list:
    """function(comm, *args) on every rank of a simulated NCCL world, a thread each;
    the results in rank order. A rank's exception (a Deadlock, say) is raised here."""
    threads = ThreadCount(world_size)
    world = OrderedWorld(world_size, threads)
    threads.worlds.append(world)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def main(rank: int) -> None:
        threads.register()
        try:
            results[rank] = function(SimulatedNccl(world, rank), *args)
        except BaseException as error:
            errors[rank] = error
        finally:
            threads.finished()

    workers = [threading.Thread(target=main, args=(rank,), daemon=True)
               for rank in range(world_size)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        if worker.is_alive():
            raise TimeoutError("a simulated rank did not finish within 120 s")
    first = next((error for error in errors if error is not None), None)
    if first is not None:
        raise first
    return results
