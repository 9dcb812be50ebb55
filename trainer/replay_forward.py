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
cost): bucket k's layers take forward x (ready_k - ready_{k-1}) / ready_last. Each
layer's optimizer step and the copy of its reduced gradient (plain allreduce's
writeback) come before its forward, shared by bytes. The communication thread runs
as priority.py's does: the buffer broadcast as the step's first job (DDP's, at the
step's first gradient), then every chunk at what our `auto` would run for its bytes
plus its share of the bucket's measured CPU work, each preceded, until every bucket
has launched, by the small all-reduce (auto's choice for 8 bytes) in which the ranks
agree on how far they have got. With nothing launched left, it reduces the next bucket's head as
its gradients come in: the trace times only each bucket's launch, so a bucket's
gradients are taken to come in at an even pace from the launch before it (the first
from backward's start) to its own.

Where it departs from the real schedule: a layer waits here for its whole bucket,
where the real forward waits only for the chunks holding its own parameters (each
bucket is sent from its first layers on); so the model is slower than the real
schedule where the forward could have started on a bucket's first chunks, most where
the step is not bound by the link. A real head grows a whole parameter at a time and
never takes in the bucket's last one, so where that parameter is large (ResNet-18's
first bucket ends with a 9 MB convolution) the model sends head chunks that the real
schedule cannot, and its comm thread starts at backward's start, not at the first
gradient. A bucket of no bytes costs no agreement of its own here, and the next
forward waits for the buffer broadcast only through the buckets behind it.

    training thread:  [fwd: wait b2, opt b2, layers b2 | b1 .. | b0 ..] backward ..... | next
    comm thread:      .. [b1 c3][b0 c1][b0 c0]            [b0 c0 c1][b1 c0][b2 c0][b1 c1] ..
                                  ^ this step's last chunks    ^ b2 launched: overtakes b1
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

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
    """The communication thread of one step (priority.PriorityReducer.run_step): at the
    step's first gradient, its first job (`before`: the buffer broadcast), then chunk
    by chunk, always the next chunk of the highest bucket launched (the earliest
    layers); with none launched left, a chunk of the next bucket's head, whose
    gradients come in at an even pace from `fills[k]` to its launch. Until every bucket
    has been seen launched, each chunk is preceded by the ranks' agreement on how far
    they are (`agreement` seconds), which sees what came in before it began; when
    nothing agreed is left, it waits for a launch or for a head's next chunk."""

    def __init__(self, chunk: int, chunk_seconds: Callable[[int, int], float],
                 agreement: float = 0.0, before: float = 0.0):
        if chunk <= 0:
            raise ValueError(f"chunks of {chunk} bytes")
        self.chunk, self.chunk_seconds = chunk, chunk_seconds
        self.agreement, self.before = agreement, before
        self.free_at = 0.0

    def run(self, launches: List[float], sizes: List[int],
            fills: Optional[List[float]] = None) -> List[float]:
        """When each bucket's last chunk ends, the buckets launched at `launches`, their
        gradients coming in from `fills` (None: each all at its launch)."""
        n = len(sizes)
        fills = list(launches) if fills is None else fills
        left, early = list(sizes), [0] * n
        done = [launches[k] if not sizes[k] else math.inf for k in range(n)]
        if not any(left):
            return done

        def head_time(k: int) -> float:  # when a whole chunk more of k's head is in
            if k >= n or early[k] + self.chunk >= sizes[k]:
                return math.inf  # its launch comes first
            return fills[k] + (early[k] + self.chunk) / sizes[k] * (launches[k] - fills[k])

        def head_fits(k: int, at: float) -> bool:  # ... and k not launched yet
            return head_time(k) <= at < launches[k]

        def next_to_launch(at: float) -> int:  # the first bucket not launched by then
            return next((k for k in range(n) if launches[k] > at), n)

        now = max(self.free_at, min(fills)) + self.before
        seen = -math.inf  # what came in at or before this moment is agreed
        while any(left):
            if seen < math.inf:
                nxt = next_to_launch(now)
                if (not any(left[k] and launches[k] <= now for k in range(n))
                        and not head_fits(nxt, now)):
                    later = [launches[k] for k in range(n) if left[k] and launches[k] > now]
                    now = max(now, min(later + [head_time(nxt)]))  # idle until then
                seen = now
                now += self.agreement
                if all(launch <= seen for launch in launches):
                    seen = math.inf  # every bucket agreed: no more agreements this step
            waiting = [k for k in range(n) if left[k] and launches[k] <= seen]
            if waiting:
                k = max(waiting)
                piece = min(self.chunk, left[k])
            else:  # the thread idled until a launch or a head's chunk: this one
                k, piece = next_to_launch(seen), self.chunk
                assert head_fits(k, seen), "an agreement always sees a chunk to send"
                early[k] += piece
            now += self.chunk_seconds(k, piece)
            left[k] -= piece
            if not left[k]:
                done[k] = now
        self.free_at = now
        return done


def simulate_forward_overlap(profile, scale: float, chunk: int,
                             reduce: Callable[[float], float], agreement: float = 0.0,
                             before: float = 0.0) -> Tuple[float, float]:
    """(seconds a step, of which waited) for `profile` (trainer.replay's TracedStep of
    plain allreduce: its buckets) under overlap=forward, compute divided by `scale`,
    buckets reduced in chunks of `chunk` bytes, `reduce(nbytes)` the seconds of one
    all-reduce, `agreement` those of one agreement, `before` those of the comm
    thread's first job of a step (the buffer broadcast DDP does there)."""
    buckets = profile.buckets
    forward, backward = profile.forward_s / scale, profile.backward_s / scale
    # what each layer does before its forward: its optimizer step and the copy of its
    # reduced gradient (plain allreduce's writeback, here layer by layer), by bytes
    stepping = (profile.optimizer_s + profile.writeback_s) / scale
    moment = profile.moment_s / scale  # backward's end to the next forward
    total = sum(bucket.nbytes for bucket in buckets)
    if not total:  # nothing to reduce: the forward waits for nothing
        return forward + backward + stepping + moment, 0.0
    shares = forward_shares(profile)

    def chunk_seconds(k: int, nbytes: int) -> float:
        work = buckets[k].work_s / scale * nbytes / buckets[k].nbytes
        return work + reduce(nbytes)

    comm = _CommThread(chunk, chunk_seconds, agreement, before)
    done = [0.0] * len(buckets)  # when the step before's buckets were reduced
    starts, waits = [], []
    now = 0.0
    for _ in range(STEPS):
        starts.append(now)
        waited = 0.0
        for k in reversed(range(len(buckets))):  # the first layers' bucket first
            if done[k] > now:
                waited, now = waited + done[k] - now, done[k]
            now += stepping * buckets[k].nbytes / total + forward * shares[k]
        waits.append(waited)
        launches = [now + bucket.ready_s / scale for bucket in buckets]
        fills = [now] + launches[:-1]  # each bucket fills after the one before
        done = comm.run(launches, [bucket.nbytes for bucket in buckets], fills)
        now += backward + moment
    return starts[-1] - starts[-2], waits[-2]  # the last whole step, once it repeats
