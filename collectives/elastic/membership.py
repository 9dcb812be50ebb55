"""Who is in the job, generation by generation: the list an elastic job agrees on.

A job that goes on after losing a host needs one thing no rank can hold: the list of
who is in. It lives in a key-value store outside the ranks (a torch TCPStore hosted by
a small service of its own, `python -m collectives.elastic.store`), and every change of
membership is a new *generation*:

    generation 0: [a, b, c, d]      ranks 0-3
    c dies; a, b and d register for generation 1
    generation 1: [a, b, d]         ranks 0-2: survivors keep their order
    e starts, and registers for generation 2
    generation 2: [a, b, d, e]      a newcomer comes last

Registering for generation g takes a slot: i = add("g/count", 1) - 1, then
set("g/slot/i", my id). The generation's list is written once (compare_set on
"g/members") by whichever registered member first sees the generation complete:

    at least min_ranks have registered, and
    every member of generation g-1 has registered or is dead, and
    no one has registered for `settle` seconds (newcomers starting together join together)

Dead means its heartbeat stopped. Each member runs a thread that adds 1 to "beat/<id>"
every `beat` seconds; a counter that has not moved for `dead_after` seconds, by the
watcher's own clock, is a dead member (so the hosts' clocks need not agree). The same
thread reads the counters of the other members of its generation at every beat, so a
member that stopped beating while the others were still inside a step (a cut link,
found only at the transport's timeout) is known dead as soon as they ask, not
`dead_after` later. Registering, and waiting for a list, are beats too: a member back
from a cut link may get there before its heartbeat thread reaches the store again. A
member still blocked in a collective that a dead peer never finished is alive, and is
waited for: it registers as soon as its own call fails (the transport's timeout at
most).

A member that registered after the list was written is not in it; it registers for the
next generation, and the members learn of it at their next step boundary
(`newcomers()`), when they all move on to a generation that includes it.

Failure modes, named:
- The store is one process. If it dies, membership can no longer change: the next
  change (or any member waiting on one) raises MembershipError naming the store. A
  generation that is running trains on, as its communicator needs no store.
- Fewer than min_ranks members for `timeout` seconds: every member waiting raises
  MembershipError saying how many are left.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..launch.exit import stop_at_exit


class MembershipError(RuntimeError):
    """Membership cannot go on: the store is unreachable, or too few members are left."""


class JobFinished(MembershipError):
    """The job was marked finished (Membership.finish): there is nothing to join."""


class Heartbeat:
    """A thread that calls `beat()` every `every` seconds until stop(). It is stopped at
    exit too (launch/exit.py): the interpreter's shutdown would end it inside a store
    call, and that aborts the process."""

    def __init__(self, beat: Callable[[], None], every: float):
        self.beat, self.every = beat, every
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="membership heartbeat",
                                       daemon=True)
        self.thread.start()
        stop_at_exit(self)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.beat()
            self.stopping.wait(self.every)

    def stop(self) -> None:
        self.stopping.set()

    def join(self, seconds: float) -> None:
        self.thread.join(seconds)


@dataclass(frozen=True)
class View:
    """One generation as one member sees it."""
    generation: int
    members: Tuple[str, ...]  # member ids, in rank order
    me: str

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)


RECONNECT_SECONDS = 5.0  # a quick call that failed connects again at most this often
STORE_ID_KEY = "store id"  # a random value the first member writes: the store's identity


def _key(generation: int, name: str) -> str:
    return f"generation {generation}/{name}"


class Membership:
    """One member's handle on the store: join a generation, notice newcomers, leave.

        membership = Membership("10.0.0.1", 29400, member_id="node2/4711", min_ranks=2)
        view = membership.join(expected=4)     # the first generation: wait for 4
        ...                                     # a peer fails:
        view = membership.join()               # the next generation, with whoever is left
        membership.leave()                     # done: stop the heartbeat
    """

    def __init__(self, host: str, port: int, member_id: str, min_ranks: int = 1,
                 max_ranks: Optional[int] = None, timeout: float = 300.0,
                 settle: float = 1.0, beat: float = 0.5, dead_after: float = 5.0):
        if min_ranks < 1 or (max_ranks is not None and max_ranks < min_ranks):
            raise ValueError(f"need 1 <= min_ranks <= max_ranks, got {min_ranks}, {max_ranks}")
        self.host, self.port, self.me = host, port, member_id
        self.min_ranks, self.max_ranks = min_ranks, max_ranks
        self.timeout, self.settle, self.beat, self.dead_after = timeout, settle, beat, dead_after
        self.store = self._connect()
        self.store_id = self._store_id(self.store)  # a restarted store is another store
        self.view: Optional[View] = None
        # member -> (its beat counter, when we last saw it move): by the heartbeat
        # thread for the generation's members, and by whoever waits for a list
        self._seen: Dict[str, Tuple[int, float]] = {}
        self._seen_lock = threading.Lock()
        self._heart_store: Optional[dist.TCPStore] = None  # the heartbeat's own connection
        self._heart = Heartbeat(self._beat, self.beat)

    # --- the store --------------------------------------------------------------------

    def _connect(self) -> dist.TCPStore:
        try:
            return dist.TCPStore(self.host, self.port, is_master=False,
                                 timeout=timedelta(seconds=max(self.dead_after, 1.0)))
        except RuntimeError as error:
            raise self._lost(error) from None

    def _store_id(self, store: dist.TCPStore) -> bytes:
        """The store's identity: a random value its first member writes. A store that
        lost its keys (restarted) gets another one, so a member can tell."""
        try:
            return store.compare_set(STORE_ID_KEY, "", secrets.token_hex(8))
        except RuntimeError as error:
            raise self._lost(error) from None

    def _lost(self, error: Exception) -> MembershipError:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return MembershipError(f"the membership store at {self.host}:{self.port} does not "
                               f"answer ({first}): membership can no longer change")

    def _call(self, method: str, *args, retry: bool = True):
        """One store call. A lost connection (this host's link was cut and has come
        back) is made again, for up to `timeout` seconds; then MembershipError. Calls
        that count (add of 1) are not repeated (`retry=False`): their first try may have
        counted. A store that answers again but is not the one we knew (restarted, so
        empty) is MembershipError at once."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return getattr(self.store, method)(*args)
            except RuntimeError as error:  # DistStoreError, DistNetworkError
                if not retry or time.monotonic() >= deadline:
                    raise self._lost(error) from None
            time.sleep(min(self.beat, 1.0))
            try:
                store = self._connect()
            except MembershipError:
                continue  # not yet: try again until the deadline
            if self._store_id(store) != self.store_id:
                raise MembershipError(f"the membership store at {self.host}:{self.port} "
                                      "was restarted: it no longer knows the job's members")
            self.store = store

    def _beat(self) -> None:
        """One beat, on the heartbeat thread's connection (a client is one socket): add 1
        to our counter and read the others'. A store that cannot be reached is
        connected again at the next beat."""
        try:
            self._heart_store = store = self._heart_store or self._connect()
            store.add(f"beat/{self.me}", 1)
            others = [m for m in (self.view.members if self.view else ()) if m != self.me]
            if others:  # watched all along (the module docstring), in one round trip
                counters = store.multi_get([f"beat/{m}" for m in others])
                seen_at = time.monotonic()
                for member, counter in zip(others, counters):
                    self._moved(member, int(counter), seen_at)
        except (RuntimeError, MembershipError):
            self._heart_store = None  # unreachable for now; the others may take us for dead

    def _moved(self, member: str, counter: int, now: float) -> bool:
        """Note `member`'s beat counter as read at `now`; True if it moved since the
        last read (or was never read: it counts as moving now)."""
        with self._seen_lock:
            seen = self._seen.get(member)
            if seen is None or counter > seen[0]:  # an older read, applied late, is not news
                self._seen[member] = (counter, now)
                return True
            return False

    # --- generations ------------------------------------------------------------------

    def latest(self) -> int:
        """The last generation whose list was written (-1: none yet). The "latest"
        counter is a hint (a closer may die before it counts its generation): the lists
        written after it are found by looking."""
        generation = self._call("add", "latest", 0) - 1
        while self._call("check", [_key(generation + 1, "members")]):
            generation += 1
        return generation

    def members_of(self, generation: int) -> Optional[List[str]]:
        """The list of `generation`, or None while it is open."""
        if not self._call("check", [_key(generation, "members")]):
            return None
        return json.loads(self._call("get", _key(generation, "members")))["members"]

    def newcomers(self) -> int:
        """How many of those registered for the generation after ours it has places for
        (max_ranks); one read. Members call it at a step boundary, all alike (rank 0
        reads, and says). The store not answering is 0 newcomers, not an error: a
        running generation needs no store, and must not stall on one."""
        assert self.view is not None, "join() first"
        try:
            waiting = self.store.add(_key(self.view.generation + 1, "count"), 0)
        except RuntimeError:
            self._reconnect_now_and_then()
            return 0
        if self.max_ranks is not None:
            waiting = min(waiting, max(self.max_ranks - self.view.world_size, 0))
        return waiting

    def _reconnect_now_and_then(self) -> None:
        """After a failed quick call: connect again, at most every few seconds, so that
        newcomers are seen again once the store answers."""
        now = time.monotonic()
        if now - getattr(self, "_last_reconnect", 0.0) < RECONNECT_SECONDS:
            return
        self._last_reconnect = now
        try:
            store = self._connect()
            if self._store_id(store) == self.store_id:
                self.store = store
        except MembershipError:
            pass

    def finish(self) -> None:
        """Mark the job done: a member that registers from now on is told so, instead
        of waiting for members that have left and then training alone."""
        self._call("set", "finished", "1")

    def join(self, expected: Optional[int] = None) -> View:
        """Register for the next generation and wait until its list is written; if it
        was written without us (we came too late), the one after. `expected` (the
        first generation: the launcher's world size): wait for that many, or for
        `timeout` and then go on with those there (at least min_ranks), instead of
        closing once registrations are quiet for `settle`. Returns our view of the
        generation we are in."""
        generation = (self.view.generation if self.view else self.latest()) + 1
        while True:
            if self._call("check", ["finished"]):
                raise JobFinished("the job has finished: there is nothing to join")
            self._register(generation)
            members = self._wait_for_list(generation, expected)
            if self.me in members:
                self.view = View(generation, tuple(members), self.me)
                return self.view
            generation += 1  # closed before we registered: the next one

    def leave(self) -> None:
        """Stop the heartbeat: the others will take us for dead after dead_after."""
        self._heart.stop()
        self._heart.join(self.beat + 5.0)


    def _register(self, generation: int) -> None:
        """Take a slot and write our id in it. A failed try is made again (for up to
        `timeout`) only if our id is not registered yet: the count may have moved."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                # a beat of our own first: a member coming back (its link was cut) may
                # register before its heartbeat thread reaches the store again, and the
                # others, who watched it fall silent, would take it for dead
                self._call("add", f"beat/{self.me}", 1, retry=False)
                slot = self._call("add", _key(generation, "count"), 1, retry=False) - 1
                self._call("set", _key(generation, f"slot/{slot}"), self.me)
                return
            except MembershipError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(min(self.beat, 1.0))
            if self.me in self._registered(generation)[1]:  # reconnects as it reads
                return

    def _registered(self, generation: int) -> Tuple[int, List[str]]:
        """(slots taken, who has registered for `generation` in the order they did). A
        slot is taken
        before its id is written: one not written yet is left out this time (its count
        has just changed, so the generation is not quiet and will not close without it;
        a member that died in between is left out for good)."""
        count = self._call("add", _key(generation, "count"), 0)
        registered: List[str] = []
        for slot in (_key(generation, f"slot/{i}") for i in range(count)):
            if self._call("check", [slot]):
                member = self._call("get", slot).decode()
                if member not in registered:  # one id, one place (a retried register)
                    registered.append(member)
        return count, registered

    def _wait_for_list(self, generation: int, expected: Optional[int]) -> List[str]:
        """Poll until generation's list is written; write it ourselves once complete."""
        last_count, last_change = -1, time.monotonic()
        short_since: Optional[float] = None
        first_seen = last_beat = time.monotonic()
        while True:
            if time.monotonic() - last_beat >= self.beat:  # waiting is beating too, for
                self._call("add", f"beat/{self.me}", 1)    # a heartbeat thread still
                last_beat = time.monotonic()               # reconnecting
            written = self.members_of(generation)
            if written is not None:
                return written
            if self._call("check", ["finished"]):
                raise JobFinished("the job has finished: there is nothing to join")
            previous = self.members_of(generation - 1) if generation > 0 else []
            if previous is None:  # the one before is still open: it closes first
                if time.monotonic() - first_seen > self.timeout:
                    raise MembershipError(f"generation {generation - 1} stayed open for "
                                          f"{self.timeout:g} s: its members never agreed")
                time.sleep(0.05)
                continue
            count, registered = self._registered(generation)
            now = time.monotonic()
            if count != last_count:  # a slot taken, its id maybe not written yet
                last_count, last_change = count, now
            # registered, but dead since: not in the list (its communicator would wait)
            registered = [m for m in registered if not self._dead(m)]
            missing = [m for m in previous if m not in registered and not self._dead(m)]
            enough = len(registered) >= self.min_ranks
            if expected is not None:  # all the launcher started; after `timeout`, those here
                quiet = len(registered) >= expected or now - first_seen > self.timeout
            else:
                quiet = now - last_change >= self.settle
            if enough and not missing and quiet:
                self._close(generation, registered, previous)
                continue  # read back what was written (ours, or another closer's)
            if not missing and not enough:  # everyone accounted for, and too few
                short_since = short_since or now
                if now - short_since > self.timeout:
                    raise MembershipError(
                        f"generation {generation}: {len(registered)} member(s) left, fewer "
                        f"than the {self.min_ranks} needed (min_ranks), for "
                        f"{self.timeout:g} s: the job cannot go on")
            else:
                short_since = None
            time.sleep(0.05)

    def _dead(self, member: str) -> bool:
        """Its counter, read now, has not moved for dead_after (by our clock, read after
        the counter: a slow read must not age what it reads)."""
        counter = self._call("add", f"beat/{member}", 0)
        now = time.monotonic()
        if self._moved(member, counter, now):
            return False
        with self._seen_lock:
            return now - self._seen[member][1] >= self.dead_after

    def _close(self, generation: int, registered: List[str], previous: List[str]) -> None:
        """Write generation's list, once: survivors in their old order, then newcomers
        in the order they registered; at most max_ranks (the rest wait for the next)."""
        order = {member: index for index, member in enumerate(previous)}
        members = sorted(registered, key=lambda m: (order.get(m, len(order)), registered.index(m)))
        if self.max_ranks is not None:
            members = members[:self.max_ranks]
        ours = json.dumps({"members": members, "written_by": self.me})
        written = self._call("compare_set", _key(generation, "members"), "", ours)
        if written.decode() == ours:  # ours was written: one more generation (a hint)
            try:
                self._call("add", "latest", 1, retry=False)
            except MembershipError:
                pass  # latest() finds the list anyway
