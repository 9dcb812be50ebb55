r"""Negotiation by name, as Horovod's coordinator does it: what the ranks agree on before
a collective runs, kept as a table that is the same on every rank.

Horovod matches collectives by *name*, not by the order they are called in. A rank
submits `allreduce.grad.fc.weight` when its hook fires; another rank may submit its
tensors in another order. The collective runs once every rank has submitted that name,
and the ranks then run the ready collectives in one agreed order.

Here every rank announces, once per cycle of its engine (engine.py), the names it was
given since the last cycle, each with a `Meta` (kind, dtypes, shapes, op, root, ...).
Every rank receives every rank's announcements of the cycle and applies them to its
`Table`, in rank order:

    cycle 7   rank 0 announces  allreduce.b   allreduce.a
              rank 1 announces  allreduce.a
    table     allreduce.b: {0}          waiting for rank 1
              allreduce.a: {0, 1}       ready -> runs now, on both ranks
    cycle 8   rank 1 announces  allreduce.b
    table     allreduce.b: {0, 1}       ready -> runs now

Since every rank applies the same messages in the same order, every table is the
same, so every rank finds the same names ready in the same order (the order in which
they were first announced) without a coordinator deciding it. What a rank decides on
its own clock (the stall inspector below) is made by rank 0 alone and travels in its
next message, so that it, too, reaches every table at the same cycle.

A name is ready when every rank has announced it, or, for an allreduce (and a barrier),
every rank that has not called join(): joined ranks take part with zeros, as in
Horovod. When a name is ready its Metas are checked against each other: the same name
with different arguments (shape, dtype, op, root, ...) is an error on every rank that
submitted it, naming two of them, and the engine goes on with the next name. Allreduce,
broadcast and reducescatter want the same shape on every rank, not only the same count,
as Horovod's coordinator does ("Mismatched ... tensor shapes"); allgather and alltoall
the same shape past the first dimension.

A call that one rank refused in its caller, for arguments only that rank holds
(alltoall's splits, its tensor's dtype), is announced all the same, its Meta saying
why (engine.py, Engine.refuse). Once every rank has submitted the name it fails on all
of them, naming that rank and its reason (`refusal`), as Horovod's coordinator turns
one rank's bad request into an error for every rank; the next names pair as before.

Unnamed collectives get Horovod's names, `allreduce.noname.<n>`, n counting the unnamed
collectives this process has submitted (engine.py): ranks that make the same unnamed
calls derive the same names.

What the table costs each cycle: one all-reduce of every rank's message length, and,
when some rank has something to say, one all-gather of the messages (a few hundred
bytes per name). Horovod's coordinator instead gathers to rank 0, which answers with a
broadcast; with every rank holding the table, nobody has to answer.

Process sets (Horovod's): some ranks that run collectives among themselves. The table
keeps them, `sets` (id -> ranks; 0 is every rank), and a name submitted in set k
(`allreduce.x in process set k`, a name of its own beside `allreduce.x`) is ready once
every rank of set k has announced it; the other ranks only keep it in their tables.
Sets are added and removed by collectives of every rank (`add_process_set`,
`remove_process_set`), applied here in the table's order, so every rank numbers them
alike. Since every rank runs its ready names in the one order of the table, ranks in
several sets never wait for each other in a cycle: whatever one rank runs first, every
other member runs first too.

The stall inspector (rank 0's, as Horovod's coordinator's): a name that some ranks
announced and the rest have not, for longer than the warning time, is reported
(which ranks miss which names); at the stall timeout the name is dropped and every rank
that submitted it gets an error instead of waiting for ever. join() has the same
watch: a rank waiting in join() while no other rank joins and nothing runs, for the
stall timeout, gets an error naming the ranks that have not joined.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
         "add_process_set", "remove_process_set")
# Changes to the table's process sets: collectives of every rank, `members` the set's ranks.
SET_CHANGES = ("add_process_set", "remove_process_set")
# The kinds a joined rank takes part in (with zeros, or by having nothing to do); any
# other collective while a rank is joined is an error on the ranks that called it.
RUN_WHILE_JOINED = ("allreduce", "barrier")
# Each rank brings its own rows to these: the first dimension may differ.
OWN_FIRST_DIMENSION = ("allgather", "alltoall")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Meta:
    """What one rank asks for under a name: what the ranks must agree on, and (for
    allgather and alltoall) the rows it brings, which the others need to know."""
    kind: str
    dtypes: Tuple[str, ...] = ()              # one per tensor (a grouped allreduce has several)
    shapes: Tuple[Tuple[int, ...], ...] = ()  # one per tensor
    op: Optional[str] = None                  # reductions: sum, avg, min, max, product
    root: int = -1                            # broadcast
    prescale: float = 1.0
    postscale: float = 1.0
    algorithm: str = "auto"
    splits: Optional[Tuple[int, ...]] = None  # alltoall: rows this rank sends to each rank
    process_set: int = 0                      # the process set it runs in (0: every rank)
    members: Tuple[int, ...] = ()             # add/remove_process_set: the set's ranks
    refused: Optional[str] = None             # why this rank refused the call in its caller

    @classmethod
    def of(cls, kind: str, tensors: Sequence[torch.Tensor] = (), **fields) -> "Meta":
        """The Meta of `kind` over `tensors` (their dtypes and shapes) and `fields`."""
        if kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}: one of {', '.join(KINDS)}")
        return cls(kind, tuple(_dtype_name(t.dtype) for t in tensors),
                   tuple(tuple(t.shape) for t in tensors), **fields)

    def describe(self) -> str:
        """e.g. `allreduce of float32 (17, 17), op avg`."""
        tensors = ", ".join(f"{dtype} {shape}" for dtype, shape in zip(self.dtypes, self.shapes))
        text = self.kind + (f" of {tensors}" if tensors else "")
        if self.op is not None:
            text += f", op {self.op}"
        if self.root >= 0:
            text += f", root {self.root}"
        if (self.prescale, self.postscale) != (1.0, 1.0):
            text += f", prescale {self.prescale:g}, postscale {self.postscale:g}"
        if self.algorithm != "auto":
            text += f", algorithm {self.algorithm}"
        if self.members:
            text += f" of ranks {list(self.members)}"
        return text


# kind.noname.<n> (a barrier: kind.noname), perhaps " in process set <k>"
UNNAMED = re.compile(r"[a-z_]+\.noname(?:\.(\d+))?(?: in process set (\d+))?")
UNNAMED_STALL = (
    "; an unnamed collective is known by its number alone, and whether the missing ranks "
    "will ever submit it cannot be told, so no later unnamed call could be paired safely: "
    "every rank's engine has stopped, as Horovod shuts down once a stall passes "
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (name the collective to have only it fail)")


def is_unnamed(name: str) -> bool:
    """Whether a table name is an unnamed collective's (`allreduce.noname.3`)."""
    return UNNAMED.fullmatch(name) is not None


