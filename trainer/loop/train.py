"""The training loop, written as the steps it takes.

    train(argv)
      parse_args            the flags (cli.py); a bad one ends the run here, exit 2
      load_inputs           the task (model, data, loss, score: trainer/tasks/) with its
                            data, and the checkpoint to resume from:
                            a missing or unusable file ends the run before any rank
                            connects
      connect               the communicator: this rank, the world, the device
      setup -> Run          model, DDP (ours with a sync strategy, or a torch peer),
                            optimizer, gradient scaler, sampler and loader, schedule
      resume                (--resume) each rank's own weights, optimizer, scaler,
                            schedule, strategy state and random generators, and the step
                            count, as the checkpoint left them
      evaluate_checkpoint   (--eval-only) the checkpoint's score, and stop
      each epoch:
        train_one_epoch     one pass over this rank's shard: per optimizer step,
                            forward_backward for each micro-batch, then optimizer_step
        evaluated_model     a copy of the model the run stands for, the same on every
                            rank: rank 0's, or the average of the replicas
        task.evaluate       its score over the whole test split, each rank a slice:
                            test accuracy, or held-out bits per byte
        summarise_epoch     the epoch's figures as one record
        report              rank 0's line, and the record appended to --metrics
        save_checkpoint     every rank's state, gathered on rank 0, which writes them
                            with the evaluated model
      finish                close the strategy, merge the trace, the last line

DistributedSampler gives every rank a different shard (reshuffled by set_epoch); with
--shards dynamic the ranks instead take the epoch one step's images at a time, so a
faster rank trains more of it (dynamic_shards.py; async-avg only). The
model trains with gradients synchronised by the chosen sync strategy, then every rank
scores the same evaluated model on its own slice of the test split and the counts are
summed. Evaluation works on a copy: it never changes what the next epoch trains.

Every rank takes these steps in the same order, so every rank makes the same
collectives in the same order; and random numbers are drawn in a fixed order from
seeded generators that the checkpoint keeps, so a resumed run continues bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

import collectives
from collectives import trace
from collectives.step_in_forward import StepInForward
from .. import torch_peers
from ..timing import SentBytes, WaitClock, background_comm_seconds, drain_background
from .. import tasks
from ..tasks import image_data, optimizers, text
from ..tasks.scoring import autocast
from . import checkpoint
from .checkpoint import seed_everything
from .cli import create_sync, fail, parse_args
from .dynamic_shards import ClaimCounter, DynamicShards, progress_schedule
from .elastic import train_elastic
from .progress import progress
from .evaluation import evaluated_copy


def main(argv=None) -> None:
    """Run training; a peer that fails ends the job with one line per rank, exit code 1."""
    try:
        train(argv)
    except collectives.PeerError as error:
        print(f"trainer: error: rank {collectives.get_comm().rank}: {error}", file=sys.stderr)
        collectives.abort(1, caused_elsewhere=True)  # under mpirun, ends every rank too


def train(argv=None) -> None:
    """One run, as its steps: set up, resume or evaluate a checkpoint, then the epochs."""
    args = parse_args(argv)  # a bad flag: argparse's error, exit 2
    task, saved = load_inputs(args)
    if args.elastic:  # generations of ranks that come and go: elastic.py
        if saved is not None:
            check_state_flags(args, saved)
        train_elastic(args, task, saved)
        return
    comm = connect(args)
    run = setup(args, task, comm)
    first_epoch, score = 1, None
    if saved is not None:
        if args.eval_only:
            evaluate_checkpoint(run, saved)
            collectives.destroy()
            return
        resume(run, saved)
        first_epoch, score = saved["epoch"] + 1, saved_score(saved)

    if first_epoch > args.epochs:  # the last line gives the checkpoint's score
        run.say(f"--resume {args.resume}: the checkpoint ended epoch {saved['epoch']} "
                f"of --epochs {args.epochs}: nothing left to train")
    else:
        run.say(f"training {task.first_line()} with {comm.world_size} rank(s), backend {comm.name}, {where_it_trains(comm)}, "
                f"sync {args.sync}, algorithm {args.algorithm}, shards {args.shards}")
        if run.strategy.replicas_differ:
            run.say(f"{args.sync} lets the ranks' models differ: each epoch evaluates (and "
                    "checkpoints) their average")
    started = time.perf_counter()
    for epoch in range(first_epoch, args.epochs + 1):
        trained = train_one_epoch(run, epoch)
        evaluated = evaluated_model(run)
        figures = task.evaluate(evaluated, comm, comm.device, args.batch_size, args.amp)
        score = figures[task.score_key]
        report(run, summarise_epoch(run, epoch, trained, figures))
        if args.checkpoint_dir:  # collective: every rank's state goes to rank 0
            save_checkpoint(run, epoch, evaluated, score)
        comm.barrier()
        if reached_stop_at(run, score):
            break
    finish(run, started, score)
    collectives.destroy()


# --- setup -----------------------------------------------------------------------------

@dataclass
class Run:
    """What a run trains with, built once by `setup`; `step` advances as it trains."""
    args: argparse.Namespace
    task: tasks.Task               # model, data, loss, score (trainer/tasks/)
    comm: Any                      # our communicator: rank, world_size, device, barrier()
    model: torch.nn.Module         # the bare model: this rank's replica, which trains
    ddp: torch.nn.Module           # the model wrapped: our DDP, or torch's for a peer
    strategy: Any                  # the sync strategy, ours or a torch peer
    torch_peer: bool               # --sync ddp*: torch's DDP and comm hook, not ours
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler   # fp16's loss scale; disabled (a no-op) otherwise
    schedule: Any                  # the learning rate over all steps of all epochs
    sampler: Any                   # this rank's part of the training split: a
                                   # DistributedSampler, or DynamicShards
    loader: DataLoader
    steps_per_epoch: int           # optimizer steps, each of --accum-steps micro-batches
                                   # (dynamic shards: the average rank's); a language
                                   # model's: --eval-every
    total_steps: int               # over the whole run: what the schedule spans
    clock: WaitClock               # seconds the training thread waits on communication
    sent: SentBytes                # bytes this rank has sent
    step: int = 0                  # optimizer steps applied so far, over all epochs
    sent_total: float = 0.0        # bytes this rank sent, over all epochs (and resumes)
    seconds_total: float = 0.0     # seconds trained, evaluation left out, likewise
    board: Any = None              # --tensorboard: rank 0's SummaryWriter
    # overlap=forward: the optimizer whose step is taken inside the next forward
    stepper: Optional[StepInForward] = None

    def say(self, *args, **kwargs) -> None:
        """print() on rank 0 only: every rank computes the same line."""
        if self.comm.rank == 0:
            print(*args, **kwargs)


def load_inputs(args: argparse.Namespace) -> Tuple[tasks.Task, Optional[dict]]:
    """The task with its data read, and the --resume checkpoint (None without one), read
    and checked: everything that can be wrong is checked before any rank connects or
    writes anything."""
    try:
        task = tasks.create(args)
    except (image_data.DatasetMissing, text.TextMissing) as error:
        fail(str(error))
    if not args.resume:
        return task, None
    if not os.path.isfile(args.resume):
        fail(f"--resume {args.resume}: no such checkpoint file")
    return task, read_checkpoint(args.resume, args.eval_only, args.elastic)


# What a checkpoint must hold to be resumed, and, for each rank, in "ranks".
CHECKPOINT_KEYS = ("model", "epoch", "step", "world_size", "ranks")
RANK_KEYS = ("model", "optimizer", "scaler", "schedule", "strategy", "rng")
# The flags a checkpoint's state belongs to: a resume with others fails (another
# strategy would silently drop the saved one's state, another model would not load).
# --shards too: its schedule is another kind (the claims taken, not the steps). A flag
# that older checkpoints lack takes the value those runs had.
STATE_FLAGS = ("arch", "dataset", "sync", "sync_option", "amp", "shards")
FLAGS_BEFORE_THEY_EXISTED = {"shards": "static"}


def read_checkpoint(path: str, eval_only: bool, elastic: bool = False) -> dict:
    """The checkpoint at `path`, checked to hold what --resume (or --eval-only, which
    needs only the model and its epoch) will read. A checkpoint of an older format
    (one state for all ranks, no "ranks") is refused with a clear line, and so is one
    of an --elastic run resumed without --elastic, or the other way round."""
    try:
        saved = checkpoint.load(path)
    except Exception as error:  # not a file torch.save wrote: say so, not a traceback
        fail(f"--resume {path}: not a checkpoint this trainer can read "
             f"({type(error).__name__}: {error})")
    written_elastic = isinstance(saved, dict) and "elastic" in saved
    if not eval_only and written_elastic != elastic:
        fail(f"--resume {path}: written by a run {'with' if written_elastic else 'without'} "
             f"--elastic: resume it {'with' if written_elastic else 'without'} --elastic")
    needed = (("model", "epoch") if eval_only else
              ("model", "epoch", "elastic") if elastic else CHECKPOINT_KEYS)
    missing = [key for key in needed if not isinstance(saved, dict) or key not in saved]
    if "ranks" in missing and "model" not in missing:
        fail(f"--resume {path}: a checkpoint of an older format (no per-rank states, "
             "\"ranks\"): it can be evaluated with --eval-only but not resumed")
    if missing:
        fail(f"--resume {path}: not a trainer checkpoint (it lacks {', '.join(missing)})")
    return saved


def where_it_trains(comm) -> str:
    """The device in words, for the first line: "on the CPU", or which GPU, how many of
    this host's ranks share it, and how communication reaches it."""
    if comm.device.type != "cuda":
        return f"on the {comm.device.type.upper()}"
    ranks_here = len(comm.topology.local_ranks(comm.rank))
    gpus = torch.cuda.device_count()
    if comm.backend == "nccl":
        return f"on {comm.device} (a GPU per rank, NCCL between them)"
    shared = (f"{gpus} GPU{'s' if gpus != 1 else ''} shared by {ranks_here} ranks here"
              if ranks_here > gpus else "a GPU per rank")
    return f"on {comm.device} ({shared}, communication through host memory)"


