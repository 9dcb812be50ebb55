"""Process-shared POSIX semaphores that live inside shared memory, called through ctypes.

A semaphore is a counter with two operations: post() adds one, wait() takes one and
sleeps while there is none to take. The channels of this package count their free and
filled slots with semaphores, and every rank sleeps on one of its own (its bell) when
nothing can move.

Where they live: POSIX offers two kinds. A *named* semaphore (sem_open) is a file of its
own in /dev/shm (on Linux sem.<name>, a page every process that opens it maps), there
until sem_unlink removes it. An *unnamed*
one (sem_init) is a sem_t in memory the program chooses; initialised with pshared=1 in
memory that several processes map, it serves them all. Ours are of the second kind: each
sits on a cache line of a rank's segment (segment.py), so a segment of N channels needs
no names and no cleanup beyond the segment's own file, and a rank that dies leaves
nothing behind. On Linux a sem_t is 32 bytes: a counter and a count of sleepers. An
uncontended post or wait is a few atomic instructions in the process; only a wait that
must sleep, or a post that must wake a sleeper, enters the kernel (a futex on the
counter's address).

They also order memory: what a process wrote before post() is visible to the process
whose wait() took that count. A channel's data needs no other fence.

Why ctypes: Python's standard library has no call for sem_init on an address of ours
(multiprocessing's semaphores are named and made by it). ctypes calls the C library
directly, converting its arguments on every call. Against posix_ipc, a C extension for
named semaphores: docs/benchmarks.md, "Shared memory: our ctypes semaphores against
posix_ipc".

Every function takes a semaphore by its address: a byte inside a mapped segment.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc():
    """The C library's semaphore calls, or None where there are none (not Linux)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("sem_init", "sem_post", "sem_trywait", "sem_timedwait"):
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.sem_post.argtypes = [ctypes.c_void_p]
    lib.sem_trywait.argtypes = [ctypes.c_void_p]
    lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    return lib


_libc = _load_libc()


def available() -> bool:
    """Whether this process can use them (Linux, with a /dev/shm)."""
    return _libc is not None


def init(address: int, value: int) -> None:
    """Make a semaphore at `address`, shared between processes, counting `value`."""
    if _libc.sem_init(address, 1, value) != 0:  # 1: shared between processes
        raise OSError(ctypes.get_errno(), "sem_init failed")


def post(address: int) -> None:
    """Add one count, waking a process asleep on it."""
    if _libc.sem_post(address) != 0:
        raise OSError(ctypes.get_errno(), "sem_post failed")


def trywait(address: int) -> bool:
    """Take one count if there is one; never blocks."""
    return _libc.sem_trywait(address) == 0


def nap(address: int, seconds: float) -> bool:
    """Take one count, sleeping up to `seconds` for it. False if none came."""
    when = time.time() + seconds  # sem_timedwait takes an absolute CLOCK_REALTIME time
    spec = _Timespec(int(when), int((when % 1) * 1e9))
    return _libc.sem_timedwait(address, ctypes.byref(spec)) == 0
