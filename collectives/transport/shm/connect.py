"""Setting up shared memory: every rank's segment created, mapped by its host, removed.

`open_segments` is collective over the backend a ShmTransport will wrap: every rank
calls it and all come to the same answer. Each rank creates its segment (segment.py),
the ranks of its host map it, and the files are removed at once: the mappings stay, and
nothing is left in /dev/shm if a rank dies later.

    rank 0: create  /dev/shm/collectives-<token>-0 ----+
    rank 1: create  /dev/shm/collectives-<token>-1 ----+   agree (a min-reduce over the
                                                       |   backend): all created?
    every rank: map each peer's file  -----------------+   agree: all mapped?
    every rank: unlink its own file                        nothing left in /dev/shm

Where any rank cannot create or map a segment (a /dev/shm too small, say), every rank
falls back to the backend, and the lowest such rank prints one warning line saying why:
a rank that runs slower than it could should say why, but a job of many ranks must not
print a screenful.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import threading
from typing import Dict, List, Optional, Tuple

import torch

from ..base import Transport
from . import semaphores
from .channel import Channel
from .segment import Segment, alive, layout


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


def open_segments(inner: Transport, slots: int,
                  slot_bytes: int) -> Optional[Tuple[Dict[int, Segment], bool]]:
    """The segments of this rank's host, by rank (ours is our inbox), and whether the
    peers' processes can be watched; None where shared memory is not to be had: no host
    has two ranks, some rank has no POSIX semaphores, or a segment failed somewhere.
    Collective over `inner`."""
    topology = inner.topology
    if topology.one_rank_per_host or not _everyone(inner, semaphores.available()):
        return None  # nothing to share, or no POSIX semaphores somewhere
    token = torch.tensor([secrets.randbits(48)])
    inner.broadcast_metadata(token, 0)
    me = inner.rank
    local = topology.local_ranks(me)
    paths = {rank: f"/dev/shm/collectives-{token.item():x}-{rank}" for rank in local}
    segments: Dict[int, Segment] = {}
    connected = False
    # The files below go whatever happens, a launcher's SIGTERM included.
    with terminate_runs_finally():
        try:
            if _given_up(inner, _create_inbox(segments, paths[me], me, local, slots,
                                              slot_bytes)):
                return None
            if _given_up(inner, _map_peers(segments, paths, me, local, slots, slot_bytes)):
                return None
            watch_pids = _everyone(inner, all(alive(s.pid.value) for s in segments.values()))
            connected = True
            return segments, watch_pids
        finally:
            if me in segments:
                os.unlink(paths[me])  # every rank has mapped it (or given up) by now
            if not connected:
                for segment in segments.values():
                    segment.close()


def _create_inbox(segments: Dict[int, Segment], path: str, me: int, local: List[int],
                  slots: int, slot_bytes: int) -> Optional[str]:
    """Create our segment and its channels' semaphores; what went wrong, if anything."""
    try:
        segments[me] = Segment(path, len(local), slots, slot_bytes, True)
        for index, src in enumerate(local):
            if src != me:
                Channel(segments[me], index, 0, src, create=True).close()
    except OSError as error:
        mib = layout(len(local), slots, slot_bytes)[1] / 2**20
        return (f"rank {me} could not create its {mib:.1f} MiB segment "
                f"in /dev/shm ({error.strerror or error}); its host's "
                f"{len(local)} ranks need {mib * len(local):.0f} MiB free there")
    return None


def _map_peers(segments: Dict[int, Segment], paths: Dict[int, str], me: int,
               local: List[int], slots: int, slot_bytes: int) -> Optional[str]:
    """Map the segment of every other rank of our host; what went wrong, if anything."""
    try:
        for rank in local:
            if rank != me:
                segments[rank] = Segment(paths[rank], len(local), slots, slot_bytes, False)
    except OSError as error:
        return f"rank {me} could not map a peer's segment: {error}"
    return None


# --- agreeing over the backend: a min-reduce of one integer ----------------------------
def _first_failing(inner: Transport, ok: bool) -> Optional[int]:
    """The lowest rank where `ok` is False; None where it holds everywhere."""
    vote = torch.tensor([inner.world_size if ok else inner.rank])
    inner.reduce_metadata(vote, "min")
    return None if vote.item() == inner.world_size else int(vote.item())


def _everyone(inner: Transport, flag: bool) -> bool:
    """True when `flag` holds on every rank."""
    return _first_failing(inner, flag) is None


def _given_up(inner: Transport, problem: Optional[str]) -> bool:
    """Whether any rank had a problem; the first that had one says what it was."""
    failed = _first_failing(inner, problem is None)
    if failed == inner.rank:
        warn_fallback(inner.backend, problem)
    return failed is not None


_warned = False  # this process has said that shared memory is off


def warn_fallback(backend: str, reason: str) -> None:
    """Say, once per process, that point-to-point goes through the backend after all:
    one line on stderr."""
    global _warned
    if not _warned:
        _warned = True
        print(f"collectives: warning: shared memory off, point-to-point goes through "
              f"{backend}: {reason}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def terminate_runs_finally():
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
