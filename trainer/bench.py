"""Training throughput: torch's DDP and our sync strategies side by side, in one run.

    python -m trainer.bench --nproc 4 --sync allreduce,ddp --model resnet18 \\
        --batch-size 32 --steps 10 --json bench.jsonl

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

Times are the slowest rank's over the timed steps.
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


def _slowest(comm, samples):
    """(median, mean) of the samples, each the slowest rank's."""
    value = torch.tensor([sorted(samples)[len(samples) // 2], sum(samples) / len(samples)],
                         dtype=torch.float64)
    comm.native_all_reduce(value, "max")
    return value[0].item(), value[1].item()


def _timed_steps(comm, step, warmup, steps):
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(steps):
        comm.barrier()
        started = time.perf_counter()
        step()
        samples.append(time.perf_counter() - started)
    return _slowest(comm, samples)


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
    strategy = getattr(wrapped, "sync", None)
    steps_done = [0]

    def train_step():  # the trainer's order: backward, after_backward, step, after_step
        optimizer.zero_grad()
        F.cross_entropy(wrapped(images), labels).backward()
        if strategy is not None:
            strategy.after_backward(model)
        optimizer.step()
        steps_done[0] += 1
        if strategy is not None:
            strategy.after_step(model, steps_done[0])

    def compute_only_step():
        with wrapped.no_sync():
            train_step()

    # A step's time is the median over the timed steps; local-sgd's averaging every H
    # steps is included in the mean, so report the mean for it (see `mean_step_ms`).
    step, mean_step = _timed_steps(comm, train_step, args.warmup, args.steps)
    compute, _ = _timed_steps(comm, compute_only_step, 1, args.steps)
    row = dict(sync=sync_name, world_size=comm.world_size, model=args.model,
               batch_size=args.batch_size,
               images_per_s=comm.world_size * args.batch_size / mean_step,
               step_ms=step * 1e3, mean_step_ms=mean_step * 1e3, compute_ms=compute * 1e3,
               comm_ms=None, hidden_share=None)
    if sync_name in ("ddp", "allreduce"):  # gradient all-reduce every step: overlap is defined
        buffers = _bucket_buffers(wrapped, model, sync_name)

        def comm_only():
            for flat in buffers:
                if sync_name == "ddp":
                    dist.all_reduce(flat)
                else:
                    wrapped.sync.reduce_bucket(flat)

        communication, _ = _timed_steps(comm, comm_only, 1, args.steps)
        hidden = (compute + communication - step) / communication
        row.update(comm_ms=communication * 1e3, hidden_share=min(1.0, max(0.0, hidden)))
    if strategy is not None:
        strategy.close()  # background rounds (async-avg, delayed) end together
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
              f"per rank, {args.steps} timed steps")
        print(f"{'sync':>12} {'img/s':>8} {'step ms':>9} {'mean ms':>9} {'compute ms':>11} "
              f"{'comm ms':>9} {'hidden':>7}")
    for name in args.sync:
        row = measure(comm, name, args)
        rows.append(row)
        if comm.rank == 0:
            comm_ms = "-" if row["comm_ms"] is None else f"{row['comm_ms']:.1f}"
            hidden = "-" if row["hidden_share"] is None else f"{row['hidden_share']:.0%}"
            print(f"{row['sync']:>12} {row['images_per_s']:>8.1f} {row['step_ms']:>9.1f} "
                  f"{row['mean_step_ms']:>9.1f} {row['compute_ms']:>11.1f} {comm_ms:>9} "
                  f"{hidden:>7}", flush=True)
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