def unnamed_number(name: str) -> Optional[Tuple[int, int]]:
    """(process set, n) of `kind.noname.<n>` [in process set k]; None for other names."""
    match = UNNAMED.fullmatch(name)
    if match is None or match.group(1) is None:
        return None
    return int(match.group(2) or 0), int(match.group(1))


def scoped(name: str, process_set: int) -> str:
    """The table's name for `name` submitted in process set `process_set`."""
    return name if process_set == 0 else f"{name} in process set {process_set}"


def _same_shapes(kind: str, a: Meta, b: Meta) -> bool:
    if len(a.shapes) != len(b.shapes):
        return False
    if kind in OWN_FIRST_DIMENSION:
        return all(len(x) == len(y) and x[1:] == y[1:] for x, y in zip(a.shapes, b.shapes))
    return a.shapes == b.shapes


def differences(a: Meta, b: Meta) -> List[str]:
    """What two ranks' Metas for one name disagree on (empty: they agree)."""
    if a.kind != b.kind:
        return ["kind"]
    checks = {
        "dtype": a.dtypes == b.dtypes,
        "shape": _same_shapes(a.kind, a, b),
        "op": a.op == b.op,
        "root": a.root == b.root,
        "scale factors": (a.prescale, a.postscale) == (b.prescale, b.postscale),
        "algorithm": a.algorithm == b.algorithm,
        "ranks": a.members == b.members,
    }
    return [what for what, same in checks.items() if not same]


def disagreement(name: str, metas: Dict[int, Meta]) -> Optional[str]:
    """The error every submitting rank raises if their Metas for `name` disagree."""
    ranks = sorted(metas)
    first = metas[ranks[0]]
    for rank in ranks[1:]:
        wrong = differences(first, metas[rank])
        if wrong:
            return (f"{name}: the ranks disagree on {', '.join(wrong)}: rank {ranks[0]} "
                    f"submitted {first.describe()}; rank {rank} submitted "
                    f"{metas[rank].describe()}")
    return None


def refusal(name: str, metas: Dict[int, Meta]) -> Optional[str]:
    """The error every submitting rank gets when some rank refused the call in its
    caller (its own arguments, which no other rank sees, were wrong there); None when
    no rank did. The other ranks' arguments may be right: the call fails anyway, on
    every rank, so that every rank's next call is the same call."""
    refused = [rank for rank in sorted(metas) if metas[rank].refused is not None]
    if not refused:
        return None
    also = f" (and on rank(s) {refused[1:]})" if refused[1:] else ""
    return (f"{name}: refused on rank {refused[0]}{also}, so it fails on every rank: "
            f"{metas[refused[0]].refused}")


