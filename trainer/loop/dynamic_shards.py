"""--shards dynamic: each epoch is a queue of steps, and a faster rank takes more of them.

With torch's DistributedSampler (--shards static) every rank trains on an equal share
of each epoch. When one host computes slower, the others finish their shares first and
wait for it at the epoch's end. A strategy whose ranks meet every step (allreduce,
DDP) waits for the slow rank anyway; one whose ranks never wait for each other
(async-avg) loses exactly that wait.

Here the epoch is cut into claims, each one optimizer step's images (--batch-size x
--accum-steps), in the order of the epoch's shuffle (the same permutation on every
rank: seeded by --seed and the epoch, as DistributedSampler's). A rank that needs the
images of its next step takes the next claim from a counter that every rank shares;
the epoch ends for a rank when the claims run out. Each image is trained once per
epoch, on exactly one rank; the few left over after the last whole claim (fewer than
one step's worth) wait for the next epoch's shuffle.

    counter = ClaimCounter.open(comm, timeout)    # collective: rank 0 hosts it
    shards = DynamicShards(len(train_set), batch_size, accum_steps, seed, counter, world)
    loader = DataLoader(train_set, batch_sampler=shards)
    shards.set_epoch(epoch)                       # before each epoch, as with the sampler

The counter is a torch TCPStore that rank 0 hosts: `store.add` is atomic, so each
value it returns goes to exactly one caller. Taking a claim costs one round trip to
rank 0, once per step (DataLoader workers fetch one micro-batch each ahead, so with
--workers a rank holds up to that many claims before it trains them). So every rank
depends on rank 0's host for its next step: a slow rank 0 answers late, a paused or
dead one stops every rank (a dead one: PeerError). Rank 0 is found as the trainer's
rendezvous finds it (MASTER_ADDR, else its host name, resolved by each rank); the
port is any free one, which a firewall between hosts must let through.

Only a strategy whose ranks may take different numbers of steps can train this way
(`uneven_steps`: async-avg). One that meets in a collective every step or every H steps
would wait for a call the other ranks never make.

The learning rate follows the run's progress through the data, not a rank's own step
count (a fast rank takes more steps than the average, a slow one fewer):
`progress_schedule` sets it from the claims every rank has taken.
"""
from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from typing import Iterator, List

import torch
import torch.distributed as dist

import collectives
from collectives.elastic.sampler import epoch_order


class ClaimCounter:
    """Counters every rank shares: `take(key)` returns 0, 1, 2, ... across all ranks,
    each value to one caller only. Hosted by rank 0 in a torch TCPStore."""

    def __init__(self, store: dist.Store):
        self.store = store

    @classmethod
    def open(cls, comm, timeout: float) -> "ClaimCounter":
        """Collective: rank 0 starts the store on a free port and tells every rank where
        it listens (its address on the network, or loopback when every rank shares its
        host)."""
        wait = timedelta(seconds=timeout)
        address = torch.zeros(258, dtype=torch.uint8)  # port (2 bytes), then the host
        if comm.rank == 0:
            host = rank_0_host(comm)
            store = dist.TCPStore(host, 0, is_master=True, timeout=wait,
                                  wait_for_workers=False)
            name = host.encode()
            address[0], address[1] = store.port // 256, store.port % 256
            address[2:2 + len(name)] = torch.tensor(list(name), dtype=torch.uint8)
        collectives.broadcast(address, src=0, comm=comm)
        if comm.rank != 0:
            port = int(address[0]) * 256 + int(address[1])
            host = bytes(address[2:].tolist()).rstrip(b"\0").decode()
            try:
                store = dist.TCPStore(host, port, is_master=False, timeout=wait)
            except RuntimeError as error:
                raise collectives.PeerError(f"cannot reach rank 0's claim counter at "
                                            f"{host}:{port}: {error}") from None
        comm.barrier()  # every rank is connected before any takes a claim
        return cls(store)

    def take(self, key: str) -> int:
        """The next value of counter `key` (starting at 0), this caller's alone."""
        try:
            return self.store.add(key, 1) - 1
        except RuntimeError as error:  # rank 0 (and its store) is gone
            raise collectives.PeerError(f"rank 0's claim counter stopped answering "
                                        f"({key}): {error}") from None


def rank_0_host(comm) -> str:
    """Where the other ranks reach rank 0: loopback when they share its host; else the
    address the launcher gave every rank for rank 0 (MASTER_ADDR: torchrun, the emulated
    cluster); else rank 0's host name, which each rank resolves itself (mpirun, srun)."""
    if comm.topology.single_host:
        return "127.0.0.1"
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


class DynamicShards:
    """A batch sampler for DataLoader(batch_sampler=...): yields the micro-batches of
    each claim this rank takes, until the epoch's claims run out."""

    def __init__(self, size: int, batch_size: int, accum_steps: int, seed: int,
                 counter: ClaimCounter, world_size: int):
        self.size, self.batch_size, self.accum_steps = size, batch_size, accum_steps
        self.seed, self.counter, self.world_size = seed, counter, world_size
        self.claims_per_epoch = size // (batch_size * accum_steps)
        self.epoch = 0
        self.position = 0  # claims taken by all ranks, all epochs, at this rank's last claim

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = self._claims_before_this_epoch()

    def _claims_before_this_epoch(self) -> int:
        return max(self.epoch - 1, 0) * self.claims_per_epoch

    def __len__(self) -> int:
        """Micro-batches this rank takes in an epoch if every rank is as fast (the
        progress bar's length); the real count depends on the ranks' pace."""
        return max(1, self.claims_per_epoch // self.world_size) * self.accum_steps

    def __iter__(self) -> Iterator[List[int]]:
        order = epoch_order(self.size, self.seed, self.epoch).tolist()
        step_images = self.batch_size * self.accum_steps
        while True:
            claim = self.counter.take(f"epoch {self.epoch}")
            if claim >= self.claims_per_epoch:
                return
            self.position = self._claims_before_this_epoch() + claim
            images = order[claim * step_images:(claim + 1) * step_images]
            for start in range(0, step_images, self.batch_size):
                yield images[start:start + self.batch_size]


def progress_schedule(optimizer: torch.optim.Optimizer, shards: DynamicShards,
                      epochs: int, cosine: bool):
    """The learning rate at the run's progress: cosine decay to 0 over every claim of
    --epochs (or constant), read at the last claim this rank took. The trainer steps it
    after each optimizer step, as it steps the static schedule, so a step trains with the
    rate of the progress made before it."""
    total = epochs * shards.claims_per_epoch

    def factor(_steps_of_this_rank: int) -> float:
        return cosine_decay(shards.position / total) if cosine else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor)


def cosine_decay(progress: float) -> float:
    """The learning rate's factor at `progress` (0: the start, 1: the end of the run):
    cosine decay from 1 to 0, and 0 after the end."""
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
