"""`sparta`: after every step, average a small random subset of the parameters.

Communicates: every optimizer step, k = max(1, round(fraction x P)) of the model's P
parameter values, one all-reduce. The subset changes every step; every rank draws the
same one from a generator seeded with (seed, step), so no index travels, only values:

    step s:   generator(seed, s) -> k distinct positions in the flattened parameters
                                    (the same on every rank)
              values  = [x[i] for i in positions]        gathered into one flat tensor
              all-reduce(values, avg)                    k float32 values, 4k bytes
              x[i]    = values                           written back in place

    parameters (flattened):  |----W1----|--b1--|--------W2--------|-b2-|
    positions of step s:        ^    ^            ^      ^   ^       ^

Gradients are never reduced: each rank trains its own replica with the trainer's
optimizer, and the replicas stay close because every value is averaged about once
every 1/fraction steps (after t steps a value has been averaged at least once with
probability 1 - (1 - fraction)^t). The positions are drawn uniformly over all values
of all parameters, without repeats (drawn with replacement, repeats dropped, more
drawn until there are k: a uniformly random k-subset, at a cost of O(k log k) rather
than a permutation of all P).

With `diloco_period` D > 0, a full DiLoCo synchronization (diloco.py: the averaged
change since the last one applied by an outer SGD with Nesterov momentum, lr 0.7,
momentum 0.9) also runs after steps D, 2D, ...; the sparse averages keep the replicas
in one basin in between, so D can be far longer than DiLoCo alone tolerates. At those
steps the sparse average is left out: DiLoCo's sync leaves every rank with the same
weights whatever a sparse average did just before (averaging some values changes no
mean over ranks), so its bytes would buy nothing.

Sends, per rank per step, the ring all-reduce of k float32 values: 2(n-1)/n x 4k bytes
on average over the n ranks (rank r sends exactly 2k - c_r - c_{r+1} values, c_i the
ring's chunk sizes, which differ by at most one). With diloco_period D, every D-th
step sends DiLoCo's 2(n-1)/n x 4P instead: per step on average
((D-1) 2(n-1)/n 4k + 2(n-1)/n 4P) / D. One all-reduce per step either way. (These are
the ring's bytes, what `algorithm="ring"` sends; halving-doubling sends the same on a
power-of-two world; "auto" may choose another for a small k.)

Options:
    fraction        0.005  the share of values averaged each step (0.5%: the top of the
                           paper's 0.05-0.5%, and its code's default p_sparta)
    diloco_period   0      D: also a full DiLoCo sync every D steps (0: never)
    outer_lr        0.7    DiLoCo's outer learning rate (diloco's default)
    outer_momentum  0.9    DiLoCo's outer Nesterov momentum (diloco's default)
    seed            0      the subsets' generator
    algorithm       auto   the all-reduce's

Buffers (BatchNorm statistics) are not averaged: each replica keeps its own, and the
run's model is the average of the replicas (`replicas_differ`).

Non-finite numbers: the averaged values are the same on every rank, so every rank
decides alike; an average that is not finite is not written back (each rank keeps its
own values), so one replica's overflow never spreads to the others.

Literature: Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema, Vrabie, "Improving
the Efficiency of Distributed Training using Sparse Parameter Averaging" (SPARTA,
EXO Labs, 2025; openreview.net/forum?id=stFPf3gzq1): averaging 0.05-0.5% of the
parameters each step keeps replicas highly correlated at up to 1000x less
communication than all-reduce, and
with DiLoCo lets its interval grow 100x with lower perplexity than DiLoCo alone. Its
reference code (exo gym, exogym/strategy/sparta.py) draws a Bernoulli(p) mask per
parameter on rank 0 and broadcasts it; the count here is fixed (k), so that the bytes
of a step are known in advance, and drawn alike on every rank, so that nothing but
values travels.

Checkpoint: the subset of step s is drawn afresh from (seed, s), so SPARTA itself
keeps nothing; with diloco_period, DiLoCo's state (its synced weights and outer
momentum, diloco.py) is saved and restored.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from .. import api
from .base import (Shape, StepCost, SyncStrategy, element_count, finite, register,
                   seeded_generator)
from .diloco import DiLoCo
from .options import check_algorithm, need


def random_subset(total: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct positions of range(total), sorted, uniformly at random: drawn
    with replacement, repeats dropped, the shortfall drawn again until none is left
    (at least half of each draw is new while count <= total / 2; above, a permutation
    of all is as cheap)."""
    if 2 * count > total:
        return torch.randperm(total, generator=generator)[:count].sort().values
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < count:
        more = torch.randint(total, (count - chosen.numel(),), generator=generator)
        chosen = torch.unique(torch.cat([chosen, more]))
    return chosen


