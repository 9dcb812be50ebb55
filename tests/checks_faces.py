"""What the faces (our DDP, the Horovod API) must do, checked on every rank.

Shared by the gloo tests (spawned ranks, tests/test_faces.py) and the mpi test (this
file run under mpirun). Each check returns something picklable that the caller compares
across ranks, or raises.
"""
import contextlib
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import collectives
import collectives.horovod as hvd
from collectives.horovod.engine import engine as horovod_engine


def _close(actual, expected, what, **tolerance):
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tolerance)


# --- Horovod's collectives ----------------------------------------------------------------
def check_horovod_collectives(comm):
    """Every collective of the Horovod face, with Horovod's semantics, on this world:
    each check below in turn, in the same order on every rank (unnamed calls pair by
    their number)."""
    hvd.init()
    hvd.init()  # a second init is harmless, as in Horovod
    rank, size = hvd.rank(), hvd.size()
    assert (rank, size) == (comm.rank, comm.world_size)
    for check in (_check_allreduce, _check_async, _check_grouped_allreduce,
                  _check_allgather, _check_broadcast, _check_alltoall,
                  _check_reducescatter, _check_objects, _check_mismatches):
        check(rank, size)
    assert hvd.local_size() >= 1 and hvd.cross_size() >= 1 and hvd.nccl_built() == 0
    mine, _ = _rank_tensors(rank, size)
    return float(hvd.allreduce(mine, op=hvd.Sum).sum())


def _rank_tensors(rank, size):
    """This rank's 3x4 float64 tensor (1..12 times rank + 1), and every rank's."""
    base = torch.arange(1, 13, dtype=torch.float64).view(3, 4)
    return base * (rank + 1), [base * (r + 1) for r in range(size)]


def _check_allreduce(rank, size):
    """Every op, average by default, a new tensor; integers scaled in float64 and
    averaged without wrapping; allreduce_ in place."""
    mine, everyone = _rank_tensors(rank, size)
    _close(hvd.allreduce(mine, average=False), sum(everyone), "sum")
    _close(hvd.allreduce(mine), sum(everyone) / size, "average")
    _close(hvd.allreduce(mine, op=hvd.Max), everyone[-1], "max")
    _close(hvd.allreduce(mine, op=hvd.Min), everyone[0], "min")
    product = everyone[0].clone()
    for other in everyone[1:]:
        product = product * other
    _close(hvd.allreduce(mine, op=hvd.Product), product, "product")
    scaled = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    _close(scaled, sum(everyone) * 1.5, "pre/postscale")
    integers = torch.full((5,), 7 * (rank + 1), dtype=torch.int32)
    _close(hvd.allreduce(integers, op=hvd.Sum, prescale_factor=0.5),
           torch.full((5,), sum(int(7 * (r + 1) * 0.5) for r in range(size)),
                      dtype=torch.int32), "integer prescale in float64, truncated")
    near_top = torch.full((3,), 30000, dtype=torch.int16)  # sums past int16's 32767
    _close(hvd.allreduce(near_top, op=hvd.Average), near_top, "int16 average near its top")
    in_place = mine.clone()
    assert hvd.allreduce_(in_place, op=hvd.Sum) is in_place
    _close(in_place, sum(everyone), "allreduce_")


def _check_async(rank, size):
    """A handle that is not done at once, poll, synchronize in any order; a name is
    taken until its handle is synchronized."""
    mine, everyone = _rank_tensors(rank, size)
    handles = [hvd.allreduce_async(mine * k, op=hvd.Sum, name=f"t{k}") for k in range(4)]
    assert not all(hvd.poll(h) for h in handles), "every op was done at once: not async"
    for k in reversed(range(4)):
        _close(hvd.synchronize(handles[k]), sum(everyone) * k, f"async {k}")
    first = hvd.allreduce_async(mine, name="dup")
    try:
        hvd.allreduce_async(mine, name="dup")
        raise AssertionError("a second op under an in-flight name was accepted")
    except ValueError:
        pass
    hvd.synchronize(first)
    hvd.synchronize(hvd.allreduce_async(mine, name="dup"))  # free again after synchronize


def _check_grouped_allreduce(rank, size):
    """Grouped, and differentiable."""
    mine, everyone = _rank_tensors(rank, size)
    group = [mine.clone().requires_grad_(), (mine[0] * 2).clone().requires_grad_()]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum)
    _close(outs[1], sum(e[0] * 2 for e in everyone), "grouped")
    (outs[0].sum() + outs[1].sum()).backward()
    _close(group[0].grad, torch.full_like(mine, size), "grouped grad")


def _check_allgather(rank, size):
    """First dimensions may differ; the gradient is this rank's rows of the gradient
    averaged over ranks (current Horovod's)."""
    rows = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    gathered = hvd.allgather(rows)
    assert gathered.shape == (sum(r + 1 for r in range(size)), 2)
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
    _close(gathered, expected.to(gathered.dtype), "allgather")
    gathered.sum().backward()
    _close(rows.grad, torch.ones(rank + 1, 2), "allgather grad")


