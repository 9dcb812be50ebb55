"""`auto`: pick an algorithm from the message size, world size and backend.

The choices come from `python -m collectives.bench` on a 2-core machine over loopback;
the measured tables are in docs/benchmarks.md. Every rank computes the same choice
from the same numbers, so the ranks always agree.

- Below 64 KiB the backend's own collective is one call with the lowest latency.
- gloo: its native all-reduce already runs at the speed of a raw ring of sendrecv on
  this transport (the practical limit of any ring), so native stays the choice.
- mpi: the binomial tree wins for medium messages (few messages, each cheap), MPICH's
  own in between, and our ring for large ones (it beat MPICH's Allreduce at 16 MiB).
"""
from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20
NATIVE_BELOW = 64 * KiB


def all_reduce_choice(nbytes: int, world_size: int, backend: str) -> str:
    if world_size == 1 or nbytes < NATIVE_BELOW or backend != "mpi":
        return "native"
    if nbytes < 2 * MiB:
        return "tree"
    if nbytes < 8 * MiB:
        return "native"
    return "ring"


def broadcast_choice(nbytes: int, world_size: int, backend: str) -> str:
    return "native"


def reduce_scatter_choice(nbytes: int, world_size: int, backend: str) -> str:
    return "ring"  # native has no reduce-scatter here: it would all-reduce everything


def all_gather_choice(nbytes: int, world_size: int, backend: str) -> str:
    return "ring"  # native has no all-gather here: it would broadcast n times
