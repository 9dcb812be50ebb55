"""`delayed`: all-reduce step t's gradients while step t+1 computes; apply them late.

Communicates: every gradient every step, as `allreduce`. After `warmup_steps`
synchronous steps (each applies its own average, as allreduce does), the all-reduce of
step t runs on a background thread (its own communicator) during step t+1's forward
and backward, so communication hides behind a whole step, not just part of backward.
The optimizer at step t+1 applies the average of step t's gradients (nothing at the
first late step): a one-step staleness.

Staleness costs accuracy, and with momentum it can cost all of it: SGD whose gradient
arrives one step late, on a quadratic of curvature h with learning rate lr and momentum
beta, is stable only while lr * h < 1 - beta (without the delay: lr * h < 2 (1 + beta)),
so at the trainer's lr 0.05 and momentum 0.9 a ResNet's loss explodes in its first
steps and the model never recovers. Two things are done about it:

    warmup_steps  (default 32) the first steps are synchronous, as post-local SGD
                  begins (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
                  ICLR 2020): a fresh network is at its sharpest, and there a stale
                  gradient overshoots even at momentum 0 (a ResNet-18's loss rises above
                  chance's).
    compensate    what is done to each late gradient, one of:

    momentum  (the default) lower the optimizer's momentum by the momentum the delay
              adds. Mitliagkas et al., "Asynchrony begets Momentum, with an Application
              to Deep Learning" (Allerton 2016), show that stale gradients act as an
              implicit momentum, 1 - 1/M for the staleness of M asynchronous workers
              (mean staleness M - 1), and that the explicit momentum should be lowered
              by it. A delay of one step is M = 2: implicit momentum 0.5
              (`implicit_momentum`), so momentum 0.9 becomes 0.4 (never below 0) once
              the steps are late. The optimizer is the training loop's, so the strategy
              adopts whichever optimizer steps this model's parameters (torch's step
              pre-hook): before each late step it sets those param groups' momentum
              (Adam's and AdamW's first-moment decay beta1 alike: 0.9 becomes 0.4;
              the stability argument is the same, unmeasured on these),
              keeping the one asked for under "explicit_momentum" ("explicit_beta1")
              in the group (so an
              optimizer's checkpoint brings it back, and lowering twice is impossible);
              close() puts it back.
    dc        delay-compensated SGD, Zheng et al., "Asynchronous Stochastic Gradient
              Descent with Delay Compensation" (ICML 2017), DC-ASGD-a: the stale gradient
              g, computed at the weights w_stale, is corrected to first order towards the
              weights w_now it is applied to, with g * g as a cheap diagonal of the
              Hessian: g + lambda * g * g * (w_now - w_stale), lambda = dc_lambda /
              sqrt(mean square of g) (a moving average, decay dc_decay; the paper's 2
              and 0.95). It keeps a copy of the weights and a mean square per parameter.
    none      apply the stale average as it is.

Measured (docs/strategies.md, with the commands): ResNet-18 on 4 ranks, the trainer's
defaults, 3 epochs. On the MNIST subset allreduce reaches 97.6 % (96.4 % after 2
epochs); delayed at these defaults 96.2 % (95.4 %); with 16 synchronous steps 94.4 %;
late from the first step, 91.4 % with momentum 0.4 and 16.6-19.4 % with dc or none
(momentum 0 or 0.2 do no better than 0.4). After the 32 synchronous steps, dc and none
end where momentum does (96.8, 96.4 %) but are at 87.6-87.8 % after 2 epochs. On the
embedded shapes (16 steps an epoch, so the warm-up is two of its three epochs)
allreduce 96.7 %, delayed 97.3 %, and with none after the same start 91.2 %. dc's correction moves a late gradient by 0.6-11 % of
its norm over a ResNet-18's first steps, and changes no accuracy measurably; without
the synchronous start, no momentum makes the late steps as good as fresh ones.

With fp16 AMP the GradScaler's scale may change between the two steps (halved after an
overflow, doubled after a run of good ones), so each gradient travels with the scale it
was computed with and is rescaled to the scale the loop will unscale it with. An
overflow in step t's gradient is seen at step t+1, when that gradient is applied (and
skipped): knowing sooner would mean waiting for the other ranks during step t, which is
what this strategy exists to avoid. Nothing non-finite stays behind: each step's
gradient is used once, and dc's mean square takes only finite gradients.

Checkpoint: the steps done (is the warm-up over?) and the gradient in flight are this
strategy's state. state_dict() waits for the gradient's all-reduce and saves the
average with its scale (with dc, also the weights it was computed at and the mean
square); after load_state_dict() the next after_backward applies it as if it had just
arrived, so a resumed run continues with the same one-step-late gradients as one that
never stopped. The lowered momentum travels in the optimizer's own checkpoint.
"""
from __future__ import annotations

