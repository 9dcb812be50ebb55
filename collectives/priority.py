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

Every rank must issue the same collectives in the same order, yet a bucket is launched
at a slightly different moment on each. So before each chunk the ranks agree on how many
buckets every one of them has launched: a tiny all-reduce (min) of their counts. The
choice then depends on that answer and on what has been reduced, which are the same
everywhere. Once every bucket is known to be launched everywhere, no more agreeing is
needed. The chunk size trades that agreement and each chunk's latency against how soon
a bucket can overtake another.

The training thread asks `wait_reduced(bucket, start)` for the parameters it needs: a
bucket's reduced part is always a suffix of it, so a parameter whose slot starts at or
after the suffix's start is ready.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional

import torch

from . import trace
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
    # the agreement priced as our quickest 8-byte all-reduce; the ranks run it as the
    # backend's own (native_all_reduce), 6.9 against 1.9 ms at 100 Mbit/s by the model,
    # which priced so would pick 4 MiB there: measured 2-4 % slower (docs/strategies.md)
    per_byte, agreement = seconds(largest) / largest, seconds(8)
    size = 256 << 10
    while size < largest and (seconds(size) + agreement) / size > (1 + extra) * per_byte:
        size *= 2
    return size


class PriorityReducer:
    """The chunk schedule of one bucketer (see the module docstring). The bucketer calls
    launched() from the training thread as buckets complete and runs run_step() as one
    job of its communication thread per step; anyone may wait_reduced()."""

    def __init__(self, buffers: List[torch.Tensor], reduce_chunk: Callable[[torch.Tensor], None],
                 comm: Transport, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 before: Optional[Callable[[], None]] = None):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes}: use a positive size")
        self.buffers, self.reduce_chunk, self.comm = buffers, reduce_chunk, comm
        self.chunk_elements = [max(1, chunk_bytes // b.element_size()) for b in buffers]
        self.before = before  # a job of the step that goes first (the buffer broadcast)
        self.changed = threading.Condition()
        self.seconds = [0.0] * len(buffers)  # each bucket's reduction time, last step
        self.cpu = [0.0] * len(buffers)      # and the CPU it took on this thread
        self.agreements = 0  # agreement all-reduces of the last step (for reports)
        self.idle_seconds = 0.0  # of the last step, waiting for this rank's launches
        self.start_step()

    # --- the training thread --------------------------------------------------------
    def start_step(self) -> None:
        """Nothing launched or reduced: a new step (before its first launch)."""
        with self.changed:
            self.launched_here = 0
            self.ready: List[Optional[Any]] = [None] * len(self.buffers)  # CUDA events
            self.reduced_from = [b.numel() for b in self.buffers]  # nothing reduced yet
            self.before_done = self.before is None
            self.failed: Optional[BaseException] = None
            self.closed = False

    def launched(self, count: int, ready=None) -> None:
        """This rank has launched its first `count` buckets; on a GPU, `ready` (a CUDA
        event) marks where their gradients are in its buffers."""
        with self.changed:
            for bucket in range(self.launched_here, count):
                self.ready[bucket] = ready
            self.launched_here = count
            self.changed.notify_all()

    def wait_before(self) -> None:
        """Block until the step's `before` job has run."""
        self._wait(lambda: self.before_done)

    def wait_reduced(self, bucket: int, start: int) -> None:
        """Block until `bucket` is reduced from element `start` to its end."""
        self._wait(lambda: self.reduced_from[bucket] <= start)

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
        """Wake a run_step() waiting for launches that will not come (the job ends)."""
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
            self.agreements, self.idle_seconds = 0, 0.0
            agreed = 0  # buckets launched on every rank
            count = len(self.buffers)
            while True:
                pending = [b for b in range(agreed) if self.reduced_from[b] > 0]
                if agreed < count:
                    if not pending:  # nothing to do before this rank launches more
                        self._wait_for_launch_beyond(agreed)
                    agreed = self._agree()
                    pending = [b for b in range(agreed) if self.reduced_from[b] > 0]
                elif not pending:
                    return
                if pending:
                    self._reduce_next_chunk(max(pending))
        except BaseException as error:
            with self.changed:
                self.failed = error
                self.changed.notify_all()
            raise

    def _wait_for_launch_beyond(self, agreed: int) -> None:
        started = time.perf_counter()
        with self.changed:
            while self.launched_here <= agreed:
                if self.closed:
                    raise RuntimeError("the bucketer was closed before its buckets launched")
                self.changed.wait(0.5)
        self.idle_seconds += time.perf_counter() - started

    def _agree(self) -> int:
        """How many buckets every rank has launched: the min of the ranks' counts."""
        with self.changed:
            counts = torch.tensor([self.launched_here], dtype=torch.int64)
        self.comm.native_all_reduce(counts, "min")
        self.agreements += 1
        return int(counts.item())

    def _reduce_next_chunk(self, bucket: int) -> None:
        end = self.reduced_from[bucket]
        start = max(0, end - self.chunk_elements[bucket])
        chunk = self.buffers[bucket][start:end]
        started, cpu = time.perf_counter(), time.thread_time()
        with trace.span(f"bucket {bucket} [{start}:{end}]", cat="comm",
                        bytes=chunk.numel() * chunk.element_size()):
            if self.ready[bucket] is not None:  # this thread's stream waits for them
                torch.cuda.current_stream(chunk.device).wait_event(self.ready[bucket])
            self.reduce_chunk(chunk)
            if chunk.is_cuda:  # reduced_from promises the bytes are in place
                torch.cuda.current_stream(chunk.device).synchronize()
        self.seconds[bucket] += time.perf_counter() - started
        self.cpu[bucket] += time.thread_time() - cpu
        with self.changed:
            self.reduced_from[bucket] = start
            self.changed.notify_all()
