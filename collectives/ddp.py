"""`collectives.DistributedDataParallel`: torch's DDP, built from the pieces here.

A script written for torch's DDP works by changing one import:

    from collectives import DistributedDataParallel as DDP
    model = DDP(model)                    # broadcasts rank 0's parameters and buffers
    loss_fn(model(x), y).backward()       # buckets are averaged during backward
    optimizer.step()

What happens underneath, in order:
1. Wrapping: the ranks check that their models have the same parameter names, shapes
   and dtypes (a clear error if not), then rank 0's parameters and buffers are
   broadcast so every replica starts identical.
2. Each forward: buffers (BatchNorm statistics) are broadcast from rank 0 first, as
   DDP's broadcast_buffers=True. (With overlap="forward" the communication thread sends
   them during backward, and the first forward after the step takes them.)
3. Each backward: the bucketer (bucketer.py) hands each complete bucket to the sync
   strategy (by default `allreduce`, see sync/allreduce.py) on a comm thread; when
   backward returns, every .grad holds the average over ranks. (With allreduce's
   overlap="forward", backward returns at once and the optimizer from
   `step_in_forward(optimizer)` steps each layer inside the next forward as its
   gradients land: step_in_forward.py.)
4. `no_sync()`: gradients accumulate locally; the next backward outside it reduces
   the accumulated sum, as torch's. With find_unused_parameters=True a parameter used
   in any of those passes, on any rank, is averaged (a rank that has no gradient for
   it adds zeros), even if the syncing pass did not use it.
5. `join()`: uneven inputs. A rank whose data ran out leaves the training loop and,
   inside the context, shadows the others' steps until every rank is done (see
   `join` below), as torch's DDP with its Join context.
6. The strategy's other moments (sync/base.py): a strategy that acts at after_backward
   or after_step (delayed, powersgd, local SGD, diloco, gossip, async-avg) is called
   by the wrapper, so a plain torch loop runs it as the trainer does: after_backward
   when a backward outside no_sync() ends, after_step when an optimizer holding the
   model's parameters has stepped (`_StrategyMoments` below). A loop that calls the
   moments itself, as the trainer does, says so: moments="loop".

Which ranks: a script that made a torch.distributed process group itself
(`dist.init_process_group(...)`, as every torch DDP tutorial does) needs no
`collectives.init()`: the wrapper adopts torch's default group, or the group passed as
`process_group=` (world.adopt_torch_group).
"""
from __future__ import annotations

import contextlib
import os
import weakref
import zlib
from dataclasses import replace
from typing import List, Optional

import torch

from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .api import broadcast_coalesced, gather_rows
from .world import adopt_torch_group, get_comm
from .bucket_sizes import choose as choose_bucket_sizes
from .bucketer import Bucketer, BucketOptions
from .step_in_forward import StepInForward
from .launch.links import emulated
from .sync import SyncStrategy, create
from .transport import Transport

# bucket_cap_mb="auto": synced steps with DDP's sizes before the buckets are re-cut (the
# first step's reductions also pay for first-touch allocations and connections)
AUTO_BUCKET_STEPS = 2
# who calls a strategy's after_backward and after_step: the wrapper, or the training loop
MOMENT_CALLERS = ("ddp", "loop")


def cpu_weight(comm: Transport) -> float:
    """How much longer a step gets for each CPU second this rank's communication takes
    (bucket_sizes.choose): R / C where the R ranks on this machine keep its C cores
    busy computing (R >= C), else 0. On the emulated cluster every host is this
    machine."""
    sharing = comm.world_size if emulated() else len(comm.topology.local_ranks(comm.rank))
    cores = os.cpu_count() or 1  # the machine's: a launcher may pin each rank to a few
    return sharing / cores if sharing >= cores else 0.0


