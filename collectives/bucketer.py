r"""Gradient bucketing with communication overlapped with backward, as DDP does it.

Reducing every gradient separately costs one message latency per parameter (ResNet-18
has 62); reducing them all at the end wastes the time backward spends computing. The
bucketer does what DDP's Reducer does:

1. Assignment (once). Parameters that need gradients, in reverse registration order
   (roughly the order backward produces their gradients), are grouped by device and
   dtype into flat buckets of at most `bucket_cap_mb` (the first one only
   `first_bucket_mb`, so communication starts early):

       params (reverse order):  fc.w fc.b | layer4... | ... | conv1.w
       buckets:                 [ 1 MiB ] [  25 MiB  ] ...  [ rest ]

2. Backward. A hook fires when a parameter's gradient has been accumulated
   (Tensor.register_post_accumulate_grad_hook). The gradient is copied into its slot
   of the bucket (or already lives there, with gradient_as_bucket_view). When a
   bucket's last gradient arrives, the bucket is handed to a communication thread,
   which runs `reduce_bucket(flat_buffer)` while backward goes on computing earlier
   layers. Buckets are launched strictly in index order, so every rank issues the same
   collectives in the same order even if its hooks fire in a different order. A
   strategy that averages (`divisor`, asked once a step) gets its gradients already
   divided by the world size: the copy into the bucket divides, as DDP's Reducer's
   does, instead of a pass over the bucket of its own.

3. Finish. `finish()` waits for every bucket and writes the reduced values back into
   `param.grad`. DDP mode calls it automatically when backward ends (an autograd engine
   callback); the Horovod face calls it from optimizer.step(). (Buckets reduced by
   priority, priority.py: it hands the step over instead, and the next forward takes
   each layer's gradients as they land, step_in_forward.py.)

Each synced step leaves a profile (`profile()`): when every gradient became ready, how
long each bucket's reduction ran and what CPU it took. bucket_sizes.py sizes the
buckets from it (DDP's bucket_cap_mb="auto").

Accumulation: a step may be several backward passes. DDP's no_sync() passes
(`enabled = False`) only accumulate into .grad; the next pass outside it reduces.
Horovod's backward_passes_per_step = k (`passes_per_sync`): a gradient is put in its
bucket on its k-th arrival of the step, the sum of its k passes (a (k+1)-th arrival is
an error). Arrival counts and the "used" marks below start afresh when a step's
reduction is done (finish(), shadow()).

Parameters without a gradient this step (a conditional or multi-task model, a frozen
branch): ranks may differ in which parameters they used, and every rank must still take
part in every bucket's reduction, or the ranks that did use them wait forever. So at
finish() each gradient that did not arrive (this pass, or its k-th time) is filled in
with what the parameter holds, as DDP's Reducer and Horovod's synchronize() do: the .grad
it accumulated in the step's earlier passes (no_sync(), or fewer than k passes), or zeros
if it has none. The rest of the buckets are then launched, on every rank, in the same
order. What happens next is the `unused` mode:

    "error"   DDP's default: after the round completes, raise on the rank that had
              missing gradients, naming them (find_unused_parameters=False).
    "detect"  DDP's find_unused_parameters=True: a tiny all-reduce of a "used" map, the
              last job of every step on every rank, tells which parameters no rank used
              in any pass since the last reduction (no_sync() passes count: a parameter
              used there on one rank is averaged like any other); their .grad is left
              untouched, exactly as DDP does.
    "zeros"   Horovod's rule: every parameter's .grad gets the reduced value, zeros
              included.

    a used inside no_sync() on rank 0 only, "detect":
        rank 0:  no_sync pass: a.grad = g   syncing pass: no a   finish: sends g
        rank 1:  no_sync pass: -            syncing pass: no a   finish: sends zeros
        used map (max over ranks): a used   ->   a.grad = (g + 0) / 2 on both ranks
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Sequence

import torch

from . import trace
from .bucket_sizes import StepProfile
from .launch.exit import stop_at_exit
from .priority import PriorityReducer
from .transport import Transport

MiB = 1 << 20
UNUSED_MODES = ("error", "detect", "zeros")
_UNASKED = object()  # a step's divisor before its first gradient asks for it


@dataclass
class Bucket:
    """One flat buffer and the parameters whose gradients live in it."""
    index: int
    params: List[torch.nn.Parameter]
    offsets: List[int]              # where each parameter's gradient starts in `buffer`
    buffer: torch.Tensor            # flat gradients, one dtype and device
    ready: List[bool] = field(default_factory=list)  # in the buffer for this reduction
    used: List[bool] = field(default_factory=list)   # a gradient arrived since the last one

    def slot(self, position: int) -> torch.Tensor:
        param = self.params[position]
        start = self.offsets[position]
        return self.buffer[start:start + param.numel()].view_as(param)


def assign_buckets(params: Sequence[torch.nn.Parameter], bucket_cap_mb: float,
                   first_bucket_mb: float) -> List[List[torch.nn.Parameter]]:
    """Group parameters (already in reverse order) into buckets by device, dtype and size.

    As DDP: each (device, dtype) group fills a bucket until it reaches its limit
    (the group's first bucket `first_bucket_mb`, later ones `bucket_cap_mb`), then
    starts the next. A bucket may pass its limit by one parameter.
    """
    filling: Dict[tuple, List[torch.nn.Parameter]] = {}
    filled_bytes: Dict[tuple, int] = {}
    closed_count: Dict[tuple, int] = {}
    done: List[List[torch.nn.Parameter]] = []
    for param in params:
        key = (param.device, param.dtype)
        filling.setdefault(key, []).append(param)
        filled_bytes[key] = filled_bytes.get(key, 0) + param.numel() * param.element_size()
        limit = (first_bucket_mb if closed_count.get(key, 0) == 0 else bucket_cap_mb) * MiB
        if filled_bytes[key] >= limit:
            done.append(filling.pop(key))
            filled_bytes[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    done.extend(bucket for bucket in filling.values() if bucket)
    return done


class CommWorker:
    """A thread that runs communication jobs one at a time, in submission order.

    On a GPU the jobs run on a CUDA stream of their own, as torch's DDP runs its
    communication: a job waits only for the GPU work its submitter had queued when it
    submitted it (a bucket's gradients copied in), not for the backward work queued
    after (the next layers' gradients), and a job is done when its GPU work is.

    Each worker is stopped (and joined, briefly) before the process closes the
    communicators at exit: see launch/exit.py.
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.jobs: "queue.Queue" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.busy_seconds = 0.0  # time spent communicating, for reports
        self.on_stop: Optional[Callable[[], None]] = None
        # The GPU this thread works on, for NCCL and CUDA's memory (a new thread starts on
        # GPU 0): `device`'s (the communicator's), else the creating thread's current one.
        if device is not None and device.type == "cuda":
            self.gpu = device
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            self.gpu = torch.device("cuda", torch.cuda.current_device())
        else:
            self.gpu = None
        self.thread = threading.Thread(target=self._run, name="collectives-comm", daemon=True)
        self.thread.start()
        stop_at_exit(self)

    def _run(self) -> None:
        stream = None
        if self.gpu is not None:  # a new thread starts on GPU 0: take the creator's
            try:
                torch.cuda.set_device(self.gpu)
                stream = torch.cuda.Stream(self.gpu)
            except BaseException as error:  # every job then ends at once with it
                self.error = error
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while True:
                job, done, name, args, ready_ns, ready = self.jobs.get()
                if job is None:
                    return
                started = time.perf_counter()
                try:
                    if self.error is None:
                        if ready is not None and stream is not None:
                            stream.wait_event(ready)
                        if ready_ns is None:  # not tracing
                            job()
                        else:  # the span says how long the job waited in the queue too
                            queued_ms = (time.perf_counter_ns() - ready_ns) / 1e6
                            with trace.span(name, cat="comm", queued_ms=queued_ms, **args):
                                job()
                except BaseException as error:  # re-raised on the training thread
                    self.error = error
                finally:
                    self._settle(stream)
                    self.busy_seconds += time.perf_counter() - started
                    done.set()

    def _settle(self, stream) -> None:
        """Wait for the GPU work the job queued (failed or not): done means its tensors
        are written and free to reuse."""
        if stream is None:
            return
        try:
            stream.synchronize()
        except BaseException as error:
            self.error = self.error or error

    def mark_ready(self) -> Optional["torch.cuda.Event"]:
        """On a GPU, an event on the calling thread's stream after the work it has
        queued so far: what a job (or a later part of one) must wait for."""
        if self.gpu is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.gpu))
        return event

    def submit(self, job: Callable[[], None], name: str = "communication", span: bool = True,
               **trace_args) -> threading.Event:
        """Queue `job`; `name` and `trace_args` label its span when tracing (none with
        span=False: a job that draws its own, as the buckets by priority do). On a GPU
        the job's work waits for the GPU work queued before this call."""
        done = threading.Event()
        ready_ns = time.perf_counter_ns() if span and trace.active() else None
        self.jobs.put((job, done, name, trace_args, ready_ns, self.mark_ready()))
        return done

    def drain(self) -> None:
        """Wait until every job submitted so far has run (an empty job queued behind
        them is done when they are); re-raise a job's error. Returns at once if the
        thread has stopped."""
        drained = self.submit(lambda: None, "drain")
        while not drained.wait(0.1):
            if not self.thread.is_alive():  # stopped: nothing more will run
                break
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Finish the jobs already submitted, then end the thread. A job that waits for
        what will not come (the training thread's launches, at exit) is told by on_stop."""
        if self.on_stop is not None:
            self.on_stop()
        self.jobs.put((None, None, None, None, None, None))

    def join(self, seconds: float) -> None:
        self.thread.join(seconds)


@dataclass(frozen=True)
class BucketOptions:
    """What a face asks of its buckets. The defaults are DDP's; `horovod()` gives
    Horovod's."""
    # The cut (both faces): the first bucket small, so communication starts early.
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    # What a step is: what a missing gradient means (UNUSED_MODES); whether it ends when
    # backward does (DDP) or when finish() is called (Horovod's optimizer.step()); how
    # many backward passes it sums (Horovod's backward_passes_per_step).
    unused: str = "error"
    finish_after_backward: bool = True
    passes_per_sync: int = 1
    # DDP's own: .grad as a view into its bucket; buckets reduced by priority in chunks
    # of this many bytes (priority.py), with `before_buckets` the step's first job.
    gradient_as_bucket_view: bool = False
    priority_chunk_bytes: Optional[int] = None
    before_buckets: Optional[Callable[[], None]] = None
    # Horovod's own: sparse gradients (nn.Embedding(sparse=True)) reduced as dense
    # tensors and handed back sparse; else by `sparse_reduce(param, grad)`, which starts
    # their reduction and returns a function that waits for the reduced gradient (an
    # allgather of indices and values: their bucket slot then carries zeros); with
    # neither, they are refused.
    sparse_as_dense: bool = False
    sparse_reduce: Optional[Callable[[torch.Tensor, torch.Tensor],
                                     Callable[[], torch.Tensor]]] = None

    @classmethod
    def horovod(cls, bucket_cap_mb: float, passes_per_sync: int, sparse_as_dense: bool,
                sparse_reduce) -> "BucketOptions":
        """Horovod's rules: the step ends in optimizer.step(), every gradient reduced
        (zeros for one that did not arrive)."""
        return cls(bucket_cap_mb=bucket_cap_mb, unused="zeros", finish_after_backward=False,
                   passes_per_sync=passes_per_sync, sparse_as_dense=sparse_as_dense,
                   sparse_reduce=sparse_reduce)

    def check(self) -> None:
        if self.unused not in UNUSED_MODES:
            raise ValueError(f"unused={self.unused!r}: choose from {', '.join(UNUSED_MODES)}")
        if self.priority_chunk_bytes and (self.unused == "detect"
                                          or self.sparse_reduce is not None
                                          or self.gradient_as_bucket_view):
            raise ValueError("buckets reduced by priority (overlap=\"forward\") are still "
                             "being reduced after backward, in no other job of the step: "
                             "find_unused_parameters (static_graph), a sparse reduction "
                             "and gradient_as_bucket_view are not supported with it")


class Bucketer:
    """Flat gradient buckets, filled during backward and reduced on a comm thread."""

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 reduce_bucket: Callable[[torch.Tensor], None], comm: Transport,
                 options: BucketOptions = BucketOptions(),
                 divisor: Optional[Callable[[], Optional[int]]] = None,
                 names: Optional[Dict[int, str]] = None):
        options.check()
        trainable = [p for p in reversed(list(params)) if p.requires_grad]
        self.comm = comm
        self.reduce_bucket = reduce_bucket
        self.options = options  # what the face asked for (BucketOptions)
        self._sparse: Dict[int, int] = {}  # id(param) -> sparse_dim of its gradient
        self._sparse_reduced: Dict[int, Callable[[], torch.Tensor]] = {}  # id -> wait
        # What every gradient is divided by as it goes in its bucket (None: nothing),
        # asked at the first gradient of each step (SyncStrategy.gradient_divisor)
        self.divisor = divisor
        self._step_divisor: object = _UNASKED
        self.names = names or {}
        self.buckets, self.where = _cut_into_buckets(trainable, options.bucket_cap_mb,
                                                     options.first_bucket_mb)
        if options.gradient_as_bucket_view:
            _make_grads_views(self.buckets)
        self.enabled = True  # False inside no_sync(): gradients just accumulate
        self.grad_scale = 1.0  # reduced gradients are multiplied by this: scale_reduced()
        self._arrivals = {id(p): 0 for b in self.buckets for p in b.params}
        self.worker = CommWorker(comm.device)
        # Reduced by priority, in chunks (priority.py): finish() then hands the step over
        # instead of waiting, and take() / complete() end it (step_in_forward.py).
        self.priority = None
        if options.priority_chunk_bytes:
            self.priority = PriorityReducer([b.buffer for b in self.buckets], reduce_bucket,
                                            comm, options.priority_chunk_bytes,
                                            options.before_buckets)
            self.worker.on_stop = self.priority.close
        self.handed_off = False  # finish() returned with the step's reductions in flight
        self._handed_grads: List[tuple] = []  # then: (param, its .grad, the grad's version)
        self.synced_steps = 0  # steps whose reduction completed
        self._ready_ns: Dict[int, int] = {}  # id(param) -> when it went in its bucket
        self._reduce_seconds = [0.0] * len(self.buckets)
        self._reduce_cpu = [0.0] * len(self.buckets)  # CPU of the comm thread, each bucket
        self._last_step: Optional[tuple] = None  # (ready times, seconds, CPU): profile()
        self._pending: List[threading.Event] = []
        self._next_to_launch = 0
        self._head = 0  # parameters at the start of that bucket with their gradients in
        self._told = (0, 0)  # what the priority schedule last heard: (launched, head)
        self._step_started = False
        self._hooks = [param.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for bucket in self.buckets for param in bucket.params]

    # --- during backward ---------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        index, position = self.where[id(param)]
        bucket = self.buckets[index]
        bucket.used[position] = True  # inside no_sync() too: its .grad will be reduced
        if not self.enabled:
            return
        self._arrivals[id(param)] += 1
        if self._arrivals[id(param)] < self.options.passes_per_sync:
            return  # accumulate locally this pass
        if bucket.ready[position]:
            raise RuntimeError(
                f"parameter {self._name(param)} got its gradient more often than "
                f"{self.options.passes_per_sync} time(s) before its reduction (reused in the "
                "graph, or more backward passes than that before step()?); this is not "
                "supported")
        if not self._step_started:
            self._step_started = True
            if self.options.finish_after_backward:  # run finish() once this backward pass ends
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._fill_slot(bucket, position, view=self.options.gradient_as_bucket_view)
        bucket.ready[position] = True
        self._ready_ns[id(param)] = time.perf_counter_ns()
        self._launch_ready_buckets()

    def _fill_slot(self, bucket: Bucket, position: int, view: bool = False) -> None:
        """Put a parameter's .grad (all it accumulated so far), or zeros if it has none,
        in its slot of the bucket; `view`: and make .grad that slot, if it is not yet."""
        param = bucket.params[position]
        slot = bucket.slot(position)
        grad = param.grad
        divisor = self._divisor()
        if grad is None:
            slot.zero_()
        elif grad.is_sparse:
            if not self.options.sparse_as_dense and self.options.sparse_reduce is not None:
                slot.zero_()
                self._sparse_reduced[id(param)] = self.options.sparse_reduce(param, grad)
                return
            if not self.options.sparse_as_dense:
                raise RuntimeError(f"parameter {self._name(param)} has a sparse gradient: "
                                   "pass sparse_as_dense=True to reduce it as a dense one")
            self._sparse[id(param)] = grad.sparse_dim()
            slot.copy_(grad.to_dense())
            if divisor is not None:
                slot.div_(divisor)
        elif grad.data_ptr() != slot.data_ptr():
            # copy mode, or the optimizer replaced a view with None
            if divisor is None:
                slot.copy_(grad)
            elif grad.requires_grad:  # backward(create_graph=True): out= would refuse it
                slot.copy_(grad).div_(divisor)
            else:  # one pass: read the gradient, write it divided
                torch.div(grad, divisor, out=slot)
            if view:
                param.grad = slot
        elif divisor is not None:  # the gradient lives in its slot already
            slot.div_(divisor)

    def _divisor(self) -> Optional[int]:
        """This step's divisor (asked once a step: a strategy may change it between
        steps, as local SGD does when its warm-up ends)."""
        if self._step_divisor is _UNASKED:
            self._step_divisor = self.divisor() if self.divisor is not None else None
        return self._step_divisor

    def _launch_ready_buckets(self) -> None:
        """Launch buckets in index order, as far as they are complete: each a job of the
        comm thread, or (by priority) one job for the step that learns of each launch
        and of the next bucket's gradients as they come in."""
        while (self._next_to_launch < len(self.buckets)
               and all(self.buckets[self._next_to_launch].ready)):
            if self.priority is None:
                buffer = self.buckets[self._next_to_launch].buffer
                self._pending.append(self.worker.submit(
                    lambda b=buffer, i=self._next_to_launch: self._reduce_timed(i, b),
                    f"bucket {self._next_to_launch}",
                    bytes=buffer.numel() * buffer.element_size()))
            self._next_to_launch += 1
            self._head = 0
        if self.priority is not None:
            self._tell_priority()

    def _tell_priority(self) -> None:
        """Tell the schedule how far this rank's gradients are in: the buckets launched
        and the head of the next one, as far as its gradients are in from its start
        (priority.py reduces such a head early while the link would idle)."""
        head = 0
        if self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            while bucket.ready[self._head]:  # the bucket's last one is not: it would launch
                self._head += 1
            # below the bucket's end, even when only parameters of no elements are missing
            head = min(bucket.offsets[self._head], max(0, bucket.buffer.numel() - 1))
        told = (self._next_to_launch, head)
        if told == self._told:
            return
        if self.worker.error is not None:  # it runs no more jobs: say why, not hang
            raise self.worker.error
        if self._told == (0, 0):  # the step's first news
            self._pending.append(self.worker.submit(self._reduce_by_priority,
                                                    "buckets by priority", span=False))
        self._told = told
        self.priority.launched(*told, ready=self.worker.mark_ready())

    def _reduce_by_priority(self) -> None:
        self.priority.run_step()
        self._reduce_seconds = list(self.priority.seconds)
        self._reduce_cpu = list(self.priority.cpu)
        # the job waits for backward's gradients too: that is not communicating
        self.worker.busy_seconds -= self.priority.idle_seconds

    def _reduce_timed(self, index: int, buffer: torch.Tensor) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        self.reduce_bucket(buffer)
        self._reduce_seconds[index] = time.perf_counter() - started
        self._reduce_cpu[index] = time.thread_time() - cpu

    # --- after backward ----------------------------------------------------------------
    def finish(self, always: bool = False) -> None:
        """Wait for every bucket's reduction and write the results into param.grad.
        Reduced by priority, it launches what is left and hands the step over
        (`handed_off`) instead: take() and complete() end it.

        always: take part even if no gradient arrived since the last step (the Horovod
        face's step(): a rank whose loss touched none of these parameters still owes
        its peers the round). Otherwise a step without gradients does nothing.
        """
        if not self._step_started and not always:
            return
        missing = [p for b in self.buckets for p, ready in zip(b.params, b.ready) if not ready]
        used_map = None
        if self.options.unused == "detect":  # what this rank used since the last reduction
            used_map = torch.tensor([u for b in self.buckets for u in b.used],
                                    dtype=torch.int32)
        if missing:  # the peers wait for these buckets: send what we hold, zeros if nothing
            for bucket in self.buckets:
                for position, ready in enumerate(bucket.ready):
                    if not ready:  # no view made: if no rank used it, .grad stays as it was
                        self._fill_slot(bucket, position)
                        bucket.ready[position] = True
            self._launch_ready_buckets()
        if used_map is not None:
            self._launch_used_map(used_map)
        if self.priority is not None and not (missing and self.options.unused == "error"):
            self.handed_off = True  # the step goes on in take() and complete()
            self._handed_grads = [(p, p.grad, _version(p.grad))
                                  for b in self.buckets for p in b.params]
            return
        self._complete(missing, used_map)

    def take(self, params: Sequence[torch.nn.Parameter]) -> List[torch.Tensor]:
        """A handed-off step: wait until these parameters' gradients are reduced (and the
        step's before_buckets job has run; take([]) waits for that alone). Returns the
        reduced gradients, views into the buckets that stay valid until complete()."""
        self.priority.wait_before()
        reduced = []
        for param in params:
            index, position = self.where[id(param)]
            bucket = self.buckets[index]
            start = bucket.offsets[position]
            self.priority.wait_reduced(index, start, start + param.numel())
            reduced.append(bucket.slot(position))
        return reduced

    def touched_grads(self) -> Dict[int, str]:
        """A handed-off step: the parameters whose .grad the loop has touched since
        backward handed the step over, {id(param): "dropped"} where .grad is None now
        (zero_grad()), {id(param): "changed"} where it was written in place or replaced
        (clip_grad_norm_, zero_grad(set_to_none=False), an edit). Written in place
        means its version counter moved: torch counts every in-place operation."""
        touched = {}
        for param, grad, version in self._handed_grads:
            if param.grad is None:
                if grad is not None:
                    touched[id(param)] = "dropped"
            elif param.grad is not grad or _version(param.grad) != version:
                touched[id(param)] = "changed"
        return touched

    def complete(self) -> None:
        """End a handed-off step: wait for every bucket, write each reduced gradient to
        .grad as finish() does, where the loop left .grad as backward made it (not
        where it has touched it since: touched_grads()), and start the next step
        afresh. So .grad ends as plain allreduce leaves it: the average, or what the
        loop's zero_grad() left."""
        skip = self.touched_grads()
        self.handed_off = False
        self._handed_grads = []
        self._complete([], None, skip)

    def _complete(self, missing: List[torch.nn.Parameter], used_map: Optional[torch.Tensor],
                  skip: Collection[int] = ()) -> None:
        """The end of finish(): wait for the step's jobs, then write the results."""
        try:
            self._wait_for_all()
        finally:  # the sparse reductions end too, whatever happened to the buckets
            sparse_reduced, self._sparse_reduced = self._sparse_reduced, {}
            reduced_sparse = _wait_for_every_one(sparse_reduced)
        self.synced_steps += 1
        # kept as they are (a swap, no work on every step); profile() reads them
        self._last_step, self._ready_ns = (
            (self._ready_ns, list(self._reduce_seconds), list(self._reduce_cpu)), {})
        if missing and self.options.unused == "error":
            names = ", ".join(self._name(p) for p in missing[:5])
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient in this backward pass "
                f"({names}{', ...' if len(missing) > 5 else ''}): pass "
                "find_unused_parameters=True, or make every parameter take part")
        flat = [p for b in self.buckets for p in b.params]
        globally_unused = set()
        if used_map is not None:
            globally_unused = {id(p) for p, u in zip(flat, used_map.tolist()) if not u}
        for bucket in self.buckets:
            for position, param in enumerate(bucket.params):
                if id(param) in globally_unused or id(param) in skip:
                    continue  # no rank used it (.grad as it was, as DDP), or stepped
                if id(param) in reduced_sparse:
                    param.grad = reduced_sparse[id(param)]
                    continue
                slot = bucket.slot(position)
                if self.grad_scale != 1.0:
                    slot.mul_(self.grad_scale)
                if id(param) in self._sparse:
                    param.grad = slot.to_sparse(self._sparse[id(param)])  # as it came
                elif param.grad is None:
                    param.grad = slot if self.options.gradient_as_bucket_view else slot.clone()
                elif param.grad.data_ptr() != slot.data_ptr():
                    param.grad.copy_(slot)

    def profile(self) -> Optional[StepProfile]:
        """The last synced step (None before there is one): when each gradient became
        ready, how long each bucket's reduction took, and the CPU it took on the
        communication thread. A gradient that did not arrive in backward counts as
        ready when backward ended (finish() filled it in)."""
        if self._last_step is None:
            return None
        ready_ns, reduce_seconds, reduce_cpu = self._last_step
        flat = [p for b in self.buckets for p in b.params]
        arrived = [ready_ns.get(id(p)) for p in flat]
        if all(at is None for at in arrived):
            return None
        last = max(at for at in arrived if at is not None)
        ready = [last if at is None else at for at in arrived]
        first = min(ready)
        return StepProfile(
            param_bytes=[p.numel() * p.element_size() for p in flat],
            ready_s=[(at - first) / 1e9 for at in ready],
            buckets=[(b.buffer.numel() * b.buffer.element_size(), seconds)
                     for b, seconds in zip(self.buckets, reduce_seconds)],
            bucket_cpu_s=reduce_cpu)

    def shadow(self) -> None:
        """Take part in one step's reductions with nothing to contribute.

        For a rank whose inputs ran out while the others train (DDP's join): zeros for
        every bucket, in order, and (mode "detect") a used map that says "none used".
        Nothing is written to .grad.
        """
        self.synced_steps += 1  # as the peers' finish() counts it
        self._reset()
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready = [True] * len(bucket.params)
        self._launch_ready_buckets()
        if self.options.unused == "detect":
            self._launch_used_map(torch.zeros(sum(len(b.params) for b in self.buckets),
                                              dtype=torch.int32))
        self._wait_for_all()

    def _launch_used_map(self, used_map: torch.Tensor) -> None:
        """Which parameters any rank used: the last job of every step on every rank (the
        same order everywhere), a max over the ranks' 0/1 maps, in place."""
        self._pending.append(self.worker.submit(
            lambda: self.comm.native_all_reduce(used_map, "max"), "used map"))

    def _wait_for_all(self) -> None:
        """Wait for every launched job, start the next step afresh, re-raise a comm error."""
        with trace.span("wait for buckets", cat="wait.buckets"):
            for done in self._pending:
                done.wait()
        error = self.worker.error
        self._reset()
        if error is not None:
            raise error

    @property
    def in_flight(self) -> bool:
        """True between the first gradient of a step and the end of its reduction
        (finish(), or complete() for a step handed over)."""
        return self._step_started

    def _reset(self) -> None:
        """A reduction is done (or about to be shadowed): the next step starts afresh, its
        arrival counts and used marks too, so nothing of this step launches the next."""
        self._pending = []
        self._next_to_launch = self._head = 0
        self._told = (0, 0)
        self._step_started = False
        if self.priority is not None:
            self.priority.start_step()
        self._step_divisor = _UNASKED
        for bucket in self.buckets:
            bucket.ready = [False] * len(bucket.params)
            bucket.used = [False] * len(bucket.params)
        self._arrivals = dict.fromkeys(self._arrivals, 0)

    def scale_reduced(self, factor: float) -> None:
        """Multiply the reduced gradients of the steps from now on by `factor` (DDP's
        join(): a sum over fewer ranks than the world, scaled as if all took part)."""
        self.grad_scale = factor

    def continue_from(self, old: "Bucketer") -> None:
        """Carry on where `old` (the same parameters, cut differently) left off between
        steps: inside no_sync() or not, its scale, its step count, and which parameters
        got a gradient since the last reduction. `old` should be closed."""
        self.enabled, self.grad_scale = old.enabled, old.grad_scale
        self.synced_steps = old.synced_steps
        used = {id(p) for b in old.buckets for p, u in zip(b.params, b.used) if u}
        for bucket in self.buckets:
            bucket.used = [id(p) in used for p in bucket.params]

    def _name(self, param) -> str:
        return self.names.get(id(param), f"<parameter of shape {tuple(param.shape)}>")

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.worker.stop()  # its on_stop closes the priority schedule


