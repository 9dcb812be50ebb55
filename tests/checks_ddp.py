"""Training the same model with torch's DDP and with ours, on every rank, and comparing.

Shared by the gloo tests (spawned ranks) and the mpi test (run under mpirun, where
torch has no DDP: this file then saves our result for comparison with gloo's).
"""
import hashlib
import sys

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import collectives
from trainer.tasks.gpt import build_gpt

STEPS = 5
BATCH = 4


class BranchyMLP(nn.Module):
    """An MLP whose middle layer is one of two branches, chosen per step."""

    def __init__(self, hidden=32):
        super().__init__()
        self.fc1 = nn.Linear(20, hidden)
        self.branch_a = nn.Linear(hidden, hidden)
        self.branch_b = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 5)

    def forward(self, x, use_b=False):
        h = F.relu(self.fc1(x))
        h = F.relu(self.branch_b(h) if use_b else self.branch_a(h))
        return self.head(h)


# float64: any two correct all-reduces may round the last bit differently (summation
# order), and ResNet-18's BatchNorm on 1x1 maps amplifies such differences about 100x per
# step; in float64 they stay far below the tolerance, so the comparison tests the logic.
DTYPE = torch.float64


def make_model(kind, hidden=32):
    torch.manual_seed(0)
    if kind == "resnet18":
        return torchvision.models.resnet18(num_classes=10).to(DTYPE)
    if kind == "gpt":  # the trainer's byte-level transformer: tied embedding and head
        return build_gpt("gpt-nano").to(DTYPE)
    return BranchyMLP(hidden).to(DTYPE)


def batch(kind, rank, world_size, step):
    """This rank's shard of the global batch of `step`."""
    generator = torch.Generator().manual_seed(100 + step)
    n = world_size * BATCH
    if kind == "resnet18":
        x = torch.randn(n, 3, 32, 32, generator=generator, dtype=DTYPE)
        y = torch.randint(0, 10, (n,), generator=generator)
    elif kind == "gpt":  # windows of bytes, each target the byte after its input
        text = torch.randint(0, 256, (n, 33), generator=generator)
        x, y = text[:, :-1], text[:, 1:]
    else:
        x = torch.randn(n, 20, generator=generator, dtype=DTYPE)
        y = torch.randint(0, 5, (n,), generator=generator)
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def branch_choice(branches, step, rank):
    if branches == "together":   # all ranks skip the same branch: globally unused
        return step % 2 == 1
    if branches == "by-rank":    # some ranks use a branch that others skip
        return (step + rank) % 3 == 0
    return False


def loss_of(outputs, targets):
    """Cross-entropy over every prediction (a language model's: every position)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def train(model, rank, world_size, kind, branches="none", accumulate=1, steps=STEPS):
    if kind == "gpt":  # as language models train: AdamW, gradients clipped
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                      weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            x, y = batch(kind, rank, world_size, step * accumulate + micro)
            kwargs = {} if kind in ("resnet18", "gpt") else {
                "use_b": branch_choice(branches, step * accumulate + micro, rank)}
            last = micro == accumulate - 1
            context = model.no_sync() if not last else _nothing()
            with context:
                loss_of(model(x, **kwargs), y).backward()
        if kind == "gpt":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def state(model):
    return {name: t.detach().clone() for name, t in
            list(model.named_parameters()) + list(model.named_buffers())}


def digest_parameters(model):
    hasher = hashlib.sha1()
    for _, p in sorted(model.named_parameters()):
        hasher.update(p.detach().numpy().tobytes())
    return hasher.hexdigest()


def compare_with_torch_ddp(comm, kind, branches="none", accumulate=1, **ours_options):
    """Train with torch DDP and with ours; assert equal; return our parameters' digest."""
    rank, world_size = comm.rank, comm.world_size
    find_unused = kind == "mlp"  # branch_b is never used when branches == "none"
    theirs = torch.nn.parallel.DistributedDataParallel(
        make_model(kind), find_unused_parameters=find_unused,
        bucket_cap_mb=ours_options.get("bucket_cap_mb", 25)
        if ours_options.get("bucket_cap_mb") != "auto" else 25)
    train(theirs, rank, world_size, kind, branches, accumulate)
    ours = collectives.DistributedDataParallel(make_model(kind), find_unused_parameters=find_unused,
                                               **ours_options)
    train(ours, rank, world_size, kind, branches, accumulate)
    expected, actual = state(theirs.module), state(ours.module)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} on rank {rank}: {m}")
    return digest_parameters(ours.module)


