"""Per-rank checks of `noloco` and `sparta` (run on spawned gloo ranks by
test_lowcomm_pairs.py): one sync against each paper's rule worked by hand, with
torch.distributed's own send/recv and all_reduce as the reference; the bytes each rank
sends against cost(); a resumed strategy against one that never stopped; a plain torch
loop against the trainer's order; and a non-finite replica that must not spread.

The "inner steps" between syncs are stand-ins: each rank moves its replica by noise of
its own (`drift`), so that the replicas differ and every rule has something to do.
"""
import io
import warnings

import torch
import torch.distributed as dist

import collectives
from collectives import api, sync
from checks_sync import mlp, ring_bytes, shard, step_once

SEED = 7
ALPHA, BETA, GAMMA = 0.5, 0.7, 0.7  # noloco's defaults: outer momentum, outer lr, pull


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def numels(model):
    return [p.numel() for p in model.parameters()]


def float_mlp():
    return mlp().float()  # the same float32 weights on every rank


@torch.no_grad()
def drift(model, comm, step):
    """Stand-in for a rank's inner steps: noise of its own, the same in every run."""
    generator = torch.Generator().manual_seed(1000 * step + comm.rank)
    for p in model.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def swap(tensor, peer):
    """The peer's `tensor`, by torch.distributed's own send and recv."""
    theirs = torch.empty_like(tensor)
    request = dist.isend(tensor.contiguous(), peer)
    dist.recv(theirs, peer)
    request.wait()
    return theirs


