"""The optimizer step taken inside the next forward, layer by layer, as gradients land.

With DDP, backward waits for its last buckets, the optimizer steps every parameter,
and only then can the next forward begin. Yet the next forward needs the first layers
first, and an optimizer such as SGD or Adam updates each parameter from its own
gradient and state alone. So here (the `allreduce` strategy with overlap="forward"):

    backward:      gradients bucketed and launched; backward returns without waiting
    step():        the step is remembered (its learning rates, as the schedule set them)
    next forward:  before each layer runs, a hook waits only for the chunks of the
                   buckets that hold the layer's parameters (priority.py sends those
                   the forward needs first), and steps those parameters
    forward ends:  whatever the forward did not use is stepped too, so backward starts
                   with every parameter updated

    model = collectives.DistributedDataParallel(net, sync=create("allreduce", overlap="forward"))
    optimizer = model.step_in_forward(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer.optimizer, T_max=100)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        optimizer.step(); optimizer.zero_grad(); schedule.step()
    optimizer.flush()  # before reading the parameters outside a forward or state_dict()

Each parameter gets exactly the update one optimizer.step() would give it: the step is
taken on a shallow copy of the optimizer that shares its state (momentum buffers,
Adam's moments) and has the remembered hyperparameters, over the parameters of one
layer at a time. The optimizer must update each parameter from its own gradient and
state (ELEMENTWISE); a rule over all gradients at once cannot run, since step() comes
before the gradients exist: clip_grad_norm_, GradScaler's inf check (fp16 AMP), a
closure (LBFGS). The model's and the optimizer's state_dict() finish the pending step
first. After step(), .grad holds this rank's own gradient (or what zero_grad() left),
not the average: the average lands in the next forward and is gone after its step.
"""
from __future__ import annotations

import copy
from typing import Callable, ContextManager, Dict, List, Optional

import torch

from . import trace

# the optimizers whose step updates each parameter from its gradient and state alone
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


def _waiting_span() -> ContextManager:
    return trace.span("waiting on communication", cat="wait")