def connect(args: argparse.Namespace):
    """This rank's communicator, from whatever launcher started it (or none)."""
    try:
        return collectives.init(backend=args.backend, timeout=args.timeout, shm=args.shm,
                                device=args.device)
    except collectives.LaunchError as error:
        fail(str(error))


def setup(args: argparse.Namespace, task: tasks.Task, comm) -> Run:
    """The model, wrapped for data parallelism, and all that trains it. Every rank builds
    them in this order: wrapping and starting a trace are collectives, and the model's
    initial weights are the seed's first random numbers."""
    seed_everything(args.seed)
    if args.trace:  # collective: measures each rank's clock offset to rank 0
        trace.start(comm, args.trace, level=args.trace_level, recording=False)
    model = task.build_model().to(comm.device)
    if args.sync == "ddp-collectives" and comm.device.type != "cpu":
        fail("--sync ddp-collectives runs torch's DDP on the torch.distributed backend "
             "\"collectives\", which takes CPU tensors: use --device cpu")
    strategy = create_sync(args)
    torch_peer = torch_peers.is_peer(args.sync)
    ddp = wrap_model(args, model, strategy, comm, torch_peer)
    clock = WaitClock(model)  # from each gradient computed, before any DDP's hook sees it
    sent = SentBytes(comm, strategy)
    optimizer = optimizers.build(args.optimizer, list(model.parameters()),
                                 task.hidden_matrices(model), args.lr, args.momentum,
                                 args.weight_decay)
    scaler = torch.amp.GradScaler(comm.device.type, enabled=args.amp == "fp16")
    if not torch_peer:  # a strategy that keeps gradients across steps needs their scale
        strategy.grad_scaler = scaler
    if args.shards == "auto":  # dynamic where the strategy allows it and ranks can differ
        uneven = getattr(strategy, "uneven_steps", False)
        training = comm.world_size > 1 and not args.eval_only
        args.shards = "dynamic" if uneven and training else "static"
    sampler, loader = shard_loader(args, task, comm)
    steps_per_epoch = len(loader) // args.accum_steps
    total_steps = args.steps or args.epochs * steps_per_epoch
    if args.shards == "dynamic":  # the rate follows the run's progress through the data
        schedule = progress_schedule(optimizer, sampler, args.epochs, args.schedule == "cosine")
    else:
        schedule = optimizers.schedule(optimizer, args.schedule, total_steps, args.warmup_steps)
    stepper = None
    if getattr(strategy, "overlap", "backward") == "forward":  # its waits are the clock's
        stepper = ddp.step_in_forward(optimizer,
                                      waiting=lambda: clock.blocking("waiting in forward"))
    board = None
    if args.tensorboard and comm.rank == 0:  # torch's writer; needs the tensorboard package
        from torch.utils.tensorboard import SummaryWriter
        board = SummaryWriter(args.tensorboard)
    return Run(args, task, comm, model, ddp, strategy, torch_peer, optimizer, scaler,
               schedule, sampler, loader, steps_per_epoch, total_steps, clock, sent,
               stepper=stepper, board=board)