def _check_broadcast(rank, size):
    """Every dtype (int16 too), every root; the gradient, averaged over ranks, lands on
    the root."""
    for dtype in (torch.int16, torch.int8, torch.uint8, torch.float16, torch.int64):
        for root in range(size):
            value = torch.full((6,), rank + 1).to(dtype)
            out = hvd.broadcast(value, root)
            assert torch.equal(out, torch.full((6,), root + 1).to(dtype)), (dtype, root)
            assert torch.equal(value, torch.full((6,), rank + 1).to(dtype)), "input changed"
    leaf = torch.ones(4, requires_grad=True)
    hvd.broadcast(leaf * (rank + 1), root_rank=size - 1).sum().backward()
    _close(leaf.grad, torch.full((4,), float(rank + 1 if rank == size - 1 else 0)),
           "broadcast grad")


def _check_alltoall(rank, size):
    """Uneven splits, and the gradient (the alltoall back); equal parts without splits;
    the async form returns the received splits always; splits that leave rows out, and
    splits of the wrong dtype or past the rows."""
    splits = torch.tensor([peer + 1 for peer in range(size)], dtype=torch.int32)
    sent = torch.cat([torch.full((peer + 1, 2), float(100 * rank + peer))
                      for peer in range(size)]).requires_grad_()
    received, counts = hvd.alltoall(sent, splits)  # with splits: (rows, received splits)
    expected = torch.cat([torch.full((rank + 1, 2), float(100 * peer + rank))
                          for peer in range(size)])
    _close(received, expected, "alltoall")
    assert counts.dtype == torch.int32 and counts.tolist() == [rank + 1] * size, counts
    (received * 2).sum().backward()
    _close(sent.grad, torch.full_like(sent, 2.0), "alltoall grad")
    equal = torch.arange(float(2 * size)).view(size, 2) + 10 * rank
    alone = hvd.alltoall(equal)  # without splits: the tensor alone
    _close(alone, torch.stack([torch.arange(2.0) + 2 * rank + 10 * peer
                               for peer in range(size)]), "alltoall equal parts")
    out, counts = hvd.synchronize(hvd.alltoall_async(equal))  # async: both, always
    _close(out, alone, "alltoall_async")
    assert counts.tolist() == [1] * size, counts
    # splits summing to less than the first dimension: the rows past them stay here,
    # and get a zero gradient
    longer = torch.ones(size + 2, requires_grad=True)
    out, counts = hvd.alltoall(longer, [1] * size)  # a list is taken as int32
    assert out.shape == (size,) and counts.tolist() == [1] * size, (out, counts)
    out.sum().backward()
    _close(longer.grad, torch.tensor([1.0] * size + [0.0, 0.0]), "alltoall short splits grad")
    for bad in (torch.tensor([1] * size, dtype=torch.int64),
                torch.tensor([100] * size, dtype=torch.int32)):
        try:
            hvd.alltoall(sent.detach(), bad)
            raise AssertionError(f"alltoall accepted splits {bad}")
        except ValueError:
            pass


def _check_reducescatter(rank, size):
    """An uneven first dimension, the first ranks get one row more; integer averages
    round toward zero, as Horovod's, in allreduce and reducescatter alike (rank 0 holds
    -3, the others 0); int64 stays exact beyond float64's 2^53."""
    full = torch.arange(float((size + 1) * 3)).view(size + 1, 3) * (rank + 1)
    part = hvd.reducescatter(full, op=hvd.Sum)
    total = sum(torch.arange(float((size + 1) * 3)).view(size + 1, 3) * (r + 1)
                for r in range(size))
    start = 0 if rank == 0 else rank + 1
    _close(part, total[start:start + (2 if rank == 0 else 1)], "reducescatter")
    signed = torch.full((size, 2), -3 if rank == 0 else 0, dtype=torch.int32)
    expected = torch.full((2,), int(-3 / size), dtype=torch.int32)
    assert torch.equal(hvd.allreduce(signed)[0], expected), "integer allreduce average"
    assert torch.equal(hvd.reducescatter(signed)[0], expected), "integer reducescatter average"
    huge = torch.full((3,), 2 ** 53 + 1, dtype=torch.int64)
    assert torch.equal(hvd.allreduce(huge), huge), hvd.allreduce(huge)


def _check_objects(rank, size):
    """Any picklable object, broadcast from rank 0 and gathered from every rank."""
    assert hvd.broadcast_object({"from": rank} if rank == 0 else None) == {"from": 0}
    assert hvd.allgather_object(("rank", rank)) == [("rank", r) for r in range(size)]
    hvd.barrier()