def _frozen(value):
    """A hyperparameter as it is now: a tensor (an lr a scheduler fills in place) copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):  # Adam's betas
        return tuple(_frozen(item) for item in value)
    return value


class StepInForward:
    """An optimizer whose step() is taken inside the next forward (the module docstring).
    Made by DistributedDataParallel.step_in_forward(optimizer)."""

    def __init__(self, ddp, optimizer: torch.optim.Optimizer,
                 waiting: Callable[[], ContextManager] = _waiting_span):
        if not isinstance(optimizer, ELEMENTWISE):
            raise ValueError(f"overlap=\"forward\" steps each layer on its own: "
                             f"{type(optimizer).__name__} is not one of the optimizers that "
                             f"update a parameter from its own gradient alone "
                             f"({', '.join(c.__name__ for c in ELEMENTWISE)})")
        self.ddp, self.optimizer, self.waiting = ddp, optimizer, waiting
        self.bucketer = ddp.bucketer
        self._part = copy.copy(optimizer)  # shares .state; param_groups set per layer
        self._group_of: Dict[int, int] = {id(p): index for index, group in
                                           enumerate(optimizer.param_groups)
                                           for p in group["params"]}
        reduced = {id(p) for bucket in self.bucketer.buckets for p in bucket.params}
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]
                   if p.requires_grad}  # frozen ones never have a gradient to step
        if trained != reduced:
            raise ValueError("step_in_forward: the optimizer must hold the model's trained "
                             "parameters and no others (one outside the model would never "
                             "be stepped; one of the model's outside it would be)")
        self._pending: Optional[List[dict]] = None  # the remembered step's hyperparameters
        self._discarded = False  # zero_grad() came instead of step(): drop the gradients
        self._stepped: set = set()                  # ids stepped in this forward
        self._hooks = []
        for module in ddp.module.modules():  # first among a module's hooks (weight_norm's
            own = [p for p in module.parameters(recurse=False) if id(p) in reduced]
            if own:                          # computes a weight from the stepped ones)
                self._hooks.append(module.register_forward_pre_hook(
                    lambda module, inputs, own=own: self._step_these(own), prepend=True))
        # (functions, not bound methods: a deepcopy of the model, as for evaluation or an
        # average of weights, copies a bound method's object, this one and its threads)
        self._hooks.append(ddp.module.register_forward_hook(
            lambda module, inputs, output: self._after_forward(module)))
        # the model's state_dict() (a checkpoint) holds the step in flight too
        self._hooks.append(ddp.module.register_state_dict_pre_hook(
            lambda module, prefix, keep_vars: self.flush()))

    # --- what a training loop calls ---------------------------------------------------
    def step(self, closure=None) -> None:
        """Remember this step, to be taken in the next forward; if this step's
        reduction was not handed over (nothing in flight), step now as usual."""
        if closure is not None:
            raise ValueError("step_in_forward: a closure (LBFGS) needs every gradient at once")
        if not self.bucketer.handed_off:
            self.optimizer.step()
            return
        if self._pending is not None:  # two step() calls for one backward
            raise RuntimeError("step_in_forward: step() was called twice for one backward")
        self._pending = [{key: _frozen(value) for key, value in group.items() if key != "params"}
                         for group in self.optimizer.param_groups]
        self.optimizer._opt_called = True  # what an LR scheduler checks: step() came first

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the optimizer's; with a step in flight that step() did not take, its
        gradients are dropped (a loop that skips a step), not written later."""
        if self.bucketer.handed_off and self._pending is None:
            self._discarded = True
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def flush(self) -> None:
        """Finish the step in flight now: wait for every bucket, step what the forward
        has not stepped yet. If step() was not called, the reduced gradients are written
        to .grad, as after a plain backward, unless zero_grad() dropped them."""
        if not self.bucketer.handed_off:
            return
        try:
            every = [p for bucket in self.bucketer.buckets for p in bucket.params]
            if self._pending is not None:
                self._step_these([p for p in every if id(p) not in self._stepped])
            skip = {id(p) for p in every} if self._discarded else self._stepped
            self.bucketer.complete(skip=skip)
        finally:
            self._pending, self._stepped, self._discarded = None, set(), False

    def state_dict(self) -> dict:
        self.flush()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.flush()
        self.optimizer.load_state_dict(state)

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    def close(self) -> None:
        """Remove the hooks (after a flush); the model takes no more steps in forward."""
        self.flush()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.ddp.stepper is self:
            self.ddp.stepper = None

    # --- inside the forward ----------------------------------------------------------
    def _after_forward(self, module: torch.nn.Module) -> None:
        """The forward has ended: step what it did not use. In a training forward a
        parameter left over was either unused (the next backward says so) or read by
        a module other than its own before it was stepped (nn.MultiheadAttention reads
        its out_proj's weight without calling it): that forward used the old value."""
        if self._pending is not None and torch.is_grad_enabled() and module.training:
            left = [name for name, p in module.named_parameters()
                    if p.requires_grad and id(p) not in self._stepped]
            if left:
                self.flush()
                raise RuntimeError(
                    f"overlap=\"forward\": {len(left)} parameter(s) were not stepped before "
                    f"this forward ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}):"
                    " unused, or read by a module other than their own (as "
                    "nn.MultiheadAttention reads out_proj's); not supported")
        self.flush()

    def _step_these(self, params: List[torch.nn.Parameter]) -> None:
        """Step `params` (one layer's) once their reduced gradients are in."""
        if self._pending is None or not self.bucketer.handed_off:
            return
        params = [p for p in params if id(p) not in self._stepped]
        if not params:
            return
        with self.waiting():
            grads = self.bucketer.take(params)
        with trace.span("optimizer", cat="compute"):
            by_group: Dict[int, list] = {}
            for p in params:
                by_group.setdefault(self._group_of[id(p)], []).append(p)
            self._part.param_groups = [dict(self._pending[index], params=members)
                                       for index, members in by_group.items()]
            self._part.state = self.optimizer.state  # load_state_dict() binds a new one
            held = [p.grad for p in params]  # what the loop left there (zero_grad's None)
            for p, grad in zip(params, grads):
                p.grad = grad
            try:
                with torch.no_grad():
                    self._part.step()
            finally:
                for p, grad in zip(params, held):
                    p.grad = grad
        self._stepped.update(id(p) for p in params)


__all__ = ["StepInForward", "ELEMENTWISE"]
