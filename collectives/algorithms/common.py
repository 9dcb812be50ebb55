"""Small pieces every algorithm shares: splitting a buffer into chunks and segments.

(Reducing one buffer into another, `reduce_into`, lives with the transport, which can
fold a message in as it arrives: Transport.irecv_reduce.)"""
from __future__ import annotations

from typing import List, Tuple


def chunk_bounds(numel: int, parts: int) -> List[int]:
    """Offsets that split `numel` elements into `parts` nearly equal chunks.

    Chunk i is [bounds[i], bounds[i+1]). Sizes differ by at most one, the larger ones
    first, and chunks may be empty when numel < parts:
        chunk_bounds(10, 4) -> [0, 3, 6, 8, 10]      chunk_bounds(2, 4) -> [0, 1, 2, 2, 2]
    """
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segments(start: int, stop: int, segment_elems: int) -> List[Tuple[int, int]]:
    """[start, stop) cut into pieces of at most `segment_elems` (none when empty)."""
    return [(lo, min(lo + segment_elems, stop)) for lo in range(start, stop, segment_elems)]
