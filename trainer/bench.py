"""Training throughput: our sync strategies and torch's own DDP and comm hooks side by side.

    python -m trainer.bench --nproc 4 --sync allreduce,ddp --model resnet18 \\
        --batch-size 32 --steps 8 --json bench.jsonl
    python -m trainer.bench --nproc 4 --sync allreduce,ddp,powersgd --model gpt-tiny
    torchrun --nproc-per-node 4 -m trainer.bench          (or under mpirun: no --nproc)
    python -m collectives.cluster --hosts 4 --bandwidth 100mbit -- python -m trainer.bench \\
        --sync allreduce,ddp,bf16,ddp-bf16,powersgd,ddp-powersgd,local-sgd,ddp-localsgd

Each --sync is one of our strategies (inside collectives.DistributedDataParallel) or
one of torch's peers (trainer/torch_peers.py: ddp, ddp-collectives, ddp-fp16,
ddp-bf16, ddp-powersgd, ddp-localsgd), with its options after colons as the trainer
takes them (local-sgd:period=4); --sync-option KEY=VALUE gives one to every --sync.

--model is any of the trainer's (trainer/tasks/), trained on random data, the same on
every rank and every step (`Workload`): a ResNet on --batch-size one-channel 28x28
images of 10 classes (default 32) with SGD (lr 0.01, momentum 0.9); a gpt-* on
--batch-size windows of random bytes as long as its context (default 16), a random
byte the target at every position, with AdamW (lr 3e-3, weight decay 0.1), the
language task's defaults. The loss is the tasks' cross-entropy. Each traced step names
the model and the batch (trainer.replay counts images or tokens by them). It measures:

    step_ms       the mean training step: forward, backward with communication,
                  optimizer, and the strategy's moments. A periodic strategy
                  (local-sgd, ddp-localsgd) is timed over whole periods only, so its
                  averaging steps are in the mean: `events` counts them (streaming
                  DiLoCo's: every fragment's synchronization). A round's
                  last step ends when the communication it left running in the
                  background (delayed, async-avg) has finished, so every round's
                  window holds all that its steps sent, and nothing of another's
    compute_ms    the same step with no communication at all (no_sync(), no moments),
                  nothing running in the background either
    waited_ms     per step, the time the training thread waited on communication
                  (trainer/timing.py: backward's tail from the last gradient computed,
                  plus the strategy's moments and the wait for the background at the
                  round's end)
    comm_ms       per step, how long communication ran off the training thread: our
                  communication threads' busy time, or for torch's rows the span of
                  its buckets in flight (seen by wrapping its hook: plain ddp then
                  runs torch's stock allreduce_hook). None where communication runs on
                  the training thread (local SGD's averaging, powersgd): all of it is
                  then in waited_ms
    hidden_share  how much of comm_ms ran while the training thread computed:
                  1 - waited_ms / comm_ms (per rank, then averaged over the ranks)
    cpu_ms        per step, the CPU time of the whole process (every thread: training,
                  ours or gloo's communication threads, torch's own)
    comm_cpu_ms   what communication cost in CPU: cpu_ms less the CPU of the
                  compute-only step above. A coarse figure: it carries the noise of
                  the compute-only step, a few per cent of the model's CPU
    thread_cpu_ms per step, the CPU of every thread but the training thread: where the
                  communication that leaves the training thread runs (ours: our
                  communication thread and gloo's TCP loop; torch's: gloo's TCP loop
                  and its work threads). With one torch thread per rank (what the
                  launchers here set) no compute runs there, so the same bytes moved
                  by ours and by torch's C++ compare without the model's noise (on 2
                  shared cores, CPU that communication takes is CPU the other ranks'
                  compute cannot have). Work done on the training thread is not in
                  it: torch's bf16 hook casts there, ours on its communication thread;
                  local SGD averages there
    images_per_s  (a ResNet; "img/s" in the table) world_size x batch size / step_ms
    tokens_per_s  (a gpt-*; "tok/s" in the table) world_size x batch size x context /
                  step_ms: the bytes predicted per second
    bucket_mb     the buckets in use, first/later in MiB (--bucket-mb auto: as chosen
                  during the warm-up; torch's rows: torch's 1 MiB first bucket and cap)
    mb_per_step   megabytes this rank sent per step: on the emulated cluster its host's
                  NIC (headers included, divided by the ranks on the host); elsewhere
                  our transport's counter (shared memory and network alike; for
                  ddp-collectives, the transport under our torch.distributed backend),
                  or for torch's rows on gloo the kernel's count of this process's
                  TCP bytes

All variants are built first and timed in alternating rounds, so that slow periods of
a shared machine hit every variant alike; each round starts one variant later than the
one before. Times are the slowest rank's; bytes the busiest rank's.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import collectives
from collectives import sync as sync_registry
from collectives import trace
from collectives.launch import add_local_rank_argument
from . import torch_peers
from .loop.cli import bucket_size, build_sync, parse_sync, sync_option
from .tasks import MODELS, kind_of, optimizers
from .tasks.gpt import SIZES as GPT_SIZES, VOCABULARY, build_gpt
from .tasks.resnets import build_model as build_resnet
from .timing import SentBytes, WaitClock, background_comm_seconds, drain_background


def _over_ranks(comm, values, op):
    """Each value reduced over the ranks with `op`: "max" gives the slowest rank's time
    or the busiest rank's bytes, "sum" a total."""
    value = torch.tensor(values, dtype=torch.float64)
    comm.native_all_reduce(value, op)
    return value.tolist()


