"""The optimizers the papers train with, and the learning rate over a run.

    --optimizer sgd     torch.optim.SGD with momentum (ResNets' default)
    --optimizer adamw   torch.optim.AdamW, betas (0.9, 0.95) as GPT-style training uses
                        (the language model's default)
    --optimizer muon    torch.optim.Muon on the hidden matrices (2-D weights inside the
                        transformer's blocks, or a ResNet's convolutions are not 2-D: a
                        ResNet's linear layers), AdamW on everything else (embeddings, the
                        head, norms, biases), as Muon's authors train

Muon orthogonalises each matrix's momentum (Newton-Schulz) before stepping. Its rate is
scaled per matrix ("match_rms_adamw") so the same --lr suits both halves.

Every sync strategy takes any of them: the optimizer is what each rank steps with
(DiLoCo's inner optimizer; its outer one is its own, Nesterov SGD).

The schedule: a linear warm-up over --warmup-steps from lr/warmup to lr, then cosine
decay to 0 over the rest of the run. With no warm-up and the cosine schedule it is
torch's CosineAnnealingLR, as the image task always had.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

NAMES = ["sgd", "adamw", "muon"]
ADAMW_BETAS = (0.9, 0.95)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices and AdamW for the other parameters, stepped as one
    optimizer: one step(), one zero_grad(), one state_dict(), and param_groups that are
    both optimizers' own groups, so a scheduler or GradScaler sets and reads them as for
    any optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        params = [p for group in muon.param_groups + adamw.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.param_groups = muon.param_groups + adamw.param_groups  # the same dicts
        self.state = _StateOfBoth(muon, adamw)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> Dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.state = _StateOfBoth(self.muon, self.adamw)


class _StateOfBoth(dict):
    """optimizer.state[p] of whichever of the two holds p (read-only view)."""

    def __init__(self, *optimizers):
        super().__init__()
        for optimizer in optimizers:
            self.update(optimizer.state)


def build(name: str, params: List[torch.nn.Parameter], hidden: List[torch.nn.Parameter],
          lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (`hidden`: those Muon takes)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)
    if name == "muon":
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in params if id(p) not in hidden_ids]
        if not hidden or not rest:
            raise ValueError("--optimizer muon needs hidden matrices and other parameters "
                             f"(found {len(hidden)} and {len(rest)})")
        muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay,
                                adjust_lr_fn="match_rms_adamw")
        return MuonWithAdamW(muon, torch.optim.AdamW(rest, lr=lr, betas=ADAMW_BETAS,
                                                     weight_decay=weight_decay))
    raise ValueError(f"unknown optimizer {name!r} (choose from {', '.join(NAMES)})")


def schedule(optimizer: torch.optim.Optimizer, kind: str, total_steps: int,
             warmup_steps: int):
    """The learning rate over `total_steps`: "constant" (after the warm-up), or "cosine"
    decay to 0; a linear warm-up over the first `warmup_steps`."""
    if kind == "cosine" and warmup_steps == 0:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    def factor(done: int) -> float:
        if done < warmup_steps:
            return (done + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (done - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor)