def wrap_model(args: argparse.Namespace, model: torch.nn.Module, strategy, comm,
               torch_peer: bool) -> torch.nn.Module:
    """The model inside DDP: our DistributedDataParallel driven by the sync strategy, or
    torch's own DDP and comm hook for a torch peer."""
    if torch_peer:
        try:
            return strategy.wrap(model, bucket_cap_mb=args.bucket_mb, observed=bool(args.trace))
        except RuntimeError as error:
            fail(str(error))
    return collectives.DistributedDataParallel(model, sync=strategy,
                                               bucket_cap_mb=args.bucket_mb, comm=comm,
                                               moments="loop")


def shard_loader(args: argparse.Namespace, task: tasks.Task,
                 comm) -> Tuple[Any, DataLoader]:
    """This rank's part of the training split in batches of --batch-size.

    --shards static: the task's sampler (images: every rank's DistributedSampler has the
    same seed, so each epoch's shards are disjoint; text: disjoint random windows,
    --eval-every steps' worth); the last, short batch is dropped so that every rank
    takes the same number of steps. --shards dynamic: a rank takes one step's images at a time
    from the epoch's queue (dynamic_shards.py); collective, since rank 0 hosts the
    queue's counter."""
    if args.shards == "dynamic":
        counter = ClaimCounter.open(comm, args.timeout)
        shards = DynamicShards(len(task.train_set), args.batch_size, args.accum_steps,
                               args.seed, counter, comm.world_size)
        if shards.claims_per_epoch < 1:
            fail(f"the training split has {len(task.train_set)} images: fewer than "
                 f"--batch-size {args.batch_size} x --accum-steps {args.accum_steps}")
        # workers fetch ahead: one micro-batch each at most, as each fetch takes claims
        ahead = {"prefetch_factor": 1} if args.workers else {}
        return shards, DataLoader(task.train_set, batch_sampler=shards,
                                  num_workers=args.workers, **ahead)
    # a language model's epoch is --eval-every steps of random windows
    per_rank = args.eval_every * args.batch_size * args.accum_steps if args.steps else None
    sampler = task.sampler(comm, args.seed, per_rank)
    loader = DataLoader(task.train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, drop_last=True)
    if len(loader) < args.accum_steps:
        fail(f"each rank has {len(sampler)} training images: fewer than --batch-size "
             f"{args.batch_size} x --accum-steps {args.accum_steps}")
    return sampler, loader


