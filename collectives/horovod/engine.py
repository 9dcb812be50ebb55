r"""The Horovod face's engine: one background thread that runs every collective, in order.

Horovod runs collectives on a background thread, asynchronously (`allreduce_async`
returns a handle at once; `poll` and `synchronize` ask about it), and before each one
the ranks *negotiate*: they tell each other what they are about to run, so that a
mismatch becomes an error instead of a hang, and so that a rank that has called
`join()` can stand in for the collectives it will never call itself.

Here the same, in small:

    caller thread                      engine thread (one per communicator)
    -------------                      ------------------------------------
    h = allreduce_async(t)  --job-->   negotiate: every rank's row, one tiny all-reduce
    poll(h)  -> False                  check the rows agree (else: error on every rank)
    synchronize(h) ... waits           run the collective with our algorithms
                 <--result--           mark h done

Jobs run one at a time in submission order, so every rank must submit its collectives
in the same order (Horovod matches them by name instead; here a name only guards
against reusing one that is still in flight).

A negotiation row describes one call:

    [joined, kind, dtype, ndim, first dim, checksum of the other dims, numel, op, root,
     algorithm]

`joined` is 1 for a rank inside join(): it runs no collective of its own and, round
after round, does what the others' rows say: an allreduce with zeros of their shape
(its contribution, as in Horovod), nothing for collectives that cannot take part
(those raise on the callers). When every row says joined, join() returns the rank
that joined last.
"""
from __future__ import annotations

import itertools
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from .. import api
from ..bucketer import CommWorker
from ..transport import Transport

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
OPS = ("sum", "avg", "min", "max", "product")
DTYPES = api.SUPPORTED_DTYPES
ALGORITHMS = list(api.ALGORITHM_IDS)


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank (the name Horovod gives such errors)."""


@dataclass
class Call:
    """What one rank is about to run: the fields of its negotiation row."""
    kind: str
    tensor: Optional[torch.Tensor] = None
    op: Optional[str] = None
    root: int = -1
    algorithm: str = "auto"

    def row(self, joined: bool) -> List[int]:
        if self.tensor is None:
            shape, dtype = (), -1
        else:
            shape, dtype = tuple(self.tensor.shape), DTYPES.index(self.tensor.dtype)
        first = shape[0] if shape else 1
        rest = zlib.crc32(repr(shape[1:]).encode())
        numel = 0 if self.tensor is None else self.tensor.numel()
        return [int(joined), KINDS.index(self.kind), dtype, len(shape), first, rest, numel,
                OPS.index(self.op) if self.op else -1, self.root,
                ALGORITHMS.index(self.algorithm)]


@dataclass
class Rows:
    """Every rank's negotiation row, with the questions the engine asks of them."""
    table: List[List[int]]

    @property
    def joined(self) -> List[int]:
        return [rank for rank, row in enumerate(self.table) if row[0]]

    @property
    def active(self) -> List[int]:
        return [rank for rank, row in enumerate(self.table) if not row[0]]

    def first_dims(self) -> List[int]:
        return [row[4] for row in self.table]

    def check(self) -> None:
        """Raise (identically on every rank) unless the active ranks agree."""
        active = self.active
        if not active:
            return
        first = self.table[active[0]]
        kind = KINDS[first[1]]

        def describe(rank: int) -> str:
            row = self.table[rank]
            dtype = str(DTYPES[row[2]]).replace("torch.", "") if row[2] >= 0 else "-"
            return (f"rank {rank} called {KINDS[row[1]]} (dtype {dtype}, {row[3]} dims, "
                    f"first dim {row[4]}, {row[6]} elements"
                    + (f", op {OPS[row[7]]}" if row[7] >= 0 else "")
                    + (f", root {row[8]}" if row[8] >= 0 else "") + ")")

        for rank in active[1:]:
            row = self.table[rank]
            same = {
                "kind": row[1] == first[1],
                "dtype": row[2] == first[2],
                "dims": row[3] == first[3] and row[5] == first[5],
                # allgather and alltoall may differ in the first dimension, nothing else
                "first dim": row[4] == first[4] or kind in ("allgather", "alltoall"),
                "op": row[7] == first[7],
                "root": row[8] == first[8],
                "algorithm": row[9] == first[9],
            }
            wrong = [what for what, ok in same.items() if not ok]
            if wrong:
                raise HorovodInternalError(
                    f"{kind}: the ranks disagree on {', '.join(wrong)}: "
                    f"{describe(active[0])}; {describe(rank)}")
        if self.joined and kind not in ("allreduce", "barrier"):
            raise HorovodInternalError(
                f"{kind}: rank(s) {self.joined} have called join(); while a rank is joined "
                "only allreduce can run (as in Horovod)")