def _check_mismatches(rank, size):
    """A mismatch is an error on every rank, and the job goes on; Adasum is refused."""
    for wrong in (torch.ones(3 + rank), torch.ones(3, dtype=torch.float32 if rank else
                                                        torch.float64)):
        try:
            hvd.allreduce(wrong)
            raise AssertionError("mismatched allreduce did not raise")
        except RuntimeError as error:
            assert "disagree" in str(error), error
    mine, everyone = _rank_tensors(rank, size)
    try:
        hvd.allreduce(mine, op=hvd.Adasum)
        raise AssertionError("Adasum did not raise")
    except NotImplementedError:
        pass
    _close(hvd.allreduce(mine, op=hvd.Sum), sum(everyone), "after the errors")


def check_horovod_join(comm):
    """Uneven work: rank r runs 2 + r allreduces, then joins; the joined ranks add zeros,
    averages divide by the whole world (Horovod's rule), join() names the last rank."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = []
    for step in range(2 + rank):
        # named: the ranks make different numbers of these calls, which would put
        # the numbers of unnamed ones (allreduce.noname.<n>) out of step
        results.append(hvd.allreduce(torch.tensor([float(step + 1)] * 3), op=hvd.Sum,
                                     name=f"step {step}"))
    last = hvd.join()
    assert last == size - 1, f"join() returned {last}"
    for step, got in enumerate(results):
        active = sum(1 for r in range(size) if step < 2 + r)
        _close(got, torch.tensor([float(active * (step + 1))] * 3), f"step {step}")
    # broadcast while a rank is joined: an error on the callers, not a hang. Each rank
    # is the joined one once, and the broadcast is named: the joined rank makes one
    # call fewer, which would put the numbers of unnamed calls out of step.
    for joiner in range(size):
        if rank == joiner:
            hvd.join()
            continue
        try:
            hvd.broadcast(torch.ones(2), root_rank=(joiner + 1) % size, name="while joined")
            raise AssertionError("broadcast with a joined rank did not raise")
        except RuntimeError as error:
            assert "join" in str(error), error
        hvd.join()
    return last


def check_horovod_negotiation(comm):
    """Negotiation by name, as Horovod's coordinator: ranks may submit named collectives
    in different orders; the same name with different arguments is an error on every
    rank, and the next collective runs; a name only some ranks submit is reported by
    rank 0's stall inspector (which ranks miss which name), then fails on the ranks that
    submitted it; a sparse allreduce equals the dense one."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # different orders: rank 0 submits t0..t3, rank 1 t3..t0, rank 2 t0..t3, ...
    names = [f"t{k}" for k in range(4)]
    handles = {name: hvd.allreduce_async(torch.full((3,), float(10 * rank + k)), op=hvd.Sum,
                                         name=name)
               for k, name in (enumerate(names) if rank % 2 == 0
                               else reversed(list(enumerate(names))))}
    for k, name in enumerate(names):
        _close(hvd.synchronize(handles[name]),
               torch.full((3,), float(sum(10 * r + k for r in range(size)))), name)
    gather = hvd.allgather_async(torch.full((rank + 1,), float(rank)), name="rows")
    root = hvd.broadcast_async(torch.full((2,), float(rank)), root_rank=size - 1, name="root")
    if rank % 2:  # and synchronized in either order
        gather, root = hvd.synchronize(gather), hvd.synchronize(root)
    else:
        root, gather = hvd.synchronize(root), hvd.synchronize(gather)
    _close(root, torch.full((2,), float(size - 1)), "broadcast among others")
    assert gather.shape == (size * (size + 1) // 2,), gather.shape

    # the same name with different arguments: every rank raises, naming two ranks' calls
    try:
        hvd.allreduce(torch.ones(3 + rank), name="mismatch")
        raise AssertionError("an allreduce of different shapes under one name ran")
    except hvd.HorovodInternalError as error:
        assert "disagree on shape" in str(error) and "rank 1 submitted" in str(error), error
    _close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)),
           "the next collective after the error")

    # a name only the last rank submits: a stall warning on rank 0, then an error
    each = horovod_engine()
    with _stall_limits_shortened(each, rank):
        if rank == size - 1:
            started = time.monotonic()
            try:
                hvd.allreduce(torch.ones(1), name="lonely")
                raise AssertionError("an allreduce only one rank submitted ran")
            except hvd.HorovodInternalError as error:
                assert "stalled" in str(error) and "allreduce.lonely" in str(error), error
            waited = time.monotonic() - started
            assert 1.4 < waited < 20, f"the stall error came after {waited:.1f} s"
        else:  # wait here (not in a collective, which would stall too) until it expired
            _wait_until_come_and_gone(lambda: "allreduce.lonely" in each.table.entries)
        if rank == 0:
            report = each.inspector.reports[-1]
            missing = [f"rank {r}: [allreduce.lonely]" for r in range(size - 1)]
            assert all(line in report for line in missing), report

    # sparse allreduce: an allgather of indices and values, equal to the dense allreduce
    generator = torch.Generator().manual_seed(rank)
    dense = torch.rand(12, 5, generator=generator)
    dense[dense < 0.7] = 0
    averaged = hvd.allreduce(dense, name="dense")
    sparse = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Average)()
    assert sparse.is_sparse
    _close(sparse.to_dense(), averaged, "sparse allreduce", rtol=1e-6, atol=1e-7)
    return float(averaged.sum())