# --- resume ----------------------------------------------------------------------------

def resume(run: Run, saved: dict) -> None:
    """Continue from a checkpoint: each rank takes back its own weights, optimizer, loss
    scale, schedule, strategy state and random generators, and the step count.

    The world size must be the one that saved it. Each rank continues its own replica,
    its own error feedback, its own shard of the data (the sampler deals the images by
    rank and world size): with another number of ranks none of these has a sound
    counterpart, so such a resume ends the run here, before training."""
    world, path = run.comm.world_size, run.args.resume
    if saved["world_size"] != world:
        fail(f"--resume {path}: saved by {saved['world_size']} rank(s), resumed with "
             f"{world}: each rank continues its own state, so resume with "
             f"{saved['world_size']} rank(s)")
    if len(saved["ranks"]) != world or any(
            key not in state for state in saved["ranks"] for key in RANK_KEYS):
        fail(f"--resume {path}: not a trainer checkpoint (\"ranks\" should hold "
             f"{world} state(s), each with {', '.join(RANK_KEYS)})")
    check_state_flags(run.args, saved)
    mine = saved["ranks"][run.comm.rank]
    run.model.load_state_dict(mine["model"])
    run.optimizer.load_state_dict(mine["optimizer"])
    run.scaler.load_state_dict(mine["scaler"])
    run.schedule.load_state_dict(mine["schedule"])
    run.strategy.load_state_dict(mine["strategy"])
    run.step = mine.get("step", saved["step"])  # a rank's own count (--shards dynamic)
    run.sent_total, run.seconds_total = saved.get("totals", (0.0, 0.0))
    checkpoint.restore_rng_state(mine["rng"])


