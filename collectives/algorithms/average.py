"""`avg` built on any sum algorithm, in arithmetic where the sum cannot overflow.

The textbook average, "sum over ranks in the tensor's dtype, then divide", fails where
the average itself is fine: two ranks holding int8 100 sum to 200, which wraps to -56,
and average to -28; two float16 40000s sum to inf. So each dtype is averaged in a way
whose intermediate values stay within range (n = world size):

    dtype                   how                                           extra cost
    float32, float64        divide first (x/n, in place), then sum        none
    float16, bfloat16       a float32 copy: divide first, sum, round back  2x the bytes
    int8, uint8, int16,     an int64 copy: sum (n values of 32 bits or     2-8x the bytes
      int32                   fewer cannot overflow it), divide, cast back
    int64                   nothing wider: split x = n*q + r (0 <= r < n),  2x the bytes
                              sum the pairs (q, r), average = Q + R // n

Floats divide first, as torch DDP does with each bucket: each x/n is at most the dtype's
largest value over n, so their sum cannot overflow, and the division is the same one
pass over the buffer that dividing afterwards costs (the common float32 path moves
and computes exactly what "sum, then divide" did). For a world of a power of two the
result is bitwise what "sum, then divide" gives wherever that did not overflow; for
other worlds each x/n rounds, one rounding more per element (within the error bound
of the summation itself). float16 divides in float32, not in place: 65504/3 rounds up
to 21840 in float16, and three of those sum past its largest value, 65504, to inf; and
float32 keeps the quotients (and the float16 values that underflow when divided)
exact enough that the result rounds to float16 only once. bfloat16 has float32's range,
so its float32 copy also divides first.

The one float case left: each x/n and each addition rounds (to nearest), so an average
within (n+1) units of roundoff of the largest finite value, |avg| > max * (1 - (n+1)u)
with u = 2**-24 for float32 and 2**-53 for float64, can still round up to inf (float64
1.797e308 on 3 ranks: 1.797e308/3 rounds up, and three of them sum to inf). Closing
that gap would need a wider copy of every float32 buffer; values that large are
already beyond any training.

Integers round down, toward minus infinity, like Python's //: the average of 3 and 4
is 3, of -3 and -4 is -4. That is floor(sum / n), exactly, for every dtype: the int64
split is exact because floor((n*Q + R) / n) = Q + floor(R / n) for the sums Q of the
quotients and R of the remainders. Q itself can step past int64's range by at most n
(e.g. n = 3 ranks at -2**63), but int64 addition wraps modulo 2**64 and the final value
lies within range, so it comes out exact all the same.

NCCL and Horovod round an integer average toward zero instead (-3 and -4 average to
-3; -3 and 0 to -1, where // gives -2), and so do the faces that stand in for them (the
torch.distributed backend, collectives/horovod). `toward_zero` turns the average
rounded down into that one: the two differ, by one, exactly where the sum is negative
and not a multiple of n, and the sum's remainder mod n is the sum of each rank's x mod n
taken mod n, which those residues (each in [0, n)) carry without overflow.

Every algorithm (ring, tree, native, ...) only ever sums here, in place, on whatever
buffer it is given; the caller passes `sum_in_place(buffer)`, which runs it.
"""
from __future__ import annotations

from typing import Callable

import torch

SumInPlace = Callable[[torch.Tensor], None]  # sum `buffer` over all ranks, in place


def average(flat: torch.Tensor, world_size: int, sum_in_place: SumInPlace) -> None:
    """flat <- the average of every rank's `flat`, where any sum-over-ranks algorithm
    does the communication. Integers round down (floor, as //)."""
    if flat.is_floating_point():
        _average_floats(flat, world_size, sum_in_place)
    elif flat.dtype == torch.int64:
        _average_int64(flat, world_size, sum_in_place)
    else:
        _average_narrow_integers(flat, world_size, sum_in_place)


def _average_floats(flat: torch.Tensor, n: int, sum_in_place: SumInPlace) -> None:
    """Divide first, then sum: no partial sum exceeds the dtype's largest value."""
    if flat.dtype in (torch.float16, torch.bfloat16):
        wide = flat.float().div_(n)  # float16's own x/n would round up past its top again
        sum_in_place(wide)
        flat.copy_(wide)  # the only rounding to 16 bits
    else:
        flat.div_(n)
        sum_in_place(flat)


def _average_narrow_integers(flat: torch.Tensor, n: int, sum_in_place: SumInPlace) -> None:
    """Sum in int64, which n values of at most 32 bits cannot overflow, then floor."""
    wide = flat.to(torch.int64)
    sum_in_place(wide)
    flat.copy_(wide.div_(n, rounding_mode="floor"))  # the average fits the dtype again


def _average_int64(flat: torch.Tensor, n: int, sum_in_place: SumInPlace) -> None:
    """Split each x into n*q + r, sum quotients and remainders, recombine exactly."""
    quotient = flat.div(n, rounding_mode="floor")
    remainder = flat.remainder(n)  # 0 <= r < n: the remainders sum to at most n(n-1)
    # Interleaved (q0, r0, q1, r1, ...): element i's pair stays in element i's chunk, so a
    # reduce-scatter's rank r still ends with the pairs of chunk r of `flat`.
    pairs = torch.stack([quotient, remainder], dim=1).view(-1)
    sum_in_place(pairs)
    quotients, remainders = pairs.view(-1, 2).unbind(1)
    torch.add(quotients, remainders.div(n, rounding_mode="floor"), out=flat)


def toward_zero(average_rounded_down: torch.Tensor, residue_sums: torch.Tensor,
                world_size: int) -> None:
    """Round an integer average toward zero, in place, as NCCL's and Horovod's avg do.

    average_rounded_down: floor(sum / n), what average() gives; residue_sums: the sum
    over ranks of each element's x mod n (in [0, n)), which is the sum mod n once taken
    mod n. Where the average is negative and the sum is not a multiple of n, floor and
    truncation differ by one: that element moves up by one (never past its dtype's
    range: it moves toward zero)."""
    inexact = residue_sums.remainder(world_size) != 0
    average_rounded_down.add_(((average_rounded_down < 0) & inexact)
                              .to(average_rounded_down.dtype))