@register("sparta")
class Sparta(SyncStrategy):
    uses_buckets = False
    forward_buffer_sync = False  # no collective before every forward
    replicas_differ = True       # each replica trains alone between averages

    def __init__(self, fraction: float = 0.005, diloco_period: int = 0,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, seed: int = 0,
                 algorithm: str = "auto"):
        need(0 < fraction <= 1, self.name, "fraction", fraction, "in (0, 1]")
        need(diloco_period >= 0, self.name, "diloco_period", diloco_period, "0 or more")
        need(outer_lr > 0, self.name, "outer_lr", outer_lr, "positive")
        need(outer_momentum >= 0, self.name, "outer_momentum", outer_momentum, "0 or more")
        check_algorithm(self.name, algorithm)
        self.fraction, self.seed, self.algorithm = fraction, seed, algorithm
        self.diloco: Optional[DiLoCo] = None
        # a benchmark times whole periods: with DiLoCo, D steps hold D - 1 sparse
        # averages and one full synchronization
        self.period = self.syncs_per_period = diloco_period or 1
        if diloco_period:
            self.diloco = DiLoCo(period=diloco_period, outer_lr=outer_lr,
                                 outer_momentum=outer_momentum,
                                 nesterov=outer_momentum > 0, algorithm=algorithm)

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.params = list(model.parameters())
        starts = [0]
        for p in self.params:
            starts.append(starts[-1] + p.numel())
        self.starts = starts  # parameter i holds positions [starts[i], starts[i+1])
        self.bounds = torch.tensor(starts)  # the same, to search the chosen positions by
        self.count = subset_size(self.fraction, starts[-1])
        if self.diloco is not None:
            self.diloco.setup(model, comm)

    def positions(self, step: int) -> torch.Tensor:
        """The flattened positions averaged after `step`: the same on every rank."""
        return random_subset(self.starts[-1], self.count, seeded_generator(self.seed, step))

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        diloco_syncs = self.diloco is not None and step % self.diloco.period == 0
        if self.comm.world_size > 1 and not diloco_syncs:
            self._average_subset(step)
        if self.diloco is not None:
            self.diloco.after_step(model, step)

    @torch.no_grad()
    def _average_subset(self, step: int) -> None:
        chosen = self.positions(step)
        bounds = torch.searchsorted(chosen, self.bounds).tolist()  # chosen's run per param
        pieces = []  # (parameter, flat view or copy, its positions, its run in `values`)
        for index, p in enumerate(self.params):
            low, high = bounds[index], bounds[index + 1]
            if high > low:
                local = (chosen[low:high] - self.starts[index]).to(p.device)
                # a non-contiguous parameter (channels_last) has no flat view: a copy
                pieces.append((p, p.detach().reshape(-1), local, low, high))
        values = torch.cat([flat[local] for _, flat, local, _, _ in pieces])
        # Every rank draws the same positions from the same model: the call needs no check.
        api.all_reduce(values, op="avg", algorithm=self.algorithm, comm=self.comm,
                       check=False)
        if finite([values]):
            for p, flat, local, low, high in pieces:
                flat.index_copy_(0, local, values[low:high].to(flat.dtype))
                if not p.is_contiguous():
                    p.copy_(flat.view_as(p))
        else:
            self.drop_sync("the average of this step's shared subset")

    def settle(self) -> None:
        if self.diloco is not None:
            self.diloco.settle()

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()

    def cost(self, shapes: Sequence[Shape], world_size: int) -> StepCost:
        """The ring all-reduce of k float32 values each step (of all P every
        diloco_period-th step instead), averaged over the ranks."""
        if world_size < 2:
            return StepCost(0.0, 0.0)
        share = 2 * (world_size - 1) / world_size  # of the buffer, each rank, on average
        numel = sum(element_count(shape) for shape in shapes)
        sparse = share * 4 * subset_size(self.fraction, numel)
        if self.diloco is None:
            return StepCost(sparse, 1.0)
        period = self.diloco.period
        full = share * 4 * numel
        return StepCost(((period - 1) * sparse + full) / period, 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {"diloco": self.diloco.state_dict()} if self.diloco is not None else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.diloco is not None:
            self.diloco.load_state_dict(state["diloco"])


def subset_size(fraction: float, total: int) -> int:
    """k: how many of `total` values a step averages (at least one)."""
    return max(1, min(total, round(fraction * total)))