def union_seconds(intervals) -> float:
    """Seconds covered by (start ns, end ns) intervals that may overlap."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total / 1e9


def _time_once(comm, step) -> tuple:
    """(seconds, CPU seconds of this whole process, CPU seconds of its other threads
    than this one) that one call of `step` took."""
    comm.barrier()
    started, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    step()
    if comm.device.type == "cuda":  # the GPU's queue of work is part of the step
        torch.cuda.synchronize(comm.device)
    own = time.thread_time() - own  # read inside the process's window: never above it
    cpu = time.process_time() - cpu
    return time.perf_counter() - started, cpu, cpu - own


def aligned_warmup(wanted: int, period: int, warmup_steps: int) -> int:
    """The fewest untimed steps, at least `wanted`, after which every window of whole
    periods holds the same number of periodic events (events follow steps
    warmup_steps + k * period)."""
    if wanted <= warmup_steps:
        return warmup_steps
    return warmup_steps + math.ceil((wanted - warmup_steps) / period) * period


# --- what is trained --------------------------------------------------------------------

DEFAULT_BATCH = {"images": 32, "language": 16}  # samples per rank, as the trainer's tasks


def build_model(name: str) -> torch.nn.Module:
    """The model `name` as the bench trains it: a gpt-* at its size (trainer/tasks/gpt.py),
    or a ResNet for one-channel 28x28 images of 10 classes."""
    if kind_of(name) == "language":
        return build_gpt(name)
    return build_resnet(name, 1, 10, 28)


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The tasks' loss (trainer/tasks/images.py, language.py): the mean cross-entropy of
    every prediction, an image's class (outputs (B, 10), targets (B,)) or each position's
    next byte (outputs (B, T, 256), targets (B, T)), in one formula."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


class Workload(NamedTuple):
    """What one variant trains: the model, one batch of random data that every step
    reuses, the optimizer, and what its throughput counts."""
    model: torch.nn.Module
    inputs: torch.Tensor            # images (B, 1, 28, 28), or bytes (B, context)
    targets: torch.Tensor           # classes (B,), or a byte for each position (B, context)
    optimizer: torch.optim.Optimizer
    units: str                      # what throughput counts, for the table: "img", "tok"
    units_per_sample: int           # 1 image, or a window's context bytes
    throughput_key: str             # the row's key: "images_per_s", "tokens_per_s"

    def loss(self, outputs: torch.Tensor) -> torch.Tensor:
        return cross_entropy(outputs, self.targets)


def build_workload(name: str, batch_size: int, device) -> Workload:
    """The model `name` from seed 0 (every variant and every rank starts alike), its
    random batch and its optimizer: SGD for a ResNet, AdamW for a gpt-*."""
    torch.manual_seed(0)
    model = build_model(name).to(device)
    params = list(model.parameters())
    if kind_of(name) == "language":
        context = GPT_SIZES[name].context
        inputs = torch.randint(0, VOCABULARY, (batch_size, context))
        targets = torch.randint(0, VOCABULARY, (batch_size, context))
        optimizer = optimizers.build("adamw", params, [], lr=3e-3, momentum=0.0,
                                     weight_decay=0.1)
        return Workload(model, inputs.to(device), targets.to(device), optimizer,
                        "tok", context, "tokens_per_s")
    inputs = torch.randn(batch_size, 1, 28, 28)
    targets = torch.randint(0, 10, (batch_size,))
    optimizer = optimizers.build("sgd", params, [], lr=0.01, momentum=0.9, weight_decay=0.0)
    return Workload(model, inputs.to(device), targets.to(device), optimizer,
                    "img", 1, "images_per_s")


# --- one sync, timed ---------------------------------------------------------------------

class Variant:
    """One sync's model, optimizer, and what is timed for it."""

    def __init__(self, comm, entry, args):
        self.name = entry  # the row's name: the sync and its options, as given
        self.model_name = args.model
        sync_name, options = split_entry(entry)
        self.trace_left = args.trace_steps if args.trace else 0  # steps still to trace
        self.work = build_workload(args.model, args.batch_size, comm.device)
        self.model, self.optimizer = self.work.model, self.work.optimizer
        if torch_peers.is_peer(sync_name):
            self.strategy = torch_peers.create(sync_name, **options)
            self.wrapped = self.strategy.wrap(self.model, bucket_cap_mb=args.bucket_mb,
                                              observed=True)
            self.buckets = ("1/25" if args.bucket_mb in (None, "auto")
                            else f"{args.bucket_mb:g}/{args.bucket_mb:g}")
        else:
            self.strategy = sync_registry.create(
                sync_name, **{"algorithm": args.algorithm, **options})
            sizes = {} if args.bucket_mb is None else dict(bucket_cap_mb=args.bucket_mb)
            if isinstance(args.bucket_mb, float):
                sizes["first_bucket_mb"] = args.bucket_mb
            self.wrapped = collectives.DistributedDataParallel(
                self.model, sync=self.strategy, comm=comm, moments="loop", **sizes)
            self.buckets = "-"
        self.clock = WaitClock(self.model)
        self.stepper = None  # overlap=forward: the step is taken inside the next forward
        if getattr(self.strategy, "overlap", "backward") == "forward":
            self.stepper = self.wrapped.step_in_forward(
                self.optimizer, waiting=lambda: self.clock.blocking("waiting in forward"))
        self.sent = SentBytes(comm, self.strategy)
        self.period = self.strategy.period
        self.steps_per_round = math.ceil(args.steps / self.period) * self.period
        wanted = args.warmup
        if args.bucket_mb == "auto":  # the buckets are re-cut during the warm-up
            wanted = max(wanted, collectives.ddp.AUTO_BUCKET_STEPS + 1)
        self.warmup = aligned_warmup(wanted, self.period, self.strategy.warmup_steps)
        self.steps_done = 0
        self.samples = {"step": [], "compute": [], "step_cpu": [], "compute_cpu": [],
                        "thread_cpu": []}
        self.sent_bytes = self.waited = self.communicating = 0.0

    def train_step(self, then=None):
        """One step in the trainer's order: backward, after_backward, step, after_step;
        and `then` (the round's last step: its drain), inside the step's span."""
        started = time.perf_counter_ns()
        with trace.span("forward", cat="compute"):
            loss = self.work.loss(self.wrapped(self.work.inputs))
        self.clock.backward(loss)
        with self.clock.blocking("after_backward"):
            self.strategy.after_backward(self.model)
        with trace.span("optimizer", cat="compute"):
            (self.stepper or self.optimizer).step()
        self.steps_done += 1
        with self.clock.blocking("after_step"):
            self.strategy.after_step(self.model, self.steps_done)
        self.optimizer.zero_grad()
        if then is not None:
            then()
        trace.add(f"step {self.steps_done}", "step", started, time.perf_counter_ns(),
                  step=self.steps_done, sync=self.name, batch=len(self.work.inputs),
                  model=self.model_name)

    def warm_up(self):
        """The untimed steps (allocations, connections, bucket rebuilds), drained: the
        first round starts with nothing in the background."""
        for _ in range(self.warmup):
            self.train_step()
        self.drain()

    def drain(self):
        """Wait for the communication this variant left running in the background
        (delayed's last all-reduce, async-avg's round): waiting, as a later step of its
        own would have waited for it. overlap=forward: the last step is taken first (its
        waits are the clock's already)."""
        if self.stepper is not None:
            self.stepper.flush()
        with self.clock.blocking("drain background"):
            drain_background(self.wrapped, self.strategy)

    def last_step_of_round(self):
        """A round's last step, which ends only when its background communication has:
        the round's window then holds all the bytes and seconds its steps started, and
        neither the compute-only sample nor the next variant's window overlaps them.
        The drain is inside the step's traced span, as it is inside its time (with
        overlap=forward it is the wait the next forward would have had)."""
        self.train_step(then=self.drain)

    def compute_only_step(self):
        """Forward, backward and the optimizer, with no communication and no moments
        (so a periodic strategy's step count is untouched)."""
        with self.wrapped.no_sync():
            self.work.loss(self.wrapped(self.work.inputs)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def communicating_seconds(self) -> float:
        """How long communication has run so far, where it runs off the training thread:
        our communication threads' busy time, or the span of torch's observed buckets
        (which may overlap one another: their union)."""
        if torch_peers.is_peer(split_entry(self.name)[0]):
            return union_seconds(self.strategy.bucket_intervals)
        return background_comm_seconds(self.wrapped, self.strategy)

    def round(self, comm):
        sent_before, communicating_before = self.sent.read(), self.communicating_seconds()
        self.clock.reset()
        for index in range(self.steps_per_round):
            (trace.resume if self.trace_left > 0 else trace.pause)()
            self.trace_left -= 1
            last = index == self.steps_per_round - 1
            seconds, cpu, threads = _time_once(
                comm, self.last_step_of_round if last else self.train_step)
            self.samples["step"].append(seconds)
            self.samples["step_cpu"].append(cpu)
            self.samples["thread_cpu"].append(threads)
        trace.pause()
        self.sent_bytes += self.sent.read() - sent_before
        self.communicating += self.communicating_seconds() - communicating_before
        self.waited += self.clock.waited
        seconds, cpu, _ = _time_once(comm, self.compute_only_step)
        self.samples["compute"].append(seconds)
        self.samples["compute_cpu"].append(cpu)

    def bucket_mb(self, args) -> str:
        """The buckets in use: "first/later" in MiB ("-": the strategy has none)."""
        sizes = getattr(self.wrapped, "bucket_sizes_mb", None)
        if sizes is not None and getattr(self.wrapped, "bucketer", None) is not None:
            return f"{sizes[0]:g}/{sizes[1]:g}"
        return self.buckets

    def row(self, comm, args):
        steps = len(self.samples["step"])
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        # Seen communication: for strategies that communicate every step off the
        # training thread (periodic ones and powersgd communicate on it: all waited).
        seen = self.period == 1 and self.communicating > 0
        hidden = (max(0.0, 1 - self.waited / self.communicating) if seen else 0.0)
        step, compute, waited, sent, communicating = _over_ranks(comm, [
            mean(self.samples["step"]), mean(self.samples["compute"]), self.waited / steps,
            self.sent_bytes / steps, self.communicating / steps], "max")
        # CPU: the mean over ranks (every rank's CPU comes out of the same cores)
        cpu, compute_cpu, thread_cpu = (total / comm.world_size for total in _over_ranks(
            comm, [mean(self.samples[kind]) for kind in ("step_cpu", "compute_cpu",
                                                         "thread_cpu")], "sum"))
        (hidden_sum,) = _over_ranks(comm, [hidden], "sum")  # each rank's share, averaged
        row = dict(sync=self.name, world_size=comm.world_size, model=args.model,
                   batch_size=args.batch_size,
                   **{self.work.throughput_key: comm.world_size * args.batch_size
                      * self.work.units_per_sample / step},
                   step_ms=step * 1e3, compute_ms=compute * 1e3, waited_ms=waited * 1e3,
                   comm_ms=communicating * 1e3 if seen else None,
                   hidden_share=hidden_sum / comm.world_size if seen else None,
                   mb_per_step=sent / 1e6, steps=steps,
                   events=steps // self.period * self.strategy.syncs_per_period,
                   cpu_ms=cpu * 1e3, comm_cpu_ms=(cpu - compute_cpu) * 1e3,
                   thread_cpu_ms=thread_cpu * 1e3,
                   bucket_mb=self.bucket_mb(args),
                   bucket_choice=getattr(self.wrapped, "bucket_choice", None))
        self.strategy.close()  # background rounds (async-avg, delayed) end together
        return row


def rotated(variants, number: int) -> list:
    """The order of round `number`: each round starts one variant later, so that no
    variant always runs in the same place of a round (where it runs can slow it:
    measured, the first of a pair in a fixed order had the slower compute-only step
    in all eight pairs of four runs). With as many rounds as variants, each runs once
    in every place."""
    start = number % len(variants)
    return variants[start:] + variants[:start]


def rank_main(args):
    comm = collectives.init(backend="gloo", device=args.device)
    if args.trace:  # collective: measures each rank's clock offset to rank 0
        trace.start(comm, args.trace, level=args.trace_level, recording=False)
    rows = []
    variants = [Variant(comm, name, args) for name in args.sync]
    work = variants[0].work  # every variant's is alike: what the rows count
    if comm.rank == 0:
        samples = ("images" if work.units_per_sample == 1
                   else f"windows of {work.units_per_sample} bytes")
        print(f"# trainer.bench: {args.model} on {comm.device} (communication on gloo), "
              f"{comm.world_size} ranks, batch {args.batch_size} {samples} "
              f"per rank, {args.rounds} rounds of {args.steps} timed steps each (whole "
              "periods for periodic strategies), alternating")
        print(f"{'sync':>13} {work.units + '/s':>9} {'step ms':>8} {'compute ms':>10} "
              f"{'waited ms':>9} {'comm ms':>8} {'hidden':>6} {'MB/step':>8} {'steps':>5} "
              f"{'events':>6} {'cpu ms':>7} {'comm cpu':>8} {'thread cpu':>10} "
              f"{'buckets MB':>10}")
    for variant in variants:
        variant.warm_up()
    for number in range(args.rounds):  # alternate, so drift on a shared machine hits all alike
        for variant in rotated(variants, number):
            variant.round(comm)
    for variant in variants:
        row = variant.row(comm, args)
        rows.append(row)
        if comm.rank == 0:
            comm_ms = "-" if row["comm_ms"] is None else f"{row['comm_ms']:.0f}"
            hidden = "-" if row["hidden_share"] is None else f"{row['hidden_share']:.0%}"
            print(f"{row['sync']:>13} {row[work.throughput_key]:>9.1f} {row['step_ms']:>8.0f} "
                  f"{row['compute_ms']:>10.0f} {row['waited_ms']:>9.0f} {comm_ms:>8} "
                  f"{hidden:>6} {row['mb_per_step']:>8.2f} {row['steps']:>5} "
                  f"{row['events']:>6} {row['cpu_ms']:>7.0f} {row['comm_cpu_ms']:>8.0f} "
                  f"{row['thread_cpu_ms']:>10.1f} "
                  f"{row['bucket_mb']:>10}",
                  flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    if args.trace:
        merged = trace.finish(comm)
        if comm.rank == 0:
            print(f"# trace: {merged} (`python -m collectives.trace {args.trace}`)")
    collectives.destroy()


def split_entry(entry: str):
    """'local-sgd:period=4' -> ('local-sgd', {'period': 4}): a sync and its options,
    read as the trainer reads its --sync (loop/cli.py parse_sync)."""
    return parse_sync(entry)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn (default 2; ignored under a launcher)")
    p.add_argument("--sync", type=lambda s: s.split(","), default=["allreduce", "ddp"],
                   help="comma list of our strategies and torch's peers "
                        f"({', '.join(torch_peers.NAMES)}), each with its options after "
                        "colons (local-sgd:period=4); default allreduce,ddp")
    p.add_argument("--sync-option", action="append", default=[], metavar="KEY=VALUE",
                   type=sync_option, help="an option for every --sync, repeatable, as if "
                   "written after each name")
    p.add_argument("--model", default="resnet18", choices=MODELS, metavar="MODEL",
                   help="the trainer's: a ResNet (images) or a gpt-* (random bytes): "
                        f"{', '.join(MODELS)} (default resnet18)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each rank trains (default cpu); cuda: the ranks share the "
                        "GPUs there are, and communication (gloo, ours and torch's DDP "
                        "alike) goes through host memory")
    p.add_argument("--batch-size", type=int,
                   help="samples per rank: images (default 32), or for a gpt-* windows of "
                        "its context (default 16)")
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps per sync in each round (default 3)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds; each times every sync in turn (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--algorithm", default="auto", help="our collective algorithm (default auto)")
    p.add_argument("--bucket-mb", type=bucket_size, default=None,
                   help="buckets of this many MiB for every row, the first one too, as "
                        "torch's DDP cuts them when given a size (default: each side's "
                        "own, a 1 MiB first bucket and 25 MiB after); auto: ours sized "
                        "for the link during the warm-up (collectives/bucket_sizes.py), "
                        "torch's at its default")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    p.add_argument("--trace", metavar="DIR", help="trace the first timed steps of every "
                   "sync into DIR/trace.json (python -m collectives.trace DIR draws it)")
    p.add_argument("--trace-steps", type=int, default=3, metavar="N",
                   help="timed steps traced per sync, from the first (default 3)")
    p.add_argument("--trace-level", type=int, choices=[1, 2], default=1,
                   help="1: steps, buckets, waits (default); 2: each algorithm's steps too")
    add_local_rank_argument(p)  # torch.distributed.launch passes --local-rank=N
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, every --sync checked (its name and options) before any rank
    starts; each --sync then carries the --sync-option values too, so that its row
    names every option it ran with."""
    p = build_parser()
    args = p.parse_args(argv)
    for index, entry in enumerate(args.sync):
        try:  # bad options fail here, before any rank starts
            build_sync(*parse_sync(entry, args.sync_option))
        except (TypeError, ValueError, RuntimeError) as error:
            p.error(str(error))
        args.sync[index] = ":".join([entry] + [f"{key}={value}"
                                               for key, value in args.sync_option])
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH[kind_of(args.model)]
    if args.nproc < 2 or min(args.steps, args.rounds, args.batch_size) < 1:
        p.error("--nproc must be at least 2; --steps, --rounds and --batch-size at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        launched = collectives.detect_launch().world_size > 1
    except collectives.LaunchError as error:
        build_parser().error(str(error))
    if launched:  # torchrun, mpirun or the emulated cluster started the ranks
        rank_main(args)
        return 0
    from collectives.launch.spawn import spawn
    spawn(rank_main, args.nproc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
