"""Shared memory between the ranks of one host; the backend to the rest.

Over loopback TCP every byte is copied twice by the kernel (into a socket buffer and
out again) and handled by the backend's I/O threads. Ranks on one host can do with
less: the sender copies a message into memory the receiver has mapped too, and the
receiver uses it where it lies. A receive that is reduced (`irecv_reduce`, as in the
ring's reduce-scatter) adds straight out of that memory, so the reduction costs no
extra copy. MPICH's shared-memory channel and NCCL's SHM transport work this way;
gloo has nothing like it, which is why an algorithm over this transport can beat
gloo's own all-reduce.

Every rank creates one segment, its inbox, and maps every peer's:

    rank 1's segment: a file in /dev/shm, mapped by every rank of its host
    +---------+----------------------------------+----------------------------+---
    | pid     | channel from rank 0              | channel from rank 2        | ...
    | bell    | free filled | slot 0 | ... | slot K-1                        |
    | board   |                                  |                            |
    +---------+----------------------------------+----------------------------+---

    rank 0 --isend--> [slot][slot][slot][slot] in rank 1's segment --irecv--> rank 1
                      free/filled semaphores count them; each side rings the other's bell

The package, one concern a file, in reading order:

    semaphores.py  process-shared POSIX semaphores inside shared memory, through ctypes
    segment.py     the inbox's layout: where the pid, bell, board and channels lie
    channel.py     one direction between two ranks: slots, pieces, relays
    board.py       the call board: ranks check they make the same call, no message
    connect.py     setting up: every segment created, mapped by its host, removed
    transport.py   ShmTransport: the route to each peer, and the progress engine

`ShmTransport.connect(inner)` adds shared memory where at least one host has two or
more ranks and every segment could be created and mapped; otherwise it returns the
backend `inner` as it is. Barrier and the native collectives always go to the backend.
"""
from .channel import SLOT_BYTES, SLOTS
from .connect import want_shm
from .segment import Segment
from .transport import ShmTransport

# The segment class under the name tests/exit_cleanly.py patches, to make a rank fail
# while every segment's file exists.
_Segment = Segment

__all__ = ["ShmTransport", "want_shm", "SLOTS", "SLOT_BYTES"]