def check_state_flags(args: argparse.Namespace, saved: dict) -> None:
    """The state saved belongs to the strategy and model of the flags that saved it
    (STATE_FLAGS): a resume with others ends the run with one line."""
    for flag in STATE_FLAGS:
        before = saved["args"].get(flag, FLAGS_BEFORE_THEY_EXISTED.get(flag))
        now = getattr(args, flag)
        if flag == "sync_option":  # the options, in whatever order they were given
            before, now = sorted(map(tuple, before or [])), sorted(map(tuple, now or []))
        if before != now:
            fail(f"--resume {args.resume}: saved with --{flag.replace('_', '-')} {before}, "
                 f"resumed with {now}: its model and strategy state belong to the flags "
                 "that saved it")


def evaluate_checkpoint(run: Run, saved: dict) -> None:
    """--eval-only: the score of the checkpoint's "model" (test accuracy, held-out bits
    per byte), printed and appended to --metrics (marked eval_only).

    "model" is the model that epoch evaluated (see `evaluated_model`), the same on every
    rank: it is scored as it is, with no averaging, so the figure is exactly the one
    that epoch printed (on the same number of ranks: each rank scores its slice in
    batches, and other batch shapes may round differently)."""
    args, epoch = run.args, saved["epoch"]
    model = copy.deepcopy(run.model)  # the architecture; the weights come next
    model.load_state_dict(saved["model"])
    figures = run.task.evaluate(model, run.comm, run.comm.device, args.batch_size, args.amp)
    run.say(f"checkpoint {args.resume} (epoch {epoch}): "
            f"{run.task.score_text(figures[run.task.score_key])}")
    if run.comm.rank == 0 and args.metrics:
        with open(args.metrics, "a") as out:
            out.write(json.dumps({"epoch": epoch, **figures, "eval_only": True}) + "\n")


# --- one epoch -------------------------------------------------------------------------

class EpochTrained(NamedTuple):
    """What one epoch's training measured, read as it ended (before evaluation)."""
    losses: List[float]     # every micro-batch's loss
    steps: int              # optimizer steps applied (skipped ones not counted)
    started: float          # time.perf_counter() as the epoch began
    train_seconds: float    # its training, evaluation not included
    sent_bytes: float       # bytes this rank sent
    busy_seconds: float     # our communication threads' busy time


