"""What a sync strategy is: when and what data-parallel training communicates.

Data-parallel training has a few moments where communication can happen. A strategy
is one small class that acts at some of them:

    reduce_bucket(flat)        a bucket of gradients is complete (runs on the comm
                               thread, overlapped with the rest of backward); what
                               gradient_divisor() says was already divided out
    after_backward(model)      every bucket has been reduced, before the optimizer step
    after_step(model, step)    the optimizer has updated the parameters

    settle()                   a measurement ends (an epoch, a benchmark's window):
                               finish what runs in the background, on every rank
                               alike (collective), leaving the strategy's state as is
    close()                    training is over: finish anything still in flight

    state_dict()               a checkpoint is being written: what this rank's strategy
                               carries from one step to the next (and must get back
                               to continue bit for bit), as tensors and numbers
    load_state_dict(state)     a run resumes: take back what state_dict() returned,
                               after setup() and before the first step

`uses_buckets` says whether gradients should be bucketed and reduced during backward at
all (local SGD, for example, trains locally and averages parameters in after_step).
`period` and `warmup_steps` say when a periodic strategy communicates: after steps
warmup_steps + period, + 2 period, ... (1 and 0 for those that communicate every
step); benchmarks time whole periods with them. `forward_buffer_sync` says whether
rank 0's buffers (BatchNorm statistics) are broadcast before every forward, as DDP
does; strategies that average buffers themselves, or must not wait for other ranks
every step, turn it off. `replicas_differ` says whether the ranks' models may differ
after a step (local SGD between averagings, gossip, asynchronous averaging): the model
such a run stands for, the one the trainer evaluates and checkpoints, is then the
average of the replicas, not any one rank's. `uneven_steps` says whether the ranks may
take different numbers of steps (async-avg: its rounds never wait at a set step), so
that a faster rank can train more of each epoch.

The training loop calls the moments in this order, every optimizer step:
    forward, backward (reduce_bucket for each bucket), after_backward, optimizer.step(),
    after_step; and close() once at the end.
The trainer's loop calls them itself; for a plain torch loop (forward, backward,
optimizer.step()) our DistributedDataParallel calls them in the same order, from hooks
at the end of each backward and after each optimizer step (ddp.py, moments="ddp").

A step whose gradients are not finite (an fp16 overflow, a bad batch) is skipped by
the loop (GradScaler, or the trainer's --skip-nonfinite), but only after the strategy
has seen it. So a strategy that keeps gradients from one step to the next (error
feedback, a warm start) must take a step into that state only when the step's
*reduced* values are all finite (`finite` below), or one inf would stay in its state
and make every later step non-finite. The reduced values are the same on every rank,
so every rank makes the same decision without asking the others. A synchronization
that averages weights rather than gradients (DiLoCo's outer step and its kin) has no
loop to skip it: the strategy drops it itself and says so (`drop_sync`: a warning from
the lowest rank that dropped it, and a count). A strategy that applies a gradient at a
later step also needs the loss scale it carries (`gradient_scale`): fp16 AMP changes
the scale between steps. So state kept across steps is stored unscaled (divided by the
scale of the step that made it) and multiplied by the current step's scale when it is
used.

State across steps is also what a checkpoint must keep. Each rank saves its own
strategy's state_dict() (the ranks' states differ: top-k residuals, a local-SGD
replica's drift), and a resumed run gives each rank its own back. A strategy whose
state is empty (allreduce, fp16, bf16, gossip) needs nothing beyond the defaults: the
model and optimizer that the trainer saves are all it has. The state holds no
communicator, thread or process-local key (a tensor's address means nothing in the
next process): what it names, it names by position, such as a bucket's index.

A strategy talks only through the collectives and the transport (`self.comm`), and the
transport's counters say what it sent. Register a new one with `@register("name")`.
"""
from __future__ import annotations

import math
import warnings
from typing import (Any, Callable, Dict, Iterable, NamedTuple, Optional, Sequence, Tuple, Type,
                    Union)

import torch

from ..transport import Transport
from .options import merged, split, typed


Shape = Union[int, Sequence[int]]  # a parameter's shape; an int is a vector's length


def element_count(shape: Shape) -> int:
    """How many elements a parameter of this shape holds."""
    return shape if isinstance(shape, int) else math.prod(shape)