def mean_over_ranks(tensor):
    total = tensor.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def same_on_every_rank(tensor):
    """Does every rank hold `tensor` bitwise as rank 0 does? (torch.distributed's
    broadcast, and all_reduce for the verdict, so that every rank answers alike)"""
    rank_0s = tensor.clone()
    dist.broadcast(rank_0s, 0)
    same = torch.tensor([int(torch.equal(rank_0s, tensor))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same)


class Recorded:
    """While active, every comm.sendrecv's (tensor sent, dst, src) is kept."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def __enter__(self):
        original = self.comm.sendrecv

        def recording(send_tensor, dst, recv_tensor, src):
            self.calls.append((send_tensor.clone(), dst, src))
            original(send_tensor, dst, recv_tensor, src)
        self.comm.sendrecv = recording
        return self.calls

    def __exit__(self, *exc):
        del self.comm.sendrecv  # the class's method again


# --- noloco ------------------------------------------------------------------------------

def noloco_peer_by_hand(sync_number, rank, world_size, seed):
    """The docstring's pairing: a permutation from a generator seeded with
    seed * 2**32 + sync (mod 2**64), paired off in order; an odd world's last sits out."""
    generator = torch.Generator().manual_seed(((seed << 32) + sync_number) % (1 << 64))
    order = torch.randperm(world_size, generator=generator).tolist()
    for i in range(0, world_size - 1, 2):
        if rank in order[i:i + 2]:
            return order[i + 1] if rank == order[i] else order[i]
    return None


def noloco_by_hand(comm, syncs=3):
    """H = 1, so every step is a sync: after each drift, the strategy's outer step against
    the rule written out here. Returns [(peer, bytes sent, largest pull)] per sync, and
    cost()."""
    model = float_mlp()
    strategy = sync.create("noloco", period=1, seed=SEED)
    strategy.setup(model, comm)
    slow = flat(model).clone()
    momentum = torch.zeros_like(slow)
    record = []
    for step in range(1, syncs + 1):
        drift(model, comm, step)
        local = flat(model).clone()
        comm.traffic.reset()
        with Recorded(comm) as sent:
            strategy.after_step(model, step)
        peer = noloco_peer_by_hand(step, comm.rank, comm.world_size, SEED)
        outer_gradient = slow - local
        if peer is None:
            assert sent == [], f"step {step}: a rank sitting out sent {len(sent)} messages"
            mean_slow, mean_gradient = slow, outer_gradient
        else:
            assert len(sent) == 1, sent
            message, dst, src = sent[0]
            assert (dst, src) == (peer, peer), (step, dst, src, peer)
            torch.testing.assert_close(message, torch.cat([slow, outer_gradient]))
            mean_slow = (slow + swap(slow, peer)) / 2
            mean_gradient = (outer_gradient + swap(outer_gradient, peer)) / 2
        pull = slow - mean_slow  # 0 until a pair's slow weights differ (3 ranks or more)
        momentum = ALPHA * momentum - BETA * mean_gradient - GAMMA * pull
        slow = slow + momentum
        torch.testing.assert_close(flat(model), slow, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(strategy.slow, slow)
        torch.testing.assert_close(strategy.momentum, momentum)
        record.append((peer, comm.traffic.bytes_sent, pull.abs().max().item()))
    return record, tuple(strategy.cost(numels(model), comm.world_size))


def noloco_state_stays_finite(comm):
    """Rank 1's replica overflows before the second sync: its group (rank 1 and its
    peer) keeps phi and delta as they were and goes back to phi; others step on."""
    model = float_mlp()
    strategy = sync.create("noloco", period=1, seed=SEED)
    strategy.setup(model, comm)
    drift(model, comm, 1)
    strategy.after_step(model, 1)
    slow, momentum = strategy.slow.clone(), strategy.momentum.clone()
    drift(model, comm, 2)
    if comm.rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.after_step(model, 2)
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    peer = noloco_peer_by_hand(2, comm.rank, comm.world_size, SEED)
    pair = sorted({comm.rank, peer} - {None})
    # said once, by the lower rank of the pair that dropped it, naming both
    assert len(said) == (1 in pair and comm.rank == pair[0]), said
    who = f"ranks {pair[0]} and {pair[1]}" if len(pair) == 2 else f"rank {pair[0]}"
    assert all(f"{who} dropped it" in m for m in said), said
    if 1 in (comm.rank, peer):
        assert torch.equal(strategy.slow, slow) and torch.equal(strategy.momentum, momentum)
    assert strategy.dropped_syncs == (1 in (comm.rank, peer))  # said where it was dropped
    assert sync.finite([strategy.slow, strategy.momentum, flat(model)])
    assert torch.equal(flat(model), strategy.slow)
    return "ok"


# --- sparta ------------------------------------------------------------------------------

class RecordedAllReduce:
    """While active, every tensor handed to api.all_reduce is kept, as it went in."""

    def __enter__(self):
        self.original, self.calls = api.all_reduce, []

        def recording(tensor, *args, **kwargs):
            self.calls.append(tensor.clone())
            return self.original(tensor, *args, **kwargs)
        api.all_reduce = recording
        return self.calls

    def __exit__(self, *exc):
        api.all_reduce = self.original


def sparta_by_hand(comm, step=5, fraction=0.05):
    """One sparse average of replicas that differ: the values that change are k of them,
    at the same positions on every rank, and become their mean over the ranks (by
    torch.distributed's all_reduce); what this rank sent is its own values there.
    Returns (k, bytes sent, the ring's bytes for k, cost())."""
    model = float_mlp()
    drift(model, comm, 1)
    strategy = sync.create("sparta", fraction=fraction, seed=SEED, algorithm="ring")
    strategy.setup(model, comm)
    before = flat(model).clone()
    mean = mean_over_ranks(before)
    comm.traffic.reset()
    with RecordedAllReduce() as sent:
        strategy.after_step(model, step)
    after = flat(model)
    changed = (after != before).nonzero().view(-1)
    k = max(1, round(fraction * before.numel()))
    assert changed.numel() == k, (changed.numel(), k)
    assert same_on_every_rank(changed), "the ranks averaged different positions"
    assert torch.equal(changed, strategy.positions(step))
    assert not torch.equal(strategy.positions(step), strategy.positions(step + 1))
    torch.testing.assert_close(after[changed], mean[changed])
    assert len(sent) == 1 and torch.equal(sent[0], before[changed]), "sent other values"
    return (k, comm.traffic.bytes_sent, ring_bytes(k, 4, comm.world_size, comm.rank),
            tuple(strategy.cost(numels(model), comm.world_size)))


def sparta_keeps_an_overflow_to_itself(comm):
    """Rank 1's replica is all inf: no average is finite, none is written back."""
    model = float_mlp()
    strategy = sync.create("sparta", fraction=0.05, seed=SEED)
    strategy.setup(model, comm)
    if comm.rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("inf"))
    before = flat(model).clone()
    strategy.after_step(model, 1)
    assert torch.equal(flat(model), before)
    assert strategy.dropped_syncs == 1
    return "ok"


def sparta_with_diloco_in_a_plain_loop(comm, steps=4, period=2, fraction=0.05):
    """sparta with DiLoCo every `period` steps in a plain torch loop: the bytes of each
    step (the ring's for k values, DiLoCo's for all P at its steps) and the replicas
    equal after each DiLoCo step. Returns (bytes of each step, cost())."""
    strategy = sync.create("sparta", fraction=fraction, diloco_period=period, seed=SEED,
                           algorithm="ring")
    model = collectives.DistributedDataParallel(float_mlp(), sync=strategy, comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    total = sum(numels(model.module))
    k = max(1, round(fraction * total))
    sent = []
    for step in range(1, steps + 1):
        x, y = shard(comm, step)
        comm.traffic.reset()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.float()), y).backward()
        optimizer.step()  # after_step runs here
        sent.append(comm.traffic.bytes_sent)
        full = step % period == 0
        assert sent[-1] == ring_bytes(total if full else k, 4, comm.world_size, comm.rank)
        assert same_on_every_rank(flat(model.module)) == full, f"step {step}"
    model.close()
    return sent, tuple(strategy.cost(numels(model.module), comm.world_size))


