"""torch's own counterparts of our sync strategies, as rows beside ours.

A comparison of sync strategies means little without the reference people already
use: torch's DistributedDataParallel with its stock comm hooks. Each peer here is
torch's code, configured to compute what our strategy of the same idea computes:

    ddp            DistributedDataParallel, plain               ours: allreduce
    ddp-collectives  the same DDP, its all-reduces through this
                   project's torch.distributed backend
                   (collectives/torch_backend/)                  ours: allreduce
    ddp-fp16       + fp16_compress_hook                          ours: fp16
    ddp-bf16       + bf16_compress_hook                          ours: bf16
    ddp-powersgd   + powerSGD_hook (rank 2, warm start,
                   error feedback), one bucket at a time
                   (one_bucket_at_a_time: the hook races
                   itself when there are 2 or more buckets)     ours: powersgd
    ddp-localsgd   + post_localSGD_hook and a
                   PeriodicModelAverager (period 8)              ours: local-sgd
    ddp-hier-localsgd  + post_localSGD_hook and a
                   HierarchicalModelAverager (inside each host
                   every local_period steps, all ranks every
                   period)                                       ours: hier-local-sgd
    torchft-diloco torchft's DiLoCo (streaming with fragments
                   and delay), no DDP (trainer/torchft_peer.py)  ours: diloco

A peer has the same moments as our SyncStrategy (after_backward, after_step, close)
so the trainer's loop and trainer.bench drive both alike; `wrap(model)` returns
torch's DDP module in place of ours (trainer/peer_base.py: what every peer shares).
Peers need torch.distributed's default group (the gloo or nccl backend;
collectives.init makes it). This file is also the registry of peers by name
(`create`, `is_peer`, `NAMES`, `OURS`): torchft's DiLoCo, in a file of its own, is
imported only when asked for.

Where torch's computation differs from ours, by design of each library:
- fp16/bf16: torch casts the bucket first and divides in 16 bits; we divide in 32
  bits and then cast (results agree to 16-bit rounding).
- powersgd: torch's hook runs plain all-reduce for its first 2 steps (its minimum,
  `start_powerSGD_iter`), works per bucket, and leaves a matrix uncompressed unless
  compression gains 2x; ours compresses from the first step per parameter, whenever
  it gains at all.
- local-sgd: torch averages parameters only and DDP broadcasts rank 0's BatchNorm
  buffers before each forward; ours averages parameters and buffers together. Both
  average after steps W+H, W+2H, ... (torch's averager is given warmup W+H-1 for
  that: by itself it would average after step W+1 first).
- hier-local-sgd: as local-sgd. torch's hierarchical averager averages when its own
  step count is a multiple of a period, counting from 0; it is started at 1 - W so
  that both average after steps W+h, W+2h, ... . Its host groups are runs of
  consecutive ranks, LOCAL_WORLD_SIZE long (the launchers place ranks so).

A checkpoint keeps what torch's hooks carry across steps, so that a resumed run goes on
bit for bit on 2 ranks (to the last bits on more: docs/reliability.md) (state_dict /
load_state_dict, as our strategies): ddp-powersgd's
PowerSGDState (its step count, error and P/Q memories per bucket, and the random
generator that seeds new Q's), with the bucket layout they are in (a resumed DDP lays
its buckets out anew: powersgd_layout.py), and ddp-localsgd's step counts (the hook's, which ends
the warm-up, and the averager's, which times the averaging).
"""
from __future__ import annotations

import socket
import time
from collections import OrderedDict
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.algorithms.model_averaging import averagers, hierarchical_model_averager

from collectives import trace
from collectives.transport.base import Traffic
from .peer_base import Peer
from .powersgd_layout import LayoutKeeper

# peer name -> the name of our strategy that computes the same thing
OURS = {"ddp": "allreduce", "ddp-collectives": "allreduce", "ddp-fp16": "fp16", "ddp-bf16": "bf16",
        "ddp-powersgd": "powersgd", "ddp-localsgd": "local-sgd",
        "ddp-hier-localsgd": "hier-local-sgd", "torchft-diloco": "diloco"}
NAMES = list(OURS)