def train_one_epoch(run: Run, epoch: int) -> EpochTrained:
    """One pass over this rank's shard: each optimizer step is --accum-steps
    micro-batches, forward and backward, then the step; an incomplete last step is
    dropped. The epoch ends when its background communication has (delayed's last
    all-reduce, async-avg's round): its bytes and seconds are this epoch's."""
    args, device = run.args, run.comm.device
    run.sampler.set_epoch(epoch)  # a new shuffle, the same permutation on every rank
    sent_before, steps_before = run.sent.read(), run.step
    busy_before = background_comm_seconds(run.ddp, run.strategy)
    run.clock.reset()  # seconds the training thread waits on communication, from here
    started = time.perf_counter()
    losses = []
    micro_batches = steps_in_epoch(run, epoch) * args.accum_steps
    batches = progress(run.loader, f"epoch {epoch}/{args.epochs}", micro_batches,
                       args.progress, show=run.comm.rank == 0)
    for index, (inputs, targets) in enumerate(batches):
        if index >= micro_batches and args.shards == "static":
            break  # an incomplete accumulation at the end of the epoch is dropped
        inputs, targets = inputs.to(device), targets.to(device)
        if index % args.accum_steps == 0:  # a new optimizer step begins
            step_started = time.perf_counter_ns()
            trace_only_chosen_steps(run)
        last_micro = (index + 1) % args.accum_steps == 0
        losses.append(forward_backward(run, inputs, targets, synchronise=last_micro))
        if last_micro and optimizer_step(run, step_started) and run.comm.rank == 0:
            batches.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)  # at its next redraw
            if run.board is not None:  # rank 0's own loss: no collective every step
                run.board.add_scalar("train/loss", losses[-1], run.step)
    if run.stepper is not None:  # the last step, before evaluating or saving (its waits
        run.stepper.flush()      # are the clock's already)
    with run.clock.blocking("drain"):  # the epoch's background communication ends in it
        drain_background(run.ddp, run.strategy)
    train_seconds = time.perf_counter() - started
    return EpochTrained(losses, run.step - steps_before, started, train_seconds,
                        run.sent.read() - sent_before,
                        background_comm_seconds(run.ddp, run.strategy) - busy_before)


def steps_in_epoch(run: Run, epoch: int) -> int:
    """The optimizer steps epoch `epoch` takes: steps_per_epoch, but a language model's
    last epoch takes what is left of --steps."""
    left = run.total_steps - (epoch - 1) * run.steps_per_epoch
    return min(run.steps_per_epoch, left) if run.args.steps else run.steps_per_epoch


def trace_only_chosen_steps(run: Run) -> None:
    """With --trace, record the optimizer step about to begin only if --trace-steps
    names it: a few steady steps, not the whole run."""
    if run.args.trace:
        first, last = run.args.trace_steps
        (trace.resume if first <= run.step + 1 <= last else trace.pause)()


def forward_backward(run: Run, inputs: torch.Tensor, targets: torch.Tensor,
                     synchronise: bool) -> float:
    """One micro-batch's forward and backward; its gradients are synchronised only when
    `synchronise` (the last micro-batch of a step), accumulated locally before that.
    Returns its loss."""
    args = run.args
    with (contextlib.nullcontext() if synchronise else run.ddp.no_sync()):
        with autocast(run.comm.device, args.amp), trace.span("forward", cat="compute"):
            # divided so that the accumulated gradient is the mean over the micro-batches
            loss = run.task.loss(run.ddp(inputs), targets) / args.accum_steps
        run.clock.backward(run.scaler.scale(loss))
    return loss.item() * args.accum_steps


def optimizer_step(run: Run, step_started: int) -> bool:
    """After a step's last backward: the strategy's after_backward, the optimizer step,
    the strategy's after_step. False when --skip-nonfinite skipped the step instead."""
    args = run.args
    with run.clock.blocking("after_backward"):
        run.strategy.after_backward(run.model)
    if args.skip_nonfinite and not gradients_finite(run):
        skip_step(run)
        return False
    if args.clip_grad:  # on the gradients the step will apply (unscaled first)
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), args.clip_grad)
    with trace.span("optimizer", cat="compute"):
        if run.stepper is not None:  # taken inside the next forward
            run.stepper.step()
        else:
            run.scaler.step(run.optimizer)
            run.scaler.update()
        run.schedule.step()
    run.step += 1
    with run.clock.blocking("after_step"):  # torch's model averager wants the grads
        run.strategy.after_step(run.model, run.step)
    run.optimizer.zero_grad(set_to_none=True)
    trace.add(f"step {run.step}", "step", step_started, time.perf_counter_ns(),
              step=run.step, sync=args.sync, model=args.arch, batch=args.batch_size)
    return True


