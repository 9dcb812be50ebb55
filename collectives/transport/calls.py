"""Checked calls: every rank makes the same collective, or every rank says how they differ.

A collective is a promise that every rank makes the same call. Broken (one rank
all-reduces 10 elements, another 11; one broadcasts while the other all-reduces), the
messages pair wrongly: a rank hangs, or returns garbage as if nothing were wrong. So
every public collective (api.py) runs inside its communicator's check:

    with comm.checked_call(call):     refused if the ranks are out of step; the call's
        ... the algorithm runs ...    signature compared across ranks; the call counted;
                                      a PeerError inside named after the call

`call` (a Call) is what this rank is doing: the collective, the algorithm asked for
and the one that runs, and its signature, a row of integers every rank's call must
share (api.call_signature: collective, op, algorithm, dtype, numel, shape, root; an
all-to-all's pieces are each rank's own size, so its row leaves them out). The check
compares the rows one of two ways:

- on the call board, where the whole world is on one host with shared memory on
  (transport/shm/board.py): each rank writes its row where the others can read it
  (`announce_call`), runs the call, then reads theirs (`confirm_call`). No message of
  its own: an all-reduce costs a few memory reads more. Calls that disagree are caught
  during or after the exchange (a stalled rank reads the board while it waits), so
  the tensors may then hold garbage (the call raises) and messages may be left half
  read: the communicator is out of step. The backend's own and the hierarchical
  algorithms, whose waits do not read the board, are confirmed before they run;
- anywhere else (ranks on several hosts, shared memory off), in a handshake before the
  call (`Call.agree`: one small all-reduce of a few integers per rank), in which
  nothing of the call's data moves, so the communicator stays usable.

Debug mode (COLLECTIVES_DEBUG=DETAIL) runs the handshake on every call, unchecked ones
too, with each rank's call number in its row, so the first call where the ranks
diverge is named with its number. What either way costs: docs/benchmarks.md, "The
argument check".

Out of step: a call that disagreed on the board, or failed before every rank was seen
to make it, may have left messages that a later call would read as its own. From then
on the communicator refuses every call, as NCCL aborts a communicator
(`CallCheck.out_of_step` says why; shm/ refuses its messages too).

This module knows when to compare and what a failure leaves; what the numbers of a
row mean, and the all-reduce a handshake runs, belong to api.py (Call's two methods).
It also holds the two errors a call raises when its ranks fail it (base.py, which
every transport imports, passes them on).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Protocol


class Board(Protocol):
    """What the check asks of a communicator (every Transport has it: base.py answers
    that there is no board, shm/board.py keeps one on a host)."""

    def announce_call(self, signature: List[int]) -> bool: ...
    def confirm_call(self, timeout: Optional[float] = None) -> None: ...
    def forget_call(self) -> None: ...
    def release_workspace(self) -> None: ...


class PeerError(RuntimeError):
    """Talking to another rank failed: it died, stalled past the timeout, or disagreed."""


class CallMismatch(PeerError):
    """The ranks announced different calls (Transport.announce_call). `rows` holds each
    rank's announced row, in rank order (None: not announced yet); Call.disagreement
    names them."""

    def __init__(self, rows: List[Optional[List[int]]]):
        super().__init__("the ranks announced different calls")
        self.rows = rows


# How long a call that failed unconfirmed waits to learn whether the ranks disagreed
# (then the error says so) or the peer or the link failed.
CONFIRM_AFTER_FAILURE_SECONDS = 2.0


class Call:
    """One collective as its check sees it. api.py's subclass words the signature:
    `agree` (the handshake) and `disagreement` (the error for rows that differ)."""

    __slots__ = ("collective", "algorithm", "runs", "signature", "waits_read_board",
                 "handshake_always")

    def __init__(self, collective: str, algorithm: str, runs: str,
                 signature: Optional[List[int]], waits_read_board: bool,
                 handshake_always: bool = False):
        self.collective = collective              # "all_reduce": what every error names
        self.algorithm = algorithm                # as asked: "auto", perhaps
        self.runs = runs                          # what runs: auto's choice, or algorithm
        self.signature = signature                # every rank's must match; None: unchecked
        self.waits_read_board = waits_read_board  # runs's waits read the call board
        self.handshake_always = handshake_always  # a handshake even where a board serves

    def agree(self, comm: Board) -> None:
        """The handshake: exchange every rank's signature, and raise RuntimeError on
        every rank, naming two ranks' calls, if they differ."""
        raise NotImplementedError

    def disagreement(self, rows: List[Optional[List[int]]]) -> str:
        """The error for the rows read on the board (None: a rank not seen), which
        differ: the same words on every rank."""
        raise NotImplementedError