def check_same_model(module: nn.Module, comm: Transport) -> None:
    """Raise on every rank if the ranks' models differ in names, shapes or dtypes."""
    described = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in
                 list(module.named_parameters()) + list(module.named_buffers())]
    numel = sum(p.numel() for p in module.parameters())
    row = [len(described), numel, zlib.crc32(";".join(described).encode())]
    rows = gather_rows(comm, row)
    for peer, other in enumerate(rows):
        if other != rows[0]:
            raise RuntimeError(
                f"the model differs across ranks: rank 0 has {rows[0][0]} parameters and "
                f"buffers with {rows[0][1]} parameter elements, rank {peer} has {other[0]} "
                f"with {other[1]}" + ("" if other[:2] != rows[0][:2] else
                                      " (same sizes, different names, shapes or dtypes)"))


def moments_of(strategy: SyncStrategy) -> List[str]:
    """The moments, of after_backward and after_step, at which `strategy` acts: those
    its class defines over the base class's, which does nothing."""
    return [name for name in ("after_backward", "after_step")
            if getattr(type(strategy), name) is not getattr(SyncStrategy, name)]


def check_same_buckets(bucketer: Bucketer, comm: Transport) -> None:
    """Raise on every rank if the ranks cut their gradients into different buckets."""
    sizes = [bucket.buffer.numel() for bucket in bucketer.buckets]
    rows = gather_rows(comm, [len(sizes), zlib.crc32(repr(sizes).encode())])
    for peer, other in enumerate(rows):
        if other != rows[0]:
            raise RuntimeError(
                f"the gradient buckets differ across ranks: rank 0 has {rows[0][0]} buckets, "
                f"rank {peer} has {other[0]}" + ("" if other[0] != rows[0][0] else
                                                  " of other sizes")
                + ": is bucket_cap_mb the same on every rank?")


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper with torch DDP's constructor arguments and behaviour.

    torch's arguments, in torch's order:
      device_ids, output_device, dim: where replicas live on multi-device hosts; a CPU
          module takes None, as torch requires (a CUDA module: its one device).
      broadcast_buffers: rank 0's buffers before every forward (default True).
      init_sync: broadcast rank 0's parameters and buffers when wrapping (default True).
      process_group: a torch.distributed group to run over (default: `comm`, else the
          default group of collectives.init() or of the script's init_process_group).
      bucket_cap_mb: gradient bucket size (default 25), or "auto": sized for the link
          after AUTO_BUCKET_STEPS synced steps with the defaults, from how long those
          steps' reductions took and when their gradients became ready
          (bucket_sizes.py). Every rank takes rank 0's sizes; `bucket_choice` holds
          them and this rank's own fit and replay (a, b, exposed_s, buckets; the CPU
          a bucket costs, cpu_per_bucket_s, and what it weighs, cpu_weight; best_s:
          the least cost, exposed time plus CPU, of any layout). The layout follows
          timings: two runs (a resumed one too) may cut differently, and with 3 or
          more ranks a different cut sums in another order (the last bits of the
          gradients may differ).
      find_unused_parameters: allow parameters without a gradient in a step (and leave
          .grad alone for those that no rank used). static_graph=True implies it, as
          torch's static graph supports unused parameters.
      gradient_as_bucket_view: .grad points into the bucket (saves a copy).
      check_reduction, skip_all_reduce_unused_params, batched_grad_copy: accepted, with
          no effect (torch's optimisations or deprecated; results are the same).
      forward_sync_buffers: when not None, overrides broadcast_buffers (as torch).
      delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
      device_mesh, bucket_cap_mb_list: not provided; anything but the default raises.

    Ours (keyword only):
      algorithm: the collective for each bucket ("ring", "halving-doubling", "tree",
                 "native", "auto"); ignored when `sync` is given.
      sync:      a SyncStrategy instance or registered name (default "allreduce").
      comm:      a communicator of ours to run over.
      first_bucket_mb: the first (smallest) bucket, so communication starts early.
      moments:   who calls the strategy's after_backward and after_step. "ddp" (the
                 default): the wrapper, for a plain torch loop (forward, backward,
                 optimizer.step()); close() then closes the strategy, and
                 `optimizer_steps` counts the steps it has told after_step of. "loop":
                 the training loop calls them itself, in the order of sync/base.py
                 (the trainer, its benchmark and its elastic loop do).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: Optional[bool] = True, init_sync: bool = True,
                 process_group=None, bucket_cap_mb: Optional[float] = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers: Optional[bool] = None,
                 *, algorithm: str = "ring", sync=None, comm: Optional[Transport] = None,
                 first_bucket_mb: float = 1.0, moments: str = "ddp"):
        super().__init__()
        if moments not in MOMENT_CALLERS:
            raise ValueError(f"moments={moments!r}: choose \"ddp\" (the wrapper calls the "
                             "strategy's after_backward and after_step) or \"loop\" (the "
                             "training loop calls them itself, as the trainer does)")
        _refuse_unprovided(delay_all_reduce_named_params=delay_all_reduce_named_params,
                           param_to_hook_all_reduce=param_to_hook_all_reduce,
                           mixed_precision=mixed_precision, device_mesh=device_mesh,
                           bucket_cap_mb_list=bucket_cap_mb_list)
        _check_devices(module, device_ids, output_device)
        self.module = module
        if comm is None:
            comm = adopt_torch_group(process_group) if process_group is not None else get_comm()
        self.comm = comm
        self.broadcast_buffers = (broadcast_buffers if forward_sync_buffers is None
                                  else forward_sync_buffers) is not False
        self._join: Optional[_JoinState] = None
        self._syncing = True  # False inside no_sync(): no reduction, no moment
        self._closed = False
        check_same_model(module, self.comm)
        if init_sync:
            broadcast_coalesced([p.data for p in module.parameters()] +
                                [b for b in module.buffers()], src=0, comm=self.comm)
        if sync is None:
            sync = create("allreduce", algorithm=algorithm)
        elif isinstance(sync, str):
            sync = create(sync)
        self.sync: SyncStrategy = sync
        self.sync.setup(module, self.comm)
        self.moments = moments
        acting = moments_of(self.sync)
        if acting and moments == "ddp" and self.sync.overlap == "forward":
            self.sync.close()
            raise ValueError(f"sync {self.sync.name!r} with overlap=\"forward\" steps inside "
                             f"the next forward, where its {' and '.join(acting)} cannot run")
        auto = bucket_cap_mb == "auto"
        cap = 25.0 if bucket_cap_mb is None or auto else bucket_cap_mb
        if not isinstance(cap, (int, float)) or cap <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}, first_bucket_mb="
                             f"{first_bucket_mb!r}: use megabytes above 0 (or \"auto\")")
        self.bucketer = None
        self.bucket_choice: Optional[dict] = None  # bucket_cap_mb="auto": what it chose
        self._bucket_options = BucketOptions(
            gradient_as_bucket_view=gradient_as_bucket_view,
            unused="detect" if (find_unused_parameters or static_graph) else "error")
        # overlap="forward": buckets reduced by priority, the optimizer stepped inside the
        # next forward (step_in_forward.py); the buffers go first on the comm thread
        self.stepper: Optional[StepInForward] = None
        self._staged_buffers: List[tuple] = []  # (copy received, the module's buffer)
        self._load_hooks: list = []  # overlap="forward": a load makes the copies stale
        if self.sync.overlap == "forward":
            if auto:  # the rest it cannot take, the bucketer refuses
                raise ValueError(f"sync {self.sync.name!r} with overlap=\"forward\": "
                                 "bucket_cap_mb=\"auto\" is not supported with it")
            self._bucket_options = replace(self._bucket_options,
                                           priority_chunk_bytes=self.sync.chunk_bytes,
                                           before_buckets=self._buffers_before_buckets())
        if self.sync.uses_buckets:
            try:
                self._make_bucketer(float(cap), float(first_bucket_mb))
            except BaseException:  # refused: nothing of this wrapper stays on the model
                self._remove_load_hooks()
                raise
        # Re-cut only where one dtype's buckets can be replayed and the strategy keeps
        # nothing per bucket (topk's residuals are).
        self._auto_buckets = (auto and self.bucketer is not None
                              and not self.sync.keeps_bucket_state
                              and len({(p.device, p.dtype) for p in module.parameters()
                                       if p.requires_grad}) == 1)
        # moments="ddp": hooked after the bucketer, so that a backward's end finds the
        # buckets reduced
        self._moments = (_StrategyMoments(self, acting) if acting and moments == "ddp"
                         else None)

    def _make_bucketer(self, cap_mb: float, first_mb: float) -> None:
        options = replace(self._bucket_options, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)
        self.bucketer = Bucketer(self.module.parameters(), self.sync.reduce_bucket,
                                 self.sync.bucket_comm, options,
                                 divisor=self.sync.gradient_divisor,
                                 names={id(p): name for name, p in
                                        self.module.named_parameters()})
        try:
            check_same_buckets(self.bucketer, self.comm)
        except BaseException:  # its hooks must not stay on the model, nor its thread run
            self.bucketer.close()
            raise
        self.bucket_sizes_mb = (first_mb, cap_mb)

    def _size_buckets_for_the_link(self) -> None:
        """bucket_cap_mb="auto", collective: every rank takes rank 0's choice from its
        profiled step and re-cuts its buckets if the choice differs."""
        self._auto_buckets = False
        profile = self.bucketer.profile()
        first, cap, details = (choose_bucket_sizes(profile, cpu_weight(self.comm))
                               if profile else (0, 0, {}))
        chosen = gather_rows(self.comm, [round(first * 1024), round(cap * 1024)])[0]
        if not chosen[1]:
            return  # rank 0 saw no gradient arrive: DDP's sizes stay
        first, cap = chosen[0] / 1024, chosen[1] / 1024
        self.bucket_choice = dict(first_bucket_mb=first, bucket_cap_mb=cap, **details)
        if (first, cap) != self.bucket_sizes_mb:
            old = self.bucketer
            old.close()
            self._make_bucketer(cap, first)
            self.bucketer.continue_from(old)  # inside no_sync() or join() too

    def step_in_forward(self, optimizer: torch.optim.Optimizer, **options) -> StepInForward:
        """overlap="forward": the optimizer to call step() on, taken inside the next
        forward layer by layer (step_in_forward.py; `options` go to StepInForward)."""
        if self.sync.overlap != "forward" or self.bucketer is None:
            raise ValueError("step_in_forward: only with a sync strategy that has "
                             "overlap=\"forward\" (e.g. allreduce)")
        if self.stepper is not None:
            raise RuntimeError("step_in_forward: this model has its optimizer already")
        self.stepper = StepInForward(self, optimizer, **options)
        return self.stepper

    def _buffers_before_buckets(self):
        """overlap="forward": rank 0's buffers, broadcast as each step's first job on the
        comm thread, into copies (`_staged_buffers`): backward leaves the buffers as
        the forward made them, the values DDP broadcasts before the next forward, but
        still holds them (BatchNorm's backward checks they did not change). The next
        forward copies them in (_take_buffers), after a flush or a checkpoint too. A
        load_state_dict() of the model since makes them stale (rank 0's from before
        the load): that forward broadcasts the loaded ones instead. None when there is
        nothing to send."""
        from .step_in_forward import load_pre_hook
        buffers = list(self.module.buffers())
        if not (self.broadcast_buffers and self.sync.forward_buffer_sync and buffers):
            return None
        self._staged_buffers = [(buffer.clone(), buffer) for buffer in buffers]
        self._buffers_received = False  # a step's copies, not yet taken by a forward
        copies = [staged for staged, _ in self._staged_buffers]

        def broadcast() -> None:
            for staged, buffer in self._staged_buffers:
                staged.copy_(buffer)
            broadcast_coalesced(copies, src=0, comm=self.sync.bucket_comm)
            self._buffers_received = True

        own = {id(module) for module in self.module.modules()}  # not a deep copy's

        def stale(module, *_) -> None:
            if id(module) in own and self.bucketer is not None:
                if self.bucketer.handed_off:  # the copies may still be on their way
                    self.bucketer.take([])
                self._buffers_received = False
        self._load_hooks = [load_pre_hook(module, stale) for module in self.module.modules()]
        return broadcast

    def _remove_load_hooks(self) -> None:
        for hook in self._load_hooks:
            hook.remove()
        self._load_hooks = []

    def _take_buffers(self) -> None:
        """overlap="forward": rank 0's buffers before a forward, as plain allreduce
        broadcasts them. The first forward after a step copies in those the step's
        first job received (waiting for them if they are still on their way); any
        other (the first forward, after no_sync(), after one that took them, after a
        load_state_dict()) broadcasts them now, as plain allreduce does. Every rank
        decides alike: steps, forwards and loads come in the same order on all."""
        if not self._staged_buffers:
            return
        if self.bucketer.handed_off:
            with self.stepper.waiting():
                self.bucketer.take([])
        if not self._buffers_received:
            broadcast_coalesced([buffer for _, buffer in self._staged_buffers], src=0,
                                comm=self.comm)
            return
        self._buffers_received = False
        with torch.no_grad():
            for staged, buffer in self._staged_buffers:
                buffer.copy_(staged)

    def forward(self, *inputs, **kwargs):
        if self._moments is not None and torch.is_grad_enabled():
            # a skipped step is a step for the strategy, told first: before any
            # collective of this forward (every rank reaches this point alike)
            self._moments.step_skipped_before()
        if self._closed and torch.is_grad_enabled():
            raise RuntimeError("this DistributedDataParallel is closed: its gradients would "
                               "not be synchronized (evaluate under torch.no_grad())")
        if self.sync.overlap == "forward" and self.stepper is None and torch.is_grad_enabled():
            raise RuntimeError("overlap=\"forward\" takes the optimizer step inside the next "
                               "forward: wrap the optimizer first, optimizer = "
                               "model.step_in_forward(optimizer)")
        if (self._auto_buckets and self._join is None and torch.is_grad_enabled()
                and self.bucketer.synced_steps >= AUTO_BUCKET_STEPS
                and not self.bucketer.in_flight):
            self._size_buckets_for_the_link()
        buffer_source = 0
        if self._join is not None and torch.is_grad_enabled():
            buffer_source = self._join.step_in(self)  # a rank that still has data
        if self.sync.overlap == "forward":  # the comm thread sent them
            self._take_buffers()
        elif self.broadcast_buffers and self.sync.forward_buffer_sync:
            buffers = list(self.module.buffers())
            if buffers:  # the source rank's BatchNorm statistics are everyone's
                broadcast_coalesced(buffers, src=buffer_source, comm=self.comm)
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block syncs them
        (and, with moments="ddp", is the one that ends with the strategy's
        after_backward)."""
        previous = self._syncing
        self._syncing = False
        if self.bucketer is not None:
            self.bucketer.enabled = False
        try:
            yield
        finally:
            self._syncing = previous
            if self.bucketer is not None:  # (re-cut inside the block: the new one)
                self.bucketer.enabled = previous

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Train on uneven inputs: ranks may run out of batches at different steps.

            with model.join():
                for x, y in loader:          # rank 0 has 7 batches, rank 1 has 5
                    loss_fn(model(x), y).backward(); optimizer.step()

        Each forward inside the block first tells every rank who is still training (one
        tiny all-reduce). A rank whose loop has ended waits at the end of the block and
        shadows each step of the others: it takes part in the buffer broadcast and in
        every bucket's reduction, with zeros, so nobody waits for it. When every rank
        is done, the parameters and buffers of a rank that trained longest are
        broadcast to all, as torch's DDP does.

        divide_by_initial_world_size: gradients are divided by the world size (True,
            torch's default) or by the number of ranks still training (False).
        throw_on_early_termination: instead, raise on every rank as soon as one runs
            out of data.
        Sync strategies that communicate outside the gradient buckets (local SGD, for
        one) cannot be shadowed and are refused.
        """
        if not enable or self.comm.world_size == 1:
            yield
            return
        if self.bucketer is None:
            raise NotImplementedError(f"join() shadows bucket reductions; the "
                                      f"{self.sync.name!r} strategy has none")
        if moments_of(self.sync):
            raise NotImplementedError(
                f"join() shadows bucket reductions; the {self.sync.name!r} strategy also "
                f"communicates at {' and '.join(moments_of(self.sync))}, which a rank out "
                "of inputs cannot shadow")
        if self.stepper is not None or self.sync.overlap == "forward":
            raise NotImplementedError("join() with overlap=\"forward\" is not supported: "
                                      "a shadowed step has no forward to take it in")
        if self._join is not None:
            raise RuntimeError("join() contexts do not nest")
        self._join = _JoinState(divide_by_initial_world_size, throw_on_early_termination)
        finished = False
        try:
            yield
            finished = True
        finally:
            state, self._join = self._join, None
        if finished:
            state.shadow_until_all_done(self)

    @property
    def optimizer_steps(self) -> int:
        """moments="ddp": the optimizer steps the wrapper has told the strategy of (the
        `step` its after_step got last). A run resumed from a checkpoint sets it to the
        steps already done, so that periodic strategies keep their schedule."""
        return self._moments.steps if self._moments is not None else 0

    @optimizer_steps.setter
    def optimizer_steps(self, steps: int) -> None:
        if self._moments is not None:
            self._moments.steps = steps

    def close(self) -> None:
        """Training is over: overlap="forward"'s step in flight is finished, with
        moments="ddp" the strategy's close() (after the after_step of a last step the
        loop skipped; its last averaging round, its threads; a loop that calls the
        moments closes the strategy itself), then every hook comes off the model and the
        comm thread stops. The model still evaluates (under torch.no_grad()). Calling it
        again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.stepper is not None:
                self.stepper.close()  # flushes the pending step, removes its hooks
            if self._moments is not None:
                self._moments.step_skipped_before()
            if self.moments == "ddp":
                self.sync.close()
        finally:
            if self._moments is not None:
                self._moments.remove()
            self._remove_load_hooks()
            if self.bucketer is not None:
                self.bucketer.close()


class _StrategyMoments:
    """moments="ddp": the strategy's after_backward and after_step, called for a plain
    torch loop at the moments the trainer calls them (sync/base.py):

        backward outside no_sync() ends  ->  after_backward(model), once the buckets'
                                             averages are in .grad
        optimizer.step() returns         ->  after_step(model, step), step from 1

    The end of a backward is an autograd engine callback, queued by the pass's first
    gradient; a step is seen by torch's optimizer step post-hook (global: the hook
    passes over optimizers that hold none of this model's parameters, such as
    diloco's outer one). Only the moments the strategy acts at are called
    (`moments_of`).

    A synced backward with no optimizer step after it (GradScaler found an inf in this
    rank's gradients, or the loop skipped the step) is still a step for the strategy:
    its after_step runs before the next training forward (or in close()), as the
    trainer calls after_step when GradScaler skips. So every rank calls after_step once
    per synced backward, even when a skip is decided on one rank alone (GradScaler's
    check reads this rank's gradients, which local SGD and its kind never average); but
    that rank calls it later than the others, so a collective of the loop's own
    between the step and the next forward (a logged loss all-reduced) would meet the
    others' averaging there: such a loop decides its skips on every rank alike
    (collectives.all_finite), as the trainer's --skip-nonfinite does. Accumulate gradients inside no_sync(): each synced backward is
    a step. A second optimizer step with no backward in between (two optimizers for one
    model, or steps inside no_sync()) is refused: after_step would run before the last
    of them. So is the loop's own call of a moment the wrapper calls: on the strategy,
    those methods raise until close(), instead of running twice.
    """

    def __init__(self, ddp: "DistributedDataParallel", acting: List[str]):
        self.ddp, self.strategy = ddp, ddp.sync
        # (the class's methods, bound: not a refusal an earlier wrapper left behind)
        self.calls = {name: getattr(type(self.strategy), name).__get__(self.strategy)
                      for name in acting}
        for name in acting:  # the instance's attribute hides the class's method
            setattr(self.strategy, name, self._refusal(name))
        self.steps = 0  # optimizer steps told to after_step
        self.backward_done = False  # a synced backward ended since the last step
        self.queued_in = -1  # the autograd graph task whose end is queued
        self.parameters = {id(p) for p in ddp.module.parameters()}
        # The hooks hold the moments weakly: a wrapper dropped without close() goes (its
        # model may stay), and takes torch's global hook with it.
        moments = weakref.ref(self)

        def on_gradient(param: torch.Tensor) -> None:
            alive = moments()
            if alive is not None:
                alive.gradient_arrived()

        def after_optimizer_step(optimizer, args, kwargs) -> None:
            alive = moments()
            if alive is not None:
                alive.optimizer_stepped(optimizer)
        self.gradient_hooks = [p.register_post_accumulate_grad_hook(on_gradient)
                               for p in ddp.module.parameters() if p.requires_grad]
        self.step_hook = register_optimizer_step_post_hook(after_optimizer_step)
        weakref.finalize(self, _unhook, self.step_hook, self.gradient_hooks, self.strategy,
                         list(self.calls))

    def _refusal(self, name: str):
        strategy = self.strategy.name

        def refuse(*args, **kwargs):
            raise RuntimeError(f"sync {strategy!r}: DistributedDataParallel calls its {name} "
                               "itself; a loop that calls the strategy's moments wraps the "
                               "model with moments=\"loop\"")
        return refuse

    def gradient_arrived(self) -> None:
        """The first gradient of a synced backward queues the backward's end (once per
        autograd graph task: a backward that failed before its end leaves none queued)."""
        task = torch._C._current_graph_task_id()
        if self.ddp._syncing and task != self.queued_in:
            self.queued_in = task
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_ended)

    def step_skipped_before(self) -> None:
        """A synced backward ended and no optimizer step followed it: that step was
        skipped, and is told to after_step now (before the next forward, or in close())."""
        if self.backward_done:
            self.backward_done = False
            self.steps += 1
            if "after_step" in self.calls:
                self.calls["after_step"](self.ddp.module, self.steps)

    def backward_ended(self) -> None:
        self.step_skipped_before()  # two synced backwards with no forward between them
        bucketer = self.ddp.bucketer
        if bucketer is not None and bucketer.in_flight:  # its own end may be queued after
            bucketer.finish()  # this one (buckets re-cut: its hooks are newer than ours)
        if "after_backward" in self.calls:
            self.calls["after_backward"](self.ddp.module)
        self.backward_done = True

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if not any(id(p) in self.parameters
                   for group in optimizer.param_groups for p in group["params"]):
            return  # another model's optimizer
        if not self.backward_done:
            raise RuntimeError(
                f"optimizer.step() on this model's parameters with no backward outside "
                f"no_sync() since the last step: DistributedDataParallel calls sync "
                f"{self.strategy.name!r}'s after_step once a backward (more than one "
                "optimizer, or steps on unsynced gradients: wrap the model with "
                "moments=\"loop\" and call the moments in the loop)")
        self.backward_done = False
        self.steps += 1
        if "after_step" in self.calls:
            self.calls["after_step"](self.ddp.module, self.steps)

    def remove(self) -> None:
        """The hooks off the model and torch's optimizers, the strategy's methods back."""
        _unhook(self.step_hook, self.gradient_hooks, self.strategy, list(self.calls))


def _unhook(step_hook, gradient_hooks, strategy: SyncStrategy, names: List[str]) -> None:
    """What _StrategyMoments put in place, taken away: by close(), or when a wrapper
    dropped without close() is collected (so the strategy can serve another)."""
    step_hook.remove()
    for hook in gradient_hooks:
        hook.remove()
    for name in names:
        vars(strategy).pop(name, None)


class _JoinState:
    """Who is still training, step by step, for DistributedDataParallel.join()."""

    def __init__(self, divide_by_initial_world_size: bool, throw_on_early_termination: bool):
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.steps = 0  # forwards this rank ran inside the block

    def _exchange(self, ddp: "DistributedDataParallel", active: bool) -> List[List[int]]:
        """Every rank's [still training, will sync this step, steps so far]."""
        syncs = ddp.bucketer.enabled if active else False
        return gather_rows(ddp.comm, [int(active), int(syncs), self.steps])

    def step_in(self, ddp: "DistributedDataParallel") -> int:
        """An active rank starts a step; returns the rank whose buffers everyone takes."""
        self.steps += 1
        rows = self._exchange(ddp, active=True)
        active = [rank for rank, row in enumerate(rows) if row[0]]
        if self.throw and len(active) < len(rows):
            raise RuntimeError(f"rank {ddp.comm.rank}: rank(s) "
                               f"{[r for r in range(len(rows)) if r not in active]} ran out "
                               "of inputs (join(throw_on_early_termination=True))")
        scale = 1.0 if self.divide_by_initial_world_size else len(rows) / len(active)
        ddp.bucketer.scale_reduced(scale)
        return max(active)

    def shadow_until_all_done(self, ddp: "DistributedDataParallel") -> None:
        """This rank's data ran out: mirror the others' steps until none is left."""
        ddp.bucketer.scale_reduced(1.0)
        while True:
            rows = self._exchange(ddp, active=False)
            active = [rank for rank, row in enumerate(rows) if row[0]]
            if not active:
                break
            if self.throw:
                raise RuntimeError(f"rank {ddp.comm.rank} ran out of inputs "
                                   "(join(throw_on_early_termination=True))")
            if ddp.broadcast_buffers and ddp.sync.forward_buffer_sync:
                buffers = list(ddp.module.buffers())
                if buffers:
                    broadcast_coalesced(buffers, src=max(active), comm=ddp.comm)
            if any(rows[rank][1] for rank in active):  # their backward reduces buckets
                ddp.bucketer.shadow()
        # The ranks that trained longest hold the final model: the highest of them sends it.
        longest = max(row[2] for row in rows)
        source = max(rank for rank, row in enumerate(rows) if row[2] == longest)
        broadcast_coalesced([p.data for p in ddp.module.parameters()] +
                            list(ddp.module.buffers()), src=source, comm=ddp.comm)


def _refuse_unprovided(**arguments) -> None:
    """torch DDP arguments this wrapper does not provide: a clear error, not a surprise."""
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(f"DistributedDataParallel({name}=...) is torch's and is "
                                      "not provided here; leave it at its default (None)")


def _check_devices(module: nn.Module, device_ids, output_device) -> None:
    """torch's rule: device_ids and output_device stay None for a CPU module; a GPU
    module may name its one device (one replica per process)."""
    on_cpu = all(p.device.type == "cpu" for p in module.parameters())
    if on_cpu and (device_ids is not None or output_device is not None):
        raise ValueError("DistributedDataParallel: device_ids and output_device must be None "
                         f"for a module on CPU (got device_ids={device_ids}, "
                         f"output_device={output_device})")
    if device_ids is not None and len(device_ids) != 1:
        raise ValueError(f"DistributedDataParallel: device_ids names one device, got {device_ids}")