def gradients_finite(run: Run) -> bool:
    """--skip-nonfinite's question: are this step's gradients finite on every rank?
    all_finite asks every rank (a collective), so all decide alike. With --shards dynamic
    the ranks take different numbers of steps and meet at no step, so each rank asks only
    itself: its replica is its own until the next averaging round."""
    gradients = [p.grad for p in run.model.parameters()]
    if run.args.shards == "dynamic":
        return all(bool(torch.isfinite(g).all()) for g in gradients if g is not None)
    return collectives.all_finite(gradients, run.comm)


def skip_step(run: Run) -> None:
    """--skip-nonfinite: some rank's gradients hold inf or NaN. all_finite gave every rank
    the same answer, so every rank drops this step's gradients together (with --shards
    dynamic, the rank that saw them drops its own step); an fp16 loss scale is halved,
    as GradScaler does when it skips a step for an overflow."""
    if run.args.shards == "dynamic":  # this rank alone (rank 0's is not the only one)
        print(f"warning: rank {run.comm.rank}: step {run.step + 1}: non-finite gradients; "
              "skipping this rank's step", file=sys.stderr)
    else:
        run.say(f"warning: step {run.step + 1}: non-finite gradients on some rank; "
                "skipping this step on every rank", file=sys.stderr)
    run.optimizer.zero_grad(set_to_none=True)
    if run.scaler.is_enabled():
        run.scaler.update(run.scaler.get_scale() * 0.5)


# --- evaluate, report, save ------------------------------------------------------------

def evaluated_model(run: Run) -> torch.nn.Module:
    """The model this run stands for, as a copy the same on every rank: what each epoch
    evaluates and checkpoints (evaluation.evaluated_copy says which model that is)."""
    return evaluated_copy(run.model, run.strategy, run.comm)


def summarise_epoch(run: Run, epoch: int, trained: EpochTrained, figures: dict) -> dict:
    """The epoch's record (one line of --metrics): the train loss averaged over ranks,
    the task's held-out figures, throughput, bytes sent, and the shares of time spent
    communicating; with the run's totals so far (steps, bytes, seconds), the axes of
    loss against steps, bytes and time."""
    args = run.args
    # summed over the ranks, which may have trained unequal parts (--shards dynamic)
    world = run.comm.world_size
    totals = torch.zeros(2 + world, dtype=torch.float64)  # losses, micro-batches, steps
    totals[0], totals[1] = float(np.sum(trained.losses)), len(trained.losses)
    totals[2 + run.comm.rank] = trained.steps  # each rank fills its slot: an all-gather
    collectives.all_reduce(totals, op="sum", algorithm="auto", comm=run.comm, check=False)
    micro_batches = totals[1].item()
    seconds = trained.train_seconds
    run.sent_total += trained.sent_bytes
    run.seconds_total += seconds
    samples = micro_batches * args.batch_size
    return {"epoch": epoch, "train_loss": totals[0].item() / max(micro_batches, 1),
            **figures,
            run.task.throughput_key: samples * run.task.units_per_sample / seconds,
            "step": run.step, "sent_total": run.sent_total,
            "train_seconds_total": run.seconds_total,
            "comm_bytes": trained.sent_bytes,
            "bytes_per_step": trained.sent_bytes / max(trained.steps, 1),
            "steps": trained.steps,
            "steps_by_rank": [int(n) for n in totals[2:].tolist()],
            # busy: our comm threads and hooks (torch's threads are not visible)
            "comm_share": (None if run.torch_peer
                           else (trained.busy_seconds + run.clock.in_hooks) / seconds),
            "waited_share": run.clock.waited / seconds,
            "train_seconds": seconds,
            "seconds": time.perf_counter() - trained.started}


def report(run: Run, record: dict) -> None:
    """Rank 0 prints the epoch's line and appends its record to --metrics."""
    args = run.args
    busy_text = "-" if run.torch_peer else f"{record['comm_share']:.0%}"
    task = run.task
    where = (f"step {record['step']}/{run.total_steps}" if args.steps
             else f"epoch {record['epoch']}/{args.epochs}")
    run.say(f"{where}: train loss {record['train_loss']:.4f}  {task.figures_text(record)}  "
            f"{record[task.throughput_key]:.0f} {task.units}/s  comm busy "
            f"{busy_text}, waited {record['waited_share']:.0%} of time, "
            f"{record['bytes_per_step'] / 2**20:.2f} MiB/step sent  ({record['seconds']:.1f} s)",
            flush=True)
    if run.comm.rank == 0 and args.metrics:
        with open(args.metrics, "a") as out:
            out.write(json.dumps(record) + "\n")
    if run.board is not None:
        write_board(run.board, record, task)


