"""One step's gradient buckets reduced in chunks, those the next forward needs first.

DDP reduces buckets first in, first out. Backward produces the last layers' gradients
first, so the bucket holding the first layers (conv1, layer1) is launched last and
reduced last; yet the next forward needs exactly those parameters first. With the
optimizer stepping each parameter as its gradient lands (step_in_forward.py), the next
forward can start as soon as its first layers are reduced, while the rest of the
buckets are still on the wire: if they are sent first. This is P3's order (Jayarajan et
al., MLSys 2019) with ByteScheduler's partitioning (Peng et al., SOSP 2019):

    backward launches:   b0 (fc, layer4)      b1 (layer3, layer2)     b2 (layer1, conv1)
    FIFO, whole buckets: [b0 .............][b1 ..........][b2 .........]  forward waits
    here, in chunks:     [b0 b0][b1 b1][b2 b2 b2 b2][b1 b1][b0 b0 b0]
                                             ^ forward starts: conv1, layer1 are reduced

The communication thread always reduces the next chunk of the highest bucket launched
(the highest index holds the earliest layers) and, inside a bucket, its chunks from the
end (the flat buffer holds parameters in reverse order: the first layers come last). A
bucket launched later preempts the rest of one launched earlier at the next chunk.

A bucket is launched when its last gradient is in, yet its first ones (the flat buffer
holds them in the order backward produced them) are in long before: ResNet-18's second
bucket waits for most of layer4 and layer3. Where nothing launched is left to reduce,
the link would idle until then; so the thread reduces the next bucket's head instead,
chunk by chunk from its start, as far as its gradients are in on every rank (P3 and
ByteScheduler send each slice as soon as it is ready). Once the bucket is launched, the
rest of it goes by priority from its end, down to where its head reached:

    bucket 1:  [head: reduced early ->)[ .. not yet .. ][<- from the end, by priority]
               0                    early_to        reduced_from              numel

Every rank must issue the same collectives in the same order, yet a gradient is ready
at a slightly different moment on each. So before each chunk the ranks agree on how far
every one of them has got: a tiny all-reduce (min) of their positions, where a position
is the elements of the buckets launched plus the ready head of the next one (buckets
launch in order, so one number says both). The choice then depends on that answer and
on what has been reduced, which are the same everywhere. Once every bucket is known to
be launched everywhere, no more agreeing is needed. The chunk size trades that
agreement and each chunk's latency against how soon a bucket can overtake another.

The training thread asks `wait_reduced(bucket, start, end)` for the parameters it
needs: a bucket's unreduced part is always one run of it, [early_to, reduced_from), so
a parameter whose slot misses that run is ready.
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import Any, Callable, List, Optional

import torch

from . import api, trace
from .transport import Transport

DEFAULT_CHUNK_BYTES = 4 << 20  # where the cost model does not apply (NCCL)
CHUNK_EXTRA = 0.02  # what a chunk's fixed costs may add to its bytes' time


def chunk_bytes_for(comm: Transport, extra: float = CHUNK_EXTRA) -> int:
    """The chunk size for this job's links (`chunk_bytes`, with this job's shape,
    links and transport); NCCL's own default where the cost model does not apply."""
    from .algorithms.auto import job_constants, model_constants_path, shape_of
    from .launch.links import link_rate_bytes
    if comm.world_size == 1 or comm.name.split("+")[0] == "nccl":
        return DEFAULT_CHUNK_BYTES
    shape = shape_of(comm.world_size, comm.topology)
    constants = job_constants(model_constants_path(), shape, link_rate_bytes() or 0.0,
                              comm.name)
    return chunk_bytes(shape, constants, extra)


def chunk_bytes(shape, constants, extra: float = CHUNK_EXTRA) -> int:
    """The smallest power of two, from 256 KiB to 64 MiB, whose all-reduce together
    with its agreement the cost model says takes at most `extra` longer per byte than a
    64 MiB all-reduce, for ranks placed as `shape` (costs.Shape) on machines of
    `constants`. Smaller chunks let a bucket overtake sooner; each costs a few
    latencies and a call. (The model's answers on its calibration, 4 emulated hosts of
    one rank: 1 MiB at 100 Mbit/s, 8 MiB at 1 Gbit/s; 64 MiB on one host, where
    overtaking gains nothing.)"""
    from .algorithms import COSTS

    def seconds(nbytes: int) -> float:
        return min(cost(nbytes, shape, constants) for cost in COSTS["all_reduce"].values())

    largest = 64 << 20
    per_byte, agreement = seconds(largest) / largest, seconds(8)  # auto's, as it runs
    size = 256 << 10
    while size < largest and (seconds(size) + agreement) / size > (1 + extra) * per_byte:
        size *= 2
    return size


