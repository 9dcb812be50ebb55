"""Per-rank checks of `onebit-adam` (run on spawned gloo ranks by test_onebit_adam.py).

1-bit Adam is worked out here a second time, by hand, in plain torch, for every rank
of the world at once: each rank's gradient at each step comes from a generator seeded
by (step, rank), so every rank can rebuild all of them and play every worker and every
server itself. The warm-up's average is torch.distributed's own all_reduce. Against
the rule: what this rank puts in each piece of the all-to-all and in the all-gather
(read back from the bytes as the strategy's docstring lays them out), what it
receives (against torch.distributed's collectives), its worker and server errors, m,
v and the gradient it hands over; and the bytes the transport counted against cost().
"""
import contextlib
import io
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import api, sync
from collectives.sync.onebit_adam import STATE
from checks_lowcomm_sparse import same_on_every_rank
from checks_sync import mlp, shard

B1, B2, EPS, LR = 0.8, 0.9, 1e-8, 0.01
FREEZE = 2


# --- helpers ---------------------------------------------------------------------------

@contextlib.contextmanager
def recorded(name):
    """Every api.<name> call made inside: its positional arguments (a collective's
    output, then its input), copied after the call."""
    calls, original = [], getattr(api, name)

    def copied(value):
        return [t.clone() for t in value] if isinstance(value, list) else value.clone()

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append([copied(value) for value in args])
        return result
    setattr(api, name, recording)
    try:
        yield calls
    finally:
        setattr(api, name, original)


