"""Start N ranks on this machine without a launcher, for the benchmarks' --nproc.

Each rank gets the variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and one CPU thread, then runs `function(*args)`, which calls
collectives.init() as under any launcher.
"""
from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, function, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    function(*args)


def spawn(function, nprocs: int, *args) -> None:
    """Run function(*args) on `nprocs` new local ranks and wait for them all."""
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(nprocs, free_port(), function, args), nprocs=nprocs)