@dataclass
class Message:
    """One rank's announcement in one cycle (pickled and all-gathered by the engine)."""
    announced: List[Tuple[str, Meta]] = field(default_factory=list)
    join: bool = False       # this rank has called join()
    shutdown: bool = False   # this rank is shutting down: every rank's engine stops
    expired: List[str] = field(default_factory=list)  # rank 0 only: stalled names to drop
    join_expired: bool = False  # rank 0 only: join() stalled; fail it where it waits

    def __bool__(self) -> bool:
        return bool(self.announced or self.join or self.shutdown or self.expired
                    or self.join_expired)


@dataclass
class Entry:
    """A name some ranks have announced: their Metas, and when it was first seen."""
    metas: Dict[int, Meta]
    first_seen: float  # this rank's clock; only rank 0's stall inspector reads it


@dataclass
class Outcome:
    """What one cycle's messages decided, the same on every rank, in order."""
    ready: List[Tuple[str, Dict[int, Meta]]] = field(default_factory=list)  # run these
    errors: List[Tuple[str, Set[int], str]] = field(default_factory=list)  # (name, ranks, why)
    join_done: Optional[int] = None      # every rank has joined: join() returns this rank
    join_failed: Optional[Tuple[Set[int], str]] = None  # (the joined ranks, why): it stalled
    shutdown_by: Optional[int] = None    # the lowest rank that announced a shutdown
    halt: Optional[str] = None           # an unnamed collective stalled: every engine stops


class Table:
    """The names announced and not yet run, identical on every rank (see the top)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.entries: Dict[str, Entry] = {}  # in the order names were first announced
        self.joined: Set[int] = set()
        self.last_joined: Optional[int] = None
        self.join_progress = 0.0  # when a rank last joined, or something ran, while joined
        # Process set id -> its ranks (0: every rank). Replaced, never changed in place,
        # so that other threads may read it while the engine applies a cycle.
        self.sets: Dict[int, Tuple[int, ...]] = {0: tuple(range(world_size))}
        self._next_set = 1

    def apply(self, messages: List[Message], now: float,
              stall_timeout: float = 0.0) -> Outcome:
        """Every rank's message of one cycle, in rank order: what runs now, what fails."""
        outcome = Outcome()
        for rank, message in enumerate(messages):
            for name, meta in message.announced:
                entry = self.entries.setdefault(name, Entry({}, now))
                entry.metas[rank] = meta
        for name in messages[0].expired:  # rank 0's stall inspector gave up on these
            entry = self.entries.pop(name, None)
            if entry is not None:
                why = self._stall_error(name, entry, stall_timeout)
                outcome.errors.append((name, set(entry.metas), why))
                if is_unnamed(name) and outcome.halt is None:
                    outcome.halt = why + UNNAMED_STALL
        newly_joined = {rank for rank, message in enumerate(messages) if message.join}
        if newly_joined:
            self.joined |= newly_joined
            self.last_joined = max(newly_joined)  # joined last; the highest of a tie
        shutting_down = [rank for rank, message in enumerate(messages) if message.shutdown]
        if shutting_down:
            outcome.shutdown_by = shutting_down[0]
            return outcome
        for name in list(self.entries):
            entry = self.entries[name]
            if self.missing(entry):
                continue
            del self.entries[name]
            meta = next(iter(entry.metas.values()))
            why = refusal(name, entry.metas) or disagreement(name, entry.metas)
            if why is None and meta.process_set not in self.sets:
                why = (f"{name}: process set {meta.process_set} was removed before every "
                       "rank of it submitted this")
            absent = [r for r in range(self.world_size) if r not in entry.metas]
            if why is None and meta.process_set == 0 and absent \
                    and meta.kind not in RUN_WHILE_JOINED:
                why = (f"{name}: rank(s) {absent} have called join(); while a rank is "
                       f"joined only allreduce can run, as in Horovod")
            if why is None and meta.kind in SET_CHANGES:
                why = self._change_sets(name, meta)
            if why is not None:
                outcome.errors.append((name, set(entry.metas), why))
            else:
                outcome.ready.append((name, entry.metas))
        if len(self.joined) == self.world_size:
            outcome.join_done = self.last_joined
            self.joined = set()
        elif self.joined and (newly_joined or outcome.ready):
            self.join_progress = now  # (an expiry decided before this is moot)
        elif self.joined and messages[0].join_expired:  # rank 0's inspector gave up
            outcome.join_failed = (set(self.joined), self._join_stall_error(stall_timeout))
            self.joined = set()
        return outcome

    def missing(self, entry: Entry) -> List[int]:
        """The ranks `entry` still waits for: the ranks of its process set that have
        neither announced it nor (for the global set) joined. (A kind that joined ranks
        cannot take part in then fails, see apply; a removed set waits for nobody.)"""
        process_set = next(iter(entry.metas.values())).process_set
        joined = self.joined if process_set == 0 else ()
        return [r for r in self.sets.get(process_set, ())
                if r not in entry.metas and r not in joined]

    def not_joined(self) -> List[int]:
        return [r for r in range(self.world_size) if r not in self.joined]

    def _change_sets(self, name: str, meta: Meta) -> Optional[str]:
        """Add or remove a process set, as every rank agreed to (None), or say why not."""
        found = [k for k, ranks in self.sets.items() if ranks == meta.members and k != 0]
        if meta.kind == "add_process_set":
            if found or meta.members == self.sets[0]:
                return (f"{name}: a process set of ranks {list(meta.members)} exists "
                        f"already (id {found[0] if found else 0})")
            self.sets = {**self.sets, self._next_set: meta.members}
            self._next_set += 1
            return None
        if not found:
            return f"{name}: there is no process set of ranks {list(meta.members)} to remove"
        self.sets = {k: ranks for k, ranks in self.sets.items() if k != found[0]}
        return None

    def set_id(self, members: Sequence[int]) -> Optional[int]:
        """The id of the process set of exactly these ranks, if there is one."""
        return next((k for k, ranks in self.sets.items() if ranks == tuple(members)), None)

    def _stall_error(self, name: str, entry: Entry, stall_timeout: float) -> str:
        missing = self.missing(entry)
        return (f"{name}: stalled: rank(s) {missing} did not submit it within "
                f"{stall_timeout:g} s, while rank(s) {sorted(entry.metas)} did (ranks "
                "submitting different names, or only some ranks submitting it)")

    def _join_stall_error(self, stall_timeout: float) -> str:
        return (f"join: stalled: rank(s) {self.not_joined()} did not join, and no "
                f"collective ran, within {stall_timeout:g} s, while rank(s) "
                f"{sorted(self.joined)} waited in join() (a rank that never calls join(), "
                "or is stuck elsewhere)")


