"""Training throughput: torch's DDP and our sync strategies side by side, in one run.

    python -m trainer.bench --nproc 4 --sync allreduce,ddp --model resnet18 \\
        --batch-size 32 --steps 10 --json bench.jsonl

For each sync ("ddp" is torch.nn.parallel.DistributedDataParallel; any other name is
one of our strategies inside collectives.DistributedDataParallel) it measures, on
random 28x28 images with the trainer's model:

    step_ms       one full training step: forward, backward with communication, optimizer
    compute_ms    the same step with no communication (inside no_sync())
    comm_ms       only the communication: every gradient bucket reduced back to back
    hidden_share  how much of comm_ms the overlap hid behind backward:
                  (compute_ms + comm_ms - step_ms) / comm_ms, clipped to [0, 1]
    images_per_s  world_size x batch size / step time

Times are the slowest rank's median over the timed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives
from collectives import sync as sync_registry
from .models import ARCHITECTURES, build_model


def _slowest_median(comm, samples):
    value = torch.tensor([sorted(samples)[len(samples) // 2]], dtype=torch.float64)
    comm.native_all_reduce(value, "max")
    return value.item()


def _timed_steps(comm, step, warmup, steps):
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(steps):
        comm.barrier()
        started = time.perf_counter()
        step()
        samples.append(time.perf_counter() - started)
    return _slowest_median(comm, samples)


def measure(comm, sync_name, args):
    torch.manual_seed(0)
    model = build_model(args.model, 1, 10, 28)
    if sync_name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:
        strategy = sync_registry.create(sync_name, algorithm=args.algorithm)
        wrapped = collectives.DistributedDataParallel(model, sync=strategy,
                                                      bucket_cap_mb=args.bucket_mb, comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch_size, 1, 28, 28)
    labels = torch.randint(0, 10, (args.batch_size,))

    def train_step():
        optimizer.zero_grad()
        F.cross_entropy(wrapped(images), labels).backward()
        optimizer.step()

    def compute_only_step():
        with wrapped.no_sync():
            train_step()

    step = _timed_steps(comm, train_step, args.warmup, args.steps)
    compute = _timed_steps(comm, compute_only_step, 1, args.steps)
    buffers = _bucket_buffers(wrapped, model, sync_name)

    def comm_only():
        for flat in buffers:
            if sync_name == "ddp":
                dist.all_reduce(flat)
            else:
                wrapped.sync.reduce_bucket(flat)

    communication = _timed_steps(comm, comm_only, 1, args.steps)
    hidden = (compute + communication - step) / communication if communication > 0 else 0.0
    return dict(sync=sync_name, world_size=comm.world_size, model=args.model,
                batch_size=args.batch_size, images_per_s=comm.world_size * args.batch_size / step,
                step_ms=step * 1e3, compute_ms=compute * 1e3, comm_ms=communication * 1e3,
                hidden_share=min(1.0, max(0.0, hidden)))


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
              f"per rank, {args.steps} timed steps")
        print(f"{'sync':>12} {'img/s':>8} {'step ms':>9} {'compute ms':>11} {'comm ms':>9} "
              f"{'hidden':>7}")
    for name in args.sync:
        row = measure(comm, name, args)
        rows.append(row)
        if comm.rank == 0:
            print(f"{row['sync']:>12} {row['images_per_s']:>8.1f} {row['step_ms']:>9.1f} "
                  f"{row['compute_ms']:>11.1f} {row['comm_ms']:>9.1f} "
                  f"{row['hidden_share']:>7.0%}", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    collectives.destroy()


def _spawned(rank, world_size, port, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    rank_main(args)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--sync", type=lambda s: s.split(","), default=["allreduce", "ddp"],
                   help="comma list: ddp (torch's) and names of our strategies")
    p.add_argument("--model", default="resnet18", choices=ARCHITECTURES)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank (default 32)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--algorithm", default="auto", help="our collective algorithm (default auto)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    args = p.parse_args(argv)
    for name in args.sync:
        if name != "ddp" and name not in sync_registry.available():
            p.error(f"unknown sync {name!r}: choose from ddp, {', '.join(sync_registry.available())}")
    if args.nproc < 2 or args.steps < 1 or args.batch_size < 1:
        p.error("--nproc must be at least 2, --steps and --batch-size at least 1")
    import torch.multiprocessing as mp
    from collectives.bootstrap import _free_port
    mp.spawn(_spawned, args=(args.nproc, _free_port(), args), nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