# --- Horovod's optimizer -------------------------------------------------------------------
class TwoHeads(nn.Module):
    """A trunk and two heads: each rank trains through the head of its own choosing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 8)
        self.head_a = nn.Linear(8, 2)
        self.head_b = nn.Linear(8, 2)

    def forward(self, x, head):
        h = torch.relu(self.trunk(x))
        return self.head_a(h) if head == "a" else self.head_b(h)


def _head(rank, step):
    return "a" if (rank + step) % 2 == 0 else "b"


def _batch(rank, step):
    generator = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)


def _local_grads(model, rank, step):
    model.zero_grad()
    x, y = _batch(rank, step)
    F.mse_loss(model(x, _head(rank, step)), y).backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def check_horovod_uneven_parameters(comm, steps=3):
    """Ranks use different parameters in a step (the used-map deadlock of old): no
    hang, and every gradient is the world's average with zeros from the ranks that did
    not use it, as Horovod does."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = TwoHeads()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    reference = TwoHeads()
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(model(x, _head(rank, step)), y).backward()
        optimizer.step()
        per_rank = [_local_grads(reference, r, step) for r in range(size)]
        with torch.no_grad():
            for name, param in reference.named_parameters():
                param -= 0.1 * sum(g[name] for g in per_rank) / size
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        _close(ours, theirs, f"{name} on rank {rank}", rtol=1e-5, atol=1e-6)
    return float(sum(p.sum() for p in model.parameters()))


# Each step is two backward passes (backward_passes_per_step=2); a pass names the ranks
# whose loss goes through head_b in it. The trunk and head_a take part in every pass.
PASSES_PER_STEP = 2
HEAD_B_USERS = [
    [{0, 1}, {1}],   # head_b's hook fires once on rank 0, twice on rank 1
    [{0, 1}, {0, 1}],  # twice everywhere: nothing of the step before may count
    [set(), {1}],    # rank 1 once, rank 0 never (its .grad is None: zeros)
]


def _accumulation_loss(model, rank, step, number, users):
    generator = torch.Generator().manual_seed(100 * step + 10 * number + rank)
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    h = torch.relu(model.trunk(x))
    out = model.head_a(h) + (model.head_b(h) if rank in users else 0)
    return out.pow(2).mean()


def check_horovod_backward_passes_per_step(comm):
    """backward_passes_per_step=2 with a parameter whose hook fires fewer than 2 times on
    some rank: as in Horovod, each rank's gradient accumulates over the step's passes and
    what it accumulated is averaged at step() (not zeros), and the count starts afresh
    every step. Compared, step by step, with that recipe replayed in one process."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, reference = TwoHeads().double(), TwoHeads().double()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=PASSES_PER_STEP)
    for step, passes in enumerate(HEAD_B_USERS):
        optimizer.zero_grad()
        for number, users in enumerate(passes):
            _accumulation_loss(model, rank, step, number, users).backward()
        if step % 2 == 0:  # both ways a step ends: step() alone, synchronize() then step()
            optimizer.step()
        else:
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        reference.zero_grad()  # every rank's passes accumulate into one sum over the world
        for r in range(size):
            for number, users in enumerate(passes):
                _accumulation_loss(reference, r, step, number, users).backward()
        with torch.no_grad():
            for param in reference.parameters():
                if param.grad is not None:
                    param -= 0.1 * param.grad / size
        for (name, ours), (_, theirs) in zip(model.named_parameters(),
                                             reference.named_parameters()):
            _close(ours, theirs, f"{name} on rank {rank} after step {step} (head_b used by "
                   f"{passes})", rtol=1e-9, atol=1e-12)
    return float(sum(p.detach().sum() for p in model.parameters()))


def check_horovod_too_many_backward_passes(comm):
    """A third backward pass with backward_passes_per_step=2, before step(): an error on
    every rank, as in Horovod, not a pass silently left out of the average; returns it.
    synchronize() then ends the step (its buckets were reduced after the second pass)."""
    hvd.init()
    model = TwoHeads().double()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=PASSES_PER_STEP)
    try:
        for number in range(PASSES_PER_STEP + 1):
            _accumulation_loss(model, comm.rank, 0, number, {0, 1}).backward()
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    optimizer.synchronize()
    return message


def check_horovod_wrapping_again_replaces_the_first(comm):
    """DistributedOptimizer over the same optimizer again, after hvd.shutdown() and
    hvd.init(): the first wrapping's hooks are gone (one per parameter), the step
    averages once, and an LR scheduler made after the wrapping works."""
    hvd.init()
    model = nn.Linear(4, 2).double()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    x = torch.full((3, 4), float(comm.rank + 1), dtype=torch.float64)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    hvd.shutdown()
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    assert optimizer is sgd
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    assert hooks == [1, 1], f"hooks per parameter: {hooks}"
    before = [p.detach().clone() for p in model.parameters()]
    model(x).sum().backward()
    optimizer.step()
    scheduler.step()
    # d(sum)/dW = the batch's column sums, 3 (rank + 1), averaged: 4.5; d(sum)/db = 3
    mean_x = 3 * sum(r + 1 for r in range(comm.world_size)) / comm.world_size
    assert torch.equal(model.weight.detach(), before[0] - 0.5 * mean_x)
    assert torch.equal(model.bias.detach(), before[1] - 0.5 * 3.0)
    assert optimizer.param_groups[0]["lr"] == 0.25
    hvd.shutdown()
    return "ok"


def check_horovod_join_training(comm):
    """Uneven inputs with DistributedOptimizer: rank r trains 2 + r steps, then joins.
    While it waits in join() its zeros stand in for its gradients, so each step's
    gradient is the active ranks' sum over the whole world (Horovod's rule), and each
    rank ends where that recipe, replayed in one process, is after its own steps."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = SmallNet()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for x, y in _uneven_batches(rank, size)[:2 + rank]:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    assert hvd.join() == size - 1
    reference, states = SmallNet(), []
    for step in range(2 + size - 1):
        grads = []
        for r in range(size):
            if step < 2 + r:
                reference.zero_grad()
                x, y = _batch(r, step)
                F.mse_loss(reference(x), y).backward()
                grads.append([p.grad.clone() for p in reference.parameters()])
        with torch.no_grad():
            for i, param in enumerate(reference.parameters()):
                param -= 0.1 * sum(g[i] for g in grads) / size
        states.append([p.detach().clone() for p in reference.parameters()])
    for ours, expected in zip(model.parameters(), states[2 + rank - 1]):
        _close(ours.detach(), expected, f"rank {rank} after its {2 + rank} steps",
               rtol=1e-5, atol=1e-6)
    return size - 1


