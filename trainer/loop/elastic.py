"""--elastic: training that goes on when ranks are lost, and takes in ranks that come.

    python -m collectives.elastic.store --port 29400 &      # on a host that outlives the ranks
    torchrun --nproc-per-node 4 -m trainer --elastic --store HOST:29400 --min-ranks 2
    python -m trainer --elastic --store HOST:29400          # later: one more rank joins

The job is a series of generations (collectives/elastic/membership.py): the ranks that
are in, in order. Each generation runs `train_generation`:

    wrap the model in our DDP over this generation's communicator
    for the rest of the run:
        the rest of the epoch, dealt over the ranks there are now (ElasticSampler)
        each step: forward, backward (buckets reduced), optimizer step, and, where the
                   replicas agree (every step; local-sgd: every averaging), a commit
        the epoch's end: evaluate, report, checkpoint (rank 0), commit

A rank that dies makes every survivor's next collective raise PeerError; `run` (from
collectives.elastic) then puts back the last commit, forms the next generation from the
survivors and hands them all the commit of the one that got furthest. A rank that comes
waits for the next commit, where every member moves to a generation that includes it,
and it receives the model, the optimizer and the counters before it trains.

What a commit holds (State): the model, the optimizer (momentum), the epoch, the images
of it trained (`done`), the optimizer steps, the strategy's own counters, the last
accuracy. The learning rate is computed from the progress through the run, so a
generation of any size continues the same schedule.

Only strategies whose replicas are equal at a known step can go back to one: gradient
averaging (allreduce, fp16, bf16), every step, and local-sgd at each averaging. The
others keep per-rank state (error feedback, drifting replicas) that a lost rank takes
with it, and are refused.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn, Optional, Tuple

import torch
from torch.utils.data import DataLoader

import collectives
from collectives.elastic import ElasticSampler, ElasticWorld, MembershipError, State, run
from collectives.launch.environment import detect_launch
from collectives.launch.exit import close_at_exit
from collectives.transport import PeerError
from collectives.sync.local_sgd import averaged_tensors
from . import checkpoint
from .checkpoint import seed_everything
from .cli import create_sync, fail
from .dynamic_shards import cosine_decay
from .evaluation import evaluated_copy

STORE_VARIABLE = "COLLECTIVES_ELASTIC_STORE"  # HOST:PORT, where --store is not given


def store_address(given: Optional[str]) -> Tuple[str, int]:
    """(host, port) of the membership store, from --store or $COLLECTIVES_ELASTIC_STORE.
    ValueError with the line to print when neither names one."""
    text = given or os.environ.get(STORE_VARIABLE, "").strip()
    if not text:
        raise ValueError(f"--elastic needs the membership store: start `python -m "
                         f"collectives.elastic.store --port 29400` on a host that outlives "
                         f"the ranks and pass --store HOST:29400 (or set ${STORE_VARIABLE})")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--store {text!r}: expected HOST:PORT")
    return host, int(port)


def refuse_a_launcher_that_ends_every_rank() -> None:
    """--elastic needs the ranks left to go on when one dies: a launcher that ends every
    rank then (mpirun, of any MPI) is refused, one line and exit 2, before any training."""
    launch = detect_launch()
    if launch.ends_every_rank_when_one_dies:
        fail(f"--elastic: mpirun ({launch.launcher}) ends every rank when one dies; start "
             "the ranks one by one, with collectives.cluster, or with one --standalone "
             "torchrun per host")


def progress_factor(args: argparse.Namespace, state: State, images: int) -> float:
    """The learning rate's factor at the run's progress: cosine decay to 0 over every
    image of --epochs (or 1), from the epoch and the images of it trained, so it is
    the same whatever the number of ranks."""
    if args.schedule == "constant":
        return 1.0
    return cosine_decay(((state.epoch - 1) * images + state.done) / (args.epochs * images))


def train_elastic(args: argparse.Namespace, task,
                  saved: Optional[dict] = None) -> None:
    """The run, generation after generation, until its epochs are done (from `saved`, an
    --elastic checkpoint, with --resume). Too few ranks left, a lost store, or the same
    failure generation after generation end it with one line (exit 1)."""
    refuse_a_launcher_that_ends_every_rank()
    try:
        host, port = store_address(args.store)
    except ValueError as error:
        fail(str(error))
    seed_everything(args.seed)  # a newcomer's weights are replaced by the job's
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    state = State(model, optimizer, epoch=1, done=0, step=0, strategy={}, accuracy=0.0,
                  epoch_loss=0.0, epoch_batches=0, epoch_seconds=0.0)
    if saved is not None:
        state.load_state_dict(saved["elastic"])  # the commit it was written from
    launched = os.environ.get("WORLD_SIZE")  # the first generation waits for them all
    started = time.perf_counter()
    try:
        world = ElasticWorld(host, port, min_ranks=args.min_ranks, timeout=args.timeout)
    except MembershipError as error:
        fail_elastic(str(error))
    close_at_exit(world.drop)  # the generation's gloo, closed before the interpreter goes
    try:
        finished = run(lambda state, world: train_generation(args, task, state, world),
                       state, world, expected=int(launched) if launched else None)
        says_done = finished is not None and world.comm.rank == 0  # the last generation's
    except MembershipError as error:
        fail_elastic(str(error))
    except PeerError as error:  # the same failure generation after generation
        fail_elastic(f"{world.membership.me}: {error}")
    finally:
        world.leave()
    if says_done:
        print(f"done in {time.perf_counter() - started:.1f} s: test accuracy "
              f"{state.accuracy:.2%}", flush=True)


def fail_elastic(message: str) -> NoReturn:
    """The job cannot go on: one line, exit 1."""
    print(f"trainer: error: {message}", file=sys.stderr)
    sys.exit(1)


def train_generation(args: argparse.Namespace, task, state: State,
                     world: ElasticWorld) -> bool:
    """Train the rest of the run over this generation's ranks (see the module
    docstring). Returns True at the end of the run."""
    comm = world.comm
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"generation {world.view.generation}: {comm.world_size} rank(s); training "
        f"{args.arch} on {args.dataset} from epoch {state.epoch}, image {state.done}, "
        f"step {state.step} (sync {args.sync}, backend {comm.name})", flush=True)
    strategy = create_sync(args)
    if state.strategy:  # local-sgd's step count
        strategy.load_state_dict(state.strategy)
    ddp = None
    try:
        # run() gave every member the same commit: DDP need not broadcast it again
        ddp = collectives.DistributedDataParallel(state.model, sync=strategy,
                                                  bucket_cap_mb=args.bucket_mb, comm=comm,
                                                  init_sync=False, moments="loop")
        while state.epoch <= args.epochs:
            record = train_rest_of_epoch(args, task, state, ddp, strategy, comm)
            if strategy.replicas_differ:  # local-sgd: the epoch ends with an averaging,
                collectives.all_reduce_coalesced(  # so that its end can be committed
                    averaged_tensors(state.model), op="avg", comm=comm)
            accuracy = evaluate_replicas(args, task, state.model, strategy, comm)
            record.update(test_acc=accuracy, generation=world.view.generation)
            say(f"epoch {state.epoch}/{args.epochs}: train loss {record['train_loss']:.4f}  "
                f"test acc {accuracy:.2%}  {record['images_per_s']:.0f} img/s  "
                f"{comm.world_size} rank(s)  ({record['seconds']:.1f} s)", flush=True)
            stop = args.stop_at is not None and accuracy >= args.stop_at
            if stop:
                say(f"test accuracy {accuracy:.2%} reached --stop-at {args.stop_at:.2%}: "
                    "stopping", flush=True)
            state.epoch = args.epochs + 1 if stop else state.epoch + 1
            state.done, state.accuracy = 0, accuracy
            state.epoch_loss, state.epoch_batches, state.epoch_seconds = 0.0, 0, 0.0
            state.strategy = strategy.state_dict()
            if comm.rank == 0:  # what the commit below holds, with the epoch's model
                keep(args, state, record)
            state.commit()
        return True
    finally:
        if ddp is not None and ddp.bucketer is not None:  # its hooks on the model, its thread
            ddp.bucketer.close()
        strategy.close()


def train_rest_of_epoch(args, task, state: State, ddp, strategy, comm) -> dict:
    """The steps left of this epoch over this generation's ranks, each committed where
    the replicas agree. Returns the epoch's figures, summed over the ranks: those of
    every generation that trained part of it, as far as their commits reach."""
    sampler = ElasticSampler(len(task.train_set), comm.rank, comm.world_size, args.batch_size,
                             state.epoch, state.done, seed=args.seed)
    loader = DataLoader(task.train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    model, optimizer = state.model, state.optimizer
    pending = torch.zeros(2, dtype=torch.float64)  # this rank's losses, batches: uncommitted
    since = time.perf_counter()
    for images, labels in loader:
        images, labels = images.to(comm.device), labels.to(comm.device)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * progress_factor(args, state, len(task.train_set))
        with torch.autocast(comm.device.type, dtype=torch.bfloat16,
                            enabled=args.amp == "bf16"):
            loss = task.loss(ddp(images), labels)
        loss.backward()
        strategy.after_backward(model)
        optimizer.step()
        state.step += 1
        strategy.after_step(model, state.step)
        optimizer.zero_grad(set_to_none=True)
        pending += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        state.done += args.batch_size * comm.world_size
        if strategy.replicas_equal_after(state.step):  # a point to go back to
            since = add_figures(state, pending, since, comm)
            state.strategy = strategy.state_dict()
            state.commit()  # collective: newcomers waiting end this generation here
    add_figures(state, pending, since, comm)  # the steps after the last commit point
    batches, seconds = state.epoch_batches, state.epoch_seconds
    return {"epoch": state.epoch, "train_loss": state.epoch_loss / max(batches, 1),
            "images_per_s": batches * args.batch_size / max(seconds, 1e-9),
            "world_size": comm.world_size, "step": state.step, "seconds": seconds}


def add_figures(state: State, pending: torch.Tensor, since: float, comm) -> float:
    """Add the steps since the last commit to the epoch's figures, the same on every rank
    (collective: summed over the ranks), so that a commit holds them with the steps.
    Returns the time it counted to."""
    now = time.perf_counter()  # each rank's own seconds, averaged: the same everywhere
    totals = torch.cat([pending, torch.tensor([now - since], dtype=torch.float64)])
    collectives.all_reduce(totals, op="sum", algorithm="auto", comm=comm, check=False)
    state.epoch_loss += totals[0].item()
    state.epoch_batches += int(totals[1].item())
    state.epoch_seconds += totals[2].item() / comm.world_size
    pending.zero_()
    return now


def evaluate_replicas(args, task, model, strategy, comm) -> float:
    """The test accuracy of the model the run stands for (train.evaluated_copy)."""
    figures = task.evaluate(evaluated_copy(model, strategy, comm), comm, comm.device,
                            args.batch_size, args.amp)
    return figures["test_acc"]


def keep(args: argparse.Namespace, state: State, record: dict) -> None:
    """Rank 0: the epoch's record to --metrics, and --checkpoint-dir/checkpoint.pt: the
    epoch's model and the state about to be committed, which --elastic --resume
    continues from."""
    if args.metrics:
        with open(args.metrics, "a") as out:
            out.write(json.dumps(record) + "\n")
    if args.checkpoint_dir:
        checkpoint.save_atomically(
            {"model": state.model.state_dict(), "epoch": record["epoch"],
             "test_acc": record["test_acc"], "args": vars(args),
             "elastic": state.state_dict()},
            os.path.join(args.checkpoint_dir, "checkpoint.pt"))
