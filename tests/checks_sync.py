"""Per-rank checks of the sync strategies (run on spawned gloo ranks by test_sync.py)."""
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import sync
from collectives.algorithms.common import chunk_bounds

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")


class SmallCNN(nn.Module):
    """A small MNIST network: two convolutions and two linear layers (21k parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def mlp(batchnorm=False):
    """The checks' MLP, in float64, the same on every rank. With `batchnorm`, a
    BatchNorm1d after the first layer: its running statistics are buffers, which each
    rank updates from its own batch, and which model averaging must average too."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(64)] if batchnorm else []
    return nn.Sequential(nn.Linear(20, 64), *norm, nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 5)).double()


def step_once(model, strategy, optimizer, x, y, step, after_optimizer=None):
    """One step in the order every strategy expects (the trainer's order);
    after_optimizer(module, step), if given, runs between the optimizer's step and the
    strategy's after_step (where model averaging averages)."""
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    strategy.after_backward(model.module)
    optimizer.step()
    if after_optimizer is not None:
        after_optimizer(model.module, step)
    strategy.after_step(model.module, step)


def shard(comm, step, batch=8):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(comm.world_size * batch, 20, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (comm.world_size * batch,), generator=generator)
    part = slice(comm.rank * batch, (comm.rank + 1) * batch)
    return x[part], y[part]


def train_mlp(comm, name, steps=5, lr=0.1, momentum=0.0, batchnorm=False,
              after_optimizer=None, **options):
    """Train the MLP with strategy `name` (each rank its own batches); return its state
    (parameters and buffers). after_optimizer: as step_once takes it."""
    strategy = sync.create(name, algorithm="ring", **options)
    model = collectives.DistributedDataParallel(mlp(batchnorm), sync=strategy,
                                                moments="loop", comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(1, steps + 1):
        step_once(model, strategy, optimizer, *shard(comm, step), step, after_optimizer)
    strategy.close()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def mean_over_ranks(tensor):
    """The mean of `tensor` over the ranks, computed with torch.distributed's own
    all-reduce (not this project's): the reference our averaging is checked against."""
    total = tensor.clone()
    torch.distributed.all_reduce(total)
    return total / torch.distributed.get_world_size()


def average_buffers_by_hand(module, step):
    """Every floating-point buffer (BatchNorm's running statistics) replaced by its mean
    over the ranks."""
    for buffer in module.buffers():
        if buffer.is_floating_point():
            buffer.copy_(mean_over_ranks(buffer))


def local_sgd_h1_equals_allreduce(comm):
    """With H = 1 and plain SGD, local SGD is gradient averaging: the parameters are
    allreduce's. It also averages BatchNorm's running statistics after every step,
    where allreduce takes rank 0's before each forward: so its buffers are those of
    allreduce whose ranks average their statistics by hand after every step."""
    expected = train_mlp(comm, "allreduce", batchnorm=True,
                         after_optimizer=average_buffers_by_hand)
    actual = train_mlp(comm, "local-sgd", period=1, batchnorm=True)
    assert {"1.running_mean", "1.running_var"} <= set(actual), "no buffers to check"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda message: f"{name}: {message}")
    return "ok"


def delayed_is_one_step_late(comm):
    # delayed step 1 applies nothing; step 2 applies step 1's average, computed at the
    # same parameters as allreduce's step 1
    expected = train_mlp(comm, "allreduce", steps=1)
    actual = train_mlp(comm, "delayed", steps=2, warmup_steps=0)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-10, atol=1e-12)
    return "ok"


def poison_next_gradient(parameter, value):
    """Make `parameter`'s gradient in the next backward all `value` (inf or NaN), as an
    fp16 overflow leaves it; returns the hook's handle, to remove after that backward."""
    return parameter.register_hook(lambda grad: torch.full_like(grad, value))


# The strategies that reduce gradients; a gradient step goes into the state of some.
GRADIENT_STRATEGIES = ("allreduce", "fp16", "bf16", "topk", "powersgd", "delayed")