def check_horovod_optimizer_rules(comm):
    """DistributedOptimizer's rules: unique names, step() after synchronize() warns,
    broadcast_optimizer_state fills a fresh optimizer's state."""
    hvd.init()
    net = nn.Linear(3, 1)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(list(net.parameters()) * 1, lr=0.1),
                                 named_parameters=[("w", net.weight), ("w", net.bias)])
        raise AssertionError("duplicate names were accepted")
    except ValueError:
        pass
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1,
                                                         momentum=0.9),
                                         named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert len(optimizer.state_dict()["state"]) == 2, "fresh optimizer state not made"
    net(torch.ones(2, 3) * (comm.rank + 1)).sum().backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught
    return float(net.weight.sum())


def check_horovod_process_sets(comm):
    """Process sets (3 ranks or more): evens [0, 2, ..] given to init(), odds added
    after, and two sets that share rank 1; every collective and its gradient inside a
    set, names scoped per set, unnamed calls numbered per set, DistributedOptimizer
    and broadcast_object over a set, clear errors for a rank outside a set, a
    duplicate set, a removed set, and a name one rank of a set submits alone."""
    size = comm.world_size
    assert size >= 3, "needs a set of two ranks and one of one"
    evens, odds = _made_process_sets(size)
    rank = hvd.rank()
    mine = evens if rank % 2 == 0 else odds
    summed = _check_collectives_in_set(mine, rank)
    _check_unnamed_per_set(mine, rank, size)
    left, right = _check_overlapping_sets(rank)
    _check_optimizer_over_set(evens, rank)
    _check_name_alone_in_set(evens, rank)
    _check_removing_sets([left, right, odds], size)
    return float(hvd.allreduce(summed, op=hvd.Sum).sum())


def _made_process_sets(size):
    """evens given to init() (twice: harmless, the set keeps its id), odds added after;
    what a set says of itself, and the errors of a rank outside a set, a duplicate set,
    a rank beyond the world, a root outside the set. Returns (evens, odds)."""
    evens = hvd.ProcessSet(range(0, size, 2))
    hvd.init(process_sets=[evens])
    hvd.init(process_sets=[evens])  # again: harmless, the set keeps its id
    rank = hvd.rank()
    odds = hvd.add_process_set(list(range(1, size, 2)))
    assert (evens.process_set_id, odds.process_set_id) == (1, 2), (evens, odds)
    mine, other = (evens, odds) if rank % 2 == 0 else (odds, evens)
    assert mine.included() and not other.included() and mine.size() == len(mine.ranks)
    assert mine.rank() == mine.ranks.index(rank) and hvd.global_process_set.rank() == rank
    assert hvd.global_process_set.size() == size and hvd.global_process_set.included()
    for wrong in (lambda: other.rank(), lambda: hvd.allreduce(torch.ones(1), process_set=other),
                  lambda: hvd.add_process_set(list(range(0, size, 2))),  # a duplicate
                  lambda: hvd.add_process_set([0, size]),                # not a rank
                  lambda: hvd.broadcast(torch.ones(1), other.ranks[0], process_set=mine)):
        try:
            wrong()
            raise AssertionError("accepted: a rank outside a set, a duplicate set, a rank "
                                 "beyond the world, or a root outside the set")
        except ValueError:
            pass
    return evens, odds


