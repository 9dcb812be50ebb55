"""The call board: checking that the ranks make the same call, without a message.

The call check (transport/calls.py) makes sure that every rank makes the same call
(collective, sizes, dtype, op, root). Where the whole world is on one host it needs no
message for it: each rank writes its call's row into the board of its own segment
(segment.py) before the call's first message (`announce`), and reads the others'
boards after the call (`confirm`):

    rank 0's board   [#7 digest row] [#8 digest row] [#5 ...] [#6 ...]
    rank 1's board   [#7 digest row] [#8 digest row] [#5 ...] [#6 ...]
                       call 8 goes to entry 8 % 4; each rank reads every board's entry

A call whose every result depends on every rank (all-reduce) cannot finish before every
rank has announced it, so confirming costs a few reads; a broadcast's root may wait
there for the others to arrive. Calls that disagree may exchange garbage or stall before
they are confirmed: a rank waiting with nothing moving reads the board at every nap
(transport.py's wait_for), and every rank raises CallMismatch, which the call check
turns into one error naming both calls, within a nap or two.

Each rank is at most one confirmed call ahead of any other, so a board of 4 entries,
used in turn, is never overwritten before it is read.

An entry: [call number, digest of the row, the row's length, the row ...]. Peers compare
digests; rows are read to name a disagreement (and, where stores may become visible out
of order, to check that an entry is whole). The number is written last, and a writer
marks the entry -1 first: an entry whose number is there is complete. x86-64 makes
stores visible to other cores in the order they were made (TSO), so that is enough;
elsewhere (aarch64) each entry read is checked against its digest.
"""
from __future__ import annotations

import platform
import time
from typing import Dict, List, Optional, Sequence

from ..base import CallMismatch, PeerError
from .segment import BOARD_ENTRIES, BOARD_WORDS, alive

# Where stores may become visible out of order, every entry read is checked whole.
_CHECK_ENTRIES = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")


class CallBoard:
    """Every rank's board, as this rank reads and writes them.

    boards: each rank's entries (Segment.board), by rank: the whole world's.
    rank:   this rank, which writes to boards[rank] only.
    pids:   the peers' process ids, to stop waiting for the entry of one that has
            exited; None where they cannot be watched (not in this pid namespace).
    """

    def __init__(self, boards: Sequence[list], rank: int, pids: Optional[Dict[int, int]]):
        self.boards = list(boards)
        self.rank = rank
        self.pids = pids
        self.rank_count = len(self.boards)
        self.announced = 0  # calls this rank announced
        self.call: Optional[tuple] = None  # (number, digest) of the call not yet confirmed

    def fits(self, row: List[int]) -> bool:
        """Whether a row fits in an entry (else the call check runs a handshake)."""
        return len(row) <= BOARD_WORDS - 3

    def announce(self, row: List[int]) -> None:
        """Write this rank's next call into its own board."""
        self.announced += 1
        digest = hash((self.announced, *row))  # ints hash alike in every process
        entry = self.boards[self.rank][self.announced % BOARD_ENTRIES]
        entry[0] = -1  # being written
        entry[1] = digest
        entry[2] = len(row)
        entry[3:3 + len(row)] = row
        entry[0] = self.announced  # last: the entry is complete
        self.call = (self.announced, digest)

    def entry(self, rank: int, number: int, whole: bool = False) -> Optional[tuple]:
        """(digest, row or None) of `rank`'s entry for call `number`; None if it has not
        announced it. `whole`: read the row too, and take the entry only if it is
        complete (its row matches its digest, its number did not change meanwhile)."""
        entry = self.boards[rank][number % BOARD_ENTRIES]
        if entry[0] != number:
            return None
        digest = entry[1]
        if not (whole or _CHECK_ENTRIES):
            return digest, None
        length = entry[2]
        row = entry[3:3 + length] if 0 <= length <= BOARD_WORDS - 3 else None
        # the number is in the digest: an older call's entry seen under it cannot pass
        if row is None or hash((number, *row)) != digest or entry[0] != number:
            return None  # being written: not announced yet
        return digest, row

    def raise_if_calls_differ(self, timeout: float) -> None:
        """Raise CallMismatch if a rank announced another call than ours. Every rank
        raises the same one: it first waits for every rank's entry (until `timeout`
        seconds, or a missing rank's exit). Nothing to check once confirmed."""
        if self.call is None:
            return
        number, mine = self.call
        entries = [self.entry(rank, number) for rank in range(self.rank_count)]
        if all(entry is None or entry[0] == mine for entry in entries):
            return
        deadline = time.monotonic() + timeout
        while True:
            entries = [self.entry(rank, number, whole=True) for rank in range(self.rank_count)]
            missing = [rank for rank, entry in enumerate(entries) if entry is None]
            if (not missing or time.monotonic() > deadline
                    or any(self.exited(rank) for rank in missing)):
                break
            time.sleep(0.01)
        self.call = None
        raise CallMismatch([None if entry is None else entry[1] for entry in entries])

    def confirm(self, timeout: float) -> None:
        """Return once every rank has announced our call; raise CallMismatch if one
        announced another, PeerError if one has not within `timeout` seconds."""
        if self.call is None:
            return  # already confirmed, or given up on (a PeerError raised below)
        number, mine = self.call
        at = number % BOARD_ENTRIES
        if not _CHECK_ENTRIES and all(board[at][0] == number and board[at][1] == mine
                                      for board in self.boards):
            self.call = None  # the usual case: every rank announced the same call
            return
        deadline = time.monotonic() + timeout
        pause = 5e-5
        while True:
            entries = [self.entry(rank, number) for rank in range(self.rank_count)]
            if any(entry is not None and entry[0] != mine for entry in entries):
                self.raise_if_calls_differ(timeout)
            if None not in entries:
                self.call = None
                return
            missing = entries.index(None)
            if time.monotonic() > deadline:
                raise PeerError(f"rank {missing} did not make call #{number} "
                                f"within {timeout:g} s")
            if self.exited(missing):
                raise PeerError(f"rank {missing} (pid {self.pids[missing]}) has exited")
            time.sleep(pause)  # a broadcast's root, waiting for the others to arrive
            pause = min(2 * pause, 0.01)

    def exited(self, rank: int) -> bool:
        """Whether a peer we watch has exited (its entry will never come)."""
        return self.pids is not None and not alive(self.pids[rank])

    def forget(self) -> None:
        """The announced call ended without being confirmed (it raised)."""
        self.call = None
