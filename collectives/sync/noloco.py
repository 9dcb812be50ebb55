"""`noloco`: DiLoCo's inner steps, then an outer step averaged with ONE random peer.

Communicates: nothing for H optimizer steps; then each rank swaps, with one peer, its
slow weights phi and its outer gradient Delta (one sendrecv each way) and takes an outer
step that both follows the pair's average outer gradient and pulls its slow weights
towards the pair's average. There is no all-reduce, no collective at all: no rank ever
waits for more than its peer of the moment.

    sync s (after steps H, 2H, ...): a permutation of the ranks, drawn from a generator
    seeded with (seed, s) on every rank alike, pairs them off in order; with an odd
    number of ranks the last one sits this sync out (it steps on its own Delta alone).

        permutation of sync s:  3 0 4 1 2       pairs (3,0) (4,1), rank 2 sits out

        rank i  --- [phi_i ; Delta_i] --->  rank j        2 x the model each way,
        rank i  <-- [phi_j ; Delta_j] ----  rank j        one message each

The outer step of rank i in group G (its pair, or itself alone), with theta_i the
replica's weights after the H inner steps (the trainer's own optimizer) and
mean_G(x) = (1/|G|) sum_{j in G} x_j:

    Delta_i = phi_i - theta_i                                outer gradient
    delta_i <- alpha delta_i - beta mean_G(Delta)            momentum, with the
                             - gamma (phi_i - mean_G(phi))   pull term
    phi_i   <- phi_i + delta_i
    theta_i <- phi_i                     the next H inner steps start from there

The first two terms are DiLoCo's outer step on the group's average; the third (gamma)
pulls each replica's slow weights towards the group's average, which is what keeps the
replicas together without a global average: the groups change every sync, so over
syncs every replica is pulled towards every other. Both ranks of a pair compute the
same averages (a + b is b + a, bit for bit). With two ranks the pair is the world:
both hold the same phi after every sync, the pull is zero, and this is DiLoCo with
the outer step in this momentum form.

Options, with the defaults of the paper's NoLoCo runs (the authors' configs: groups of
2, 50 local steps, outer lr 0.7, outer momentum 0.5):
    period          50     H, the inner steps between two syncs
    outer_lr        0.7    beta
    outer_momentum  0.5    alpha
    gamma           0.7    the pull towards the group's average; the authors' code
                           (sparse_optimizer_c.py) weights it with the outer lr
    seed            0      the pairings' generator
    algorithm       auto   taken, as by every strategy, and unused (no collective)
The update is the momentum form the paper writes (phi += delta, delta as above), the
one its code takes.
The paper also routes activations at random between pipeline stages; with data
parallelism alone there is nothing to route, and that part is left out.

Sends, per rank per sync, 2 P float32 values (P parameters): phi and Delta, 8P bytes,
one message. Per optimizer step on average: 8P / H bytes; with an odd world of n the
rank sitting out sends nothing, so over ranks (and over syncs, for any one rank)
(2 floor(n/2) / n) 8P / H. One peer exchange per sync (cost() counts it as a
collective: one latency).

Why a rank sits out rather than making a group of three: a group of three would send
each of its members' phi and Delta to two peers (twice the bytes, and a wait for the
slower of two), on the sync where it forms; sitting out costs one sync of mixing for
one rank, and the permutation gives every rank the same chance of it.

Buffers (BatchNorm statistics) are not exchanged: each replica keeps its own, as in
`diloco`, and the run's model is the average of the replicas (`replicas_differ`).

Non-finite numbers: the two ranks of a pair hold the same averages, so both decide
alike. An outer step whose averages are not finite is not taken: phi and delta stay as
they were, and the replica goes back to phi (its inner steps since the last sync are
dropped), so one overflow never enters the state.

Literature: Kolehmainen, Blagoev, Donaghy, Ersoy, Nies, "NoLoCo: No-all-reduce Low
Communication Training Method for Large Models" (2025): 125M to 6.8B parameter models,
up to 4% faster convergence than DiLoCo, a synchronization about ten times faster than
DiLoCo's all-reduce across hundreds of accelerators over the internet.

Checkpoint: phi and delta (the slow weights and the outer momentum). Which peer a sync
pairs a rank with follows from (seed, the step the loop passes), so nothing random is
kept.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from .base import (Shape, StepCost, SyncStrategy, element_count, finite, register,
                   seeded_generator)
from .options import check_algorithm, need


def peer_at(sync: int, rank: int, world_size: int, seed: int) -> Optional[int]:
    """The rank `rank` averages with at sync number `sync`: its neighbour in the pairs
    (p0, p1), (p2, p3), ... of a random permutation p of the ranks; None for the last
    rank of an odd world, which sits out."""
    order = torch.randperm(world_size, generator=seeded_generator(seed, sync)).tolist()
    place = order.index(rank)
    partner = place ^ 1  # 0 <-> 1, 2 <-> 3, ...
    return order[partner] if partner < world_size else None


@register("noloco")
class NoLoCo(SyncStrategy):
    uses_buckets = False
    forward_buffer_sync = False  # no collective before every forward
    replicas_differ = True       # the replicas are never averaged over all ranks

    def __init__(self, period: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.5,
                 gamma: float = 0.7, seed: int = 0, algorithm: str = "auto"):
        need(period >= 1, self.name, "period", period, "at least 1")
        need(outer_lr > 0, self.name, "outer_lr", outer_lr, "positive")
        need(0 <= outer_momentum < 1, self.name, "outer_momentum", outer_momentum,
             "in [0, 1)")
        need(gamma >= 0, self.name, "gamma", gamma, "0 or more")
        # Taken (every strategy takes one) but unused: noloco sends point to point only.
        check_algorithm(self.name, algorithm)
        self.period, self.seed = period, seed
        self.alpha, self.beta, self.gamma = outer_momentum, outer_lr, gamma

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.params = list(model.parameters())
        self.slow = torch.cat([p.detach().reshape(-1) for p in self.params])  # phi
        self.momentum = torch.zeros_like(self.slow)                             # delta

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        if step % self.period == 0:
            self._outer_step(step // self.period)

    @torch.no_grad()
    def _outer_step(self, sync: int) -> None:
        local = torch.cat([p.detach().reshape(-1) for p in self.params])       # theta
        message = torch.cat([self.slow, self.slow - local])                     # phi, Delta
        peer = (peer_at(sync, self.comm.rank, self.comm.world_size, self.seed)
                if self.comm.world_size > 1 else None)
        if peer is None:  # alone this sync: the group's averages are its own
            averages = message
        else:
            theirs = torch.empty_like(message)
            self.comm.sendrecv(message, peer, theirs, peer)
            averages = (message + theirs) / 2
        if finite([averages]):
            size = self.slow.numel()
            mean_slow, mean_outer_gradient = averages[:size], averages[size:]
            self.momentum.mul_(self.alpha).sub_(mean_outer_gradient, alpha=self.beta)
            self.momentum.sub_(self.slow - mean_slow, alpha=self.gamma)
            self.slow.add_(self.momentum)
        else:
            pair = [self.comm.rank] if peer is None else [self.comm.rank, peer]
            self.drop_sync(f"outer step {sync}'s average", ranks=pair)
        self._load_slow_weights()

    def _load_slow_weights(self) -> None:
        offset = 0
        for p in self.params:
            p.detach().copy_(self.slow[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def cost(self, shapes: Sequence[Shape], world_size: int) -> StepCost:
        """8P bytes (phi and Delta, float32) per sync for a rank with a peer; averaged
        over the ranks of an odd world, one of which sits out each sync."""
        if world_size < 2:
            return StepCost(0.0, 0.0)
        paired = 2 * (world_size // 2) / world_size
        numel = sum(element_count(shape) for shape in shapes)
        return StepCost(paired * 8 * numel / self.period, paired / self.period)

    def state_dict(self) -> Dict[str, Any]:
        return {"slow": self.slow.clone(), "momentum": self.momentum.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.slow.copy_(state["slow"])
        self.momentum.copy_(state["momentum"])