def _check_collectives_in_set(mine, rank):
    """Every collective and its gradient among this rank's set only; returns the set's
    allreduce."""
    members, me = mine.ranks, mine.rank()
    # allreduce, under a name the other set uses at the same time: names are per set
    summed = hvd.allreduce(torch.full((4,), float(rank + 1)), op=hvd.Sum, name="x",
                           process_set=mine)
    _close(summed, torch.full((4,), float(sum(r + 1 for r in members))), "set allreduce")
    averaged = hvd.grouped_allreduce([torch.full((2,), float(rank)), torch.ones(3)],
                                     process_set=mine)
    _close(averaged[0], torch.full((2,), sum(members) / len(members)), "set grouped")
    # allgather with uneven rows and its gradient, averaged over the set's ranks
    rows = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    gathered = hvd.allgather(rows, process_set=mine)
    _close(gathered, torch.cat([torch.full((r + 1, 2), float(r)) for r in members]),
           "set allgather")
    (gathered * (1 + torch.arange(float(gathered.shape[0]))[:, None])).sum().backward()
    start = sum(r + 1 for r in members[:me])
    _close(rows.grad, (1 + torch.arange(float(start), float(start + rank + 1)))[:, None]
           .expand(rank + 1, 2), "set allgather grad")
    # broadcast from the set's last rank (a global rank), and its gradient on the root
    leaf = torch.ones(3, requires_grad=True)
    out = hvd.broadcast(leaf * (rank + 1), root_rank=members[-1], process_set=mine)
    _close(out, torch.full((3,), float(members[-1] + 1)), "set broadcast")
    out.sum().backward()
    _close(leaf.grad, torch.full((3,), float(rank + 1 if rank == members[-1] else 0)),
           "set broadcast grad")
    # alltoall with splits (one row more to each next member) and received splits
    splits = [peer + 1 for peer in range(len(members))]
    sent = torch.cat([torch.full((n, 2), float(10 * rank + peer))
                      for peer, n in enumerate(splits)]).requires_grad_()
    received, counts = hvd.alltoall(sent, splits, process_set=mine)
    assert counts.tolist() == [me + 1] * len(members), counts
    _close(received, torch.cat([torch.full((me + 1, 2), float(10 * r + me)) for r in members]),
           "set alltoall")
    received.sum().backward()
    _close(sent.grad, torch.ones_like(sent), "set alltoall grad")
    # reducescatter: the set's ranks share the first dimension
    full = torch.arange(float(2 * len(members))).view(len(members), 2) * (rank + 1)
    part = hvd.reducescatter(full, op=hvd.Sum, process_set=mine)
    _close(part, full[me:me + 1] / (rank + 1) * sum(r + 1 for r in members), "set reducescatter")
    parts = hvd.grouped_reducescatter([full, full * 2], op=hvd.Sum, process_set=mine)
    _close(parts[1], part * 2, "set grouped reducescatter")
    hvd.barrier(process_set=mine)
    # sparse allreduce within the set equals the dense one
    dense = torch.zeros(6, 3)
    dense[rank % 6, rank % 3] = float(rank + 1)
    sparse = hvd.sparse_allreduce_async(dense.to_sparse(), "emb", hvd.Sum, process_set=mine)()
    _close(sparse.to_dense(), hvd.allreduce(dense, op=hvd.Sum, process_set=mine),
           "set sparse allreduce")
    obj = hvd.broadcast_object({"from": rank}, root_rank=members[0], process_set=mine)
    assert obj == {"from": members[0]}, obj
    return summed


def _check_unnamed_per_set(mine, rank, size):
    """Unnamed calls are numbered per set: a different number of them in each set, then
    an unnamed global allreduce still matches on every rank."""
    for _ in range(1 + rank % 2):
        hvd.allreduce(torch.ones(1), process_set=mine)
    _close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(size)),
           "unnamed global allreduce after unnamed set ones")


def _check_overlapping_sets(rank):
    """Two sets that share rank 1, submitted in opposite orders on rank 1 and the
    others; returns them."""
    left, right = hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])
    sets = [s for s in (left, right) if s.included()]
    handles = {s.process_set_id: hvd.allreduce_async(torch.full((2,), float(rank)), op=hvd.Sum,
                                                     name="shared", process_set=s)
               for s in (reversed(sets) if rank == 1 else sets)}
    for s in sets:
        _close(hvd.synchronize(handles[s.process_set_id]),
               torch.full((2,), float(sum(s.ranks))), f"overlapping set {s.ranks}")
    return left, right


