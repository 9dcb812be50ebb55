"""The training loop: data sharded over ranks, a ResNet, and our DistributedDataParallel.

Each epoch: DistributedSampler gives every rank a different shard (reshuffled by
set_epoch), the model trains with gradients synchronised by the chosen sync strategy,
then every rank evaluates its own slice of the test split and the counts are summed.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import collectives
from collectives import trace
from .. import torch_peers
from ..timing import SentBytes, WaitClock, background_comm_seconds
from . import checkpoint, data
from .cli import create_sync, parse_args
from .models import build_model


def fail(message: str) -> None:
    print(f"trainer: error: {message}", file=sys.stderr)
    sys.exit(2)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def autocast(device: torch.device, amp: str):
    if amp == "off":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def evaluate(model: torch.nn.Module, test_set, comm, device, batch_size: int, amp: str):
    """(accuracy, mean loss) over the whole test split; each rank takes every n-th image."""
    collectives.broadcast_coalesced(list(model.buffers()), src=0, comm=comm)  # rank 0's BN stats
    mine = Subset(test_set, range(comm.rank, len(test_set), comm.world_size))
    totals = torch.zeros(3, dtype=torch.float64)  # correct, count, summed loss
    model.eval()
    with torch.no_grad():
        for images, labels in DataLoader(mine, batch_size=max(batch_size, 128)):
            images, labels = images.to(device), labels.to(device)
            with autocast(device, amp):
                logits = model(images)
            totals[0] += (logits.argmax(1) == labels).sum().item()
            totals[1] += labels.numel()
            totals[2] += F.cross_entropy(logits.float(), labels, reduction="sum").item()
    model.train()
    collectives.all_reduce(totals, op="sum", algorithm="auto", comm=comm, check=False)
    return totals[0].item() / max(totals[1].item(), 1), totals[2].item() / max(totals[1].item(), 1)


def main(argv=None) -> None:
    """Run training; a peer that fails ends the job with one line per rank, exit code 1."""
    try:
        train(argv)
    except collectives.PeerError as error:
        print(f"trainer: error: rank {collectives.get_comm().rank}: {error}", file=sys.stderr)
        collectives.abort(1)  # under mpirun, ends every rank (a hung one too)


def train(argv=None) -> None:
    args = parse_args(argv)  # a bad flag: argparse's error, exit 2
    try:  # everything that can be wrong is checked before anything is written
        split = data.load(args.dataset, args.data_dir, args.train_samples, args.test_samples)
    except data.DatasetMissing as error:
        fail(str(error))
    if args.resume and not os.path.isfile(args.resume):
        fail(f"--resume {args.resume}: no such checkpoint file")

    try:
        comm = collectives.init(backend=args.backend, timeout=args.timeout, shm=args.shm)
    except collectives.LaunchError as error:
        fail(str(error))
    device, rank, world = comm.device, comm.rank, comm.world_size
    say = print if rank == 0 else (lambda *a, **k: None)
    seed_everything(args.seed)

    if args.trace:  # collective: measures each rank's clock offset to rank 0
        trace.start(comm, args.trace, level=args.trace_level, recording=False)
    model = build_model(args.arch, split.channels, split.num_classes, split.image_size).to(device)
    strategy = create_sync(args)
    torch_peer = torch_peers.is_peer(args.sync)
    if torch_peer:
        try:
            ddp = strategy.wrap(model, bucket_cap_mb=args.bucket_mb, observed=bool(args.trace))
        except RuntimeError as error:
            fail(str(error))
    else:
        ddp = collectives.DistributedDataParallel(model, sync=strategy,
                                                  bucket_cap_mb=args.bucket_mb, comm=comm)
    clock = WaitClock(model)
    sent = SentBytes(comm, torch_peer)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    if not torch_peer:  # a strategy that keeps gradients across steps needs their scale
        strategy.grad_scaler = scaler
    sampler = DistributedSampler(split.train, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(split.train, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, drop_last=True)
    if len(loader) < args.accum_steps:
        fail(f"each rank has {len(sampler)} training images: fewer than --batch-size "
             f"{args.batch_size} x --accum-steps {args.accum_steps}")

    steps_per_epoch = len(loader) // args.accum_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda done: 1.0) \
        if args.schedule == "constant" else \
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    start_epoch, step = 1, 0
    if args.resume:
        saved = checkpoint.load(args.resume)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        schedule.load_state_dict(saved["schedule"])
        start_epoch, step = saved["epoch"] + 1, saved["step"]
        checkpoint.restore_rng_state(saved["rng"])
        if args.eval_only:
            accuracy, _ = evaluate(model, split.test, comm, device, args.batch_size, args.amp)
            say(f"checkpoint {args.resume} (epoch {saved['epoch']}): "
                f"test accuracy {accuracy:.2%}")
            if rank == 0 and args.metrics:
                with open(args.metrics, "a") as out:
                    out.write(json.dumps({"epoch": saved["epoch"], "test_acc": accuracy,
                                          "eval_only": True}) + "\n")
            collectives.destroy()
            return

    say(f"training {args.arch} on {args.dataset} ({len(split.train)} images) with {world} "
        f"rank(s), backend {comm.name}, sync {args.sync}, algorithm {args.algorithm}")
    started = time.perf_counter()
    accuracy = 0.0
    for epoch in range(start_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        sent_before, steps_before = sent.read(), step
        busy_before = background_comm_seconds(ddp, strategy)
        clock.reset()  # seconds the training thread waits on communication, from here
        epoch_started = time.perf_counter()
        losses = []
        batches = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", disable=rank != 0,
                       leave=False, mininterval=1.0, dynamic_ncols=True,
                       total=steps_per_epoch * args.accum_steps)
        for index, (images, labels) in enumerate(batches):
            if index >= steps_per_epoch * args.accum_steps:
                break  # an incomplete accumulation at the end of the epoch is dropped
            images, labels = images.to(device), labels.to(device)
            if index % args.accum_steps == 0:  # a new optimizer step begins
                step_started = time.perf_counter_ns()
                if args.trace:  # record only the steps of --trace-steps
                    (trace.resume if args.trace_steps[0] <= step + 1 <= args.trace_steps[1]
                     else trace.pause)()
            last_micro = (index + 1) % args.accum_steps == 0
            with (contextlib.nullcontext() if last_micro else ddp.no_sync()):
                with autocast(device, args.amp), trace.span("forward", cat="compute"):
                    loss = F.cross_entropy(ddp(images), labels) / args.accum_steps
                clock.backward(scaler.scale(loss))
            losses.append(loss.item() * args.accum_steps)
            if last_micro:
                with clock.blocking("after_backward"):
                    strategy.after_backward(model)
                if args.skip_nonfinite and not collectives.all_finite(
                        [p.grad for p in model.parameters()], comm):
                    say(f"warning: step {step + 1}: non-finite gradients on some rank; "
                        "skipping this step on every rank", file=sys.stderr)
                    optimizer.zero_grad(set_to_none=True)
                    if scaler.is_enabled():
                        scaler.update(scaler.get_scale() * 0.5)
                    continue
                with trace.span("optimizer", cat="compute"):
                    scaler.step(optimizer)
                    scaler.update()
                    schedule.step()
                step += 1
                with clock.blocking("after_step"):  # torch's model averager wants the grads
                    strategy.after_step(model, step)
                optimizer.zero_grad(set_to_none=True)
                trace.add(f"step {step}", "step", step_started, time.perf_counter_ns(),
                          step=step, sync=args.sync)
                if rank == 0:
                    batches.set_postfix(loss=f"{losses[-1]:.3f}")
        train_seconds = time.perf_counter() - epoch_started
        sent_bytes, steps = sent.read() - sent_before, max(step - steps_before, 1)
        busy = background_comm_seconds(ddp, strategy) - busy_before
        accuracy, _ = evaluate(model, split.test, comm, device, args.batch_size, args.amp)
        train_loss = torch.tensor([float(np.mean(losses))], dtype=torch.float64)
        collectives.all_reduce(train_loss, op="avg", algorithm="auto", comm=comm, check=False)
        record = {"epoch": epoch, "train_loss": train_loss.item(), "test_acc": accuracy,
                  "images_per_s": len(losses) * args.batch_size * world / train_seconds,
                  "comm_bytes": sent_bytes, "bytes_per_step": sent_bytes / steps,
                  "steps": step - steps_before,
                  # busy: our comm threads and hooks (torch's threads are not visible)
                  "comm_share": None if torch_peer else (busy + clock.in_hooks) / train_seconds,
                  "waited_share": clock.waited / train_seconds,
                  "train_seconds": train_seconds,
                  "seconds": time.perf_counter() - epoch_started}
        busy_text = "-" if torch_peer else f"{record['comm_share']:.0%}"
        say(f"epoch {epoch}/{args.epochs}: train loss {record['train_loss']:.4f}  "
            f"test acc {accuracy:.2%}  {record['images_per_s']:.0f} img/s  comm busy "
            f"{busy_text}, waited {record['waited_share']:.0%} of time, "
            f"{record['bytes_per_step'] / 2**20:.2f} MiB/step sent  ({record['seconds']:.1f} s)",
            flush=True)
        if rank == 0:
            if args.metrics:
                with open(args.metrics, "a") as out:
                    out.write(json.dumps(record) + "\n")
            if args.checkpoint_dir:
                checkpoint.save_atomically(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "schedule": schedule.state_dict(),
                     "epoch": epoch, "step": step,
                     "sampler": {"seed": args.seed, "epoch": epoch},
                     "rng": checkpoint.rng_state(), "args": vars(args)},
                    os.path.join(args.checkpoint_dir, "checkpoint.pt"))
        comm.barrier()
        if args.stop_at is not None and accuracy >= args.stop_at:
            say(f"test accuracy {accuracy:.2%} reached --stop-at {args.stop_at:.2%}: stopping")
            break  # every rank sees the same all-reduced accuracy, so all stop together
    strategy.close()
    if args.trace:
        merged = trace.finish(comm)
        say(f"trace of steps {args.trace_steps[0]}-{args.trace_steps[1]}: {merged} (open it in "
            f"https://ui.perfetto.dev; `python -m collectives.trace {args.trace}` draws it)")
    say(f"done in {time.perf_counter() - started:.1f} s: test accuracy {accuracy:.2%}")
    collectives.destroy()
