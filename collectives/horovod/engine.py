r"""The Horovod face's engine: a background thread that negotiates collectives by name,
runs them, and shuts down with its peers.

Horovod runs collectives on a background thread, asynchronously (`allreduce_async`
returns a handle at once; `poll` and `synchronize` ask about it). The thread works in
cycles; in each one every rank tells every other what it has been asked to run, by
name, and the collectives that every rank has asked for run, in an order they all
agree on. Here the same, in small:

    caller threads                     engine thread (one per communicator), each cycle
    --------------                     -------------------------------------------------
    h = allreduce_async(t, name="a")   1. announce the names submitted since last cycle
      -> queued, handle h              2. all-gather every rank's announcement (one tiny
    poll(h) -> False                      all-reduce of their lengths, one all-gather)
    synchronize(h) ... waits           3. apply them to the table (negotiation.py): the
                                          same on every rank, so the same names are ready
                                       4. run the ready ones with our algorithms, in the
                 <--result---             table's order; fail the ones that disagree
                                       5. nothing to do anywhere: wait a little longer
                                          each idle cycle (up to the cycle time)

Names: `allreduce.<name>` for a named allreduce, `allreduce.noname.<n>` for an unnamed
one, so ranks that submit the same unnamed collectives derive the same names. Horovod's
n is its handle number, which counts every submission; here n counts the unnamed ones
only, so that named ones cannot shift the numbers on one rank and not on another: a
rank that trains one more step before join() submits more of DistributedOptimizer's
(named) buckets than its peers, and its next unnamed allreduce must still match
theirs. A name is taken from submission until its handle is synchronized: a
second submission under it is refused (ValueError), and whether it is never depends on
timing.

Process sets (process_sets.py): a collective submitted in set k is named within the
set (its unnamed ones numbered per set), announced in the same cycles as the others,
and, once every rank of set k has submitted it, run by those ranks on a group of them
over the engine's communicator (transport/group.py); the other ranks pass it by.

join() waits like any collective: rank 0's stall inspector fails it (naming the ranks
that have not joined) once no rank has joined and nothing has run for the stall
timeout.

Ending: a rank that shuts down (hvd.shutdown(), or its process ending: the engine is
stopped at exit, before the communicator closes, see launch/exit.py) says so in one
last cycle, and every rank's engine stops with it: what was waiting there fails at once
with HorovodInternalError, as does anything submitted later, instead of waiting for the
timeout. A peer that dies without a word is found by the transport (a closed connection,
or shared memory's check of its process) in the next cycle, with the same effect. An
error that concerns one collective (the ranks disagree on it, a named one stalled past
the timeout, it cannot run while a rank is joined) fails that collective only, on every
rank that submitted it, and the next one runs as usual.

Unnamed collectives never pair different calls. Three things keep every rank's n in step:
- a call refused in the caller (ops.py checks its arguments there) is announced all
  the same, under the name it would have had (`refuse`): some of a call's arguments are
  each rank's own (alltoall's splits, a tensor's dtype), so one rank may refuse a call
  its peers have made rightly and already submitted. Dropped there, the rank's next
  call would take the refused one's number and pair with the peers' refused call (they
  would get its rows, and every later call would be one off); announced, the table
  fails that call on every rank, naming the rank and why (negotiation.refusal), and the
  next call is the next one everywhere. The caller raises its own error at once; the
  name stays taken until the table settles it, and a later call under the same name
  waits for that. (Horovod refuses such a call before its coordinator hears of it, and
  its peers wait for it until the stall timeout: one rank's bad splits stop the job.)
- what the table decides about an unnamed name (it ran, with joined ranks standing in;
  it was refused because a rank is joined; the ranks disagreed on it) counts on every
  rank, submitter or not (`_count_unnamed`): a rank that was joined meanwhile then
  numbers its next unnamed call as the others do;
- an unnamed name that stalls past the stall timeout stops every rank's engine in the
  same cycle, with one line saying why (negotiation.UNNAMED_STALL), as Horovod shuts
  down once a stall passes HOROVOD_STALL_SHUTDOWN_TIME_SECONDS. Counting it on the
  ranks that did not submit it would be wrong as often as right: a rank that made a
  stray call it alone makes must be counted, a rank that is merely late and will
  submit the same call must not, and no rank can tell which. Failing that one name
  and going on (what a named collective does: its name says which call it is) would
  pair the late rank's call with the others' next one, a silently wrong number.

The engine talks over a duplicate of the communicator, so its cycles never mix with
other traffic (the script's own collectives, DDP's buckets).

One engine per communicator: `engine()` gives the current communicator's, making it on
first use (hvd.init() makes it on every rank at the same point: making one is
collective); `forget_engines()` stops them all (hvd.shutdown()). The process sets added
on an engine (process_sets.py) are entries of its table, so they go with it: their
ProcessSet objects are left without an id.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from .. import api
from ..launch.exit import stop_at_exit
from ..transport import Transport
from ..transport.group import Group
from ..world import get_comm
from .negotiation import (Message, Meta, Outcome, StallInspector, Table, scoped,
                          unnamed_number)
from .runs import shadow

log = logging.getLogger("collectives.horovod")

# Horovod's settings, read once per engine (seconds unless said otherwise)
STALL_WARNING_SECONDS = 60.0   # HOROVOD_STALL_CHECK_TIME_SECONDS
CYCLE_MS = 5.0                 # HOROVOD_CYCLE_TIME: the longest idle wait between cycles
FIRST_IDLE_WAIT = 0.0005       # an idle cycle waits this long, doubling up to CYCLE_MS


class HorovodInternalError(RuntimeError):
    """A collective failed (the name Horovod gives such errors)."""


class Handle:
    """An operation in flight: done once the engine has its result or its error."""

    def __init__(self, name: str, then: Optional[Callable[[Any], Any]] = None):
        self.name = name
        self.then = then  # what synchronize() returns, made from the result
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def finish(self, result: Any) -> None:
        self.result = result
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


# run(metas, comm): the collective itself, on the engine thread, once every rank has
# submitted the name; `metas` holds every submitting rank's Meta (allgather needs the
# others' first dimensions, alltoall their splits).
Run = Callable[[Dict[int, Meta], Transport], Any]


@dataclass
class Request:
    """One submission of this rank: its full name, its Meta, how to run it, its handle."""
    name: str
    meta: Meta
    run: Run
    handle: Handle


def _env_number(name: str, default: float) -> float:
    """A number from the environment (Horovod's settings), or `default`."""
    value = os.environ.get(name, "").strip()
    try:
        return float(value) if value else default
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


class Engine:
    """Negotiates and runs the face's collectives on one thread (see the top).

    shadow(meta, comm): this rank's part, while joined, in a collective the others run
    (an allreduce: zeros of its shape; a barrier: nothing).
    """

    def __init__(self, comm: Transport, shadow: Callable[[Meta, Transport], None]):
        self.parent = comm
        # Collective: every rank makes its engine at the same point (hvd.init()).
        self.comm = comm.duplicate() if comm.world_size > 1 else comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.shadow = shadow
        self.table = Table(comm.world_size)
        # the hvd.ProcessSet objects added on this table (process_sets.py): they lose
        # their ids when the engine is forgotten
        self.added_sets: list = []
        self.stall_timeout = _env_number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0) \
            or comm.timeout.total_seconds()
        warn_after = _env_number("HOROVOD_STALL_CHECK_TIME_SECONDS", STALL_WARNING_SECONDS)
        if os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip().lower() in ("1", "true"):
            warn_after = 0.0
        # Rank 0 watches for stalls; its decisions travel in its messages.
        self.inspector = StallInspector(warn_after, self.stall_timeout, log.warning) \
            if comm.rank == 0 else None
        self.cycle_seconds = _env_number("HOROVOD_CYCLE_TIME", CYCLE_MS) / 1000.0

        self._lock = threading.Lock()
        # notified when a refused call is settled (or the engine stops)
        self._settled = threading.Condition(self._lock)
        self._wakeup = threading.Event()      # set by each submission
        self._handles = itertools.count(1)    # handle numbers
        self._next_unnamed: Dict[int, int] = {}  # process set -> its next <n> of noname.<n>
        self.handles: Dict[int, Handle] = {}
        self.names_in_flight: set = set()
        self._refused: Dict[str, Handle] = {}  # refused here, not yet settled by the table
        self._queued: List[Request] = []      # submitted, not yet announced
        self._announced: Dict[str, Request] = {}  # announced, waiting to be ready
        self._join: Optional[Handle] = None   # join() in progress
        self._join_announced = False
        self._stopping = False                # stop() asked: announce it, then end
        self.stopped: Optional[str] = None    # why the engine no longer runs anything
        self.thread = threading.Thread(target=self._loop, name="horovod-engine", daemon=True)
        self.thread.start()
        stop_at_exit(self)

    # --- submitting (any thread) ------------------------------------------------------
    def submit(self, kind: str, name: Optional[str], meta: Meta, run: Run,
               then: Optional[Callable[[Any], Any]] = None) -> int:
        """Queue a collective for negotiation under `kind.name` (`kind.noname.<n>`
        without a name, n counting in meta's process set); return its handle number.
        synchronize() returns run's result, or then(result)."""
        with self._lock:
            number = next(self._handles)
            full = self._name_of_a_new_call(kind, name, meta.process_set)
            if self.stopped is not None:
                raise HorovodInternalError(self.stopped)
            if full in self.names_in_flight:
                raise ValueError(f"an operation named {full!r} is already in flight: "
                                 "synchronize it before reusing the name")
            self.names_in_flight.add(full)
            handle = self.handles[number] = Handle(full, then)
            self._queued.append(Request(full, meta, run, handle))
        self._wakeup.set()
        return number

    @contextlib.contextmanager
    def refusing(self, kind: str, name: Optional[str], process_set: int = 0):
        """Around the checks of one call's arguments, on the caller's thread: what they
        refuse (TypeError, ValueError, NotImplementedError) is announced (`refuse`)
        before it reaches the caller, so that the call fails on every rank and the next
        calls pair (see the top). Only the checks go inside: a call submitted is no
        longer refused in the caller."""
        try:
            yield
        except (TypeError, ValueError, NotImplementedError) as error:
            self.refuse(kind, name, process_set, str(error))
            raise

    def refuse(self, kind: str, name: Optional[str], process_set: int, why: str) -> None:
        """Announce a call this rank refused in its caller, under the name it would have
        had (an unnamed one uses up its number), its Meta saying `why`: the table fails
        that name on every rank that submits it (negotiation.refusal). Nothing here
        waits for it; the name stays taken until the table has settled it. Not
        announced: a name that this rank's earlier call, in flight, holds (the peers'
        calls pair with that one), or anything once the engine has stopped."""
        meta = Meta(kind.replace("grouped_", ""), process_set=process_set, refused=why)
        with self._lock:
            full = self._name_of_a_new_call(kind, name, process_set)
            if self.stopped is not None or full in self.names_in_flight:
                return
            self.names_in_flight.add(full)
            handle = self._refused[full] = Handle(full)
            self._queued.append(Request(full, meta, _never_run, handle))
        self._wakeup.set()

    def _name_of_a_new_call(self, kind: str, name: Optional[str], process_set: int) -> str:
        """The table's name for a call being submitted or refused (the lock held):
        `kind.name`, or `kind.noname.<n>`, n counting in the process set (counted even
        if the call is refused, as Horovod counts), scoped to the set. A refusal still
        being settled under that name was an earlier call: wait until it is."""
        if name is None:
            count = self._next_unnamed.get(process_set, 1)
            self._next_unnamed[process_set] = count + 1
            name = f"noname.{count}"
        full = scoped(f"{kind}.{name}", process_set)
        self._settled.wait_for(lambda: full not in self._refused or self.stopped is not None)
        return full

    def submit_join(self) -> int:
        """This rank has no more collectives of its own: announce it, and stand in for
        the others' allreduces until every rank has joined. The handle's result is the
        rank that joined last."""
        with self._lock:
            number = next(self._handles)
            if self.stopped is not None:
                raise HorovodInternalError(self.stopped)
            if self._join is not None:
                raise ValueError("join() is already in progress on this rank")
            self._join = self.handles[number] = Handle("join.noname")
            self._join_announced = False
        self._wakeup.set()
        return number

    def poll(self, number: int) -> bool:
        return self._handle(number).done.is_set()

    def synchronize(self, number: int) -> Any:
        """Wait for the operation; return its result or raise its error. The engine
        always finishes a handle: with a result, an error, or its own stop."""
        handle = self._handle(number)
        handle.done.wait()
        with self._lock:
            self.handles.pop(number, None)
            self.names_in_flight.discard(handle.name)
        if handle.error is not None:
            raise handle.error
        return handle.then(handle.result) if handle.then is not None else handle.result

    def _handle(self, number: int) -> Handle:
        try:
            return self.handles[number]
        except KeyError:
            raise ValueError(f"handle {number} is unknown or was already "
                             "synchronized") from None

    # --- stopping ---------------------------------------------------------------------
    def stop(self) -> None:
        """Shut down: the next cycle tells every rank, then the thread ends."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()

    def join(self, seconds: float) -> None:
        """Wait up to `seconds` for the thread to end (launch/exit.py's protocol)."""
        self.thread.join(seconds)

    def _stop_everything(self, reason: str) -> None:
        """The engine runs nothing more: fail what waits, and what comes later."""
        with self._lock:
            self.stopped = reason
            waiting = [r.handle for r in self._queued] + \
                      [r.handle for r in self._announced.values()]
            if self._join is not None:
                waiting.append(self._join)
            self._queued, self._announced, self._join = [], {}, None
            self.names_in_flight.difference_update(self._refused)
            self._refused.clear()
            self._settled.notify_all()
        for handle in waiting:
            handle.fail(HorovodInternalError(reason))

    # --- the engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        idle_cycles = 0
        self.comm.enter_thread()  # the rank's GPU, for the collectives run here
        try:
            while True:
                self._wakeup.clear()
                message = self._outgoing()
                messages = self._exchange(message)
                outcome = self.table.apply(messages, time.monotonic(), self.stall_timeout)
                if outcome.halt is not None:  # the same cycle on every rank
                    self._stop_everything(f"Horovod has been shut down: {outcome.halt}")
                    return
                if outcome.shutdown_by is not None:
                    self._fail(outcome)
                    who = ("this rank" if outcome.shutdown_by == self.rank
                           else f"rank {outcome.shutdown_by}")
                    self._stop_everything(
                        f"Horovod has been shut down: {who} shut down (hvd.shutdown(), or its "
                        "process ended); when one rank shuts down, every rank does")
                    return
                self._carry_out(outcome)
                if message or outcome.ready or outcome.errors or outcome.join_done is not None \
                        or outcome.join_failed is not None:
                    idle_cycles = 0
                    continue
                idle_cycles = min(idle_cycles + 1, 20)
                self._wakeup.wait(min(self.cycle_seconds, FIRST_IDLE_WAIT * 2 ** idle_cycles))
        except BaseException as error:  # the transport failed: a peer died or stalled
            self._stop_everything(f"Horovod has been shut down: communication with the "
                                  f"other ranks failed ({error})")
        finally:
            if self.comm is not self.parent:
                try:
                    self.comm.close()
                except Exception:  # ending anyway
                    pass

    def _outgoing(self) -> Message:
        """This rank's message for the cycle: what was submitted since the last one."""
        with self._lock:
            new, self._queued = self._queued, []
            for request in new:
                self._announced[request.name] = request
            join = self._join is not None and not self._join_announced
            if join:
                self._join_announced = True
            shutdown = self._stopping
        expired, join_expired = [], False
        if self.inspector is not None and (self.table.entries or self.table.joined):
            now = time.monotonic()
            expired = self.inspector.inspect(self.table, now)
            join_expired = self.inspector.join_stalled(self.table, now)
        return Message([(r.name, r.meta) for r in new], join, shutdown, expired, join_expired)

    def _exchange(self, message: Message) -> List[Message]:
        """Every rank's message of this cycle, in rank order.

        Two collectives: every rank's length (one tiny all-reduce), then, unless every
        message is empty, the pickled messages padded to the longest (one all-gather).
        The messages come from the job's own ranks, which trust each other as
        torch.distributed's object collectives do.
        """
        if self.world_size == 1:
            return [message]
        payload = pickle.dumps(message) if message else b""
        lengths = [row[0] for row in api.gather_rows(self.comm, [len(payload)])]
        widest = max(lengths)
        if widest == 0:
            return [Message() for _ in lengths]
        mine = torch.zeros(widest, dtype=torch.uint8)
        if payload:
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        everyone = torch.empty(self.world_size * widest, dtype=torch.uint8)
        api.all_gather(everyone, mine, comm=self.comm, check=False)
        return [pickle.loads(everyone[r * widest:r * widest + n].numpy().tobytes())
                if n else Message() for r, n in enumerate(lengths)]

    def _count_unnamed(self, name: str) -> None:
        """An unnamed collective that the table ran or failed counts on every rank,
        whether this rank submitted it or not: after join() (the others' allreduces ran
        without this rank; their broadcast, allgather or add_process_set was refused
        while it was joined) this rank's next unnamed call gets the number theirs does.
        Sound because every such outcome is final for the ranks that did not submit: a
        joined rank makes no call of its own until every rank has joined, by which time
        the others are past it. (A name that stalled is another matter: the missing
        ranks may yet submit it, so the engines stop instead, see negotiation.py.)"""
        number = unnamed_number(name)
        if number is not None:
            process_set, n = number
            with self._lock:
                self._next_unnamed[process_set] = max(self._next_unnamed.get(process_set, 1),
                                                      n + 1)

    def _fail(self, outcome: Outcome) -> None:
        for name, _ranks, why in outcome.errors:
            self._count_unnamed(name)
            with self._lock:
                request = self._announced.pop(name, None)
                if request is not None and request.meta.refused is not None:
                    self._refused.pop(name, None)  # settled: the name is free again
                    self.names_in_flight.discard(name)
                    self._settled.notify_all()
            if request is not None:
                request.handle.fail(HorovodInternalError(why))

    def _scope(self, process_set: int, metas: Dict[int, Meta]):
        """Where a ready collective runs: the engine's communicator for the global set;
        for another, the group of its ranks (every one of them submitted it), with the
        Metas keyed by rank in the group."""
        if process_set == 0:
            return self.comm, metas
        members = sorted(metas)
        return Group(self.comm, members), {i: metas[r] for i, r in enumerate(members)}

    def _carry_out(self, outcome: Outcome) -> None:
        """Fail what failed, run what is ready (in the table's order), end join()."""
        self._fail(outcome)
        for name, metas in outcome.ready:
            self._count_unnamed(name)
            with self._lock:
                request = self._announced.pop(name, None)
            if request is None:
                meta = next(iter(metas.values()))
                if meta.process_set == 0:  # joined: this rank stands in
                    self.shadow(meta, self.comm)
                continue  # (another set's: its ranks run it)
            try:
                comm, metas = self._scope(request.meta.process_set, metas)
                result = request.run(metas, comm)
            except Exception as error:
                # Peers may be inside this collective on the engine's communicator, or
                # past it: this rank can no longer tell which message comes next (out
                # of memory mid-call, a tensor resized after submission, a peer lost).
                # The engine stops; the transport tells the peers.
                request.handle.fail(HorovodInternalError(f"{name}: {error}"))
                raise
            else:
                request.handle.finish(result)
        if outcome.join_done is not None:
            with self._lock:
                handle, self._join = self._join, None
            if handle is not None:
                handle.finish(outcome.join_done)
        if outcome.join_failed is not None and self.rank in outcome.join_failed[0]:
            with self._lock:  # (a join() submitted since is not in the table yet)
                handle, self._join = self._join, None
            if handle is not None:
                handle.fail(HorovodInternalError(outcome.join_failed[1]))


def _never_run(metas: Dict[int, Meta], comm: Transport) -> Any:
    """The run of a refused call: the table fails a refused name, it never runs it."""
    raise AssertionError("a refused call was found ready")


# --- one engine per communicator ----------------------------------------------------------
_engines: Dict[int, Engine] = {}  # id(communicator) -> its engine


def engine() -> Engine:
    """The engine of the current communicator, made on first use (hvd.init() makes it:
    making one is collective, every rank at the same point)."""
    comm = get_comm()
    found = _engines.get(id(comm))
    if found is None or found.parent is not comm:
        if found is not None:  # the engine of a closed communicator whose id was reused
            found.stop()
            _drop_process_sets(found)
        found = _engines[id(comm)] = Engine(comm, shadow)
    return found


def forget_engines(wait_seconds: float = 10.0) -> None:
    """Stop every engine, telling the other ranks (hvd.shutdown()); the process sets
    added go with them."""
    for each in _engines.values():
        each.stop()
    for each in _engines.values():
        each.join(wait_seconds)
        _drop_process_sets(each)
    _engines.clear()


def _drop_process_sets(each: Engine) -> None:
    """The process sets added on an engine that is gone: their objects lose their ids,
    as Horovod leaves them after shutdown."""
    for process_set in each.added_sets:
        process_set._invalidate()
    each.added_sets.clear()