def _check_optimizer_over_set(evens, rank):
    """DistributedOptimizer over the evens: they end alike; the odds step alone."""
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                         named_parameters=net.named_parameters(),
                                         process_set=evens)
    before = net.weight.detach().clone()
    net(torch.ones(2, 3) * (rank + 1)).sum().backward()
    optimizer.step()
    grads = [2.0 * (r + 1) for r in (evens.ranks if rank % 2 == 0 else [rank])]
    _close(net.weight.detach(), before - 0.1 * sum(grads) / len(grads) * torch.ones(1, 3),
           "optimizer over a set")


def _check_name_alone_in_set(evens, rank):
    """A name one rank of the evens submits alone: a stall error naming the other."""
    each = horovod_engine()
    key = "allreduce.alone in process set 1"
    with _stall_limits_shortened(each, rank):
        if rank == 0:
            try:
                hvd.allreduce(torch.ones(1), name="alone", process_set=evens)
                raise AssertionError("an allreduce one rank of a set submitted ran")
            except hvd.HorovodInternalError as error:
                message = str(error)
                assert "stalled" in message and f"rank(s) {evens.ranks[1:]}" in message, error
        else:
            _wait_until_come_and_gone(lambda: key in each.table.entries)


def _check_removing_sets(added, size):
    """Removing: the objects lose their ids, a second removal does nothing, a removed
    set takes no collective, and its ranks may form a set again."""
    odds = added[-1]
    assert all(hvd.remove_process_set(s) for s in added)
    assert odds.process_set_id is None and odds.size() is None
    assert not hvd.remove_process_set(odds) and not hvd.remove_process_set(hvd.global_process_set)
    try:
        hvd.allreduce(torch.ones(1), process_set=odds)
        raise AssertionError("a collective in a removed set was accepted")
    except ValueError:
        pass
    again = hvd.add_process_set(list(range(1, size, 2)))  # its ranks are free again
    assert again.process_set_id == 5, again
    hvd.remove_process_set(again)


def check_horovod_join_stalls(comm):
    """join() fails, as a stalled collective does, once it has waited the stall timeout
    with no other rank joining and nothing running, naming the ranks that did not
    join; the next join() then works."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    each = horovod_engine()
    with _stall_limits_shortened(each, rank):
        if rank == size - 1:
            started = time.monotonic()
            try:
                hvd.join()
                raise AssertionError("join() returned while the other ranks had not joined")
            except hvd.HorovodInternalError as error:
                assert f"rank(s) {list(range(size - 1))} did not join" in str(error), error
            waited = time.monotonic() - started
            assert 1.4 < waited < 20, f"join's stall error came after {waited:.1f} s"
        else:  # not in a collective (it would stall too): wait until the join has failed
            _wait_until_come_and_gone(lambda: bool(each.table.joined))
        if rank == 0:
            assert "waited in join()" in each.inspector.reports[-1], each.inspector.reports
    return hvd.join()


# --- stalls, provoked on purpose -------------------------------------------------------------
@contextlib.contextmanager
def _stall_limits_shortened(each, rank):
    """Inside, rank 0's stall inspector (the only one that expires names) warns after
    0.3 s and fails after 1.5 s. Shortened after a barrier (a rank late to a barrier
    must not be taken for a stall), restored before the barrier that ends it."""
    hvd.barrier()
    if rank == 0:
        limits = each.inspector.warn_after, each.inspector.fail_after
        each.inspector.warn_after, each.inspector.fail_after = 0.3, 1.5
    try:
        yield
    finally:
        if rank == 0:
            each.inspector.warn_after, each.inspector.fail_after = limits
    hvd.barrier()


def _wait_until_come_and_gone(present, seconds=30.0):
    """Wait, outside any collective (one would stall too), until `present()` has held
    and holds no more: a name that another rank submitted alone entered the table and
    expired. Gives up after `seconds`; the checks that follow then fail."""
    deadline = time.monotonic() + seconds
    while not present() and time.monotonic() < deadline:
        time.sleep(0.02)
    while present() and time.monotonic() < deadline:
        time.sleep(0.02)


def check_horovod_face(comm):
    """Every Horovod check above, one after another in one world."""
    return (check_horovod_collectives(comm), check_horovod_join(comm),
            check_horovod_uneven_parameters(comm), check_horovod_join_training(comm),
            check_horovod_optimizer_rules(comm), check_horovod_negotiation(comm))


# --- our DDP ---------------------------------------------------------------------------------
def _uneven_batches(rank, world_size):
    """Rank r has 3 + r batches (uneven inputs)."""
    return [_batch(rank, step) for step in range(3 + rank)]


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.body(x)


def _train_with_join(model, rank, world_size, **join_options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join(**join_options):
        for x, y in _uneven_batches(rank, world_size):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def check_ddp_join_equals_torch(comm, divide_by_initial_world_size=True):
    """Uneven inputs with join(): our DDP ends where torch's DDP ends."""
    theirs = _train_with_join(torch.nn.parallel.DistributedDataParallel(SmallNet()),
                              comm.rank, comm.world_size,
                              divide_by_initial_world_size=divide_by_initial_world_size)
    ours = _train_with_join(collectives.DistributedDataParallel(SmallNet()),
                            comm.rank, comm.world_size,
                            divide_by_initial_world_size=divide_by_initial_world_size)
    for name in theirs:
        _close(ours[name], theirs[name], f"{name} on rank {comm.rank}", rtol=1e-5, atol=1e-6)
    return float(sum(p.sum() for p in ours.values()))