def one_bad_gradient_is_forgotten(comm, value, steps=6, bad_step=2):
    """{strategy: [are the reduced gradients finite?] at each step} on this rank.

    At `bad_step` rank 1's gradient of one weight matrix is all `value`; every other
    gradient is clean. As the trainer's --skip-nonfinite does, a step whose gradients are
    not finite on some rank is skipped on every rank.
    """
    finite_steps = {}
    for name in GRADIENT_STRATEGIES:
        late = {"warmup_steps": 0} if name == "delayed" else {}  # late from step 1
        strategy = sync.create(name, algorithm="ring", **late)
        model = collectives.DistributedDataParallel(mlp(), sync=strategy, moments="loop", comm=comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        finite_steps[name], applied = [], 0
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            x, y = shard(comm, step)
            poisoned = step == bad_step and comm.rank == 1
            handle = poison_next_gradient(model.module[2].weight, value) if poisoned else None
            F.cross_entropy(model(x), y).backward()
            if handle is not None:
                handle.remove()
            strategy.after_backward(model.module)
            grads = [p.grad for p in model.parameters()]
            finite_steps[name].append(sync.finite(grads))
            if collectives.all_finite(grads, comm):
                optimizer.step()
                applied += 1
                strategy.after_step(model.module, applied)
        strategy.close()
    return finite_steps


def delayed_unscales_each_gradient_with_its_own_scale(comm, steps=6, bad_step=2):
    """With fp16 AMP's GradScaler, delayed must apply at step t+1 exactly the unscaled
    average that a plain all-reduce would have applied at step t, although the scale
    changes in between: growth_interval=1 doubles it after every applied step, and an
    overflow at `bad_step` (seen, and skipped, at bad_step + 1) halves it.
    Returns the scale of every step."""
    strategy = sync.create("delayed", algorithm="ring", warmup_steps=0)
    model = collectives.DistributedDataParallel(mlp(), sync=strategy, moments="loop", comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    strategy.grad_scaler = scaler
    params = list(model.parameters())
    previous = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    scales = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        x, y = shard(comm, step)
        poisoned = step == bad_step and comm.rank == 1
        handle = poison_next_gradient(model.module[2].weight, float("inf")) if poisoned else None
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if handle is not None:
            handle.remove()
        scales.append(scaler.get_scale())
        # What a plain all-reduce step would hand the optimizer: this step's average, unscaled.
        unscaled = torch.cat([p.grad.reshape(-1) for p in params]) / scaler.get_scale()
        collectives.all_reduce(unscaled, op="avg", algorithm="ring", comm=comm)
        strategy.after_backward(model.module)
        scaler.unscale_(optimizer)  # what scaler.step applies (or skips, if not finite)
        applied = torch.cat([p.grad.reshape(-1) for p in params])
        if sync.finite([previous]):
            torch.testing.assert_close(applied, previous, rtol=1e-12, atol=0,
                                       msg=lambda m: f"step {step}: {m}")
        else:
            assert not sync.finite([applied]), f"step {step}: the overflow was not passed on"
        scaler.step(optimizer)
        scaler.update()
        strategy.after_step(model.module, step)
        previous = unscaled
    strategy.close()
    return scales


def gossip_keeps_the_mean(comm):
    strategy = sync.create("gossip")
    model = mlp()
    torch.manual_seed(comm.rank)  # every rank starts somewhere else
    for p in model.parameters():
        p.data.normal_()
    strategy.setup(model, comm)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean_before = collectives.all_reduce(before.clone(), op="avg", comm=comm)
    for step in range(1, 4):
        strategy.after_step(model, step)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean_after = collectives.all_reduce(after.clone(), op="avg", comm=comm)
    torch.testing.assert_close(mean_after, mean_before, rtol=0, atol=1e-12)
    spread_before = (before - mean_before).norm().item()
    spread_after = (after - mean_after).norm().item()
    assert spread_after < 0.7 * spread_before, (spread_before, spread_after)
    return "ok"


def ring_bytes(numel, element_size, n, rank):
    """Bytes rank `rank` sends in a ring all-reduce: every chunk but two of its own."""
    bounds = chunk_bounds(numel, n)
    size = [bounds[i + 1] - bounds[i] for i in range(n)]
    return (2 * numel - size[rank] - size[(rank + 1) % n]) * element_size


def bytes_of_one_step(comm, name, **options):
    strategy = sync.create(name, algorithm="ring", **options)
    model = collectives.DistributedDataParallel(mlp().float(), sync=strategy,
                                                moments="loop", comm=comm,
                                                bucket_cap_mb=0.01, first_bucket_mb=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = shard(comm, 1)
    comm.traffic.reset()
    step_once(model, strategy, optimizer, x.float(), y, 1)
    sent = comm.traffic.bytes_sent
    strategy.close()
    return sent, model


def byte_counts_match_formulas(comm):
    n, rank = comm.world_size, comm.rank
    dense, model = bytes_of_one_step(comm, "allreduce")
    buckets = [b.buffer.numel() for b in model.bucketer.buckets]
    assert len(buckets) > 1
    assert dense == sum(ring_bytes(k, 4, n, rank) for k in buckets)
    for name in ("fp16", "bf16"):
        half, _ = bytes_of_one_step(comm, name)
        assert half * 2 == dense, (name, half, dense)
    sparse, _ = bytes_of_one_step(comm, "topk", ratio=0.05)
    ks = [max(1, int(0.05 * k)) for k in buckets]
    assert sparse == sum((n - 1) * (4 * k + 4 * k) for k in ks), (sparse, ks)  # values + indices
    low_rank, model = bytes_of_one_step(comm, "powersgd", rank=2)
    params = list(model.module.parameters())
    matrices = [p for p in params if p.dim() == 2 and 2 * sum(p.shape) < p.numel()]
    assert matrices
    uncompressed = sum(p.numel() for p in params) - sum(p.numel() for p in matrices)
    ps = sum(2 * p.shape[0] for p in matrices)     # r * n per matrix
    qs = sum(2 * p.shape[1] for p in matrices)     # r * m per matrix
    expected = sum(ring_bytes(k, 4, n, rank) for k in (uncompressed, ps, qs))
    assert low_rank == expected, (low_rank, expected)
    return {"dense": dense, "fp16": dense // 2, "topk": sparse, "powersgd": low_rank}


def async_avg_does_not_wait_for_a_slow_rank(comm, flag_path):
    """Rank 1 stalls in its first step until rank 0 has finished all its steps.

    If async-avg made the training thread wait for its peers anywhere, rank 0 could not
    finish while rank 1 stalls, rank 1's wait would run out, and the check fails:
    no timing is involved. Returns (rank 0 finished while rank 1 stalled, rounds, bytes).
    """
    strategy = sync.create("async-avg", algorithm="ring")
    model = collectives.DistributedDataParallel(mlp(), sync=strategy, moments="loop", comm=comm)
    comm.traffic.reset()  # the rounds run on a duplicate communicator that counts here
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    finished_first = None
    for step in range(1, 11):
        step_once(model, strategy, optimizer, *shard(comm, step), step)
        if comm.rank == 1 and step == 1:  # the straggler
            deadline = time.monotonic() + 60
            while not os.path.exists(flag_path) and time.monotonic() < deadline:
                time.sleep(0.05)
            finished_first = os.path.exists(flag_path)
    if comm.rank == 0:
        open(flag_path, "w").close()
    strategy.close()
    return finished_first, strategy.rounds, comm.traffic.bytes_sent


def async_avg_settles_ranks_a_round_apart(comm):
    """Rank 1 starts round 2 (it saw round 1 finish); rank 0 has not yet, and the epoch
    ends: settling must finish round 2 on both, not wait for it on rank 1 alone while
    rank 0 goes on to the next collective."""
    from trainer.timing import drain_background
    torch.manual_seed(0)
    model = mlp()
    strategy = sync.create("async-avg")
    strategy.setup(model, comm)
    with torch.no_grad():  # replicas apart, so that averaging shows
        for p in model.parameters():
            p.add_(comm.rank)
    strategy.after_step(model, 1)  # round 1 starts on both
    if comm.rank == 1:
        strategy.round[1].wait()
        strategy.after_step(model, 2)  # round 1 applied, round 2 started
        assert strategy.rounds == 1 and strategy.round is not None
    drain_background(None, strategy)  # the epoch ends
    comm.barrier()  # the next collective on the training communicator
    assert strategy.rounds == 2 and strategy.round is None, (strategy.rounds, strategy.round)
    mine = torch.cat([p.reshape(-1) for p in model.parameters()])
    assert torch.equal(mine, mean_over_ranks(mine)), "round 2 left the replicas apart"
    strategy.close()
    return "ok"


def load_mnist(train):
    from torchvision import datasets
    dataset = datasets.MNIST(DATA, train=train, download=False)
    images = (dataset.data.float().unsqueeze(1) / 255 - 0.1307) / 0.3081
    return images, dataset.targets


def mnist_accuracy(comm, name, epochs=3, options=None, momentum=0.9):
    """Train SmallCNN on this rank's shard of the MNIST subset; return test accuracy.

    SGD (lr 0.05, cosine decay to 0) on batches of 32 per rank, as the trainer does.
    """
    images, labels = load_mnist(train=True)
    test_images, test_labels = load_mnist(train=False)
    torch.manual_seed(0)
    strategy = sync.create(name, algorithm="ring", **(options or {}))
    model = collectives.DistributedDataParallel(SmallCNN(), sync=strategy,
                                                moments="loop", comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    mine = torch.arange(comm.rank, len(images), comm.world_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * (len(mine) // 32))
    step = 0
    for epoch in range(epochs):
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        for batch in order.split(32):
            if len(batch) < 32:
                continue
            step += 1
            step_once(model, strategy, optimizer, images[batch], labels[batch], step,
                      after_optimizer=lambda module, step: schedule.step())
    strategy.close()
    with torch.no_grad():
        predicted = model.module(test_images).argmax(1)
    return (predicted == test_labels).float().mean().item()


def every_strategy_learns_mnist(comm, runs):
    """{name: accuracy} for {name: keyword arguments of mnist_accuracy}."""
    return {name: mnist_accuracy(comm, name, **settings) for name, settings in runs.items()}
