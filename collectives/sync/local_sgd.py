"""`local-sgd`: train alone, average the models every H steps (post-local SGD).

Communicates: all parameters and floating-point buffers, one all-reduce every H
optimizer steps (none in between). After `warmup_steps` synchronous steps (gradients
averaged every step, exactly like `allreduce`), each rank trains on its own and the
replicas drift apart for H steps before they are averaged back together.

Literature: Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019);
Lin et al., "Don't Use Large Mini-Batches, Use Local SGD" (ICLR 2020) introduce
post-local SGD (synchronous warm-up first) and report it matching or beating
large-batch SGD accuracy on CIFAR/ImageNet ResNets with H up to 16, at 1/H of the
communication rounds. With H = 1 and plain SGD it is exactly gradient averaging.

Checkpoint: the count of steps done (it decides whether a step is still warm-up); each
rank's replica, which differs from the others' between two averagings, is the model
the trainer saves for every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .. import api
from .allreduce import AllReduce
from .base import register
from .options import need


def averaged_tensors(model: torch.nn.Module):
    """What model averaging averages: parameters and floating-point buffers."""
    return [p.data for p in model.parameters()] + [
        b for b in model.buffers() if b.is_floating_point()]


@register("local-sgd")
class LocalSGD(AllReduce):
    forward_buffer_sync = False  # buffers are averaged with the parameters
    replicas_differ = True  # the model is the average of the replicas

    def __init__(self, period: int = 8, warmup_steps: int = 0, algorithm: str = "auto"):
        super().__init__(algorithm)
        need(period >= 1, self.name, "period", period, "at least 1")
        need(warmup_steps >= 0, self.name, "warmup_steps", warmup_steps, "0 or more")
        self.period, self.warmup_steps = period, warmup_steps
        self.steps_done = 0

    def gradient_divisor(self) -> Optional[int]:
        return super().gradient_divisor() if self.steps_done < self.warmup_steps else None

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        if self.steps_done < self.warmup_steps:  # synchronous warm-up: average gradients
            super().reduce_bucket(flat)

    def averages_after(self, step: int) -> bool:
        """Is `step` one after which the replicas are averaged?"""
        return step > self.warmup_steps and (step - self.warmup_steps) % self.period == 0

    def replicas_equal_after(self, step: int) -> bool:
        return step <= self.warmup_steps or self.averages_after(step)  # warm-up: synchronous

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        self.steps_done = step
        if self.averages_after(step):
            api.all_reduce_coalesced(averaged_tensors(model), op="avg",
                                     algorithm=self.algorithm, comm=self.comm)

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer steps done: before its first after_step, a resumed run would
        otherwise take itself for one still in warm-up."""
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps_done = state["steps_done"]
