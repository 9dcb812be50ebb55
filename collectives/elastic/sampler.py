"""The rest of the epoch, dealt over the ranks there are now.

torch's DistributedSampler deals a whole epoch over a world fixed at its start. After a
rank is lost mid-epoch, the survivors must train what is left of it, each image once:

    order    = the epoch's shuffle, the same on every rank (seed + epoch)
    left     = order[state.done:]            what no step has trained yet
    mine     = left[rank::world]             dealt round-robin over this generation

so the first k steps of the generation, over all its ranks, train exactly left[:k x
world x batch]: a loop that adds world x batch to `state.done` at every step knows, at
any commit, which images are trained. What cannot fill a step on every rank (fewer
than world x batch images) waits for the next epoch's shuffle.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shuffle of `size` indices, the same on every rank (seeded by seed +
    epoch, as torch's DistributedSampler shuffles)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator)


class ElasticSampler(Sampler[int]):
    def __init__(self, size: int, rank: int, world_size: int, batch_size: int, epoch: int,
                 done: int = 0, seed: int = 0):
        self.size, self.rank, self.world_size = size, rank, world_size
        self.batch_size, self.epoch, self.done, self.seed = batch_size, epoch, done, seed

    def steps(self) -> int:
        """Steps every rank takes before the epoch's images run out."""
        return max(self.size - self.done, 0) // (self.world_size * self.batch_size)

    def __len__(self) -> int:
        return self.steps() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        left = epoch_order(self.size, self.seed, self.epoch)[self.done:]
        mine = left[self.rank::self.world_size][:len(self)]
        return iter(mine.tolist())
