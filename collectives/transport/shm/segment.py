"""A rank's inbox: one file in /dev/shm, mapped by every rank of its host.

Every rank creates one segment and maps the segment of every other rank of its host.
Rank r's segment holds what the others send to r: one channel per local rank (its own
unused), after a header of three parts, each on cache lines of its own so that two
ranks writing two of them never fight over one line:

    rank 1's segment, on a host of ranks 0 .. L-1
    +--------------------------------------+  0
    | pid    the owner's process id        |     int64, for peers to see it exit
    +--------------------------------------+  64
    | bell   a semaphore peers post        |     after filling or freeing its slots
    +--------------------------------------+  128
    | board  4 entries of 32 int64         |     the calls it announced (board.py)
    +--------------------------------------+  HEADER
    | channel from local rank 0            |
    |   free  | filled | slot 0 | ... | slot K-1
    |   sem_t | sem_t  | header (64 B: size, offset, piece size) + slot_bytes of data
    +--------------------------------------+  HEADER + channel_bytes
    | channel from local rank 1: unused    |     a rank sends nothing to itself
    +--------------------------------------+  HEADER + 2 x channel_bytes
    | channel from local rank 2            |
    +--------------------------------------+  ...

The free and filled semaphores count the channel's slots (channel.py says how the two
sides take turns). Every offset in this picture is computed here and nowhere else: the
other files ask a Segment for its pieces.

A segment is about local ranks x 4 MiB (K = 4 slots of 1 MiB per channel), so a host of
8 ranks takes 8 x 8 x 4 MiB = 256 MiB of /dev/shm in all.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Tuple

import torch

from . import semaphores

LINE = 64          # shared fields sit on cache lines of their own; a sem_t fits in one
SLOT_HEADER = 64   # message size, piece offset, piece size (3 int64)
BOARD_ENTRIES = 4  # announced calls kept, used in turn (board.py says why 4 is enough)
BOARD_WORDS = 32   # int64 per entry: the call's number, its digest, the row's length, the row
HEADER = 2 * LINE + BOARD_ENTRIES * BOARD_WORDS * 8  # pid, bell, board


def layout(local_size: int, slots: int, slot_bytes: int) -> Tuple[int, int]:
    """Sizes in bytes: (one channel, the whole segment)."""
    channel = 2 * LINE + slots * (SLOT_HEADER + slot_bytes)
    return channel, HEADER + local_size * channel


class Segment:
    """One rank's inbox: a /dev/shm file with a header and one channel per rank of its
    host (indexed by local rank; its own is unused).

    The creator allocates every page of it at once. A file merely sized (ftruncate) is
    sparse: it maps fine however full /dev/shm is, and the first write to a page that
    the tmpfs has no room for kills the writer with SIGBUS, in the middle of a
    collective. Allocated up front, a /dev/shm too small (Docker's default is 64 MiB)
    is an OSError here, where connect() can still fall back to the backend.
    """

    def __init__(self, path: str, local_size: int, slots: int, slot_bytes: int, create: bool):
        self.path = path
        self.slots, self.slot_bytes = slots, slot_bytes
        self.channel_bytes, size = layout(local_size, slots, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS later
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(path)  # ours and of no use: leave nothing in /dev/shm
            raise
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self._anchor)  # for the semaphores
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pid = ctypes.c_int64.from_buffer(self.map, 0)
        self.bell = self.address + LINE
        self.board = [(ctypes.c_int64 * BOARD_WORDS).from_buffer(
            self.map, 2 * LINE + i * BOARD_WORDS * 8) for i in range(BOARD_ENTRIES)]
        if create:
            self.pid.value = os.getpid()
            semaphores.init(self.bell, 0)

    def channel_offset(self, src: int) -> int:
        """Where the channel from local rank `src` starts."""
        return HEADER + src * self.channel_bytes

    def channel_semaphores(self, src: int) -> Tuple[int, int]:
        """Addresses of the free and filled semaphores of the channel from `src`."""
        free = self.address + self.channel_offset(src)
        return free, free + LINE

    def slot(self, src: int, index: int) -> Tuple[ctypes.Array, torch.Tensor]:
        """Slot `index` of the channel from `src`: its header (3 int64) and its bytes."""
        at = self.channel_offset(src) + 2 * LINE + index * (SLOT_HEADER + self.slot_bytes)
        header = (ctypes.c_int64 * 3).from_buffer(self.map, at)
        return header, self.bytes[at + SLOT_HEADER:at + SLOT_HEADER + self.slot_bytes]

    def close(self) -> None:
        self.bytes = self.pid = self.board = self._anchor = None  # views first, or the map can't close
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the map goes with it


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, exited but not yet reaped, does not): how a
    rank learns that the owner of a segment it waits on has gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
