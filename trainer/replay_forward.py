r"""Replaying `allreduce:overlap=forward`: the next forward under the last buckets.

trainer.replay's simulate() times one step whose forward starts after every bucket is
reduced. With overlap=forward (collectives/priority.py, collectives/step_in_forward.py)
the schedule changes, not the buckets: backward returns at once, the communication
thread reduces the buckets in chunks, the bucket of the earliest layers first (a
bucket launched later overtakes the rest of one launched earlier), and each layer of
the next forward waits only for its own bucket, then takes its optimizer step. So a
step no longer ends when communication does; it is simulated over several steps until
it repeats (`simulate_forward_overlap`), from the same traced step as plain allreduce:
the same buckets, ready at the same moments of backward, in chunks of the size
collectives/priority.py picks for the cluster from the cost model.

The trace times the forward as a whole, not layer by layer. The replay gives each
bucket's layers the share of the forward that the backward spent making that bucket's
gradients (backward runs the same layers, in reverse, at about twice a forward's
cost): bucket k's layers take forward x (ready_k - ready_{k-1}) / ready_last. The
optimizer's time is shared by bytes. Every chunk costs what our `auto` would run for
its bytes, plus the small all-reduce in which the ranks agree on it, plus its share of
the bucket's measured CPU work:

    training thread:  [fwd: wait b2, opt b2, layers b2 | b1 .. | b0 ..] backward ..... | next
    comm thread:      .. [b1 c3][b0 c1][b0 c0]            [b0 c0 c1][b1 c0][b2 c0][b1 c1] ..
                                  ^ this step's last chunks    ^ b2 launched: overtakes b1
"""
from __future__ import annotations

import math
from typing import Callable, List, Tuple

STEPS = 8  # simulated steps: enough for the schedule to repeat (it does from the second)


def forward_shares(profile) -> List[float]:
    """Each bucket's share of the forward: the share of backward's compute that made its
    gradients (bucket 0 is ready first: the last layers)."""
    ready = [bucket.ready_s for bucket in profile.buckets]
    last = ready[-1] if ready and ready[-1] > 0 else 0.0
    if not last:  # all ready at once: by bytes
        total = sum(bucket.nbytes for bucket in profile.buckets) or 1
        return [bucket.nbytes / total for bucket in profile.buckets]
    return [(r - (ready[k - 1] if k else 0.0)) / last for k, r in enumerate(ready)]


class _CommThread:
    """The communication thread: launched buckets reduced chunk by chunk, always the
    next chunk of the highest bucket launched (the earliest layers)."""

    def __init__(self, chunk: int, chunk_seconds: Callable[[int, int], float]):
        self.chunk, self.chunk_seconds = chunk, chunk_seconds
        self.free_at = 0.0

    def run(self, launches: List[float], sizes: List[int]) -> List[float]:
        """When each bucket's last chunk ends, the buckets launched at `launches`."""
        left = list(sizes)
        done = [launches[k] if not sizes[k] else math.inf for k in range(len(sizes))]
        now = self.free_at
        while any(left):
            waiting = [k for k in range(len(left)) if left[k] and launches[k] <= now]
            if not waiting:  # idle until the next launch
                now = min(launches[k] for k in range(len(left)) if left[k])
                continue
            k = max(waiting)
            piece = min(self.chunk, left[k])
            now += self.chunk_seconds(k, piece)
            left[k] -= piece
            if not left[k]:
                done[k] = now
        self.free_at = now
        return done


def simulate_forward_overlap(profile, scale: float, chunk: int,
                             reduce: Callable[[float], float],
                             own: float = 0.0) -> Tuple[float, float]:
    """(seconds a step, of which waited) for `profile` (trainer.replay's TracedStep of
    plain allreduce: its buckets) under overlap=forward, compute divided by `scale`,
    buckets reduced in chunks of `chunk` bytes, `reduce(nbytes)` the seconds of one
    all-reduce; `own`: seconds of collectives on the training thread in each forward
    (buffer broadcasts), waited in full."""
    buckets = profile.buckets
    forward, backward = profile.forward_s / scale, profile.backward_s / scale
    optimizer = profile.optimizer_s / scale
    between = (profile.writeback_s + profile.moment_s) / scale  # backward's end to the next forward
    total = sum(bucket.nbytes for bucket in buckets) or 1
    shares = forward_shares(profile)
    agreement = reduce(8)  # the ranks agree on each chunk with one tiny all-reduce

    def chunk_seconds(k: int, nbytes: int) -> float:
        work = buckets[k].work_s / scale * nbytes / buckets[k].nbytes if buckets[k].nbytes else 0
        return agreement + work + reduce(nbytes)

    comm = _CommThread(chunk, chunk_seconds)
    done = [0.0] * len(buckets)  # when the step before's buckets were reduced
    starts, waits = [], []
    now = 0.0
    for _ in range(STEPS):
        starts.append(now)
        waited, now = 0.0, now + own
        for k in reversed(range(len(buckets))):  # the first layers' bucket first
            if done[k] > now:
                waited, now = waited + done[k] - now, done[k]
            now += optimizer * buckets[k].nbytes / total + forward * shares[k]
        waits.append(waited)
        launches = [now + bucket.ready_s / scale for bucket in buckets]
        done = comm.run(launches, [bucket.nbytes for bucket in buckets])
        now += backward + between
    return starts[-1] - starts[-2], waits[-2]  # the last whole step, once it repeats