import threading
from typing import Any, Dict

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import api
from ..bucketer import CommWorker
from .base import SyncStrategy, finite, register
from .options import check_algorithm, need, one_of

COMPENSATIONS = ("momentum", "dc", "none")


def set_gradients(params, flat: torch.Tensor) -> None:
    """Each parameter's .grad: its slice of `flat`, copied."""
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


@register("delayed")
class Delayed(SyncStrategy):
    uses_buckets = False

    def __init__(self, algorithm: str = "auto", compensate: str = "momentum",
                 implicit_momentum: float = 0.5, dc_lambda: float = 2.0,
                 dc_decay: float = 0.95, warmup_steps: int = 32):
        check_algorithm(self.name, algorithm)
        one_of(self.name, "compensate", compensate, COMPENSATIONS)
        need(0 <= implicit_momentum < 1, self.name, "implicit_momentum", implicit_momentum,
             "in [0, 1)")
        need(dc_lambda >= 0, self.name, "dc_lambda", dc_lambda, "0 or more")
        need(0 <= dc_decay < 1, self.name, "dc_decay", dc_decay, "in [0, 1)")
        need(warmup_steps >= 0, self.name, "warmup_steps", warmup_steps, "0 or more")
        self.algorithm = algorithm
        self.warmup_steps = warmup_steps
        self.steps_done = 0  # after_backward calls: the first warmup_steps are synchronous
        self.compensate = compensate
        self.implicit_momentum = implicit_momentum
        self.dc_lambda, self.dc_decay = dc_lambda, dc_decay
        # (flat gradients being averaged, their scale, the weights they were computed
        # at (dc only, else None), done event)
        self.in_flight = None
        self.mean_square = None  # dc: moving average of the unscaled average gradient²

    def setup(self, model, comm) -> None:
        super().setup(model, comm)
        self.channel = comm.duplicate()  # the training thread keeps using comm
        self.worker = CommWorker(comm.device)
        self.lowered = []  # the param groups whose momentum was lowered
        self.momentum_hook = None
        if self.compensate == "momentum":
            # The optimizer is the training loop's: adopt whichever steps this model
            # (torch calls the hook before every optimizer's step, ours or not).
            self.parameter_ids = {id(p) for p in model.parameters()}
            self.momentum_hook = register_optimizer_step_pre_hook(self._lower_momentum)

    def _wait_in_flight(self):
        flat, scale, weights, done = self.in_flight
        done.wait()
        if self.worker.error is not None:
            raise self.worker.error
        return flat, scale, weights

    def after_backward(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        current = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                             for p in params])
        scale = self.gradient_scale()  # what this step's gradients are multiplied by
        self.steps_done += 1
        if self.steps_done <= self.warmup_steps:  # synchronous: this step's own average
            api.all_reduce(current, op="avg", algorithm=self.algorithm, comm=self.channel,
                           check=False)
            set_gradients(params, current)
            return
        weights = (torch.cat([p.detach().reshape(-1) for p in params])
                   if self.compensate == "dc" else None)
        if self.in_flight:
            previous, previous_scale, previous_weights = self._wait_in_flight()
        else:
            previous, previous_scale, previous_weights = torch.zeros_like(current), scale, None
        done = self.worker.submit(lambda: api.all_reduce(
            current, op="avg", algorithm=self.algorithm, comm=self.channel, check=False),
            "last step's gradients")
        self.in_flight = (current, scale, weights, done)
        if previous_scale != scale:
            # The loop unscales with this step's scale: re-express last step's gradient
            # in it, so that unscaling yields exactly what last step would have applied.
            previous.mul_(scale / previous_scale)
        if self.compensate == "dc" and previous_weights is not None:
            self._compensate_delay(previous, scale, previous_weights, weights)
        set_gradients(params, previous)  # the optimizer applies last step's average

    def _compensate_delay(self, gradient: torch.Tensor, scale: float,
                          stale_weights: torch.Tensor, weights: torch.Tensor) -> None:
        """DC-ASGD-a, in place: gradient += lambda * g * g * (w_now - w_stale), g the
        unscaled gradient, lambda = dc_lambda / sqrt(mean square of g)."""
        unscaled = gradient / scale
        if not finite([unscaled]):
            return  # the loop skips this step; the mean square must not keep an inf
        if self.mean_square is None:
            self.mean_square = unscaled.square()
        else:
            self.mean_square.mul_(self.dc_decay).addcmul_(unscaled, unscaled,
                                                          value=1 - self.dc_decay)
        lam = self.dc_lambda / (self.mean_square.sqrt() + 1e-7)
        # gradient carries the scale once: lambda * (g s) * g * dw
        gradient.add_(lam * gradient * unscaled * (weights - stale_weights))

    def _lower_momentum(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """Before an optimizer steps: if it steps this model's parameters, set each such
        param group's momentum to the one asked for less the delay's implicit momentum.
        Idempotent: the momentum asked for is kept in the group ("explicit_momentum"),
        and so comes back with the optimizer's checkpoint."""
        if self.steps_done <= self.warmup_steps:
            return  # synchronous steps keep the momentum asked for
        for group in optimizer.param_groups:
            if not all(id(p) in self.parameter_ids for p in group["params"]):
                continue  # another model's optimizer
            if "momentum" in group:  # SGD's, Muon's
                explicit = group.setdefault("explicit_momentum", group["momentum"])
                group["momentum"] = max(0.0, explicit - self.implicit_momentum)
            elif "betas" in group:  # Adam's first moment is a momentum too
                explicit = group.setdefault("explicit_beta1", group["betas"][0])
                group["betas"] = (max(0.0, explicit - self.implicit_momentum),
                                  *group["betas"][1:])
            else:
                raise ValueError("delayed: compensate=momentum lowers an optimizer's "
                                 f"momentum (SGD's, Adam's beta1); {type(optimizer).__name__} "
                                 "has none: use compensate=dc or none")
            if not any(group is lowered for lowered in self.lowered):
                self.lowered.append(group)

    def state_dict(self) -> Dict[str, Any]:
        """The steps done (the warm-up's count) and, once steps are late, the gradient
        in flight, averaged (its all-reduce is waited for), and its scale; with dc, the
        weights it was computed at and the mean square."""
        state = {"steps_done": self.steps_done}
        if self.in_flight:
            average, scale, weights = self._wait_in_flight()
            state.update(gradient=average, scale=scale)
            if self.compensate == "dc":
                state.update(weights=weights, mean_square=self.mean_square)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take back the steps done, and put a saved gradient back in flight, its
        all-reduce already done."""
        self.steps_done = state.get("steps_done", self.warmup_steps)
        if "gradient" in state:
            arrived = threading.Event()
            arrived.set()
            device = next(self.model.parameters()).device  # a checkpoint loads on the CPU
            weights = state.get("weights")
            self.in_flight = (state["gradient"].to(device, copy=True), state["scale"],
                              None if weights is None else weights.to(device, copy=True),
                              arrived)
            if state.get("mean_square") is not None:
                self.mean_square = state["mean_square"].to(device, copy=True)

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
            if self.momentum_hook is not None:  # the optimizer as it was given
                self.momentum_hook.remove()
                for group in self.lowered:
                    if "explicit_momentum" in group:
                        group["momentum"] = group.pop("explicit_momentum")
                    if "explicit_beta1" in group:
                        group["betas"] = (group.pop("explicit_beta1"), *group["betas"][1:])