def everyones(tensor):
    """torch.distributed's all-gather: every rank's `tensor`, in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return pieces


def read_piece(piece, chunks):
    """(float32 scale of each parameter, [bits of each parameter's chunk]) from one
    piece's bytes: the scales, then each parameter's L/8 bytes, bit j of a chunk at
    bit j % 8 (lowest first) of its byte j // 8."""
    k = len(chunks)
    scales = piece[:4 * k].clone().view(torch.float32)
    offset, bits = 4 * k, []
    for length in chunks:
        raw = piece[offset:offset + length // 8].tolist()
        offset += length // 8
        bits.append([(raw[j // 8] >> (j % 8)) & 1 for j in range(length)])
    assert offset == piece.numel(), (offset, piece.numel())
    return scales, bits


def gradients(rank, step, shapes, zero_first=False):
    """Rank `rank`'s gradients at `step`, as any rank can rebuild them; zero_first: the
    first parameter's first element 0 (no gradient there, on every rank)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    if zero_first:
        grads[0].view(-1)[0] = 0.0
    return grads


def scale_of(values):
    """||values|| / sqrt(len), rounded to float32 as it travels, back in float64."""
    return float(torch.tensor(math.sqrt(float((values * values).sum()) / values.numel()),
                              dtype=torch.float32))


def sign(values):
    return torch.where(values >= 0, 1.0, -1.0).to(values.dtype)


# --- the rule by hand, for every rank --------------------------------------------------

class ByHand:
    """1-bit Adam for a whole world of n ranks, in plain torch: m and v (the same on
    every rank), and each rank's worker and server errors."""

    def __init__(self, shapes, n):
        self.n = n
        self.numels = [math.prod(shape) for shape in shapes]
        self.chunks = [math.ceil(numel / (8 * n)) * 8 for numel in self.numels]
        self.m = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
        self.worker_errors = [[torch.zeros(n * c, dtype=torch.float64) for c in self.chunks]
                              for _ in range(n)]
        self.server_errors = [[torch.zeros(c, dtype=torch.float64) for c in self.chunks]
                              for _ in range(n)]

    def warmup(self, averages):
        """Adam on the average gradient."""
        for i, g in enumerate(averages):
            self.m[i] = B1 * self.m[i] + (1 - B1) * g
            self.v[i] = B2 * self.v[i] + (1 - B2) * g * g

    def compressed(self, grads_by_rank):
        """One compressed all-reduce. Returns (sent, served): sent[q][p] = (scales,
        bits) that rank q sends rank p; served[r] = (scales, bits) server r's piece."""
        n = self.n
        sent = [[([], []) for _ in range(n)] for _ in range(n)]
        received = [[[] for _ in self.numels] for _ in range(n)]  # [server][param] (s, c)
        for q in range(n):
            for i, (numel, chunk) in enumerate(zip(self.numels, self.chunks)):
                local = B1 * self.m[i] + (1 - B1) * grads_by_rank[q][i]        # m_q
                c = torch.cat([local.reshape(-1), torch.zeros(n * chunk - numel,
                                                              dtype=torch.float64)])
                c = c + self.worker_errors[q][i]                               # + e_w
                s = scale_of(c)
                self.worker_errors[q][i] = c - s * sign(c)                     # e_w
                for p in range(n):
                    part = c[p * chunk:(p + 1) * chunk]
                    sent[q][p][0].append(s)
                    sent[q][p][1].append((part >= 0).long().tolist())
                    received[p][i].append((s, sign(part)))
        served, decoded = [], [[] for _ in self.numels]
        for r in range(n):
            scales, bits = [], []
            for i in range(len(self.numels)):
                average = sum(s * signs for s, signs in received[r][i]) / n    # a
                z = average + self.server_errors[r][i]                         # + e_s
                s = scale_of(z)
                self.server_errors[r][i] = z - s * sign(z)                     # e_s
                scales.append(s)
                bits.append((z >= 0).long().tolist())
                decoded[i].append(s * sign(z))
            served.append((scales, bits))
        for i, numel in enumerate(self.numels):  # every rank: m, masked where v is 0
            m = torch.cat(decoded[i])[:numel].view_as(self.m[i])
            self.m[i] = torch.where(self.v[i] != 0, m, torch.zeros_like(m))
        return sent, served

    def directions(self):
        return [m / (v.sqrt() + EPS) for m, v in zip(self.m, self.v)]


def two_layers():
    """Parameters of 35, 5, 15 and 3 elements: none a multiple of 8 n, so all padded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3)).double()


def steps_by_hand(comm, steps=4):
    """FREEZE warm-up steps, then compressed ones, each against the rule by hand. The
    first parameter's first element has no gradient in the warm-up: its v is 0, so its
    momentum is masked to 0 after it."""
    n, me = comm.world_size, comm.rank
    model = two_layers()
    strategy = sync.create("onebit-adam", beta1=B1, beta2=B2, eps=EPS, freeze_step=FREEZE,
                           algorithm="ring")
    strategy.setup(model, comm)
    params = list(model.parameters())
    shapes = [tuple(p.shape) for p in params]
    hand = ByHand(shapes, n)
    assert strategy.chunks == hand.chunks
    cost = strategy.cost(shapes, n)
    for step in range(1, steps + 1):
        warm = step <= FREEZE
        grads_by_rank = [gradients(q, step, shapes, zero_first=warm) for q in range(n)]
        for p, g in zip(params, grads_by_rank[me]):
            p.grad = g.clone()
        comm.traffic.reset()
        with recorded("all_reduce") as reduces, recorded("all_to_all") as exchanges, \
                recorded("all_gather") as gathers:
            strategy.after_backward(model)
        if warm:
            assert (len(reduces), len(exchanges), len(gathers)) == (1, 0, 0)
            averages = []
            for g in grads_by_rank[me]:  # torch.distributed's own all_reduce
                total = g.clone()
                dist.all_reduce(total)
                averages.append(total / n)
            hand.warmup(averages)
        else:
            assert (len(reduces), len(exchanges), len(gathers)) == (0, 1, 1)
            assert comm.traffic.bytes_sent == cost.bytes, (comm.traffic.bytes_sent, cost)
            sent, served = hand.compressed(grads_by_rank)
            received, pieces = exchanges[0]
            for p, piece in enumerate(pieces):  # what this rank sends each rank
                scales, bits = read_piece(piece, hand.chunks)
                torch.testing.assert_close(scales.double(),
                                           torch.tensor(sent[me][p][0], dtype=torch.float64))
                assert bits == sent[me][p][1], (step, p)
            everyone = everyones(torch.stack(pieces))  # what it receives: rank q's piece me
            for q, piece in enumerate(received):
                assert torch.equal(piece, everyone[q][me]), (step, q)
            gathered, mine = gathers[0]  # the server's piece, and everyone's
            scales, bits = read_piece(mine, hand.chunks)
            torch.testing.assert_close(scales.double(),
                                       torch.tensor(served[me][0], dtype=torch.float64))
            assert bits == served[me][1], step
            assert torch.equal(gathered, torch.cat(everyones(mine)))
            for i, (start, chunk) in enumerate(zip(strategy.starts, strategy.chunks)):
                torch.testing.assert_close(  # the grid's columns of parameter i, row by row
                    strategy.worker_error[:, start:start + chunk].reshape(-1),
                    hand.worker_errors[me][i])
                torch.testing.assert_close(strategy.server_error[start:start + chunk],
                                           hand.server_errors[me][i])
        numels = [p.numel() for p in params]
        for p, m, v, hand_m, hand_v, direction in zip(
                params, strategy.m.split(numels), strategy.v.split(numels), hand.m, hand.v,
                hand.directions()):
            torch.testing.assert_close(m.view_as(p), hand_m)
            torch.testing.assert_close(v.view_as(p), hand_v)
            torch.testing.assert_close(p.grad, direction)
        assert strategy.step == step
        if not warm:  # the masked element: no momentum, no step
            assert strategy.m[0] == 0 and params[0].grad.view(-1)[0] == 0
        assert same_on_every_rank([p.grad for p in params] + [strategy.m, strategy.v])
    return cost.bytes


def warmup_is_torchs_adam(comm, steps=3):
    """With bias_correction, the warm-up stepped by SGD(lr) is torch.optim.Adam on the
    average gradient (torch.distributed's)."""
    n = comm.world_size
    ours, theirs = two_layers(), two_layers()
    strategy = sync.create("onebit-adam", beta1=B1, beta2=B2, eps=EPS, freeze_step=steps,
                           bias_correction=True, algorithm="ring")
    strategy.setup(ours, comm)
    sgd = torch.optim.SGD(ours.parameters(), lr=LR, momentum=0)
    adam = torch.optim.Adam(theirs.parameters(), lr=LR, betas=(B1, B2), eps=EPS)
    shapes = [tuple(p.shape) for p in ours.parameters()]
    for step in range(1, steps + 1):
        grads = gradients(comm.rank, step, shapes)
        for p, q, g in zip(ours.parameters(), theirs.parameters(), grads):
            p.grad = g.clone()
            q.grad = g.clone()
            dist.all_reduce(q.grad)
            q.grad.div_(n)
        strategy.after_backward(ours)
        sgd.step()
        adam.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    return "ok"


class Scaler:
    """GradScaler's get_scale(), from a list: a loss scale that changes between steps."""

    def __init__(self, scales):
        self.scales = iter(scales)

    def get_scale(self):
        return self.scale

    def next(self):
        self.scale = next(self.scales)


def loss_scale_leaves_no_trace(comm):
    """Gradients scaled by a power of 2 (fp16 AMP's loss scale, changing between
    steps): the state is bitwise the unscaled run's, and the gradient handed over is its
    direction times the step's scale."""
    plain, scaled = two_layers(), two_layers()
    runs = [sync.create("onebit-adam", freeze_step=FREEZE, algorithm="ring")
            for _ in range(2)]
    runs[0].setup(plain, comm)
    runs[1].setup(scaled, comm)
    scaler = runs[1].grad_scaler = Scaler([2.0 ** 10, 2.0 ** 16, 2.0 ** 8, 2.0 ** 12])
    shapes = [tuple(p.shape) for p in plain.parameters()]
    for step in range(1, 5):
        scaler.next()
        for p, q, g in zip(plain.parameters(), scaled.parameters(),
                           gradients(comm.rank, step, shapes)):
            p.grad, q.grad = g.clone(), g * scaler.get_scale()
        runs[0].after_backward(plain)
        runs[1].after_backward(scaled)
        for p, q in zip(plain.parameters(), scaled.parameters()):
            assert torch.equal(q.grad, p.grad * scaler.get_scale()), step
        theirs = runs[1].state_dict()
        for key, value in runs[0].state_dict().items():
            assert (value == theirs[key] if key == "step" else
                    torch.equal(value, theirs[key])), (step, key)
    return "ok"


def non_finite_steps_leave_no_trace(comm):
    """A NaN on rank 1 in the warm-up, then an inf and a NaN on rank 1 after it: every
    rank hands over non-finite gradients (for the loop to skip) and keeps m, v, both
    errors and its step count; the finite steps between and after are taken."""
    model = two_layers()
    strategy = sync.create("onebit-adam", freeze_step=FREEZE, algorithm="ring")
    strategy.setup(model, comm)
    params = list(model.parameters())
    shapes = [tuple(p.shape) for p in params]
    poisons = {1: float("nan"), 4: float("inf"), 5: float("nan")}
    for step in range(1, 8):
        for p, g in zip(params, gradients(comm.rank, step, shapes)):
            p.grad = g
        if step in poisons and comm.rank == 1:
            params[2].grad[1, 3] = poisons[step]
        before = strategy.state_dict()
        strategy.after_backward(model)
        poisoned = step in poisons
        assert sync.finite([p.grad for p in params]) == (not poisoned), step
        after = strategy.state_dict()
        assert (after["step"] == before["step"]) == poisoned, step
        if poisoned:
            for key in STATE:
                assert torch.equal(after[key], before[key]), (step, key)
        assert sync.finite([after[key] for key in STATE])
    assert strategy.step == 4 and strategy.compressing
    return "ok"


# --- in a plain torch loop, and resumed ------------------------------------------------

def train(comm, steps, model=None, strategy=None, optimizer=None, first=1):
    """Steps `first` .. `first + steps - 1` of the checks' MLP in a plain torch loop
    (our DistributedDataParallel calls the strategy), paired with SGD as documented."""
    if model is None:
        strategy = sync.create("onebit-adam", freeze_step=FREEZE, algorithm="ring")
        model = collectives.DistributedDataParallel(mlp(), sync=strategy, comm=comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0)
    for step in range(first, first + steps):
        x, y = shard(comm, step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, strategy, optimizer


def plain_loop_bytes(comm, steps=3):
    """The bytes a plain torch loop sends in `steps` steps after the warm-up, against
    cost(); and the replicas equal."""
    model, strategy, optimizer = train(comm, FREEZE)
    comm.traffic.reset()
    train(comm, steps, model, strategy, optimizer, first=FREEZE + 1)
    sent = comm.traffic.bytes_sent
    model.close()
    numels = [p.numel() for p in model.module.parameters()]
    assert sent == steps * strategy.cost(numels, comm.world_size).bytes, sent
    assert same_on_every_rank(list(model.module.parameters())), "the replicas differ"
    return sent


def resumes_bit_for_bit(comm, first, then):
    """`first` steps, a checkpoint (through torch.save, as the trainer's), `then` more;
    and a fresh model, optimizer and strategy loaded from it, `then` more: both end
    bitwise alike, the strategy's state included."""
    model, strategy, optimizer = train(comm, first)
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "strategy": strategy.state_dict()}, buffer)
    train(comm, then, model, strategy, optimizer, first=first + 1)
    expected = {key: t.clone() for key, t in model.module.state_dict().items()}
    expected_state = strategy.state_dict()
    model.close()

    buffer.seek(0)
    saved = torch.load(buffer)
    strategy = sync.create("onebit-adam", freeze_step=FREEZE, algorithm="ring")
    resumed = collectives.DistributedDataParallel(mlp(), sync=strategy, comm=comm)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=LR, momentum=0)
    resumed.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    strategy.load_state_dict(saved["strategy"])
    resumed.optimizer_steps = first
    train(comm, then, resumed, strategy, optimizer, first=first + 1)
    resumed.close()
    for key, tensor in resumed.module.state_dict().items():
        assert torch.equal(tensor, expected[key]), f"{key} differs after resuming"
    state = strategy.state_dict()
    assert state["step"] == expected_state["step"] == first + then
    for key in STATE:
        assert torch.equal(state[key], expected_state[key]), f"its {key} differs after resuming"
    return "ok"


def every_check(comm):
    """All of the above on this rank; the bytes counted, for the test to compare."""
    return {
        "by hand": steps_by_hand(comm),
        "torch's adam": warmup_is_torchs_adam(comm),
        "loss scale": loss_scale_leaves_no_trace(comm),
        "non-finite": non_finite_steps_leave_no_trace(comm),
        "loop": plain_loop_bytes(comm),
        "resume in the warm-up": resumes_bit_for_bit(comm, 1, 3),
        "resume after it": resumes_bit_for_bit(comm, 3, 2),
    }