# --- both --------------------------------------------------------------------------------

def checkpoint_round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def resumes_bit_for_bit(comm, name, options, stop, end):
    """Steps 1..stop, then the strategy's state_dict() through a checkpoint into a fresh
    one on a copy of the replica; steps stop+1..end on both must end bitwise alike."""
    model = float_mlp()
    strategy = sync.create(name, **options)
    strategy.setup(model, comm)
    for step in range(1, stop + 1):
        drift(model, comm, step)
        strategy.after_step(model, step)
    resumed_model = float_mlp()
    resumed_model.load_state_dict(model.state_dict())
    resumed = sync.create(name, **options)
    resumed.setup(resumed_model, comm)
    resumed.load_state_dict(checkpoint_round_trip(strategy.state_dict()))
    for step in range(stop + 1, end + 1):
        drift(model, comm, step)
        strategy.after_step(model, step)
        drift(resumed_model, comm, step)
        resumed.after_step(resumed_model, step)
    strategy.close()
    resumed.close()
    assert torch.equal(flat(resumed_model), flat(model)), f"{name}: resumed elsewhere"
    return "ok"


def plain_loop_matches_trainer_order(comm, name, options, steps=6):
    """Our DistributedDataParallel calling the strategy itself (moments="ddp") ends where
    the trainer's order (moments="loop") does, having sent the same bytes. Returns
    (the bytes this rank sent in `steps` steps, cost())."""
    ends = []
    for moments in ("ddp", "loop"):
        strategy = sync.create(name, algorithm="ring", **options)
        model = collectives.DistributedDataParallel(float_mlp(), sync=strategy, comm=comm,
                                                    moments=moments)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        comm.traffic.reset()
        for step in range(1, steps + 1):
            x, y = shard(comm, step)
            if moments == "loop":
                step_once(model, strategy, optimizer, x.float(), y, step)
            else:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x.float()), y).backward()
                optimizer.step()
        if moments == "loop":
            strategy.close()
        else:
            model.close()
        ends.append((flat(model.module), comm.traffic.bytes_sent))
    (plain, plain_sent), (trainer, trainer_sent) = ends
    assert plain_sent == trainer_sent, (name, plain_sent, trainer_sent)
    assert torch.equal(plain, trainer), name
    return plain_sent, tuple(strategy.cost(numels(model.module), comm.world_size))


def every_check(comm):
    """All of the checks on this rank, in one world: {check: its result}."""
    return {
        "noloco by hand": noloco_by_hand(comm),
        "noloco finite": noloco_state_stays_finite(comm),
        "noloco resumes": resumes_bit_for_bit(comm, "noloco", dict(period=2, seed=SEED),
                                              stop=3, end=6),
        "noloco plain loop": plain_loop_matches_trainer_order(
            comm, "noloco", dict(period=2, seed=SEED)),
        "sparta by hand": sparta_by_hand(comm),
        "sparta finite": sparta_keeps_an_overflow_to_itself(comm),
        "sparta with diloco": sparta_with_diloco_in_a_plain_loop(comm),
        "sparta resumes": resumes_bit_for_bit(
            comm, "sparta", dict(fraction=0.05, diloco_period=2, seed=SEED), stop=3, end=5),
        "sparta plain loop": plain_loop_matches_trainer_order(
            comm, "sparta", dict(fraction=0.05, diloco_period=3, seed=SEED)),
    }
