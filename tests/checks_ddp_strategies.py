"""Every sync strategy through our DistributedDataParallel in a plain torch loop, against
the same strategy driven as the trainer drives it (run by test_ddp_strategies.py).

The plain loop is torch DDP's: forward, backward, optimizer.step(), nothing else; the
wrapper calls the strategy's after_backward and after_step itself. The trainer's loop
calls them in its own order (collectives/sync/base.py) on a wrapper told so
(moments="loop"). Same model, data and seed: every rank must end with the same weights
either way, and send the same bytes.
"""
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import sync

STEPS = 7
SKIPPED = 4  # this iteration's step is skipped after its backward, as GradScaler skips one
ALONE = 2  # this iteration's step is skipped on rank 0 alone (its own inf, say)
BATCH = 4

# Small periods, so that a few steps pass several of each strategy's events: delayed's
# warm-up ends, local SGD averages after a warm-up, hier-local-sgd averages on the host
# and across hosts, diloco takes outer steps after its warm-up; topk sends a tenth.
OPTIONS = {
    "delayed": dict(warmup_steps=2),
    "diloco": dict(period=2, warmup_steps=1),
    "hier-local-sgd": dict(period=4, local_period=2),
    "local-sgd": dict(period=2, warmup_steps=1),
    "powersgd": dict(rank=1),
    "sparseloco": dict(period=2),
    "noloco": dict(period=2),
    "sparta": dict(fraction=0.1, diloco_period=3),
    "muloco": dict(period=2, warmup_steps=1),
    "onebit-adam": dict(freeze_step=2),
    "topk": dict(ratio=0.1),
}
# Rounds on a background thread finish when the threads happen to get there, and two
# runs would differ: the loop settles them after every step (a collective that finishes
# the round on every rank), so that they begin and end at the same steps in every run.
SETTLED_EVERY_STEP = ("async-avg",)


def mlp():
    """The same float64 MLP on every rank, with a BatchNorm whose running statistics are
    buffers (broadcast from rank 0, or averaged, depending on the strategy)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 5)).double()


def micro_batch(comm, step, part):
    """This rank's share of micro-batch `part` of iteration `step`."""
    generator = torch.Generator().manual_seed(1000 * step + part)
    n = comm.world_size * BATCH
    x = torch.randn(n, 20, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (n,), generator=generator)
    mine = slice(comm.rank * BATCH, (comm.rank + 1) * BATCH)
    return x[mine], y[mine]


def train(comm, name, moments):
    """STEPS iterations of two micro-batches each (the first inside no_sync()), one of
    them skipped after its backward on every rank, one on rank 0 alone where the
    replicas are their own. moments="ddp": a plain torch loop, the wrapper calls
    the strategy; "loop": the trainer's order, the loop calls it. Returns this rank's
    parameters and buffers, and the bytes it sent after wrapping."""
    strategy = sync.create(name, algorithm="ring", **OPTIONS.get(name, {}))
    model = collectives.DistributedDataParallel(mlp(), sync=strategy, comm=comm,
                                                moments=moments)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm.traffic.reset()
    steps = 0
    for iteration in range(1, STEPS + 1):
        optimizer.zero_grad()
        with model.no_sync():  # gradient accumulation: no moment may run here
            x, y = micro_batch(comm, iteration, 0)
            F.cross_entropy(model(x), y).backward()
        x, y = micro_batch(comm, iteration, 1)
        F.cross_entropy(model(x), y).backward()
        if moments == "loop":
            strategy.after_backward(model.module)
        # A skip on one rank alone happens where the ranks' gradients are their own
        # (GradScaler's inf check on local gradients); async-avg's rounds are settled at
        # fixed steps here, which a deferred after_step would move: it never skips.
        alone = iteration == ALONE and comm.rank == 0 and strategy.replicas_differ
        skipped = name not in SETTLED_EVERY_STEP and (iteration == SKIPPED or alone)
        if not skipped:
            optimizer.step()
        if moments == "loop":  # a skipped step is a step for the strategy, as the
            steps += 1         # trainer's when GradScaler skips one
            strategy.after_step(model.module, steps)
        if name in SETTLED_EVERY_STEP:
            strategy.settle()
    if moments == "loop":
        strategy.close()
    else:
        model.close()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    return state, comm.traffic.bytes_sent


def refusals(comm):
    """What the wrapper refuses, in one line on every rank: {case: message}."""
    messages = {}

    def attempt(case, action):
        try:
            action()
            messages[case] = None
        except (RuntimeError, ValueError, NotImplementedError) as error:
            messages[case] = f"{type(error).__name__}: {error}"

    def loop_calls_a_moment_the_wrapper_calls():
        strategy = sync.create("powersgd")
        model = collectives.DistributedDataParallel(mlp(), sync=strategy, comm=comm)
        x, y = micro_batch(comm, 1, 0)
        F.cross_entropy(model(x), y).backward()
        try:
            strategy.after_backward(model.module)
        finally:
            model.close()

    def two_steps_after_one_backward():
        model = collectives.DistributedDataParallel(mlp(), sync="gossip", comm=comm)
        first = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
        second = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)
        x, y = micro_batch(comm, 1, 0)
        F.cross_entropy(model(x), y).backward()
        first.step()
        try:
            second.step()
        finally:
            model.close()

    def join_with_a_moment():
        model = collectives.DistributedDataParallel(mlp(), sync="local-sgd", comm=comm)
        try:
            with model.join():
                pass
        finally:
            model.close()

    attempt("moments", lambda: collectives.DistributedDataParallel(
        mlp(), comm=comm, moments="trainer"))
    attempt("called twice", loop_calls_a_moment_the_wrapper_calls)
    attempt("two optimizers", two_steps_after_one_backward)
    attempt("join", join_with_a_moment)
    return messages


def digest_parameters(state):
    """A fingerprint of the parameters' bytes, to compare ranks without shipping
    tensors (each rank's buffers hold the statistics of its own last batch)."""
    hasher = hashlib.sha1()
    for name, _ in mlp().named_parameters():
        hasher.update(name.encode() + state[name].numpy().tobytes())
    return hasher.hexdigest()


def every_strategy_both_ways(comm):
    """On this rank, for every registered strategy: {strategy: (bytes the plain loop
    sent, bytes the trainer's order sent, the largest difference between their
    states, the plain loop's parameters' digest)}; and what the wrapper refuses."""
    results = {}
    for name in sync.available():
        plain, plain_sent = train(comm, name, "ddp")
        trainer, trainer_sent = train(comm, name, "loop")
        difference = max((plain[key].double() - trainer[key].double()).abs().max().item()
                         for key in trainer)
        results[name] = (plain_sent, trainer_sent, difference, digest_parameters(plain))
    return results, refusals(comm)