def auto_buckets_equal_torch_ddp(comm):
    """bucket_cap_mb="auto": the buckets are re-cut after two steps, the training still
    equals torch's DDP; returns (digest, the choice, the sizes in use)."""
    digest = compare_with_torch_ddp(comm, "mlp", bucket_cap_mb="auto")
    ours = collectives.DistributedDataParallel(make_model("mlp"), find_unused_parameters=True,
                                               bucket_cap_mb="auto")
    train(ours, comm.rank, comm.world_size, "mlp")
    choice = ours.bucket_choice
    return digest, sorted(choice.items()), ours.bucket_sizes_mb


def auto_buckets_inside_no_sync(comm):
    """bucket_cap_mb="auto" re-cut in a forward inside no_sync(): that pass's backward
    still only accumulates. Returns the bytes each no_sync backward sent."""
    model = collectives.DistributedDataParallel(make_model("mlp"), find_unused_parameters=True,
                                                bucket_cap_mb="auto")
    sent = []
    for step in range(4):
        for micro, syncing in enumerate((False, True)):
            x, y = batch("mlp", comm.rank, comm.world_size, 2 * step + micro)
            with (model.no_sync() if not syncing else _nothing()):
                loss = F.cross_entropy(model(x), y)  # step 3's first forward re-cuts
                before = comm.traffic.snapshot().bytes_sent
                loss.backward()
                if not syncing:
                    sent.append(comm.traffic.snapshot().bytes_sent - before)
    assert model.bucket_choice is not None
    return sent


def train_ours(comm, kind, **options):
    model = collectives.DistributedDataParallel(make_model(kind), find_unused_parameters=True,
                                                **options)
    train(model, comm.rank, comm.world_size, kind)
    return digest_parameters(model.module)


if __name__ == "__main__":
    comm = collectives.init(backend="mpi", timeout=120)
    result = train_ours(comm, "mlp", algorithm="ring")
    sys.stdout.write(f"rank {comm.rank} digest {result}\n")


