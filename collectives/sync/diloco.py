"""`diloco`: train alone for H steps, then take one outer step on the averaged change.

Communicates: the parameters' change since the last synchronization (the
"pseudo-gradient"), one all-reduce every H optimizer steps, nothing in between. Each
rank trains its replica with the trainer's own optimizer (the inner one) for H steps.
Then every rank averages, over the ranks, how far it moved:

    pseudo_gradient = mean over ranks of (synced - local)      synced: the weights every
                                                               rank held after the last
                                                               synchronization
and applies it to the synced weights with an outer optimizer, SGD with Nesterov
momentum (lr 0.7, momentum 0.9 in the papers):

    synced <- outer_sgd_step(synced, pseudo_gradient)
    local  <- synced                                 every replica starts the next H steps
                                                     from the same weights
With outer_lr 1 and no momentum this is local SGD's plain averaging.

A synchronous warm-up (`warmup_steps` W) first trains W steps exactly as `allreduce`
does (gradients averaged every step, in buckets during backward), then starts DiLoCo
from the weights every rank holds after step W, with a fresh outer momentum: the
synchronizations come after steps W + H, W + 2H, ... . The papers start DiLoCo from a
model pretrained synchronously; this is that pretraining inside one run.

Streaming DiLoCo cuts the parameters into F fragments (contiguous runs of the model's
parameters of about equal size) and synchronizes one fragment every H/F steps, in
turn, so each fragment still syncs every H steps but the network carries 1/F of the
model at a time. Each fragment's exchange may run in the background for `delay` (tau)
inner steps: its pseudo-gradient is taken at step t - tau, sent while training goes on,
and merged at step t:

    local_fragment <- (1 - alpha) synced_fragment + alpha local_fragment

alpha 0 (the default) takes the synced weights; the inner steps made during the delay
are then dropped for that fragment, as in torchft. With F = 1 and tau = 0 this is plain
DiLoCo.

Buffers (BatchNorm statistics) are not synchronized: each replica keeps its own, and
the run's model is the average of the replicas (`replicas_differ`), what the trainer
evaluates and saves. A synchronization whose average is not finite (one rank's
overflow) is dropped on every rank: no outer step, every replica back at the synced
weights.

Literature: Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models" (2023): inner AdamW, H = 500, outer Nesterov lr 0.7 momentum 0.9,
matching synchronous training with 500x less communication. Douillard et al.,
"Streaming DiLoCo with overlapping communication" (2025): fragments and tau. torchft's
`DiLoCo` (torchft/local_sgd.py) implements both; trainer/torchft_peer.py runs it as the
peer `torchft-diloco`, and the tests check that both end with the same parameters.

Checkpoint: the synced weights of every fragment, the outer optimizer's momentum, a
fragment's pseudo-gradient in flight (its all-reduce is waited for, then saved
averaged), and the steps done (whether the warm-up is over), so a resumed run
continues the same schedule.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .. import api
from ..bucketer import CommWorker
from .base import SyncStrategy, finite, register
from .options import WORDS, check_algorithm, need


def split_into_fragments(params: List[torch.Tensor], count: int) -> List[List[torch.Tensor]]:
    """`params` in order, cut into `count` contiguous runs of about equal numel.

    Run i ends at the first parameter that takes the running total past (i+1)/count of
    the whole; every run holds at least one parameter."""
    if not 1 <= count <= len(params):
        raise ValueError(f"cannot cut {len(params)} parameters into {count} fragments")
    total = sum(p.numel() for p in params)
    fragments, current, seen = [], [], 0
    for index, p in enumerate(params):
        current.append(p)
        seen += p.numel()
        left_params, left_runs = len(params) - index - 1, count - len(fragments) - 1
        if left_runs > 0 and (seen * count >= total * (len(fragments) + 1)
                              or left_params == left_runs):
            fragments.append(current)
            current = []
    fragments.append(current)
    return fragments


def check_schedule(name: str, period, fragments, delay) -> None:
    """Whole numbers, a period cut evenly into fragments, a delay within one fragment's
    turn: else a ValueError naming the strategy (`name`: torchft's peer checks its own
    options with this too) and the option."""
    for option, value in (("period", period), ("fragments", fragments), ("delay", delay)):
        need(isinstance(value, int) and not isinstance(value, bool), name, option, value,
             WORDS[int])
    need(fragments >= 1, name, "fragments", fragments, "at least 1")
    need(period >= 1 and period % fragments == 0, name, "period", period,
         f"a positive multiple of fragments ({fragments})")
    need(0 <= delay < period // fragments, name, "delay", delay,
         f"0 or more and below period/fragments = {period // fragments}")


def check_outer(name: str, outer_lr, outer_momentum, nesterov, alpha) -> None:
    """The outer step's options, as check_schedule checks the schedule's."""
    need(outer_lr > 0, name, "outer_lr", outer_lr, "positive")
    need(outer_momentum >= 0, name, "outer_momentum", outer_momentum, "0 or more")
    need(not nesterov or outer_momentum > 0, name, "nesterov", nesterov,
         "false when outer_momentum is 0")
    need(0 <= alpha <= 1, name, "alpha", alpha, "in [0, 1]")


@register("diloco")
class DiLoCo(SyncStrategy):
    uses_buckets = False
    forward_buffer_sync = False  # no collective before every forward
    replicas_differ = True       # between synchronizations the replicas drift

    def __init__(self, period: int = 8, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, delay: int = 0,
                 alpha: float = 0.0, warmup_steps: int = 0, algorithm: str = "auto"):
        check_schedule(self.name, period, fragments, delay)
        need(isinstance(warmup_steps, int) and warmup_steps >= 0, self.name,
             "warmup_steps", warmup_steps, "a whole number, 0 or more")
        self.warmup_steps = warmup_steps
        # the warm-up averages gradients in buckets; without one, nothing is bucketed
        self.uses_buckets = warmup_steps > 0
        self.steps_done = 0
        check_outer(self.name, outer_lr, outer_momentum, nesterov, alpha)
        check_algorithm(self.name, algorithm)
        self.period, self.fragment_count, self.delay, self.alpha = period, fragments, delay, alpha
        self.syncs_per_period = fragments  # one fragment every period / fragments steps
        self.every = period // fragments  # steps between two fragment synchronizations
        self.outer_options = dict(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self.algorithm = algorithm
        self.in_flight = None  # (fragment index, flat pseudo-gradient, done event)

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.fragments = split_into_fragments(list(model.parameters()), self.fragment_count)
        # The weights every rank held after the last synchronization, one list per
        # fragment, each with its outer optimizer (its momentum is the outer state).
        self.synced = [[p.detach().clone() for p in fragment] for fragment in self.fragments]
        self.outer = [torch.optim.SGD(synced, **self.outer_options) for synced in self.synced]
        if self.delay:
            self.channel = comm.duplicate()  # the training thread keeps using comm
            self.worker = CommWorker(comm.device)

    def in_warmup(self) -> bool:
        """Is the next step one of the synchronous warm-up's?"""
        return self.steps_done < self.warmup_steps

    def gradient_divisor(self) -> Optional[int]:
        return self.comm.world_size if self.in_warmup() else None

    def reduce_bucket(self, flat: torch.Tensor) -> None:
        """Warm-up: sum the bucket's gradients, divided already (allreduce's way)."""
        if self.in_warmup():
            api.all_reduce(flat, op="sum", algorithm=self.algorithm, comm=self.bucket_comm,
                           check=False)

    def fragment_at(self, step: int) -> int:
        """The fragment whose synchronization completes at the next multiple of `every`
        at or after `step` (counted from the end of the warm-up): fragments take turns,
        0 first."""
        return (-(-(step - self.warmup_steps) // self.every) - 1) % self.fragment_count

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        self.steps_done = step
        if step <= self.warmup_steps:
            if step == self.warmup_steps:
                self._start_from(model)
            return
        since = step - self.warmup_steps  # inner steps since DiLoCo began
        if (since + self.delay) % self.every == 0:
            self._send(self.fragment_at(step))
        if since % self.every == 0:
            self._merge()

    @torch.no_grad()
    def _start_from(self, model: torch.nn.Module) -> None:
        """The warm-up is over: the weights every rank now holds (the same on all) are
        the first synced ones. The outer optimizers have taken no step: no momentum."""
        for synced, fragment in zip(self.synced, self.fragments):
            for tensor, p in zip(synced, fragment):
                tensor.copy_(p)

    def _send(self, index: int) -> None:
        """Average this fragment's pseudo-gradient over the ranks: at once without a
        delay, else on the background channel while the next inner steps run."""
        pseudo = torch.cat([(synced - p.detach()).reshape(-1) for synced, p in
                            zip(self.synced[index], self.fragments[index])])
        if not self.delay:
            api.all_reduce(pseudo, op="avg", algorithm=self.algorithm, comm=self.comm)
            done = None
        else:
            done = self.worker.submit(lambda: api.all_reduce(
                pseudo, op="avg", algorithm=self.algorithm, comm=self.channel, check=False),
                f"fragment {index}'s pseudo-gradient")
        self.in_flight = (index, pseudo, done)

    def _wait_in_flight(self):
        index, pseudo, done = self.in_flight
        if done is not None:
            done.wait()
            if self.worker.error is not None:
                raise self.worker.error
        return index, pseudo

    @torch.no_grad()
    def _merge(self) -> None:
        """The outer step on the fragment's synced weights, then the replica takes them
        (mixed with its own by alpha). An average that is not finite (an overflow on any
        rank; every rank holds the same average, so every rank decides alike) is not
        stepped on: the synced weights and the outer momentum stay as they were, and
        the replica goes back to them."""
        index, pseudo = self._wait_in_flight()
        self.in_flight = None
        if not finite([pseudo]):
            self.drop_sync(f"the average of fragment {index}'s outer synchronization")
            for synced, p in zip(self.synced[index], self.fragments[index]):
                p.copy_(synced)
            return
        offset = 0
        for synced in self.synced[index]:
            synced.grad = pseudo[offset:offset + synced.numel()].view_as(synced)
            offset += synced.numel()
        self.outer[index].step()
        for synced, p in zip(self.synced[index], self.fragments[index]):
            synced.grad = None
            local = p.detach().clone()
            p.copy_(synced)
            p.lerp_(local, self.alpha)

    def settle(self) -> None:
        """Wait for a fragment in flight (every rank has sent the same one)."""
        if self.delay:
            self.worker.drain()

    def close(self) -> None:
        try:
            if self.in_flight:
                self._wait_in_flight()  # its fragment is never merged: training is over
        finally:
            self.in_flight = None
            if self.delay:
                self.worker.stop()

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {
            "synced": [[t.clone() for t in synced] for synced in self.synced],
            "outer": [optimizer.state_dict() for optimizer in self.outer],
            "steps_done": self.steps_done}
        if self.in_flight:
            index, pseudo = self._wait_in_flight()
            state["in_flight"] = (index, pseudo.clone())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        device = next(self.model.parameters()).device  # a checkpoint loads on the CPU
        for synced, saved in zip(self.synced, state["synced"]):
            for tensor, value in zip(synced, saved):
                tensor.copy_(value)
        for optimizer, saved in zip(self.outer, state["outer"]):
            optimizer.load_state_dict(saved)
        self.steps_done = state.get("steps_done", 0)  # absent from checkpoints without it
        if "in_flight" in state:  # its all-reduce already done
            index, pseudo = state["in_flight"]
            self.in_flight = (index, pseudo.to(device), None)
