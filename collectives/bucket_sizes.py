r"""Buckets sized for the link: what `bucket_cap_mb="auto"` picks, and why.

A bucket's reduction cannot start before its last gradient is ready, and it costs a
fixed part (latency, waking threads, the algorithm's steps) plus a part per byte:

    reduce(K bytes) = a + b K

Big buckets pay `a` rarely but start late: the last one holds gradients that backward
produced early, and all of it is reduced after backward ends. Small buckets start
early, but every one pays `a`, and on a slow link the queue of them outlasts backward
anyway. DDP takes 25 MB (the first bucket 1 MB) whatever the link; the right size on a
100 Mbit/s link is not the right one on a 100 Gbit/s link.

So, after a few synced steps with DDP's sizes (`Bucketer.profile()`):

1. `a` and `b` are fitted to the reductions just measured: each bucket's size against
   how long its reduction ran on the communication thread (least squares; nothing
   assumed about the link).
2. Backward is replayed for every candidate layout: the gradients become ready when
   they did in the measured step, the buckets are cut as `assign_buckets` cuts them,
   and one communication thread reduces them in order:

       start(i) = max(ready(i), end(i-1))      end(i) = start(i) + a + b K(i)

   The time backward's end waits for the last reduction is `exposed`.
3. Every bucket also costs CPU that does not depend on its size (`c`: the
   algorithm's calls, messages and steps), fitted the same way to the CPU each
   reduction took on the communication thread. Where ranks share cores
   (more ranks than cores on one machine, as 4 ranks on 2 cores or the emulated
   cluster), that CPU is taken from backward: R ranks on C cores each spending `c`
   more make the step about c R / C longer. So a layout costs

       exposed + buckets x c x R / C          (R / C: `cpu_weight`; 0 where cores
                                               are spare)

   Without the CPU term the replay picks the layout with the least wait, whose many
   small buckets can take more CPU from backward than the wait they save. Measured:
   docs/benchmarks.md, "At 1 Gbit/s the step is bound by CPU: the division done by
   the copy, and buckets that weigh their CPU".
4. The layout that costs least wins; among layouts within 5 % (or 1 ms) of it, the
   one with the fewest buckets, so a fast link is not flooded with small messages
   for nothing. Every rank takes rank 0's choice.

What this leaves out: the CPU of the backend's own threads (gloo's, moving a
bucket's bytes) is not seen from the communication thread, and a step's timings
vary; both are why near-ties go to fewer buckets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

MiB = 1 << 20
CAP_CANDIDATES_MB = (1, 2, 4, 8, 16, 25, 32, 64, 128, 256)
FIRST_CANDIDATES_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128, 256)
NEAR_TIE = 0.05      # layouts this close to the best count as tied ...
NEAR_TIE_S = 1e-3    # ... or this many seconds


@dataclass
class StepProfile:
    """One synced step as the bucketer saw it."""
    param_bytes: List[int]      # each trainable parameter's gradient, in bucket order
    ready_s: List[float]        # when each became ready, seconds after the first
    buckets: List[Tuple[int, float]]  # (bytes, seconds its reduction ran), each bucket
    bucket_cpu_s: List[float] = field(default_factory=list)  # CPU each reduction took


def fit_link(buckets: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """(a, b): reduce(K) = a + b K, least squares over the measured buckets, both kept
    at zero or above. One size only: all of it is taken as per-byte cost."""
    n = len(buckets)
    mean_k = sum(k for k, _ in buckets) / n
    mean_t = sum(t for _, t in buckets) / n
    spread = sum((k - mean_k) ** 2 for k, _ in buckets)
    if spread == 0:
        return 0.0, mean_t / mean_k if mean_k else 0.0
    b = sum((k - mean_k) * (t - mean_t) for k, t in buckets) / spread
    if b <= 0:  # timings that fall with size: noise; take them as fixed cost
        return mean_t, 0.0
    a = mean_t - b * mean_k
    if a < 0:  # through the origin instead
        return 0.0, sum(k * t for k, t in buckets) / sum(k * k for k, _ in buckets)
    return a, b


def cut(param_bytes: Sequence[int], cap_bytes: float, first_bytes: float) -> List[List[int]]:
    """Parameter indices per bucket, as assign_buckets cuts one dtype's parameters."""
    buckets, filling, filled = [], [], 0
    for index, size in enumerate(param_bytes):
        filling.append(index)
        filled += size
        if filled >= (first_bytes if not buckets else cap_bytes):
            buckets.append(filling)
            filling, filled = [], 0
    if filling:
        buckets.append(filling)
    return buckets


def exposed(profile: StepProfile, cap_bytes: float, first_bytes: float,
            a: float, b: float) -> Tuple[float, int]:
    """(seconds the last reduction ends after the last gradient, buckets) for one
    layout, replaying the profiled step."""
    end = 0.0
    buckets = cut(profile.param_bytes, cap_bytes, first_bytes)
    for members in buckets:
        ready = max(profile.ready_s[i] for i in members)
        size = sum(profile.param_bytes[i] for i in members)
        end = max(ready, end) + a + b * size
    return end - max(profile.ready_s), len(buckets)


def cpu_per_bucket(profile: StepProfile) -> float:
    """`c`: the CPU seconds a reduction takes whatever its size, fitted to the measured
    buckets (0 where the profile has no CPU times)."""
    if len(profile.bucket_cpu_s) != len(profile.buckets) or not profile.buckets:
        return 0.0
    return fit_link([(size, cpu) for (size, _), cpu in
                     zip(profile.buckets, profile.bucket_cpu_s)])[0]


def choose(profile: StepProfile, cpu_weight: float = 0.0) -> Tuple[float, float, dict]:
    """(first_bucket_mb, bucket_cap_mb, details) for the profiled step; `cpu_weight`:
    how much longer the step gets for each CPU second a rank's communication takes
    (R / C where R ranks share C cores, else 0)."""
    a, b = fit_link(profile.buckets)
    c = cpu_per_bucket(profile)
    per_bucket = c * cpu_weight  # seconds of step each bucket's CPU costs
    total = sum(profile.param_bytes)
    caps = [mb for mb in CAP_CANDIDATES_MB if mb * MiB < 2 * total] or [CAP_CANDIDATES_MB[0]]
    layouts = []
    for cap in caps:
        for first in FIRST_CANDIDATES_MB:
            if first <= cap:
                seconds, count = exposed(profile, cap * MiB, first * MiB, a, b)
                layouts.append((seconds + count * per_bucket, count, cap, first, seconds))
    best = min(cost for cost, *_ in layouts)
    tied = [layout for layout in layouts
            if layout[0] <= max(best * (1 + NEAR_TIE), best + NEAR_TIE_S)]
    cost, count, cap, first, seconds = min(tied, key=lambda layout: (layout[1], -layout[3],
                                                                     layout[0]))
    return first, cap, dict(a=a, b=b, exposed_s=seconds, buckets=count, best_s=best,
                            cpu_per_bucket_s=c, cpu_weight=cpu_weight)