class Handle:
    """An operation in flight: `poll()` without blocking, `wait()` for its result."""

    def __init__(self, name: Optional[str]):
        self.name = name
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None


class Engine:
    """Runs the face's collectives on one thread, negotiated, in submission order."""

    def __init__(self, comm: Transport):
        self.comm = comm
        self.worker = CommWorker()
        self.handles: Dict[int, Handle] = {}
        self.names_in_flight: set = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.last_rows: Optional[Rows] = None  # the previous round, for join()'s answer

    # --- submitting -------------------------------------------------------------------
    def submit(self, job: Callable[[], Any], name: Optional[str] = None,
               kind: str = "op") -> int:
        """Queue `job` (it runs on the engine thread); return its handle number.

        Horovod refuses a second operation of a kind under the name of one in flight.
        Here a name stays taken until its handle is synchronized (not merely until the
        operation ends), so whether a reuse is refused never depends on timing.
        """
        if name is not None:
            name = f"{kind}.{name}"
        with self._lock:
            if name is not None:
                if name in self.names_in_flight:
                    raise ValueError(f"an operation named {name!r} is already in flight: "
                                     "synchronize it before reusing the name")
                self.names_in_flight.add(name)
            handle_id = next(self._ids)
            handle = self.handles[handle_id] = Handle(name)

        def run() -> None:
            try:
                handle.result = job()
            except BaseException as error:  # handed to whoever synchronizes
                handle.error = error
            finally:
                handle.done.set()
        self.worker.submit(run)
        return handle_id

    def poll(self, handle_id: int) -> bool:
        return self._handle(handle_id).done.is_set()

    def synchronize(self, handle_id: int) -> Any:
        handle = self._handle(handle_id)
        handle.done.wait()
        with self._lock:
            del self.handles[handle_id]
            self.names_in_flight.discard(handle.name)
        if handle.error is not None:
            raise handle.error
        return handle.result

    def run(self, job: Callable[[], Any], name: Optional[str] = None,
            kind: str = "op") -> Any:
        """Submit and wait: the synchronous collectives."""
        return self.synchronize(self.submit(job, name, kind))

    def _handle(self, handle_id: int) -> Handle:
        try:
            return self.handles[handle_id]
        except KeyError:
            raise ValueError(f"handle {handle_id} is unknown or was already "
                             "synchronized") from None

    # --- on the engine thread -----------------------------------------------------------
    def negotiate(self, call: Call, joined: bool = False) -> Rows:
        """One round: every rank's row for the call it is about to make."""
        rows = Rows(api.gather_rows(self.comm, call.row(joined)))
        if rows.active:
            self.last_rows = rows
        return rows

    def join(self, shadow_allreduce: Callable[[List[int]], None]) -> int:
        """This rank has no more collectives: stand in for the others' until all join.

        Each round, an allreduce the others run is matched with zeros of its shape
        (`shadow_allreduce(row)`); other collectives raise on their callers. Returns the
        rank that joined last (the highest, if several joined in the same round).
        """
        previous = self.last_rows
        while True:
            rows = Rows(api.gather_rows(self.comm, Call("barrier").row(joined=True)))
            if not rows.active:
                break
            previous = rows
            try:
                rows.check()
            except HorovodInternalError:
                continue  # the callers raise; nothing runs
            row = rows.table[rows.active[0]]
            if KINDS[row[1]] == "allreduce":
                shadow_allreduce(row)
            elif KINDS[row[1]] == "barrier":
                self.comm.barrier()
        self.last_rows = None
        if previous is None:
            return self.comm.world_size - 1
        last = previous.active  # still running in the round before everyone had joined
        return max(last) if last else self.comm.world_size - 1

    def close(self) -> None:
        self.worker.stop()