class StallInspector:
    """Rank 0's watch over names that some ranks announced and others did not.

    After `warn_after` seconds such a name is reported, as Horovod's stall inspector
    does (`Missing ranks: 1: [allreduce.x, ...]`), again every `warn_after` seconds; after
    `fail_after` seconds it is expired: rank 0 tells every rank to drop it, and the ranks
    that submitted it get an error. warn_after <= 0 turns warnings off.
    """

    def __init__(self, warn_after: float, fail_after: float, report):
        self.warn_after = warn_after
        self.fail_after = fail_after
        self.report = report  # called with the warning's text
        self.last_warning = self.last_join_warning = float("-inf")
        self.reports: List[str] = []  # every warning given, for whoever wants to read them

    def inspect(self, table: Table, now: float) -> List[str]:
        """Warn if it is time; return the names to expire now."""
        stalled = {name: entry for name, entry in table.entries.items()
                   if table.missing(entry)}
        expired = [name for name, entry in stalled.items()
                   if now - entry.first_seen > self.fail_after]
        late = {name: entry for name, entry in stalled.items()
                if now - entry.first_seen > self.warn_after}
        if (self.warn_after > 0 and late
                and now - self.last_warning >= self.warn_after):
            self.last_warning = now
            text = self.warning(table, late, now)
            self.reports.append(text)
            self.report(text)
        return expired

    def join_stalled(self, table: Table, now: float) -> bool:
        """Whether ranks have waited in join() past the stall timeout while no other
        rank joined and nothing ran; warns, as inspect() does, after warn_after."""
        if not table.joined:
            return False
        waited = now - table.join_progress
        if (self.warn_after > 0 and waited > self.warn_after
                and now - self.last_join_warning >= self.warn_after):
            self.last_join_warning = now
            text = (f"collectives.horovod: rank(s) {sorted(table.joined)} have waited in "
                    f"join() for {waited:.0f} s while rank(s) {table.not_joined()} neither "
                    f"joined nor ran a collective (it fails after {self.fail_after:g} s)")
            self.reports.append(text)
            self.report(text)
        return waited > self.fail_after

    def warning(self, table: Table, late: Dict[str, Entry], now: float) -> str:
        by_rank: Dict[int, List[str]] = {}
        for name, entry in late.items():
            for rank in table.missing(entry):
                by_rank.setdefault(rank, []).append(name)
        lines = [f"  rank {rank}: [{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}]"
                 for rank, names in sorted(by_rank.items())]
        oldest = max(now - entry.first_seen for entry in late.values())
        return ("collectives.horovod: one or more collectives were submitted by some ranks "
                f"only and have waited for the rest for more than {self.warn_after:g} s "
                f"(the oldest {oldest:.0f} s; each fails after {self.fail_after:g} s). "
                "Ranks submitting different names, or only some ranks submitting, would "
                "wait for ever. Missing ranks:\n" + "\n".join(lines))
