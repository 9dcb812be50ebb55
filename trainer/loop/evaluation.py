"""What each epoch scores: the model the run stands for, over the whole test split.

Every rank scores the same model on every n-th test image and the counts are summed,
so the accuracy is the whole split's, whatever the number of ranks.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import collectives
from collectives.sync.local_sgd import averaged_tensors  # what model averaging averages


def autocast(device: torch.device, amp: str):
    """--amp: forward in bf16 or fp16 where torch deems it safe, or in fp32 (off)."""
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


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


def evaluate(model: torch.nn.Module, test_set, comm, device, batch_size: int, amp: str):
    """(accuracy, mean loss) of `model` over the whole test split: every rank scores the
    same model on every n-th image, and the counts are summed."""
    mine = Subset(test_set, range(comm.rank, len(test_set), comm.world_size))
    totals = torch.zeros(3, dtype=torch.float64)  # correct, count, summed loss
    model.eval()
    with torch.no_grad():
        for images, labels in DataLoader(mine, batch_size=max(batch_size, 128)):
            images, labels = images.to(device), labels.to(device)
            with autocast(device, amp):
                logits = model(images)
            totals[0] += (logits.argmax(1) == labels).sum().item()
            totals[1] += labels.numel()
            totals[2] += F.cross_entropy(logits.float(), labels, reduction="sum").item()
    model.train()
    collectives.all_reduce(totals, op="sum", algorithm="auto", comm=comm, check=False)
    return totals[0].item() / max(totals[1].item(), 1), totals[2].item() / max(totals[1].item(), 1)