def seeded_generator(seed: int, count: int) -> torch.Generator:
    """A generator every rank seeds alike from (seed, count), a step or a sync number:
    seed * 2**32 + count, taken mod 2**64. What it draws (noloco's pairs, sparta's
    positions) is then agreed on with nothing sent."""
    return torch.Generator().manual_seed(((seed << 32) + count) % (1 << 64))


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of what a strategy keeps across steps for `param` (a momentum, an error
    buffer): float32 for a 16-bit parameter, whose precision would lose the small
    changes those sums live on (in bfloat16, m * 0.999 rounds back to m); else its own."""
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


class StepCost(NamedTuple):
    """What one rank sends per optimizer step, on average over the strategy's schedule
    (a period, a warm-up left out): the terms a cost model prices."""
    bytes: float        # payload bytes this rank sends, as its transport counts them
    collectives: float  # collective calls (each pays the network's latency at least once)


class SyncStrategy:
    """Base class: does nothing at every moment. Subclasses override what they need."""

    name = "none"
    uses_buckets = True
    forward_buffer_sync = True
    # False: every rank holds the same parameters after each step (gradients were
    # averaged). True: the replicas drift apart, and the run's model is their average.
    replicas_differ = False
    # True: the ranks never meet in a collective at a set step (asynchronous rounds),
    # so they may take different numbers of steps, and a fast rank may train more of
    # an epoch than a slow one (the trainer's --shards dynamic).
    uneven_steps = False
    period = 1
    warmup_steps = 0
    # True: the strategy computes the whole update (1-bit Adam's m / sqrt(v)) and hands
    # it over as the gradient, so the optimizer must take it as it is: plain SGD, no
    # momentum, no clipping (the trainer refuses other flags).
    hands_over_the_update = False
    # how many synchronizations each period holds (streaming DiLoCo: one per fragment);
    # benchmarks count them
    syncs_per_period = 1
    # True: the strategy keeps state per gradient bucket (topk's residuals), so the
    # buckets must not be re-cut once training has begun (bucket_cap_mb="auto").
    keeps_bucket_state = False
    # "backward": buckets are reduced as backward goes on, and backward waits for the
    # last (DDP's schedule). "forward": in chunks of chunk_bytes, those the next forward
    # needs first, the optimizer stepping each layer inside it (allreduce's option).
    overlap = "backward"
    chunk_bytes = 0
    # A duplicate of `comm` (setup) for bucket work that runs while the training thread
    # may call collectives of its own (overlap="forward"); None: the buckets use `comm`.
    channel: Optional[Transport] = None
    # fp16 AMP: the torch.amp.GradScaler whose loss scale multiplies the gradients the
    # strategy sees (set by the training loop; None when gradients arrive unscaled).
    grad_scaler = None

    # synchronizations this rank dropped for a non-finite average (drop_sync), in this
    # process (a count for the warnings, not kept in a checkpoint)
    dropped_syncs = 0

    def drop_sync(self, what: str, ranks: Optional[Sequence[int]] = None) -> None:
        """Say that a synchronization was dropped because its average is not finite (an
        overflow on some rank), and count it. `ranks`: those that dropped it, alike (a
        pair's two); None: every rank. The lowest of them warns, each time: a run that
        keeps dropping them trains replicas that no longer meet, which its loss alone
        would not say."""
        self.dropped_syncs += 1
        rank = getattr(getattr(self, "comm", None), "rank", 0)
        if rank != (0 if ranks is None else min(ranks)):
            return
        who = ("every rank" if ranks is None else
               f"rank{'s' * (len(ranks) > 1)} " + " and ".join(map(str, sorted(ranks))))
        warnings.warn(f"{self.name}: {what} is not finite (an overflow on some rank); {who} "
                      f"dropped it ({self.dropped_syncs} dropped so far)", RuntimeWarning,
                      stacklevel=2)

    def gradient_scale(self) -> float:
        """The factor the gradients of this step carry: the GradScaler's scale, else 1.

        Read during backward or in after_backward, before the loop's scaler.step()
        unscales and scaler.update() changes the scale for the next step. Only a loop
        that unscales after after_backward (as the trainer does) should set grad_scaler.
        """
        return 1.0 if self.grad_scaler is None else self.grad_scaler.get_scale()

    def setup(self, model: torch.nn.Module, comm: Transport) -> None:
        """Called once, after parameters have been broadcast from rank 0."""
        self.model, self.comm = model, comm

    @property
    def bucket_comm(self) -> Transport:
        """The communicator the buckets are reduced over (and the bucketer's jobs run
        on): `channel` where the strategy made one, else `comm`."""
        return self.channel or self.comm

    def gradient_divisor(self) -> Optional[int]:
        """What each gradient should be divided by as it goes in its bucket, or None.

        A strategy that averages says the world size: reduce_bucket then gets the
        gradients already divided, and the division costs no pass over memory of its
        own (the bucketer divides while it copies, as DDP's Reducer does). Asked once
        a step, at its first gradient."""
        return None

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        """Reduce one flat bucket of gradients in place (on the comm thread)."""

    def after_backward(self, model: torch.nn.Module) -> None:
        """Every bucket is reduced and written back to .grad."""

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        """The optimizer has stepped; `step` counts from 1."""

    def replicas_equal_after(self, step: int) -> bool:
        """Does every rank hold the same parameters once after_step(step) has run: a
        point an elastic job can commit and go back to? Always, unless the replicas
        drift apart (then a subclass names the steps where they meet)."""
        return not self.replicas_differ

    def settle(self) -> None:
        """Collective: wait until the communication this strategy runs in the
        background has finished on every rank, so that its bytes and seconds belong to
        the measurement ending now. The next step finds the result ready. Nothing runs
        in the background unless a subclass says so."""

    def close(self) -> None:
        """Training is over: wait for (or cancel) anything still in flight."""

    def cost(self, shapes: Sequence[Shape], world_size: int) -> Optional[StepCost]:
        """What this strategy sends per step for a model of float32 parameters of these
        shapes (an int: a vector of that many elements) on `world_size` ranks, worked
        out from its rule (the tests check it against the transport's count); None where
        no strategy says it yet. Shapes, not sizes: demo's tiles depend on them."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        """What this rank's strategy carries across steps, for a checkpoint (between two
        steps, on every rank). Nothing, unless a subclass keeps something."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from `state`, a state_dict() of this strategy saved by the same rank
        of an earlier run; called after setup(), before the first step."""


def finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every tensor holds only finite numbers (no inf, no NaN).

    Call it on reduced values, which every rank holds identically: then every rank gets
    the same answer with no collective of its own. A non-finite number on any one rank
    survives the reduction (inf + x is inf or NaN, NaN + x is NaN), so it is seen by all.
    """
    return all(bool(torch.isfinite(t).all()) for t in tensors)


_REGISTRY: Dict[str, Type[SyncStrategy]] = {}


def register(name: str) -> Callable[[Type[SyncStrategy]], Type[SyncStrategy]]:
    """Class decorator: make a strategy available by `name`."""
    def add(cls: Type[SyncStrategy]) -> Type[SyncStrategy]:
        if name in _REGISTRY:
            raise ValueError(f"a sync strategy named {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def available() -> list:
    """The registered strategy names."""
    return sorted(_REGISTRY)


def strategy_class(name: str) -> Type[SyncStrategy]:
    """The class registered as `name`; an unknown name lists the available ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown sync strategy {name!r}: choose from {', '.join(available())}")
    return _REGISTRY[name]


def parse(spec: str, **options) -> Tuple[str, Dict[str, Any]]:
    """'local-sgd:period=8' -> ('local-sgd', {'period': 8}): the strategy a spec names
    and its options (those after the name, and `options`), each converted to or checked
    against the type its constructor declares (options.py). What create() would refuse
    of an option's name or type is refused here, before anything is built."""
    name, given = split(spec)
    declared_by = strategy_class(name).__init__
    return name, typed(name, declared_by, merged(name, given, options))


def create(spec: str, **options) -> SyncStrategy:
    """A new strategy from a spec: a registered name, with options after it or as keyword
    arguments: create("allreduce:overlap=forward") is create("allreduce",
    overlap="forward"). A bad option is one line naming the strategy, the option, the
    value and what it needs (ValueError; TypeError for an option it does not take)."""
    name, typed_options = parse(spec, **options)
    return _REGISTRY[name](**typed_options)
