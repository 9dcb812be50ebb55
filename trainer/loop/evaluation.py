"""What each epoch scores: the model the run stands for, the same on every rank.

The task scores it over the whole test split (trainer/tasks/scoring.py).
"""
from __future__ import annotations

import copy

import torch

import collectives
from collectives.sync.local_sgd import averaged_tensors  # what model averaging averages


def evaluated_copy(model: torch.nn.Module, strategy, comm) -> torch.nn.Module:
    """A copy of `model`, the model the run stands for, the same on every rank: what each epoch
    evaluates and checkpoints. The replica that trains is left as it is, so evaluation
    never changes training.

    Which model that is depends on the strategy:
    - Gradients averaged every step (allreduce, fp16, bf16, topk, powersgd, delayed,
      torch's ddp, ddp-fp16, ddp-bf16, ddp-powersgd): the replicas hold the same
      parameters and differ only in BatchNorm's running statistics, which each rank
      updated from its own batches. DDP's next forward would take rank 0's, so the
      copy does: rank 0's model.
    - Replicas that drift apart (`replicas_differ`: local-sgd between averagings,
      gossip, async-avg, torch's ddp-localsgd): no rank's replica is the run's model;
      their average is (what local SGD computes every period, and what gossip and
      asynchronous averaging converge to). The copy holds the mean over the ranks of
      the parameters and floating-point buffers; integer buffers (BatchNorm's
      num_batches_tracked: the same count on every rank, but for --shards dynamic,
      where each rank counts its own steps) are rank 0's.

    Collective over `comm`, whose ranks hold the replicas `strategy` keeps.
    """
    # parameters and buffers, no gradients; the module hooks come along (overlap=forward's
    # find no step in flight: the epoch's last was taken before evaluating)
    model = copy.deepcopy(model)
    buffers = list(model.buffers())
    if strategy.replicas_differ:
        collectives.all_reduce_coalesced(averaged_tensors(model), op="avg", comm=comm)
        buffers = [b for b in buffers if not b.is_floating_point()]
    collectives.broadcast_coalesced(buffers, src=0, comm=comm)
    return model
