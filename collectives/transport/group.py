"""Some ranks of a communicator, seen as a communicator of their own.

    host = Group(comm, [2, 3])       # the ranks of one host: host.rank is 0 or 1
    ring.all_reduce(host, flat, "sum")

Hierarchical algorithms run a ring among the ranks of one host, then among one rank
of each host; a group lets them call the same ring code on those ranks. Group rank i
is `members[i]` of the parent; point-to-point calls are passed to the parent with the
rank translated, so they take the parent's routes (shared memory inside a host) and
count in its traffic. Messages between two ranks keep their order whatever group
they are sent in, so groups used one after another on one thread need no tags.

Only point-to-point is offered: a group has no native collectives and no barrier
(`native_collectives` is False, and `auto` then picks algorithms built from
point-to-point, see api.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .base import Handle, Transport


class Group(Transport):
    native_collectives = False

    def __init__(self, parent: Transport, members: Sequence[int]):
        if parent.rank not in members:
            raise ValueError(f"rank {parent.rank} is not in the group {list(members)}")
        self.parent = parent
        self.members = list(members)
        super().__init__(self.members.index(parent.rank), len(self.members),
                         parent.local_rank, parent.device, parent.timeout)
        self.traffic = parent.traffic
        self.backend = parent.backend
        self.segment_bytes = parent.segment_bytes
        self.step_by_step = parent.step_by_step

    @property
    def name(self) -> str:
        return self.parent.name

    def workspace(self, name: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        # the parent's: a group's calls go through it, under its one-thread rule
        return self.parent.workspace(name, like, numel)

    def release_workspace(self) -> None:
        self.parent.release_workspace()

    def staging_device(self, tensor: torch.Tensor) -> Optional[torch.device]:
        return self.parent.staging_device(tensor)  # its messages go through the parent

    def isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        return self.parent.isend(tensor, self.members[dst])

    def irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        return self.parent.irecv(tensor, self.members[src])

    def irecv_reduce(self, accumulator: torch.Tensor, src: int, op: str,
                     scratch: Optional[torch.Tensor] = None,
                     forward_to: Optional[int] = None) -> Handle:
        forward = None if forward_to is None else self.members[forward_to]
        return self.parent.irecv_reduce(accumulator, self.members[src], op, scratch, forward)

    def exchange(self, sends, receives) -> None:
        # one step of the parent's, so that NCCL posts it as one group
        self.parent.exchange([(tensor, self.members[dst]) for tensor, dst in sends],
                             [(tensor, self.members[src]) for tensor, src in receives])
