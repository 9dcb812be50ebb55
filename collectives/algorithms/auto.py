"""`auto`: pick an algorithm from the message size and the world size.

The thresholds come from `python -m collectives.bench` on a 2-core machine over
loopback (gloo and MPICH); the measured tables are in docs/benchmarks.md. Every rank
computes the same choice from the same numbers, so the ranks always agree.
"""
from __future__ import annotations

# all-reduce: below this many bytes the backend's own collective (one well-tuned
# call, lowest latency) wins; above it our segmented ring wins.
NATIVE_BELOW_BYTES = 256 * 1024


def all_reduce_choice(nbytes: int, world_size: int, backend: str) -> str:
    if world_size == 1:
        return "native"
    if nbytes < NATIVE_BELOW_BYTES:
        return "native"
    return "ring"


def broadcast_choice(nbytes: int, world_size: int, backend: str) -> str:
    return "native"


def reduce_scatter_choice(nbytes: int, world_size: int, backend: str) -> str:
    return "ring"


def all_gather_choice(nbytes: int, world_size: int, backend: str) -> str:
    return "ring"
