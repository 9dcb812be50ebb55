"""Who is on which host, with how many GPUs: learned at rank 0's store, before any group.

    census = Census.take(store, rank, world_size, gpus=gpu_ids())
    census.hosts            [[0, 1], [2, 3]]      ranks by host (by their lowest rank)
    census.local_rank(3)    1                     its place among its host's ranks
    census.short_of_gpus()  None, or the first host with fewer GPUs than ranks

The backend has to be chosen before the process group exists, and it depends on every
host: NCCL wants one GPU per rank (it refuses two ranks on one GPU: "Duplicate GPU
detected"), so "auto" takes nccl only where every host has at least as many GPUs as
ranks. A launcher's local rank is not always there either (an MPI started by srun, a
plain `mpiexec` of another MPI): the census gives each rank its place on its host.

Each rank writes one line to the store, `fingerprint gpu-ids hostname`, and reads
everyone's: world_size small keys, once per job. Ranks with equal fingerprints (host
name and boot id, as transport/topology.py counts hosts) share a host.
"""
from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional, Tuple

_KEY = "collectives/census/{rank}"


def host_fingerprint() -> int:
    """A number equal on every rank of this host (same name, same boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    digest = hashlib.sha256(f"{socket.gethostname()}/{boot_id}".encode()).digest()
    return int.from_bytes(digest[:7], "little")  # fits an int64


def gpu_count() -> int:
    """The CUDA GPUs this process can use (0 without CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_ids() -> List[str]:
    """The UUIDs of the GPUs this process sees. Processes of one host may see the same
    GPUs (all of them) or one each (`CUDA_VISIBLE_DEVICES` per rank, Slurm's
    --gpus-per-task): the census counts a host's GPUs as the distinct ids its ranks see."""
    import torch
    return [str(torch.cuda.get_device_properties(index).uuid) for index in range(gpu_count())]


def ranks_by_host(host_of: Tuple[int, ...]) -> List[List[int]]:
    """Each host's ranks, in rank order; hosts in order of their lowest rank."""
    out: List[List[int]] = [[] for _ in range(max(host_of) + 1)]
    for rank, host in enumerate(host_of):
        out[host].append(rank)
    return out


@dataclass(frozen=True)
class Census:
    host_of: Tuple[int, ...]              # rank -> host index; hosts by their lowest rank
    gpus: Tuple[Tuple[str, ...], ...]     # rank -> the ids of the GPUs its process sees
    names: Tuple[str, ...]                # rank -> its host's name

    @classmethod
    def from_lines(cls, lines: List[str]) -> "Census":
        """From each rank's line, `fingerprint gpu-ids hostname` ("-": no GPU), in rank
        order."""
        index, host_of, gpus, names = {}, [], [], []
        for line in lines:
            fingerprint, ids, name = line.split(" ", 2)
            host_of.append(index.setdefault(fingerprint, len(index)))
            gpus.append(tuple(ids.split(",")) if ids != "-" else ())
            names.append(name)
        return cls(tuple(host_of), tuple(gpus), tuple(names))

    @classmethod
    def take(cls, store, rank: int, world_size: int, gpus: List[str],
             timeout: Optional[timedelta] = None) -> "Census":
        """Collective over the store: every rank of the job calls it once, with the ids
        of the GPUs it sees (gpu_ids())."""
        store.set(_KEY.format(rank=rank),
                  f"{host_fingerprint()} {','.join(gpus) or '-'} {socket.gethostname()}")
        keys = [_KEY.format(rank=peer) for peer in range(world_size)]
        if timeout is not None:
            store.wait(keys, timeout)
        else:
            store.wait(keys)
        return cls.from_lines([store.get(key).decode() for key in keys])

    @property
    def hosts(self) -> List[List[int]]:
        return ranks_by_host(self.host_of)

    def local_rank(self, rank: int) -> int:
        return self.hosts[self.host_of[rank]].index(rank)

    def gpus_of_host(self, ranks: List[int]) -> int:
        """The distinct GPUs the ranks of one host see between them."""
        return len({gpu for rank in ranks for gpu in self.gpus[rank]})

    def short_of_gpus(self) -> Optional[str]:
        """None where every host has at least as many GPUs as ranks; else the first host
        that has not, in words ("host gpu1 has 4 ranks and 1 GPU")."""
        for ranks in self.hosts:
            gpus = self.gpus_of_host(ranks)
            if gpus < len(ranks):
                return (f"host {self.names[ranks[0]]} has {len(ranks)} rank"
                        f"{'s' if len(ranks) != 1 else ''} and {gpus} "
                        f"GPU{'s' if gpus != 1 else ''}")
        return None

    @property
    def any_gpu(self) -> bool:
        return any(self.gpus)