class PriorityReducer:
    """The chunk schedule of one bucketer (see the module docstring). The bucketer calls
    launched() from the training thread as gradients come in and runs run_step() as one
    job of its communication thread per step; anyone may wait_reduced()."""

    def __init__(self, buffers: List[torch.Tensor], reduce_chunk: Callable[[torch.Tensor], None],
                 comm: Transport, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 before: Optional[Callable[[], None]] = None):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes}: use a positive size")
        self.buffers, self.reduce_chunk, self.comm = buffers, reduce_chunk, comm
        self.chunk_elements = [max(1, chunk_bytes // b.element_size()) for b in buffers]
        self.starts = [0]  # where each bucket starts in a position (the module docstring)
        for buffer in buffers:
            self.starts.append(self.starts[-1] + buffer.numel())
        self.before = before  # a job of the step that goes first (the buffer broadcast)
        self.changed = threading.Condition()
        self.seconds = [0.0] * len(buffers)  # each bucket's reduction time, last step
        self.cpu = [0.0] * len(buffers)      # and the CPU it took on this thread
        self.agreements = 0  # agreement all-reduces of the last step (for reports)
        self.early_chunks = 0  # chunks of the last step reduced before their bucket launched
        self.idle_seconds = 0.0  # of the last step, waiting for this rank's gradients
        self.start_step()

    # --- the training thread --------------------------------------------------------
    def start_step(self) -> None:
        """Nothing launched or reduced: a new step (before its first gradient)."""
        with self.changed:
            self.launched_here = 0  # buckets this rank has launched
            self.head_here = 0  # elements of the next one whose gradients are in
            self.ready: List[Optional[Any]] = [None] * len(self.buffers)  # CUDA events
            self.head_ready: Optional[Any] = None  # and the head's
            self.reduced_from = [b.numel() for b in self.buffers]  # nothing reduced yet
            self.early_to = [0] * len(self.buffers)
            self.before_done = self.before is None
            self.failed: Optional[BaseException] = None
            self.closed = False

    def launched(self, count: int, head: int = 0, ready=None) -> None:
        """This rank has launched its first `count` buckets, and the gradients of the
        next one's first `head` elements are in it; on a GPU, `ready` (a CUDA event)
        marks where all of them are in their buffers."""
        with self.changed:
            for bucket in range(self.launched_here, count):
                self.ready[bucket] = ready
            self.launched_here, self.head_here, self.head_ready = count, head, ready
            self.changed.notify_all()

    def wait_before(self) -> None:
        """Block until the step's `before` job has run."""
        self._wait(lambda: self.before_done)

    def wait_reduced(self, bucket: int, start: int, end: int) -> None:
        """Block until elements `start` to `end` of `bucket` are reduced."""
        self._wait(lambda: max(start, self.early_to[bucket])
                   >= min(end, self.reduced_from[bucket]))

    def unreduced(self) -> List[int]:
        """Each bucket's elements not reduced yet."""
        with self.changed:
            return [max(0, end - start) for start, end in zip(self.early_to, self.reduced_from)]

    def _wait(self, done: Callable[[], bool]) -> None:
        """Block until done(); raise the communication thread's error instead."""
        with self.changed:
            while not done():
                if self.failed is not None:
                    raise self.failed
                if self.closed:
                    raise RuntimeError("the bucketer was closed with its reduction unfinished")
                self.changed.wait(0.5)

    def close(self) -> None:
        """Wake a run_step() waiting for gradients that will not come (the job ends)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    # --- the communication thread ----------------------------------------------------
    def run_step(self) -> None:
        """Reduce every bucket of this step, chunk by chunk, by priority."""
        try:
            if self.before is not None:
                self.before()
                if torch.cuda.is_initialized():  # before_done promises its copies landed
                    torch.cuda.current_stream().synchronize()
                with self.changed:
                    self.before_done = True
                    self.changed.notify_all()
            self.seconds = [0.0] * len(self.buffers)
            self.cpu = [0.0] * len(self.buffers)
            self.agreements, self.early_chunks, self.idle_seconds = 0, 0, 0.0
            self._schedule()
        except BaseException as error:
            with self.changed:
                self.failed = error
                self.changed.notify_all()
            raise

    def _schedule(self) -> None:
        """One chunk at a time: of the highest launched bucket with anything unreduced;
        if none, of the next bucket's head, as far as every rank has its gradients."""
        agreed = head = 0  # buckets launched on every rank; the next one's head there
        count = len(self.buffers)
        while True:
            if agreed < count:
                if self._highest_unreduced(agreed) is None and not self._head_chunk_fits(
                        agreed, head):
                    self._wait_for_gradients(agreed)
                agreed, head = self._agree()
            bucket = self._highest_unreduced(agreed)
            if bucket is not None:
                self._reduce_next_chunk(bucket)
            elif agreed == count:
                return
            elif self._head_chunk_fits(agreed, head):
                self._reduce_head_chunk(agreed)

    def _highest_unreduced(self, launched: int) -> Optional[int]:
        """The highest of the first `launched` buckets with anything unreduced, if any."""
        return next((b for b in reversed(range(launched))
                     if self.reduced_from[b] > self.early_to[b]), None)

    def _head_chunk_fits(self, bucket: int, head: int) -> bool:
        """Whether a whole chunk of `bucket`'s head, beyond what went early, is in."""
        return head - self.early_to[bucket] >= self.chunk_elements[bucket]

    def _wait_for_gradients(self, agreed: int) -> None:
        """Until this rank has launched bucket `agreed`, or a chunk more of its head."""
        started = time.perf_counter()
        with self.changed:
            while not (self.launched_here > agreed
                       or self._head_chunk_fits(agreed, self.head_here)):
                if self.closed:
                    raise RuntimeError("the bucketer was closed before its buckets launched")
                self.changed.wait(0.5)
        self.idle_seconds += time.perf_counter() - started

    def _agree(self) -> tuple:
        """How far every rank has got: the min of the ranks' positions, as (buckets
        launched, elements of the next one's head)."""
        with self.changed:
            position = self.starts[self.launched_here] + self.head_here
        counts = torch.tensor([position], dtype=torch.int64)
        # auto's choice for 8 bytes (naive or a tree across hosts: a third of gloo's
        # own there); check=False: every rank sends one int64, always
        api.all_reduce(counts, op="min", comm=self.comm, check=False)
        self.agreements += 1
        position = int(counts.item())
        bucket = bisect.bisect_right(self.starts, position) - 1
        if bucket == len(self.buffers):
            return bucket, 0
        return bucket, position - self.starts[bucket]

    def _reduce_next_chunk(self, bucket: int) -> None:
        """The chunk at the end of `bucket`'s unreduced run."""
        end = self.reduced_from[bucket]
        start = max(self.early_to[bucket], end - self.chunk_elements[bucket])
        self._reduce(bucket, start, end, self.ready[bucket])
        with self.changed:
            self.reduced_from[bucket] = start
            self.changed.notify_all()

    def _reduce_head_chunk(self, bucket: int) -> None:
        """The chunk at the start of `bucket`'s unreduced run, before it is launched."""
        start = self.early_to[bucket]
        end = start + self.chunk_elements[bucket]
        with self.changed:  # this rank's head covers the agreed one: its event does too
            ready = self.ready[bucket] if self.launched_here > bucket else self.head_ready
        self._reduce(bucket, start, end, ready)
        self.early_chunks += 1
        with self.changed:
            self.early_to[bucket] = end
            self.changed.notify_all()

    def _reduce(self, bucket: int, start: int, end: int, ready) -> None:
        chunk = self.buffers[bucket][start:end]
        started, cpu = time.perf_counter(), time.thread_time()
        with trace.span(f"bucket {bucket} [{start}:{end}]", cat="comm",
                        bytes=chunk.numel() * chunk.element_size()):
            if ready is not None:  # this thread's stream waits for the gradients
                torch.cuda.current_stream(chunk.device).wait_event(ready)
            self.reduce_chunk(chunk)
            if chunk.is_cuda:  # the reduced run promises the bytes are in place
                torch.cuda.current_stream(chunk.device).synchronize()
        self.seconds[bucket] += time.perf_counter() - started
        self.cpu[bucket] += time.thread_time() - cpu
