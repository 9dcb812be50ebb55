"""Training throughput: torch's DDP and our sync strategies side by side, in one run.

    python -m trainer.bench --nproc 4 --sync allreduce,ddp --model resnet18 \\
        --batch-size 32 --steps 10 --json bench.jsonl
    torchrun --nproc-per-node 4 -m trainer.bench          (or under mpirun: no --nproc)
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit -- python -m trainer.bench

For each sync ("ddp" is torch.nn.parallel.DistributedDataParallel; any other name is
one of our strategies inside collectives.DistributedDataParallel) it measures, on
random 28x28 images with the trainer's model:

    step_ms       one full training step (median): forward, backward with
                  communication, optimizer, and the strategy's hooks
    mean_step_ms  the mean step, which counts periodic work (local-sgd's averaging)
    compute_ms    the same step with no communication (inside no_sync())
    comm_ms       only the communication: every gradient bucket reduced back to back
                  (ddp and allreduce, which reduce gradients every step)
    hidden_share  how much of comm_ms the overlap hid behind backward:
                  (compute_ms + comm_ms - step_ms) / comm_ms, clipped to [0, 1]
    images_per_s  world_size x batch size / mean step time
    nic_mb_per_step   on the emulated cluster: megabytes the busiest host's NIC sent
                  per training step (headers included)

All variants are built first and timed in alternating rounds, so that slow periods of
a shared machine hit every variant alike. Times are the slowest rank's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives
from collectives import cluster
from collectives import sync as sync_registry
from .models import ARCHITECTURES, build_model


def _slowest(comm, samples):
    """(median, mean) of the samples, each the slowest rank's."""
    value = torch.tensor([sorted(samples)[len(samples) // 2], sum(samples) / len(samples)],
                         dtype=torch.float64)
    comm.native_all_reduce(value, "max")
    return value[0].item(), value[1].item()


def _time_once(comm, step) -> float:
    comm.barrier()
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


class Variant:
    """One sync's model, optimizer and the three things timed for it."""

    def __init__(self, comm, sync_name, args):
        self.name = sync_name
        torch.manual_seed(0)
        self.model = build_model(args.model, 1, 10, 28)
        if sync_name == "ddp":
            self.wrapped = torch.nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=args.bucket_mb)
            self.strategy = None
        else:
            self.strategy = sync_registry.create(sync_name, algorithm=args.algorithm)
            self.wrapped = collectives.DistributedDataParallel(
                self.model, sync=self.strategy, bucket_cap_mb=args.bucket_mb, comm=comm)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.images = torch.randn(args.batch_size, 1, 28, 28)
        self.labels = torch.randint(0, 10, (args.batch_size,))
        self.steps_done = 0
        self.samples = {"step": [], "compute": [], "comm": []}
        self.nic_sent = 0  # bytes this host's NIC sent during the timed steps
        # Overlap is defined for gradient all-reduce every step (ddp and allreduce).
        self.buffers = (_bucket_buffers(self.wrapped, self.model, sync_name)
                        if sync_name in ("ddp", "allreduce") else None)

    def train_step(self):  # the trainer's order: backward, after_backward, step, after_step
        self.optimizer.zero_grad()
        F.cross_entropy(self.wrapped(self.images), self.labels).backward()
        if self.strategy is not None:
            self.strategy.after_backward(self.model)
        self.optimizer.step()
        self.steps_done += 1
        if self.strategy is not None:
            self.strategy.after_step(self.model, self.steps_done)

    def compute_only_step(self):
        with self.wrapped.no_sync():
            self.train_step()

    def comm_only(self):
        for flat in self.buffers:
            if self.name == "ddp":
                dist.all_reduce(flat)
            else:
                self.wrapped.sync.reduce_bucket(flat)

    def round(self, comm, steps):
        before = cluster.link_bytes()
        for _ in range(steps):
            self.samples["step"].append(_time_once(comm, self.train_step))
        if before is not None:
            self.nic_sent += cluster.link_bytes()["sent"] - before["sent"]
        self.samples["compute"].append(_time_once(comm, self.compute_only_step))
        if self.buffers is not None:
            self.samples["comm"].append(_time_once(comm, self.comm_only))

    def row(self, comm, args):
        step, mean_step = _slowest(comm, self.samples["step"])
        compute, _ = _slowest(comm, self.samples["compute"])
        row = dict(sync=self.name, world_size=comm.world_size, model=args.model,
                   batch_size=args.batch_size,
                   images_per_s=comm.world_size * args.batch_size / mean_step,
                   step_ms=step * 1e3, mean_step_ms=mean_step * 1e3, compute_ms=compute * 1e3,
                   comm_ms=None, hidden_share=None, nic_mb_per_step=None)
        if cluster.link_bytes() is not None:
            sent = torch.tensor([self.nic_sent / len(self.samples["step"])], dtype=torch.float64)
            comm.native_all_reduce(sent, "max")
            row["nic_mb_per_step"] = sent.item() / 1e6
        if self.buffers is not None:
            communication, _ = _slowest(comm, self.samples["comm"])
            hidden = (compute + communication - step) / communication
            row.update(comm_ms=communication * 1e3, hidden_share=min(1.0, max(0.0, hidden)))
        if self.strategy is not None:
            self.strategy.close()  # background rounds (async-avg, delayed) end together
        return row


def _bucket_buffers(wrapped, model, sync_name):
    """Flat buffers shaped like the gradient buckets each implementation reduces."""
    if sync_name != "ddp" and wrapped.bucketer is not None:
        return [bucket.buffer.clone() for bucket in wrapped.bucketer.buckets]
    from collectives.bucketer import assign_buckets
    params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
    return [torch.zeros(sum(p.numel() for p in group))
            for group in assign_buckets(params, 25.0, 1.0)]


def rank_main(args):
    comm = collectives.init(backend="gloo")
    rows = []
    if comm.rank == 0:
        print(f"# trainer.bench: {args.model}, {comm.world_size} ranks, batch {args.batch_size} "
              f"per rank, {args.rounds} rounds of {args.steps} timed steps each, alternating")
        print(f"{'sync':>12} {'img/s':>8} {'step ms':>9} {'mean ms':>9} {'compute ms':>11} "
              f"{'comm ms':>9} {'hidden':>7} {'nic MB/step':>12}")
    variants = [Variant(comm, name, args) for name in args.sync]
    for variant in variants:  # warm up: allocations, connections, bucket rebuilds
        for _ in range(args.warmup):
            variant.train_step()
    for _ in range(args.rounds):  # alternate, so drift on a shared machine hits all alike
        for variant in variants:
            variant.round(comm, args.steps)
    for variant in variants:
        row = variant.row(comm, args)
        rows.append(row)
        if comm.rank == 0:
            comm_ms = "-" if row["comm_ms"] is None else f"{row['comm_ms']:.1f}"
            hidden = "-" if row["hidden_share"] is None else f"{row['hidden_share']:.0%}"
            nic = "-" if row["nic_mb_per_step"] is None else f"{row['nic_mb_per_step']:.1f}"
            print(f"{row['sync']:>12} {row['images_per_s']:>8.1f} {row['step_ms']:>9.1f} "
                  f"{row['mean_step_ms']:>9.1f} {row['compute_ms']:>11.1f} {comm_ms:>9} "
                  f"{hidden:>7} {nic:>12}", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    collectives.destroy()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn (default 2; ignored under a launcher)")
    p.add_argument("--sync", type=lambda s: s.split(","), default=["allreduce", "ddp"],
                   help="comma list: ddp (torch's) and names of our strategies")
    p.add_argument("--model", default="resnet18", choices=ARCHITECTURES)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank (default 32)")
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps per sync in each round (default 3)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds; each times every sync in turn (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--algorithm", default="auto", help="our collective algorithm (default auto)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    args = p.parse_args(argv)
    for name in args.sync:
        if name != "ddp" and name not in sync_registry.available():
            p.error(f"unknown sync {name!r}: choose from ddp, {', '.join(sync_registry.available())}")
    if args.nproc < 2 or min(args.steps, args.rounds, args.batch_size) < 1:
        p.error("--nproc must be at least 2; --steps, --rounds and --batch-size at least 1")
    try:
        launched = collectives.detect_launch().world_size > 1
    except collectives.LaunchError as error:
        p.error(str(error))
    if launched:  # torchrun, mpirun or the emulated cluster started the ranks
        rank_main(args)
        return 0
    from collectives.spawn import spawn
    spawn(rank_main, args.nproc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
