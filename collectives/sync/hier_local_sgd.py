"""`hier-local-sgd`: average inside each host often, across hosts rarely.

Communicates: all parameters and floating-point buffers, in two kinds of averaging
after an optimizer step (after `warmup_steps` synchronous steps, counted from there):

    every `period` steps         across every rank (hierarchical all-reduce: shared
                                 memory inside each host, then one exchange of the
                                 host's share over the network, then shared memory)
    every `local_period` steps   among the ranks of each host only (shared memory: no
    (when not the above)         byte on the network)

Local SGD averages everything every H steps over the network; here the ranks of a
host stay close at nearly no cost, so only the hosts drift apart between two network
averagings. With one rank per host the host averaging has nothing to do, and this is
local SGD with period H; with one host it is local SGD with period `local_period`.

Literature: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD" (ICLR 2020),
section on hierarchical local SGD: local SGD inside a node and across nodes, with
the node-level period much longer, reporting accuracy of mini-batch SGD at a fraction
of the cross-node rounds. torch's HierarchicalModelAverager
(torch.distributed.algorithms.model_averaging) is its reference implementation; the
peer `ddp-hier-localsgd` (trainer/torch_peers.py) runs it, and the tests check that
both end with the same parameters.

Checkpoint: the count of steps done, as local-sgd.
"""
from __future__ import annotations

import torch

from .. import api
from ..transport.group import Group
from .base import register
from .local_sgd import LocalSGD, averaged_tensors
from .options import check_algorithm, need


@register("hier-local-sgd")
class HierarchicalLocalSGD(LocalSGD):

    def __init__(self, period: int = 8, local_period: int = 1, warmup_steps: int = 0,
                 algorithm: str = "hierarchical"):
        # The averaging across hosts is the hierarchical all-reduce whatever the
        # trainer's --algorithm: the two levels are what this strategy is about.
        check_algorithm(self.name, algorithm)
        super().__init__(period, warmup_steps, "hierarchical")
        need(local_period >= 1, self.name, "local_period", local_period, "at least 1")
        need(period % local_period == 0, self.name, "period", period,
             f"a multiple of local_period ({local_period})")
        self.local_period = local_period

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.host = Group(comm, comm.topology.local_ranks(comm.rank))

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        self.steps_done = step
        since_warmup = step - self.warmup_steps
        if since_warmup <= 0:
            return
        if since_warmup % self.period == 0:  # every rank: the hierarchical all-reduce
            api.all_reduce_coalesced(averaged_tensors(model), op="avg",
                                     algorithm=self.algorithm, comm=self.comm)
        elif since_warmup % self.local_period == 0 and self.host.world_size > 1:
            api.all_reduce_coalesced(averaged_tensors(model), op="avg", comm=self.host)
