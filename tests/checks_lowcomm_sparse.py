"""Per-rank checks of `sparseloco` and `demo` (run on spawned gloo ranks by
test_lowcomm_sparse.py).

Each method's synchronization is worked out here a second time, by hand, in plain
torch: the papers' rules written out step by step, with torch.distributed's own
collectives (not this project's) where the ranks meet. Against it: what each rank
puts on the wire (read back from the bytes as the strategies' docstrings lay them
out), what every rank ends with, and the bytes the transport counted against cost().
"""
import contextlib
import io
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import api, sync
from checks_sync import mlp, shard


# --- helpers ---------------------------------------------------------------------------

@contextlib.contextmanager
def recorded_gathers():
    """Every api.all_gather made inside: [(what this rank sent, what it gathered)]."""
    calls, original = [], api.all_gather

    def recording(output, input, *args, **kwargs):
        result = original(output, input, *args, **kwargs)
        calls.append((input.clone(), output.clone()))
        return result
    api.all_gather = recording
    try:
        yield calls
    finally:
        api.all_gather = original


def check_the_gather(sent, gathered):
    """Our all-gather's result is torch.distributed's, byte for byte."""
    pieces = [torch.empty_like(sent) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, sent)
    assert torch.equal(gathered, torch.cat(pieces)), "the all-gather differs from torch's"


def same_on_every_rank(tensors):
    """Every rank holds bitwise the same tensors."""
    mine = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(mine, other) for other in everyone)


def summed_over_ranks(tensor):
    """torch.distributed's sum over the ranks (the reference for our averages)."""
    total = tensor.clone()
    dist.all_reduce(total)
    return total


def floats(payload, start, count):
    return payload[start:start + 4 * count].clone().view(torch.float32)


def int16s(payload, start, count):
    return payload[start:start + 2 * count].clone().view(torch.int16).long()


# --- sparseloco by hand ----------------------------------------------------------------

def kept_by_hand(chunk_values, k):
    """Positions (ascending) of the k entries of largest magnitude: by sorting."""
    order = sorted(range(len(chunk_values)), key=lambda i: -abs(float(chunk_values[i])))
    return sorted(order[:k])