def _version(grad: Optional[torch.Tensor]) -> int:
    """A gradient's version counter (0 for None): torch adds one at each in-place write."""
    return 0 if grad is None else grad._version


def _cut_into_buckets(trainable: Sequence[torch.nn.Parameter], bucket_cap_mb: float,
                      first_bucket_mb: float) -> tuple:
    """The buckets, each with a zeroed flat buffer, and where each parameter's gradient
    lives: {id(param): (bucket index, position in it)}."""
    buckets: List[Bucket] = []
    where: Dict[int, tuple] = {}
    for index, group in enumerate(assign_buckets(trainable, bucket_cap_mb, first_bucket_mb)):
        offsets, total = [], 0
        for param in group:
            offsets.append(total)
            total += param.numel()
        buffer = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
        buckets.append(Bucket(index, group, offsets, buffer, [False] * len(group),
                              [False] * len(group)))
        for position, param in enumerate(group):
            where[id(param)] = (index, position)
    return buckets, where


def _make_grads_views(buckets: List[Bucket]) -> None:
    """gradient_as_bucket_view: every .grad becomes its slot of its bucket (keeping what
    it held), so backward accumulates straight into the bucket."""
    for bucket in buckets:
        for position, param in enumerate(bucket.params):
            slot = bucket.slot(position)
            if param.grad is not None:
                slot.copy_(param.grad)
            param.grad = slot


def _wait_for_every_one(waits: Dict) -> Dict:
    """{key: wait()} for every wait, even after one raised (each frees what it holds);
    then the first error, if any."""
    results, first_error = {}, None
    for key, wait in waits.items():
        try:
            results[key] = wait()
        except Exception as error:
            first_error = first_error or error
    if first_error is not None:
        raise first_error
    return results
