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
state (ELEMENTWISE).

Whatever reads or writes the weights or the optimizer's state between step() and the
next forward sees what plain allreduce would, where the step came before it:
- state_dict() of the model (or of any of its modules) and of the optimizer: the step
  in flight is finished first (hooks on both);
- load_state_dict() of either, in either order: the step is finished first, then the
  load overwrites what it loads (plain allreduce's step came before the load too), so
  the loaded values win; the buffers the step received are dropped and the next
  forward broadcasts rank 0's loaded ones (ddp.py): load on every rank, as torch's
  DDP needs for the weights;
- an evaluation: a forward steps each layer before it runs, under no_grad too;
- .grad: this rank's own gradient until the next forward ends, then the average
  where the loop left .grad as backward made it (no zero_grad() yet), as plain
  allreduce leaves it after step(); zero_grad() instead of step() drops the step, and
  zero_grad() before step() makes the step plain allreduce's (on what it left).

What needs every averaged gradient before the step, which here comes before the
gradients exist, is refused with one line: GradScaler's step (its inf check),
gradients changed between backward and step() (clip_grad_norm_), the wrapped
optimizer stepped itself (on this rank's own gradients), a closure (LBFGS). To clip or
scale, call flush() after backward: .grad then holds the average, and that step is
plain allreduce's (without the overlap):

    loss.backward(); optimizer.flush()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
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
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._pending: Optional[List[dict]] = None  # the remembered step's hyperparameters
        self._stepped: set = set()                  # ids stepped in this forward
        self._hooks = []
        # (functions, not bound methods: a deepcopy of the model, as for evaluation or an
        # average of weights, copies a bound method's object, this one and its threads)
        for module in ddp.module.modules():  # first among a module's hooks (weight_norm's
            own = [p for p in module.parameters(recurse=False) if id(p) in reduced]
            if own:                          # computes a weight from the stepped ones)
                self._hooks.append(module.register_forward_pre_hook(
                    lambda module, inputs, own=own: self._step_these(own), prepend=True))
            # a checkpoint holds the step in flight; a load comes after it
            self._hooks.append(module.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: self.flush()))
            self._hooks.append(load_pre_hook(module, lambda *_: self.flush()))
        self._hooks.append(ddp.module.register_forward_hook(
            lambda module, inputs, output: self._after_forward(module)))
        # the optimizer's own: its checkpoint and load likewise; a step of its own refused
        self._hooks += [
            optimizer.register_state_dict_pre_hook(lambda opt: self.flush()),
            optimizer.register_load_state_dict_pre_hook(lambda opt, state: self.flush()),
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._own_step(opt))]

    # --- what a training loop calls ---------------------------------------------------
    def step(self, closure=None) -> None:
        """Remember this step, to be taken in the next forward. Where no step is in
        flight (after flush()), or zero_grad() came first, step now as plain allreduce."""
        if closure is not None:
            raise ValueError("step_in_forward: a closure (LBFGS) needs every gradient at once")
        if self.__dict__.pop("found_inf", None) is not None:  # _step_supports_amp_scaling
            self.__dict__.pop("grad_scale", None)
            raise RuntimeError(
                "overlap=\"forward\": GradScaler's step with a step in flight: its inf check "
                "needs every averaged gradient at once, and they land layer by layer in the "
                "next forward; call optimizer.flush() before scaler.step(optimizer) (that "
                "step is then plain allreduce's)")
        if not self.bucketer.handed_off:
            self.optimizer.step()
            return
        if self._pending is not None:  # two step() calls for one backward
            raise RuntimeError("step_in_forward: step() was called twice for one backward")
        touched = self.bucketer.touched_grads()
        changed = [self._names.get(key, "?") for key, how in touched.items() if how == "changed"]
        if changed:
            raise RuntimeError(
                f"overlap=\"forward\": the gradients of {len(changed)} parameter(s) "
                f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}) were changed "
                "between backward and step() (clip_grad_norm_, zero_grad(set_to_none=False), "
                "an edit of .grad): .grad holds this rank's own gradient until the average "
                "lands in the next forward; call optimizer.flush() first (.grad then holds "
                "the average, and this step is plain allreduce's)")
        if touched:  # zero_grad() came first: the step sees what it left, as plain's
            self.flush()
            self.optimizer.step()
            return
        self._pending = [{key: _frozen(value) for key, value in group.items() if key != "params"}
                         for group in self.optimizer.param_groups]
        self.optimizer._opt_called = True  # what an LR scheduler checks: step() came first

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the optimizer's. With a step in flight that step() did not take, the step
        is dropped (a loop that skips a step): the averages are not written over what
        zero_grad() left (Bucketer.complete)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def flush(self) -> None:
        """Finish the step in flight now: wait for every bucket, step what the forward
        has not stepped yet, and write the averages to .grad where the loop left it as
        backward made it (as plain allreduce's backward does)."""
        if not self.bucketer.handed_off:
            return
        try:
            if self._pending is not None:
                self._step_these([p for bucket in self.bucketer.buckets
                                  for p in bucket.params if id(p) not in self._stepped])
            self.bucketer.complete()
        finally:
            self._pending, self._stepped = None, set()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()  # its hook finishes the step first

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)  # likewise: the loaded state wins

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """What GradScaler.step() asks. True while a step is in flight: the scaler then
        hands step() its scale and inf flag (found_inf) instead of unscaling this
        rank's own gradients and checking them, and step() refuses. After flush(), it
        unscales and checks the averages in .grad as for any optimizer."""
        return self.bucketer.handed_off

    def close(self) -> None:
        """Remove the hooks (after a flush, even a failed one); the model takes no more
        steps in forward."""
        try:
            self.flush()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            if self.ddp.stepper is self:
                self.ddp.stepper = None

    # --- the wrapped optimizer's step pre-hook ---------------------------------------
    def _own_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse a step of the wrapped optimizer's own while a step is in flight: it
        would step on this rank's gradient alone (GradScaler's scaler.step(optimizer)
        comes here too). The per-layer copy steps freely."""
        if optimizer is self.optimizer and self.bucketer.handed_off:
            raise RuntimeError(
                "overlap=\"forward\": the optimizer given to step_in_forward() was stepped "
                "itself (optimizer.step(), or scaler.step(optimizer)) with a step in "
                "flight: .grad holds this rank's own gradient, not the average; call step() "
                "on the optimizer step_in_forward() returned, or its flush() first")

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


def load_pre_hook(module: torch.nn.Module, hook: Callable):
    """hook(module, state_dict, prefix, ...) before `module` loads its own tensors from
    a state_dict, in its own load_state_dict() or a parent's (torch's public method
    where this torch has it, else the private one older versions have)."""
    if hasattr(module, "register_load_state_dict_pre_hook"):
        return module.register_load_state_dict_pre_hook(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


__all__ = ["StepInForward", "ELEMENTWISE", "load_pre_hook"]