def quantized_by_hand(values, bits):
    """The authors' quantizer, written out: centre on the mean, bins of width 6 std /
    2^bits around the middle bin, each bin decoded as the mean of its members.
    Returns (codes, shift, codebook, decoded)."""
    bins = 2 ** bits
    shift = values.mean()
    centred = values - shift
    std = (centred.pow(2).sum() / (len(values) - 1)).sqrt() if len(values) > 1 else 0.0
    width = 6 * std / bins if std > 0 else 1.0  # one value, or all alike: any width
    codes = [min(max(int(torch.round(c / width + bins // 2)), 0), bins - 1) for c in centred]
    codebook = torch.zeros(bins)
    for b in range(bins):
        members = [float(c) for c, code in zip(centred, codes) if code == b]
        if members:
            codebook[b] = sum(members) / len(members)
    decoded = torch.stack([codebook[code] + shift for code in codes])
    return codes, shift, codebook, decoded


def sparseloco_sent_by_hand(error, chunk, density, bits):
    """What one parameter's error buffer sends: [(chunk, position, decoded value)], the
    codes and scales (bits < 32), and the dense tensor the ranks decode."""
    flat = error.reshape(-1)
    length = min(chunk, flat.numel())
    k = max(1, round(density * length))
    chunks = math.ceil(flat.numel() / length)
    padded = torch.cat([flat, flat.new_zeros(chunks * length - flat.numel())])
    positions = [kept_by_hand(padded[c * length:(c + 1) * length], k) for c in range(chunks)]
    values = torch.stack([padded[c * length + i] for c in range(chunks)
                          for i in positions[c]]).float()
    codes = scales = None
    if bits < 32:
        codes, shift, codebook, values = quantized_by_hand(values, bits)
        scales = torch.cat([shift.view(1), codebook])
    dense = torch.zeros(chunks * length, dtype=error.dtype)
    for n, (c, i) in enumerate((c, i) for c in range(chunks) for i in positions[c]):
        dense[c * length + i] = values[n]
    return positions, values, codes, scales, dense[:flat.numel()].view_as(error)


def read_sparseloco_payload(payload, numels, chunk, density, bits):
    """Per parameter (positions per chunk, decoded values, codes, scales), read from the
    bytes as sparseloco's docstring lays them out: float32s (each parameter's shift
    and codebook, or its values), then int16 positions, then codes packed 8/bits a
    byte, low bits first."""
    shapes = []
    for numel in numels:
        length = min(chunk, numel)
        shapes.append((math.ceil(numel / length), max(1, round(density * length))))
    offset, scale_sets, value_sets = 0, [], []
    for chunks, k in shapes:
        count = (1 + 2 ** bits) if bits < 32 else chunks * k
        (scale_sets if bits < 32 else value_sets).append(floats(payload, offset, count))
        offset += 4 * count
    position_sets = []
    for chunks, k in shapes:
        position_sets.append(int16s(payload, offset, chunks * k).view(chunks, k).tolist())
        offset += 2 * chunks * k
    code_sets = []
    if bits < 32:
        for (chunks, k), scales in zip(shapes, scale_sets):
            size = math.ceil(chunks * k * bits / 8)
            packed = payload[offset:offset + size].tolist()
            offset += size
            per_byte = 8 // bits
            codes = [(packed[j // per_byte] >> (bits * (j % per_byte))) & (2 ** bits - 1)
                     for j in range(chunks * k)]
            code_sets.append(codes)
            value_sets.append(torch.stack([scales[1 + c] + scales[0] for c in codes]))
    assert offset == payload.numel(), (offset, payload.numel())
    return [(positions, values, code_sets[i] if code_sets else None,
             scale_sets[i] if scale_sets else None)
            for i, (positions, values) in enumerate(zip(position_sets, value_sets))]


def sparseloco_syncs_by_hand(comm, bits, syncs=2):
    """Two synchronizations (period 1) of a Linear(10, 3): the weight's 30 entries in 4
    chunks of 8 (the last padded), 2 kept of each; the bias one chunk of 3, 1 kept.
    Each rank's replica moves by its own random delta before each; checked against
    the rule by hand: what it sends, what it decodes, its error buffer, its weights."""
    n = comm.world_size
    options = dict(period=1, chunk=8, density=0.25, bits=bits, error_decay=0.5,
                   outer_lr=0.7)
    torch.manual_seed(0)
    model = nn.Linear(10, 3)
    strategy = sync.create("sparseloco", algorithm="ring", **options)
    strategy.setup(model, comm)
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    synced = [p.detach().clone() for p in params]
    errors = [torch.zeros_like(p) for p in params]
    cost = strategy.cost(numels, n)
    for step in range(1, syncs + 1):
        generator = torch.Generator().manual_seed(100 * step + comm.rank)
        deltas = [torch.randn(p.shape, generator=generator) for p in params]
        with torch.no_grad():
            for p, s, d in zip(params, synced, deltas):
                p.copy_(s - d)
        comm.traffic.reset()
        with recorded_gathers() as gathers:
            strategy.after_step(model, step)
        assert comm.traffic.bytes_sent == cost.bytes * options["period"], (
            comm.traffic.bytes_sent, cost)
        assert len(gathers) == cost.collectives * options["period"] == 1
        sent_bytes, gathered = gathers[0]
        check_the_gather(sent_bytes, gathered)
        on_the_wire = read_sparseloco_payload(sent_bytes, numels, 8, 0.25, bits)

        sent = []
        for i, (error, delta) in enumerate(zip(errors, deltas)):
            errors[i] = 0.5 * error + delta                    # e <- beta e + delta
            positions, values, codes, scales, dense = sparseloco_sent_by_hand(
                errors[i], 8, 0.25, bits)
            wire_positions, wire_values, wire_codes, wire_scales = on_the_wire[i]
            assert wire_positions == positions, (i, wire_positions, positions)
            torch.testing.assert_close(wire_values, values)
            if bits < 32:
                assert wire_codes == codes, (i, wire_codes, codes)
                torch.testing.assert_close(wire_scales, scales)
            errors[i] = errors[i] - dense                       # e <- e - sent
            sent.append(dense)
        for i, dense in enumerate(sent):                        # average, outer step
            synced[i] = synced[i] - 0.7 * summed_over_ranks(dense) / n
        for p, s, mine, e in zip(params, synced, strategy.errors, errors):
            torch.testing.assert_close(p.detach(), s)
            torch.testing.assert_close(mine, e)
        assert same_on_every_rank(params), "the replicas differ after a synchronization"
    return cost.bytes


def sparseloco_drops_a_non_finite_sync(comm):
    """Rank 1's replica turns NaN, then inf, before two synchronizations: both are
    dropped on every rank (weights back to the synced ones, error buffers as they
    were), and the next one is taken as usual."""
    torch.manual_seed(0)
    model = nn.Linear(10, 3)
    strategy = sync.create("sparseloco", period=1, chunk=8, density=0.25, algorithm="ring")
    strategy.setup(model, comm)
    params = list(model.parameters())

    def move(step, poison=None):
        generator = torch.Generator().manual_seed(100 * step + comm.rank)
        with torch.no_grad():
            for p in params:
                p.sub_(torch.randn(p.shape, generator=generator))
            if poison is not None and comm.rank == 1:
                params[0][1, 2] = poison
        strategy.after_step(model, step)

    move(1)
    before = ([t.clone() for t in strategy.synced], [t.clone() for t in strategy.errors])
    for step, poison in ((2, float("nan")), (3, float("inf"))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            move(step, poison)
        said = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert strategy.dropped_syncs == step - 1, step  # counted on every rank
        assert len(said) == (comm.rank == 0) and all("dropped" in m for m in said), said
        for p, s, kept in zip(params, strategy.synced, before[0]):
            assert torch.equal(p.detach(), kept) and torch.equal(s, kept), f"step {step}"
        for e, kept in zip(strategy.errors, before[1]):
            assert torch.equal(e, kept), f"step {step}: the error buffer changed"
    move(4)
    assert sync.finite(params) and not torch.equal(params[0].detach(), before[0][0])
    return "ok"


# --- demo by hand ----------------------------------------------------------------------

def dct_by_hand(size):
    """The orthonormal DCT-II, entry by entry."""
    return torch.tensor([[math.sqrt((1 if f == 0 else 2) / size)
                          * math.cos(math.pi * (j + 0.5) * f / size) for j in range(size)]
                         for f in range(size)], dtype=torch.float64)


def tiles_of(shape, chunk):
    """(rows, cols, h, w) as DeMo cuts a parameter of `shape` (largest divisors)."""
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    h = max(d for d in range(1, min(rows, chunk) + 1) if rows % d == 0)
    w = max(d for d in range(1, min(cols, chunk) + 1) if cols % d == 0)
    return rows, cols, h, w


def tile_coefficients(x, shape, chunk):
    """[the 2-D DCT of each tile], tiles row-block by row-block, flattened row by row."""
    rows, cols, h, w = tiles_of(shape, chunk)
    grid = x.reshape(rows, cols)
    dh, dw = dct_by_hand(h), dct_by_hand(w)
    return [(dh @ grid[r:r + h, c:c + w] @ dw.T).reshape(-1)
            for r in range(0, rows, h) for c in range(0, cols, w)]


def from_tile_coefficients(coefficients, shape, chunk):
    rows, cols, h, w = tiles_of(shape, chunk)
    dh, dw = dct_by_hand(h), dct_by_hand(w)
    grid = torch.zeros(rows, cols, dtype=torch.float64)
    tiles = iter(coefficients)
    for r in range(0, rows, h):
        for c in range(0, cols, w):
            grid[r:r + h, c:c + w] = dh.T @ next(tiles).reshape(h, w) @ dw
    return grid.reshape(shape)


def designed_gradient(shape, chunk, k, generator):
    """A gradient whose top-k DCT coefficients are known: in every tile, small noise
    and k chosen positions of magnitude 1 to 2. Returns (gradient, chosen positions)."""
    rows, cols, h, w = tiles_of(shape, chunk)
    tiles, chosen = [], []
    for _ in range((rows // h) * (cols // w)):
        coefficients = 0.05 * torch.randn(h * w, generator=generator, dtype=torch.float64)
        positions = sorted(torch.randperm(h * w, generator=generator)[:k].tolist())
        signs = torch.randint(0, 2, (k,), generator=generator) * 2 - 1
        coefficients[positions] = signs * (1 + torch.rand(k, generator=generator,
                                                          dtype=torch.float64))
        tiles.append(coefficients)
        chosen.append(positions)
    return from_tile_coefficients(tiles, shape, chunk), chosen


def read_demo_payload(payload, counts):
    """Per parameter (values, positions), as demo's docstring lays the bytes out: every
    value (float32), then every position (int16)."""
    values = floats(payload, 0, sum(counts)).split(counts)
    positions = int16s(payload, 4 * sum(counts), sum(counts)).split(counts)
    assert payload.numel() == 6 * sum(counts)
    return list(zip(values, positions))


def demo_steps_by_hand(comm, steps=2):
    """Two steps of a float64 Linear(8, 4): its weight in two 4 x 4 tiles, its bias one
    run of 4; 3 coefficients kept of each. Step 1's gradients are designed (their
    top 3 known); step 2's random. Checked against the rule by hand: what each rank
    sends, its momentum, and the gradient every rank ends with."""
    n, chunk, k, beta = comm.world_size, 4, 3, 0.5
    torch.manual_seed(0)
    model = nn.Linear(8, 4).double()
    strategy = sync.create("demo", momentum=beta, chunk=chunk, topk=k, algorithm="ring")
    strategy.setup(model, comm)
    params = list(model.parameters())
    shapes = [tuple(p.shape) for p in params]
    cost = strategy.cost(shapes, n)
    momenta = [torch.zeros_like(p) for p in params]
    generator = torch.Generator().manual_seed(comm.rank)
    for step in range(1, steps + 1):
        chosen = None
        if step == 1:
            designed = [designed_gradient(shape, chunk, k, generator) for shape in shapes]
            grads, chosen = [g for g, _ in designed], [c for _, c in designed]
        else:
            grads = [torch.randn(shape, generator=generator, dtype=torch.float64)
                     for shape in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        comm.traffic.reset()
        with recorded_gathers() as gathers:
            strategy.after_backward(model)
        assert comm.traffic.bytes_sent == cost.bytes, (comm.traffic.bytes_sent, cost)
        assert len(gathers) == cost.collectives == 1
        sent_bytes, gathered = gathers[0]
        check_the_gather(sent_bytes, gathered)
        counts = [rows // h * (cols // w) * k for rows, cols, h, w in
                  (tiles_of(shape, chunk) for shape in shapes)]
        on_the_wire = read_demo_payload(sent_bytes, counts)

        for i, (shape, grad) in enumerate(zip(shapes, grads)):
            momenta[i] = beta * momenta[i] + grad                   # m <- beta m + g
            tiles = tile_coefficients(momenta[i], shape, chunk)     # DCT per tile
            positions = [kept_by_hand(tile, k) for tile in tiles]   # top-k per tile
            if chosen is not None:
                assert positions == chosen[i], (i, positions, chosen[i])
            values = torch.stack([tile[j] for tile, js in zip(tiles, positions)
                                  for j in js]).float()             # as they travel
            wire_values, wire_positions = on_the_wire[i]
            assert wire_positions.tolist() == [j for js in positions for j in js]
            torch.testing.assert_close(wire_values, values)
            sparse = [torch.zeros_like(tile) for tile in tiles]
            at = iter(values.double())
            for tile, js in zip(sparse, positions):
                for j in js:
                    tile[j] = next(at)
            momenta[i] = momenta[i] - from_tile_coefficients(sparse, shape, chunk)
            average = [summed_over_ranks(tile) / n for tile in sparse]    # Q
            decoded = from_tile_coefficients(average, shape, chunk)       # IDCT(Q)
            assert decoded.abs().min() > 1e-9, "too near 0 for its sign to be sure"
            assert torch.equal(params[i].grad, decoded.sign()), (i, params[i].grad, decoded)
            torch.testing.assert_close(strategy.momenta[i], momenta[i], rtol=0, atol=1e-6)
        assert same_on_every_rank([p.grad for p in params])
    return cost.bytes


def demo_passes_a_non_finite_step_on(comm):
    """Rank 1's gradient holds an inf at step 2: every rank's gradients come out
    non-finite (so the loop skips the step everywhere) and every momentum stays as it
    was; step 3 is finite again."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    strategy = sync.create("demo", chunk=4, topk=3, algorithm="ring")
    strategy.setup(model, comm)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(comm.rank)
    for step in (1, 2, 3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        if step == 2 and comm.rank == 1:
            params[0].grad[2, 5] = float("inf")
        before = [m.clone() for m in strategy.momenta]
        strategy.after_backward(model)
        grads = [p.grad for p in params]
        assert sync.finite(grads) == (step != 2), f"step {step}"
        if step == 2:
            assert all(torch.equal(m, kept) for m, kept in zip(strategy.momenta, before))
    return "ok"


# --- both, in a plain torch loop and resumed -------------------------------------------

def train(comm, name, options, steps, model=None, strategy=None, optimizer=None,
          first=1):
    """Steps `first` .. `first + steps - 1` of the checks' MLP (float32) in a plain torch
    loop: our DistributedDataParallel calls the strategy (moments="ddp")."""
    if model is None:
        strategy = sync.create(name, algorithm="ring", **options)
        model = collectives.DistributedDataParallel(mlp().float(), sync=strategy, comm=comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(first, first + steps):
        x, y = shard(comm, step)
        optimizer.zero_grad()
        F.cross_entropy(model(x.float()), y).backward()
        optimizer.step()
    return model, strategy, optimizer


def plain_loop_bytes(comm, name, options, steps):
    """The bytes a plain torch loop sends over `steps` steps, against cost(); and
    whether the replicas are equal at the end."""
    strategy = sync.create(name, algorithm="ring", **options)
    model = collectives.DistributedDataParallel(mlp().float(), sync=strategy, comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.module.parameters())
    shapes = [tuple(p.shape) if name == "demo" else p.numel() for p in params]
    comm.traffic.reset()
    train(comm, name, options, steps, model, strategy, optimizer)
    sent = comm.traffic.bytes_sent
    model.close()
    expected = strategy.cost(shapes, comm.world_size).bytes * steps
    assert sent == expected, (name, sent, expected)
    assert same_on_every_rank(params), f"{name}: the replicas differ"
    return sent


def assert_same_state(mine, theirs, where):
    """Bitwise equality of two strategy states, however nested."""
    if isinstance(mine, torch.Tensor):
        assert torch.equal(mine, theirs), f"{where} differs after resuming"
    elif isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), where
        for key in mine:
            assert_same_state(mine[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs)):
            assert_same_state(a, b, f"{where}[{index}]")
    else:
        assert mine == theirs, f"{where}: {mine!r} against {theirs!r}"


def resumes_bit_for_bit(comm, name, options, first, then, before_saving=None):
    """`first` steps, a checkpoint (through torch.save, as the trainer's), `then` more;
    and a fresh model, optimizer and strategy loaded from the checkpoint, `then` more:
    both end bitwise alike, strategy state included. before_saving(strategy): a check
    that the checkpoint holds something worth resuming."""
    model, strategy, optimizer = train(comm, name, options, first)
    if before_saving is not None:
        before_saving(strategy)
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "strategy": strategy.state_dict()}, buffer)
    train(comm, name, options, then, model, strategy, optimizer, first=first + 1)
    expected = {key: t.clone() for key, t in model.module.state_dict().items()}
    expected_state = strategy.state_dict()
    model.close()

    buffer.seek(0)
    saved = torch.load(buffer)
    strategy = sync.create(name, algorithm="ring", **options)
    resumed = collectives.DistributedDataParallel(mlp().float(), sync=strategy, comm=comm)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    resumed.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    strategy.load_state_dict(saved["strategy"])
    resumed.optimizer_steps = first
    train(comm, name, options, then, resumed, strategy, optimizer, first=first + 1)
    resumed.close()
    for key, tensor in resumed.module.state_dict().items():
        assert torch.equal(tensor, expected[key]), f"{name}: {key} differs after resuming"
    assert_same_state(strategy.state_dict(), expected_state, f"{name}'s state")
    return "ok"


def every_check(comm):
    """All of the above on this rank; the bytes counted, for the test to report."""
    return {
        "sparseloco 2 bits": sparseloco_syncs_by_hand(comm, bits=2),
        "sparseloco 32 bits": sparseloco_syncs_by_hand(comm, bits=32),
        "sparseloco non-finite": sparseloco_drops_a_non_finite_sync(comm),
        "sparseloco loop": plain_loop_bytes(comm, "sparseloco", dict(period=2, chunk=512), 4),
        "sparseloco resume": resumes_bit_for_bit(comm, "sparseloco",
                                                 dict(period=2, chunk=512), 3, 3),
        "demo": demo_steps_by_hand(comm),
        "demo non-finite": demo_passes_a_non_finite_step_on(comm),
        "demo loop": plain_loop_bytes(comm, "demo", dict(chunk=16, topk=8), 3),
        "demo resume": resumes_bit_for_bit(comm, "demo", dict(chunk=16, topk=8), 2, 2),
    }
