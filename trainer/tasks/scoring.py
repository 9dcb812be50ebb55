"""Scoring a model over a test split, the same figures whatever the number of ranks.

Every rank scores the same model on every n-th test sample, and the sums (correct
answers, losses, counts: what the task asks for) are all-reduced.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.data import DataLoader, Subset

import collectives


def autocast(device: torch.device, amp: str):
    """--amp: forward in bf16 or fp16 where torch deems it safe, or in fp32 (off)."""
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def summed_over_test_split(model: torch.nn.Module, test_set, comm, device, batch_size: int,
                           amp: str, totals_of_batch, width: int) -> torch.Tensor:
    """`totals_of_batch(outputs, targets)` (`width` sums: correct answers, losses,
    counts) summed over the whole test split: every rank scores the same model on
    every n-th sample, and the sums are all-reduced, so the figures are the whole split's
    whatever the number of ranks."""
    mine = Subset(test_set, range(comm.rank, len(test_set), comm.world_size))
    totals = torch.zeros(width, dtype=torch.float64)  # a rank with no sample adds zeros
    model.eval()
    with torch.no_grad():
        for inputs, targets in DataLoader(mine, batch_size=max(batch_size, 128)):
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast(device, amp):
                outputs = model(inputs)
            totals += totals_of_batch(outputs.float(), targets).double().cpu()
    model.train()
    collectives.all_reduce(totals, op="sum", algorithm="auto", comm=comm, check=False)
    return totals