class CallCheck:
    """One communicator's calls: how many it made, and whether its ranks are in step."""

    __slots__ = ("count", "out_of_step")

    def __init__(self) -> None:
        self.count = 0                          # calls so far: the last is "call #count"
        self.out_of_step: Optional[str] = None  # why every later call is refused

    def refuse_if_out_of_step(self, collective: str) -> None:
        if self.out_of_step:
            raise RuntimeError(f"{collective}: refused, an earlier call on this "
                               f"communicator left its ranks out of step: {self.out_of_step}")

    @contextlib.contextmanager
    def checked(self, comm: Board, call: Call) -> Iterator[None]:
        """The context `call` runs in on `comm` (see the module docstring)."""
        self.refuse_if_out_of_step(call.collective)
        on_board = self._announce_or_agree(comm, call)
        self.count += 1
        confirmed = not on_board
        try:
            if not confirmed and not call.waits_read_board:
                comm.confirm_call()  # its waits would not see a disagreement: check first
                confirmed = True
            yield
            if not confirmed:
                comm.confirm_call()
                confirmed = True
        except CallMismatch as mismatch:
            comm.release_workspace()  # receives the call left may still land in it
            raise self._fall_out_of_step(call, mismatch) from None
        except PeerError as error:
            comm.release_workspace()
            if not confirmed:  # perhaps because the ranks made different calls
                confirmed = self._confirm_after(comm, call, error)
            raise PeerError(f"{call.collective} ({call.algorithm}, call #{self.count}): "
                            f"{error}") from error
        finally:
            if not confirmed:  # ended by an error: whatever it left, later calls are refused
                comm.forget_call()
                self.out_of_step = self.out_of_step or (
                    f"{call.collective} call #{self.count} failed before every rank was "
                    "seen to make the same call")

    @staticmethod
    def _announce_or_agree(comm: Board, call: Call) -> bool:
        """Put the call's signature where the ranks compare it: True when it went on the
        call board (confirmed later); False when there is none to compare or the
        handshake has compared it already."""
        if call.signature is None:
            return False
        if not call.handshake_always and comm.announce_call(call.signature):
            return True
        call.agree(comm)
        return False

    def _confirm_after(self, comm: Board, call: Call, error: PeerError) -> bool:
        """A call failed with `error` before it was confirmed: raise the disagreement if
        the ranks made different calls. True if every rank is seen to have made this one
        (the error was a peer's or the link's: still, messages of it may be left)."""
        try:
            comm.confirm_call(timeout=CONFIRM_AFTER_FAILURE_SECONDS)
        except CallMismatch as mismatch:
            raise self._fall_out_of_step(call, mismatch) from error
        except PeerError:
            return False
        self.out_of_step = f"{call.collective} call #{self.count} failed: {error}"
        return True

    def _fall_out_of_step(self, call: Call, mismatch: CallMismatch) -> RuntimeError:
        """The ranks disagreed, seen on the board: the error every rank raises. The
        call's messages may have moved, and be left half read: later calls are refused."""
        self.out_of_step = call.disagreement(mismatch.rows)
        return RuntimeError(self.out_of_step)
