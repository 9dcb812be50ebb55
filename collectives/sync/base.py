"""What a sync strategy is: when and what data-parallel training communicates.

Data-parallel training has a few moments where communication can happen. A strategy
is one small class that acts at some of them:

    reduce_bucket(flat)        a bucket of gradients is complete (runs on the comm
                               thread, overlapped with the rest of backward)
    after_backward(model)      every bucket has been reduced, before the optimizer step
    after_step(model, step)    the optimizer has updated the parameters

    close()                    training is over: finish anything still in flight

`uses_buckets` says whether gradients should be bucketed and reduced during backward at
all (local SGD, for example, trains locally and averages parameters in after_step).
`period` and `warmup_steps` say when a periodic strategy communicates: after steps
warmup_steps + period, + 2 period, ... (1 and 0 for those that communicate every
step); benchmarks time whole periods with them. `forward_buffer_sync` says whether
rank 0's buffers (BatchNorm statistics) are broadcast before every forward, as DDP
does; strategies that average buffers themselves, or must not wait for other ranks
every step, turn it off.

The training loop calls the moments in this order, every optimizer step:
    forward, backward (reduce_bucket for each bucket), after_backward, optimizer.step(),
    after_step; and close() once at the end.

A strategy talks only through the collectives and the transport (`self.comm`), and the
transport's counters say what it sent. Register a new one with `@register("name")`.
"""
from __future__ import annotations

from typing import Callable, Dict, Type

import torch

from ..transport import Transport


class SyncStrategy:
    """Base class: does nothing at every moment. Subclasses override what they need."""

    name = "none"
    uses_buckets = True
    forward_buffer_sync = True
    period = 1
    warmup_steps = 0

    def setup(self, model: torch.nn.Module, comm: Transport) -> None:
        """Called once, after parameters have been broadcast from rank 0."""
        self.model, self.comm = model, comm

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        """Reduce one flat bucket of gradients in place (on the comm thread)."""

    def after_backward(self, model: torch.nn.Module) -> None:
        """Every bucket is reduced and written back to .grad."""

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        """The optimizer has stepped; `step` counts from 1."""

    def close(self) -> None:
        """Training is over: wait for (or cancel) anything still in flight."""


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


def create(name: str, **options) -> SyncStrategy:
    """A new strategy by name; an unknown name lists the available ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown sync strategy {name!r}: choose from {', '.join(available())}")
    return _REGISTRY[name](**options)