def write_board(board, record: dict, task: tasks.Task) -> None:
    """The evaluation's figures to TensorBoard against the step, and against what it cost:
    the MiB this rank has sent and the seconds trained (as steps of their own tags:
    TensorBoard's x axis is a step)."""
    for key in ("test_loss", task.score_key, "test_ppl", "train_loss"):
        if key in record:
            value, name = record[key], key.replace("test_", "held_out_" if
                                                    task.kind == "language" else "test_")
            board.add_scalar(f"by_step/{name}", value, record["step"])
            board.add_scalar(f"by_MiB_sent/{name}", value, round(record["sent_total"] / 2**20))
            board.add_scalar(f"by_seconds/{name}", value, round(record["train_seconds_total"]))
    board.add_scalar(f"throughput/{task.throughput_key}", record[task.throughput_key],
                     record["step"])
    board.flush()


def rank_state(run: Run) -> dict:
    """This rank's own part of a checkpoint: what differs between ranks, or may."""
    return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
            "scaler": run.scaler.state_dict(), "schedule": run.schedule.state_dict(),
            "strategy": run.strategy.state_dict(), "rng": checkpoint.rng_state(),
            "step": run.step}  # ranks differ with --shards dynamic


def save_checkpoint(run: Run, epoch: int, evaluated: torch.nn.Module,
                    score: float) -> None:
    """--checkpoint-dir/checkpoint.pt, written atomically by rank 0: all that `resume`
    needs to continue bit for bit, every rank's state in "ranks", with the flags that
    made it; "model" is the epoch's evaluated model (`evaluated_model`), the one its
    score belongs to (--eval-only reads it).

    Collective: every rank calls it, and sends its state to rank 0."""
    args = run.args
    ranks = checkpoint.gather_on_rank_0(run.comm, rank_state(run))
    if run.comm.rank != 0:
        return
    path = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    try:
        checkpoint.save_atomically(
            {"model": evaluated.state_dict(), "epoch": epoch, "step": run.step,
             "args": vars(args), "world_size": run.comm.world_size,
             run.task.score_key: score, "totals": (run.sent_total, run.seconds_total),
             "ranks": ranks}, path)
    except OSError as error:  # a full disk, no permission: the last checkpoint stays whole
        print(f"trainer: error: rank 0: cannot write the checkpoint {path}: {error}",
              file=sys.stderr)
        collectives.abort(1)  # the other ranks wait in the next collective: end them too


def reached_stop_at(run: Run, score: float) -> bool:
    """--stop-at: the score is all-reduced, so every rank decides alike and all stop
    together; the schedule still spans the whole run."""
    stop_at = run.args.stop_at
    if stop_at is not None and run.task.reached(score, stop_at):
        run.say(f"{run.task.score_text(score)} reached --stop-at {stop_at}: stopping")
        return True
    return False


def saved_score(saved: dict) -> Optional[float]:
    """The score of the epoch a checkpoint ended (test_acc or test_bpb)."""
    return next((saved[key] for key in ("test_acc", "test_bpb") if key in saved), None)


def finish(run: Run, started: float, score: Optional[float]) -> None:
    """Close the strategy (its threads), merge the trace, and print the last line."""
    args = run.args
    run.strategy.close()
    if args.trace:
        merged = trace.finish(run.comm)
        run.say(f"trace of steps {args.trace_steps[0]}-{args.trace_steps[1]}: {merged} (open "
                f"it in https://ui.perfetto.dev; `python -m collectives.trace {args.trace}` "
                "draws it)")
    if run.board is not None:
        run.board.close()
    scored = "" if score is None else f": {run.task.score_text(score)}"
    run.say(f"done in {time.perf_counter() - started:.1f} s{scored}")
