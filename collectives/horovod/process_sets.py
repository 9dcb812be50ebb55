"""Horovod's process sets: some ranks that run collectives among themselves.

    evens = hvd.add_process_set([0, 2])     # every rank calls it, in the same order
    if evens.included():                    # ranks 0 and 2
        hvd.allreduce(t, process_set=evens) # evens.rank() is 0 or 1, evens.size() 2
    hvd.remove_process_set(evens)           # every rank again

or `hvd.init(process_sets=[hvd.ProcessSet([0, 2]), ...])`. Ranks are always the
job's (hvd.rank()): a broadcast's root_rank too, as in Horovod.

Underneath, a process set is two things the library has already:
- a name space in the negotiation (negotiation.py): `allreduce.x` submitted in set k
  is ready once every rank of set k has submitted it, and the table every rank keeps
  says which ranks set k holds. Adding and removing a set are collectives of every
  rank, negotiated like the others, so every rank numbers the sets alike;
- a communicator of its ranks (transport/group.py): once ready, the collective runs
  on the group of its ranks over the engine's communicator (engine.py), with the
  same algorithms as over every rank.

A ProcessSet object holds the id the table gave its ranks; removing the set, or
hvd.shutdown(), leaves it without one (process_set_id None), as in Horovod.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..world import get_comm
from .engine import Engine, engine
from .negotiation import Meta


class ProcessSet:
    """Some ranks of the job, by their global ranks (sorted); pass it to hvd.init() or
    hvd.add_process_set(), then to any collective as process_set=."""

    process_set_id: Optional[int] = None
    ranks: Optional[List[int]] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int]):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise NotImplementedError(
                "ProcessSet takes a list of ranks; sets made from an MPI communicator are "
                "not provided (pass the ranks of the communicator instead)") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks, got {ranks_or_comm!r}")
        self.ranks = ranks

    def size(self) -> Optional[int]:
        """How many ranks the set holds; None until it is added."""
        if self.process_set_id is None:
            return None
        return get_comm().world_size if self.process_set_id == 0 else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's place in the set (0 .. size-1); None until it is added; a
        ValueError on a rank outside it, as in Horovod."""
        if self.process_set_id is None:
            return None
        return scope(self).rank

    def included(self) -> Optional[bool]:
        """Whether this rank belongs to the set; None for a set without ranks."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return get_comm().rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])  # every rank; its ranks are filled in by hvd.init()
global_process_set.process_set_id = 0


@dataclass(frozen=True)
class Scope:
    """Where a collective runs, as this rank sees it: a set's id and ranks, and this
    rank's place among them."""
    id: int
    ranks: Tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


def scope(process_set: ProcessSet) -> Scope:
    """The Scope of `process_set`, or a clear error: not a ProcessSet, never added or
    removed since, or this rank not in it (Horovod's errors, as ValueError)."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be an hvd.ProcessSet, got "
                         f"{type(process_set).__name__}")
    comm = get_comm()
    if process_set.process_set_id == 0:
        return Scope(0, tuple(range(comm.world_size)), comm.rank)
    ranks = None
    if process_set.process_set_id is not None:
        ranks = engine().table.sets.get(process_set.process_set_id)
    if ranks is None:
        raise ValueError(f"{process_set} has not been added (hvd.add_process_set, or "
                         "hvd.init(process_sets=...)), or was removed")
    if comm.rank not in ranks:
        raise ValueError(f"rank {comm.rank} is not a member of the provided process set "
                         f"(ranks {list(ranks)})")
    return Scope(process_set.process_set_id, ranks, ranks.index(comm.rank))


def add_process_set(process_set) -> ProcessSet:
    """Add a process set (a ProcessSet, or a list of ranks) and return it, with its id.

    A collective of every rank, as in Horovod: every rank adds the same sets in the same
    order. A set of the same ranks must not exist already (ValueError). Refused here,
    it is refused on every rank (engine.Engine.refusing), as any collective."""
    current = engine()
    with current.refusing("add_process_set", None):
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        ranks = tuple(process_set.ranks)
        size = get_comm().world_size
        if not ranks or len(set(ranks)) != len(ranks) \
                or not 0 <= ranks[0] <= ranks[-1] < size:
            raise ValueError(f"a process set holds distinct ranks of 0..{size - 1}, at "
                             f"least one; got {list(ranks)}")
        if ranks == current.table.sets[0] or current.table.set_id(ranks) is not None:
            raise ValueError(f"Attempted to add a duplicate process set: {process_set} (a "
                             f"set of ranks {list(ranks)} exists already)")
    process_set.process_set_id = _change(current, "add_process_set", ranks)
    current.added_sets.append(process_set)  # to lose its id when the engine goes
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set (a collective of every rank); False, doing nothing, for the
    global set or a set not added. The ProcessSet is left without an id."""
    if process_set.process_set_id in (None, 0):
        return False
    current = engine()
    ranks = current.table.sets.get(process_set.process_set_id)
    if ranks is None:
        process_set._invalidate()
        return False
    _change(current, "remove_process_set", ranks)
    process_set._invalidate()
    return True


def add_at_init(process_sets) -> None:
    """hvd.init(process_sets=[...]): add each (a list of ProcessSet); one whose ranks
    repeat an earlier one's is left without an id, as Horovod leaves it. "dynamic" (or
    None) adds none: sets can always be added later here."""
    global_process_set.ranks = list(range(get_comm().world_size))
    if process_sets is None or (isinstance(process_sets, str)
                                and process_sets.lower() == "dynamic"):
        return
    for process_set in process_sets:
        if not isinstance(process_set, ProcessSet):
            raise ValueError(f"hvd.init(process_sets=...) takes hvd.ProcessSet objects, got "
                             f"{type(process_set).__name__}")
        known = engine().table.set_id(process_set.ranks)
        if known is not None and known == process_set.process_set_id:
            continue  # added by an earlier hvd.init(): init is idempotent
        if known is not None or process_set.ranks == global_process_set.ranks:
            process_set._invalidate()  # a repeat of another set's ranks
            continue
        add_process_set(process_set)


def _change(current: Engine, kind: str, ranks: Tuple[int, ...]) -> Optional[int]:
    """Add or remove the set of `ranks` by a collective of every rank, negotiated on
    the engine like any other; the set's id in the table once it has run (None once
    removed)."""
    meta = Meta(kind, members=ranks)
    handle = current.submit(kind, None, meta,
                            lambda metas, comm: current.table.set_id(ranks))
    return current.synchronize(handle)