def compare_horovod_with_torch_ddp(comm, compression="none"):
    """Horovod's recipe through collectives.horovod equals torch DDP on the MLP."""
    import collectives.horovod as hvd
    rank, world_size = comm.rank, comm.world_size
    theirs = torch.nn.parallel.DistributedDataParallel(make_model("mlp"),
                                                       find_unused_parameters=True)
    train(theirs, rank, world_size, "mlp")
    model = make_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=getattr(hvd.Compression, compression))
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch("mlp", rank, world_size, step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    tolerance = dict(rtol=1e-5, atol=1e-6) if compression == "none" else dict(rtol=0, atol=2e-3)
    for name, expected in state(theirs.module).items():
        torch.testing.assert_close(state(model)[name], expected, **tolerance,
                                   msg=lambda m: f"{name} on rank {rank}: {m}")
    averaged = hvd.allreduce(torch.tensor(float(rank)), name="rank")
    assert averaged.item() == (world_size - 1) / 2
    return digest_parameters(model)


# --- gradient accumulation (no_sync) with parameters that only some passes use ---------------
class SometimesB(nn.Module):
    """`a` takes part in every pass; `b` only when the pass asks for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x, use_b):
        out = self.a(x)
        return out + self.b(x) if use_b else out


# Each step is a list of passes, the last one syncing and the others inside no_sync(); a
# pass names the ranks that use `b` in it. One step after another on the same model, so a
# step also shows that what earlier steps used is forgotten once they have synced.
ACCUMULATION_STEPS = [
    ({0}, set()),        # rank 0 uses b inside no_sync() only, and nobody while syncing
    (set(), set()),      # nobody: b keeps no gradient, on every rank
    ({0}, {1}),          # rank 0 inside no_sync(), rank 1 in the syncing pass
    (set(), {1}),        # one rank, in the syncing pass only
    ({0, 1}, set()),     # both ranks, inside no_sync() only
    ({1}, {0}, set()),   # three passes: each rank in a different no_sync() pass
]


def _accumulate_step(model, optimizer, rank, step, passes):
    """One step of gradient accumulation; returns every parameter's .grad after it."""
    optimizer.zero_grad()
    for number, users in enumerate(passes):
        generator = torch.Generator().manual_seed(1000 * step + 10 * number + rank)
        x = torch.randn(4, 4, generator=generator, dtype=DTYPE)
        syncing = number == len(passes) - 1
        with (_nothing() if syncing else model.no_sync()):
            model(x, rank in users).pow(2).sum().backward()
    grads = {name: None if p.grad is None else p.grad.detach().clone()
             for name, p in model.module.named_parameters()}
    optimizer.step()
    return grads


def compare_accumulation_with_torch_ddp(comm, gradient_as_bucket_view=False):
    """no_sync() with find_unused_parameters=True, where `b` is used in some passes on some
    ranks: after every step each .grad is torch DDP's (a parameter used by any rank in any
    pass since the last sync is averaged; one that no rank used keeps its .grad), and the
    ranks agree."""
    rank = comm.rank
    models = {}
    for face, wrapper in (("torch", torch.nn.parallel.DistributedDataParallel),
                          ("ours", collectives.DistributedDataParallel)):
        model = wrapper(SometimesB().to(DTYPE), find_unused_parameters=True,
                        gradient_as_bucket_view=gradient_as_bucket_view)
        models[face] = (model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, passes in enumerate(ACCUMULATION_STEPS):
        theirs, ours = (_accumulate_step(*models[face], rank, step, passes)
                        for face in ("torch", "ours"))
        for name, expected in theirs.items():
            where = f"{name}.grad on rank {rank} after step {step} (b used by {passes})"
            assert (ours[name] is None) == (expected is None), \
                f"{where}: torch's is {expected}, ours is {ours[name]}"
            if expected is not None:
                torch.testing.assert_close(ours[name], expected, rtol=1e-9, atol=1e-12,
                                           msg=lambda m: f"{where}: {m}")
    return digest_parameters(models["ours"][0].module)


class MaskAndFrequencies(nn.Module):
    """A layer with the buffers of attention that are not floats: a causal mask (bool)
    and rotary frequencies (complex64), drawn from `seed` (each rank its own)."""

    def __init__(self, seed):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("causal", torch.ones(4, 4, dtype=torch.bool))
        self.register_buffer("freqs_cis", torch.ones(4, 4, dtype=torch.complex64))
        self.redraw(seed)

    @torch.no_grad()
    def redraw(self, seed):
        generator = torch.Generator().manual_seed(seed)
        self.causal.copy_(torch.rand(4, 4, generator=generator) > 0.5)
        self.freqs_cis.copy_(torch.polar(torch.ones(4, 4), torch.rand(4, 4, generator=generator)))

    def forward(self, x):  # x: (batch, 4 positions, 8 features)
        pairs = torch.view_as_complex(self.proj(x).reshape(*x.shape[:-1], 4, 2))
        rotated = torch.view_as_real(pairs * self.freqs_cis).flatten(-2)
        return (rotated @ rotated.transpose(-1, -2)).masked_fill(~self.causal, 0.0)

    def buffer_values(self):
        return [self.causal.tolist(), self.freqs_cis.tolist()]


def bool_and_complex_buffers_come_from_rank_0(comm):
    """Each rank's buffers drawn from its own seed: after wrapping (the initial sync)
    and after a forward that follows a redraw on every rank (the per-forward broadcast),
    the buffer values this rank holds."""
    model = collectives.DistributedDataParallel(MaskAndFrequencies(seed=comm.rank))
    after_wrapping = model.module.buffer_values()
    model.module.redraw(seed=10 + comm.rank)
    model(torch.randn(2, 4, 8)).sum().backward()
    return after_wrapping, model.module.buffer_values()