class TorchPeer(Peer):
    """torch's DDP plus one of torch's comm hooks, driven like our strategies."""

    def __init__(self, name: str, period: int = 8, warmup_steps: int = 0, rank: int = 2,
                 seed: int = 0, local_period: int = 1):
        if name not in OURS:
            raise ValueError(f"unknown torch peer {name!r}: choose from {', '.join(NAMES)}")
        if period < 1 or warmup_steps < 0 or rank < 1 or local_period < 1:
            raise ValueError(f"{name}: period, local_period and rank must be at least 1, "
                             f"warmup_steps 0 or more (got {period}, {local_period}, {rank}, "
                             f"{warmup_steps})")
        if period % local_period:
            raise ValueError(f"{name}: period ({period}) must be a multiple of local_period "
                             f"({local_period})")
        self.name, self.seed, self.rank, self.local_period = name, seed, rank, local_period
        # Steps between two periodic communications, and synchronous steps before the
        # first (as our strategies say them: trainer.bench times whole periods).
        periodic = name in ("ddp-localsgd", "ddp-hier-localsgd")
        self.period = period if periodic else 1
        # Post-local SGD's replicas drift apart between averagings (as our strategies say
        # it: the run's model is their average); every other peer averages gradients.
        self.replicas_differ = periodic
        # torch's PowerSGD hook runs plain all-reduce for its first 2 steps.
        self.warmup_steps = warmup_steps if periodic else {"ddp-powersgd": 2}.get(name, 0)
        self.averager = None
        # Where this peer's collectives run on our backend (ddp-collectives), the counter
        # of its transport: every byte it sends, by shared memory or by network. None
        # for gloo's peers, whose bytes only the kernel sees (trainer/timing.py).
        self.traffic: Optional[Traffic] = None
        self.hook_state = None  # the state torch's hook keeps across steps, if it has one

    def wrap(self, model: torch.nn.Module, bucket_cap_mb=None,
             observed: bool = False) -> torch.nn.Module:
        """torch's DistributedDataParallel around `model`, with this peer's hook
        (bucket_cap_mb None or "auto": torch's default, 25).

        observed: see when each bucket's communication runs. torch's collectives run in
        C++, so the hook is wrapped: a bucket runs from the call of the hook to the
        completion of its future; the intervals go to `self.bucket_intervals` and, when
        tracing, into the trace as "bucket i" spans. Plain `ddp` then reduces through
        torch's stock allreduce_hook (the same all-reduce, called from Python)."""
        self.bucket_intervals = []  # (start ns, end ns) of each observed bucket
        if not dist.is_initialized():
            raise RuntimeError(f"{self.name} is torch's DDP: it needs torch.distributed "
                               "(backend gloo or nccl), not the mpi backend")
        group = None  # torch's default group: gloo (or nccl)
        if self.name == "ddp-collectives":
            from collectives import torch_backend
            torch_backend.register()
            group = dist.new_group(backend=torch_backend.NAME)
            self.traffic = _transport_traffic(group)
        cap = None if bucket_cap_mb == "auto" else bucket_cap_mb
        wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap,
                                                            process_group=group)
        state, hook = group, default_hooks.allreduce_hook if observed else None
        if self.name == "ddp-fp16":
            hook = default_hooks.fp16_compress_hook
        elif self.name == "ddp-bf16":
            hook = default_hooks.bf16_compress_hook
        elif self.name == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.rank,
                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                random_seed=self.seed)
            # torch's hook, with its state kept in step with DDP's bucket layout: it
            # changes after a resumed run's first step (powersgd_layout.py)
            self.layout_keeper = LayoutKeeper(model, state)
            hook = one_bucket_at_a_time(self.layout_keeper.hook)
        elif self.replicas_differ:  # ddp-localsgd, ddp-hier-localsgd
            state = post_localSGD_hook.PostLocalSGDState(
                process_group=None, subgroup=None, start_localSGD_iter=self.warmup_steps,
                post_local_gradient_allreduce=False)  # after warm-up: purely local steps
            hook = post_localSGD_hook.post_localSGD_hook
            self.averager = (self._hierarchical_averager() if self.name == "ddp-hier-localsgd"
                             else averagers.PeriodicModelAverager(
                                 period=self.period,
                                 warmup_steps=self.warmup_steps + self.period - 1))
        if self.name in ("ddp-powersgd", "ddp-localsgd", "ddp-hier-localsgd"):
            self.hook_state = state
        if hook is not None:
            wrapped.register_comm_hook(state, self._observed(hook) if observed else hook)
        self.module = model
        return wrapped

    def _hierarchical_averager(self):
        """torch's HierarchicalModelAverager: each host's ranks every local_period steps,
        every rank every period, both counted from the end of the warm-up."""
        per_host = _host_size()
        periods = {self.local_period: per_host, self.period: dist.get_world_size()}
        averager = hierarchical_model_averager.HierarchicalModelAverager(
            period_group_size_dict=OrderedDict(sorted(periods.items())), warmup_steps=1)
        averager.step = 1 - self.warmup_steps  # its step W+h is the trainer's step W+h
        return averager

    def _observed(self, hook):
        """`hook`, timed from its call to the completion of its future."""
        def observed_hook(state, bucket):
            started = time.perf_counter_ns()
            index = bucket.index()
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

            def finished(future):
                ended = time.perf_counter_ns()
                self.bucket_intervals.append((started, ended))
                trace.add(f"bucket {index}", "comm", started, ended, bytes=nbytes)
                return future.value()
            return hook(state, bucket).then(finished)
        return observed_hook

    def after_backward(self, model: torch.nn.Module) -> None:
        """Nothing: torch's DDP has finished its reduction inside backward()."""

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        if self.averager is not None:
            self.averager.average_parameters(model.parameters())

    def settle(self) -> None:
        """Nothing in the background: torch's DDP waits for its all-reduces in backward."""

    def close(self) -> None:
        """Nothing in flight: every torch collective here is waited on inside the step."""

    def state_dict(self) -> Dict[str, Any]:
        """What torch's hook and averager carry across steps; empty for the other peers.

        PowerSGDState: every slot but the process group, which is what torch's own
        __getstate__ returns (without the warning it logs each time)."""
        if self.name == "ddp-powersgd":
            return {"powersgd": {slot: getattr(self.hook_state, slot)
                                 for slot in self.hook_state.__slots__
                                 if slot != "process_group"},
                    "layouts": dict(self.layout_keeper.layouts)}
        if self.averager is not None:  # ddp-localsgd, ddp-hier-localsgd
            return {"hook_iter": self.hook_state.iter, "averager_step": self.averager.step}
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a state_dict() of the same peer (after wrap())."""
        if self.name == "ddp-powersgd":
            device = next(self.module.parameters()).device  # a checkpoint loads on the CPU
            for slot, value in state["powersgd"].items():
                if isinstance(value, dict):  # error_dict, p_memory_dict, q_memory_dict
                    value = {key: tensor.to(device) for key, tensor in value.items()}
                setattr(self.hook_state, slot, value)
            self.layout_keeper.layouts = dict(state["layouts"])
        elif self.averager is not None:  # ddp-localsgd, ddp-hier-localsgd
            self.hook_state.iter = state["hook_iter"]
            self.averager.step = state["averager_step"]


def one_bucket_at_a_time(hook):
    """`hook`, as a comm hook that starts a bucket's communication only once the bucket
    before it (in the same backward pass) has finished all of its own.

    torch's powerSGD_hook issues its first all-reduce when DDP calls it, and its second
    and third (the P's, then the Q's) from callbacks of the first, on the backend's
    thread. With two or more buckets, the next bucket's first all-reduce, issued by
    DDP's backward thread, then races with them: one rank may enqueue bucket 0's P's
    before bucket 1's uncompressed gradients, another after. Collectives are matched by
    the order they are enqueued, so the ranks add up different tensors; gloo stops on
    the sizes ("Received data size doesn't match expected size", on gpt-tiny at 4 ranks,
    where DDP makes a first bucket of 1 MiB and a second of the rest). Waiting for the
    bucket before keeps the order the same on every rank; the numbers are torch's hook's,
    unchanged. (It costs the overlap of one bucket's communication with the next's.)"""
    previous = []  # the future of this backward pass's last bucket so far, if any

    def hook_in_bucket_order(state, bucket):
        if previous:
            previous.pop().wait()  # raises the bucket before's error, if it had one
        future = hook(state, bucket)
        if not bucket.is_last():
            previous.append(future)
        return future
    return hook_in_bucket_order


def _host_size() -> int:
    """The ranks of each host, as torch's subgroups need them: hosts of one size, each
    a run of consecutive ranks. Collective; raises the same error on every rank when the
    placement is otherwise (uneven hosts, ranks dealt round robin)."""
    placement = [None] * dist.get_world_size()
    dist.all_gather_object(placement, socket.gethostname())
    runs = [placement[0]]
    for host in placement[1:]:
        if host != runs[-1]:
            runs.append(host)
    sizes = {placement.count(host) for host in runs}
    if len(runs) != len(set(runs)) or len(sizes) != 1:
        raise RuntimeError("ddp-hier-localsgd: torch's hierarchical averager groups runs of "
                           "consecutive ranks of one size; here the ranks sit on hosts "
                           f"{placement} (ours, hier-local-sgd, takes any placement)")
    return sizes.pop()


def _transport_traffic(group: dist.ProcessGroup) -> Traffic:
    """The traffic counter of the transport our backend runs `group`'s collectives on."""
    backend = group._get_backend(torch.device("cpu"))  # the CollectivesBackend itself
    return backend.comm.traffic


def is_peer(name: str) -> bool:
    return name in OURS


def create(name: str, **options) -> Peer:
    """A peer by name; options as our strategies take them (period, warmup_steps, rank,
    seed). An option the peer does not know raises TypeError."""
    if name == "torchft-diloco":
        from .torchft_peer import TorchftDiLoCo  # torchft is an optional extra
        return TorchftDiLoCo(**options)
    allowed: Dict[str, set] = {"ddp-localsgd": {"period", "warmup_steps"},
                               "ddp-hier-localsgd": {"period", "local_period", "warmup_steps"},
                               "ddp-powersgd": {"rank", "seed"}}
    unknown = set(options) - allowed.get(name, set())
    if unknown:
        raise TypeError(f"{name} takes no option(s) {', '.join(sorted(unknown))}")
    return TorchPeer(name, **options)
