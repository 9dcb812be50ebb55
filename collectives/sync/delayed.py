"""`delayed`: all-reduce step t's gradients while step t+1 computes; apply them late.

Communicates: every gradient every step, as `allreduce`, but the all-reduce of step t
runs on a background thread (its own communicator) during step t+1's forward and
backward, so communication hides behind a whole step, not just part of backward. The
optimizer at step t+1 applies the average of step t's gradients (zero at step 1): a
one-step staleness.

With fp16 AMP the GradScaler's scale may change between the two steps (halved after an
overflow, doubled after a run of good ones), so each gradient travels with the scale it
was computed with and is rescaled to the scale the loop will unscale it with. An
overflow in step t's gradient is seen at step t+1, when that gradient is applied (and
skipped): knowing sooner would mean waiting for the other ranks during step t, which is
what this strategy exists to avoid. Nothing non-finite stays behind: each step's
gradient is used once.

Literature: the "delayed gradient" / one-step-stale schemes studied by Zheng et al.,
"Asynchronous SGD with Delay Compensation" (ICML 2017) and used by PipeDream (Harlap et
al., 2018) report accuracy close to synchronous SGD for a delay of one step at
moderate learning rates.

Checkpoint: the gradient in flight is this strategy's state. state_dict() waits for its
all-reduce and saves the average with its scale; after load_state_dict() the next
after_backward applies it as if it had just arrived, so a resumed run continues with
the same one-step-late gradients as one that never stopped.
"""
from __future__ import annotations

import threading
from typing import Any, Dict

import torch

from .. import api
from ..bucketer import CommWorker
from .base import SyncStrategy, register


@register("delayed")
class Delayed(SyncStrategy):
    uses_buckets = False

    def __init__(self, algorithm: str = "auto"):
        self.algorithm = algorithm
        self.in_flight = None   # (flat gradients being averaged, their scale, done event)

    def setup(self, model, comm) -> None:
        super().setup(model, comm)
        self.channel = comm.duplicate()  # the training thread keeps using comm
        self.worker = CommWorker()

    def _wait_in_flight(self):
        flat, scale, done = self.in_flight
        done.wait()
        if self.worker.error is not None:
            raise self.worker.error
        return flat, scale

    def after_backward(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        current = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                             for p in params])
        scale = self.gradient_scale()  # what this step's gradients are multiplied by
        previous, previous_scale = (self._wait_in_flight() if self.in_flight
                                    else (torch.zeros_like(current), scale))
        done = self.worker.submit(lambda: api.all_reduce(
            current, op="avg", algorithm=self.algorithm, comm=self.channel, check=False),
            "last step's gradients")
        self.in_flight = (current, scale, done)
        if previous_scale != scale:
            # The loop unscales with this step's scale: re-express last step's gradient
            # in it, so that unscaling yields exactly what last step would have applied.
            previous.mul_(scale / previous_scale)
        offset = 0
        for p in params:  # the optimizer applies last step's average
            p.grad = previous[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def state_dict(self) -> Dict[str, Any]:
        """The gradient in flight, averaged (its all-reduce is waited for), and its scale;
        empty before the first step."""
        if not self.in_flight:
            return {}
        average, scale = self._wait_in_flight()
        return {"gradient": average, "scale": scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Put a saved gradient back in flight, its all-reduce already done."""
        if "gradient" in state:
            arrived = threading.Event()
            arrived.set()
            device = next(self.model.parameters()).device  # a checkpoint loads on the CPU
            self.in_flight = (state["gradient"].to(device, copy=True), state["scale"], arrived)

    def settle(self) -> None:
        """Wait for last step's all-reduce. Every rank submits one per step, so every
        rank waits for the same one; it stays in flight, to be applied next step."""
        self.worker.drain()

    def close(self) -> None:
        try:
            if self.in_flight:
                self._wait_in_flight()  # its gradient is never applied: training is over
        finally:
            self.in_flight = None
            self.worker.stop()
