"""Which ranks share a host: the topology every rank learns at init.

    hosts:   [[0, 1], [2, 3]]        two hosts of two ranks (numbered by their lowest rank)
    host_of: [0, 0, 1, 1]            local_rank(2) == 0, leader(3) == 2

No rank numbers are guessed from: every rank sends a fingerprint of its host (hostname
and boot id) in one small native all-reduce, and ranks with equal fingerprints share a
host. Launchers may place ranks in any order (MPICH's `-hosts a,b` deals them round
robin), so a host's ranks need not be consecutive; `ring_order()` lists every host's
ranks together, which is the order a ring should visit them so that only one stream
crosses each host's link in each direction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from ..launch.census import host_fingerprint, ranks_by_host


@dataclass(frozen=True)
class Topology:
    host_of: Tuple[int, ...]  # rank -> host index; hosts numbered by their lowest rank

    @classmethod
    def from_fingerprints(cls, fingerprints: Sequence[int]) -> "Topology":
        index = {}
        return cls(tuple(index.setdefault(f, len(index)) for f in fingerprints))

    @classmethod
    def one_host(cls, world_size: int) -> "Topology":
        return cls((0,) * world_size)

    @classmethod
    def exchange(cls, comm) -> "Topology":
        """Collective: every rank learns every rank's host (one native all-reduce)."""
        table = torch.zeros(comm.world_size, dtype=torch.int64)
        table[comm.rank] = host_fingerprint()
        comm.reduce_metadata(table, "sum")  # each rank fills its slot: an all-gather
        return cls.from_fingerprints(table.tolist())

    @property
    def hosts(self) -> List[List[int]]:
        """Each host's ranks, in rank order; hosts in order of their lowest rank."""
        return ranks_by_host(self.host_of)

    def local_ranks(self, rank: int) -> List[int]:
        return self.hosts[self.host_of[rank]]

    def local_rank(self, rank: int) -> int:
        return self.local_ranks(rank).index(rank)

    def leader(self, rank: int) -> int:
        return self.local_ranks(rank)[0]

    @property
    def single_host(self) -> bool:
        return max(self.host_of) == 0

    @property
    def one_rank_per_host(self) -> bool:
        return len(set(self.host_of)) == len(self.host_of)

    def ring_order(self) -> List[int]:
        """Ranks host by host: consecutive ranks share a host wherever they can."""
        return [rank for host in self.hosts for rank in host]

    def describe(self) -> str:
        return " ".join(f"[{','.join(map(str, host))}]" for host in self.hosts)