def ddp_join_digest(comm):
    """Our DDP's join() alone (ring all-reduce): the same on every backend, bit for bit."""
    model = collectives.DistributedDataParallel(SmallNet(), algorithm="ring")
    trained = _train_with_join(model, comm.rank, comm.world_size)
    return float(sum(p.double().sum() for p in trained.values()))


def check_ddp_join_both_ways(comm):
    """join() equals torch's, dividing by the initial world size and by the ranks left."""
    return (check_ddp_join_equals_torch(comm, True), check_ddp_join_equals_torch(comm, False))


def check_ddp_join_throws_early(comm):
    """join(throw_on_early_termination=True): every rank raises once one runs out."""
    model = collectives.DistributedDataParallel(SmallNet())
    _train_with_join(model, comm.rank, comm.world_size, throw_on_early_termination=True)
    return "no error"


def check_ddp_uneven_parameters_without_flag(comm):
    """find_unused_parameters=False and ranks that use different parameters: the rank
    that lacks gradients raises, naming them; no rank hangs."""
    model = collectives.DistributedDataParallel(TwoHeads())
    x, y = _batch(comm.rank, 0)
    head = "a" if comm.rank == 0 else "b"
    F.mse_loss(model(x, head), y).backward()
    return "finished"


def check_ddp_subgroup(comm):
    """process_group=: a DDP over ranks 0 and 1 only, on a torch subgroup."""
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    if comm.rank > 1:
        return None
    model = collectives.DistributedDataParallel(SmallNet(), process_group=group)
    x, y = _batch(comm.rank, 0)
    F.mse_loss(model(x), y).backward()
    reference = SmallNet()
    grads = []
    for r in (0, 1):
        reference.zero_grad()
        xr, yr = _batch(r, 0)
        F.mse_loss(reference(xr), yr).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
    for p, g0, g1 in zip(model.module.parameters(), *grads):
        _close(p.grad, (g0 + g1) / 2, "subgroup average", rtol=1e-5, atol=1e-7)
    return model.comm.world_size


def check_ddp_subgroup_and_arguments(comm):
    return check_ddp_subgroup(comm), check_ddp_torch_arguments(comm)


def check_ddp_torch_arguments(comm):
    """torch DDP's constructor arguments: accepted, refused clearly, or checked."""
    model = collectives.DistributedDataParallel(SmallNet(), None, None, 0, True, True, None,
                                                25, False, False, False, False)
    for bad in (dict(mixed_precision=object()), dict(device_mesh=object())):
        try:
            collectives.DistributedDataParallel(SmallNet(), **bad)
            raise AssertionError(f"{bad} was accepted")
        except NotImplementedError:
            pass
    try:
        collectives.DistributedDataParallel(SmallNet(), device_ids=[0])
        raise AssertionError("device_ids for a CPU module was accepted")
    except ValueError:
        pass
    return model.broadcast_buffers


# --- a rank that ends ---------------------------------------------------------------------
PEER_EXIT_TIMEOUT = 120  # the job's timeout: a peer's exit must be noticed long before


def peer_exit() -> int:
    """The last rank ends its process (its interpreter exits as a script's does) while
    every other rank waits in an allreduce, which must raise HorovodInternalError
    within seconds, not at the timeout. Prints how long it took; the exit status."""
    rank, size = hvd.rank(), hvd.size()
    hvd.barrier()
    if rank == size - 1:
        time.sleep(0.5)  # the others are inside their allreduce by now
        return 0
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(4), name="after the exit")
    except hvd.HorovodInternalError as error:
        sys.stdout.write(f"rank {rank} noticed the exit in {time.monotonic() - started:.2f} s: "
                         f"{error}\n")
        return 0
    sys.stdout.write(f"rank {rank}: the allreduce ran without the rank that ended\n")
    return 1


if __name__ == "__main__":
    if sys.argv[1:] == ["peer-exit"]:  # under any launcher, on any backend
        hvd.init(timeout=PEER_EXIT_TIMEOUT)
        sys.exit(peer_exit())
    # under mpirun, on the mpi backend; then the last rank ends
    comm = collectives.init(backend="mpi", timeout=PEER_EXIT_TIMEOUT)
    results = [*check_horovod_face(comm), check_horovod_process_sets(comm),
               check_horovod_join_stalls(comm), ddp_join_digest(comm)]
    sys.stdout.write(f"rank {comm.rank} results {results!r}\n")
    sys.exit(peer_exit())
