"""Per-rank checks of `muloco` (run on spawned gloo ranks by test_muloco.py).

Each synchronization is worked out here a second time, by hand, in plain torch: the
rule of the strategy's docstring (error feedback, the compressor, the average, DiLoCo's
Nesterov outer step) written out step by step, with torch.distributed's own collectives
(not this project's) where the ranks meet. Against it: what each rank puts on the wire
(read back from the bytes as the docstring lays them out), what every rank ends with
(weights, error buffers, outer momentum), and the bytes the transport counted against
cost(). Then a round that is not finite, `none` against diloco, a plain torch loop, and
a resume bit for bit.
"""
import math

import torch
from torch import nn

from collectives import sync
from checks_lowcomm_sparse import resumes_bit_for_bit as sparse_resumes_bit_for_bit
from checks_lowcomm_sparse import (check_the_gather, floats, int16s, plain_loop_bytes,
                                   quantized_by_hand, recorded_gathers, same_on_every_rank,
                                   sparseloco_sent_by_hand, summed_over_ranks)

# A Linear(10, 3): its weight's 30 entries in 4 chunks of 8 (the last padded), 2 kept
# of each; its bias one chunk of 3, 1 kept.
CHUNK, DENSITY, DECAY, LR, MOMENTUM = 8, 0.25, 0.5, 0.7, 0.9


def by_hand_options(compression, bits):
    return dict(period=1, compression=compression, bits=bits, chunk=CHUNK, density=DENSITY,
                error_decay=DECAY, outer_lr=LR, outer_momentum=MOMENTUM, algorithm="ring")


def momentum_buffers(strategy):
    """The outer optimizer's momentum, one tensor per parameter (None before a step)."""
    state = strategy.outer[0].state
    return [state[t]["momentum_buffer"] if t in state else None for t in strategy.synced[0]]


def move_replica(params, synced, step, rank):
    """This rank's replica at `synced` minus a random delta of its own: what H inner
    steps would have done. Returns the deltas."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    deltas = [torch.randn(p.shape, generator=generator) for p in params]
    with torch.no_grad():
        for p, s, d in zip(params, synced, deltas):
            p.copy_(s - d)
    return deltas


# --- what travels, by hand ----------------------------------------------------------

def topk_sent_by_hand(error):
    """(positions per chunk, float32 values, dense) that topk sends of one buffer:
    sparseloco's chunks, values unquantized."""
    positions, values, _, _, dense = sparseloco_sent_by_hand(error, CHUNK, DENSITY, 32)
    return positions, values, dense


def quantized_sent_by_hand(error, bits):
    """(codes, [shift, codebook], dense) that quantize sends of one buffer: every entry."""
    codes, shift, codebook, decoded = quantized_by_hand(error.reshape(-1).float(), bits)
    return codes, torch.cat([shift.view(1), codebook]), decoded.to(error.dtype).view_as(error)


def read_topk_payload(payload, numels):
    """Per parameter (positions per chunk, values), read from the bytes as the docstring
    lays them out: every value (float32), then every position (int16)."""
    shapes = []
    for numel in numels:
        length = min(CHUNK, numel)
        shapes.append((math.ceil(numel / length), max(1, round(DENSITY * length))))
    counts = [chunks * k for chunks, k in shapes]
    assert payload.numel() == 6 * sum(counts), (payload.numel(), counts)
    values = floats(payload, 0, sum(counts)).split(counts)
    positions = int16s(payload, 4 * sum(counts), sum(counts)).split(counts)
    return [(where.view(chunks, k).tolist(), value)
            for (chunks, k), where, value in zip(shapes, positions, values)]


def read_quantized_payload(payload, numels, bits):
    """Per parameter (codes, [shift, codebook]): every parameter's shift and codebook
    (float32), then every parameter's codes, 8/bits a byte, low bits first."""
    count, per_byte, offset = 1 + 2 ** bits, 8 // bits, 0
    scale_sets = []
    for _ in numels:
        scale_sets.append(floats(payload, offset, count))
        offset += 4 * count
    code_sets = []
    for numel in numels:
        size = math.ceil(numel * bits / 8)
        packed = payload[offset:offset + size].tolist()
        offset += size
        code_sets.append([(packed[j // per_byte] >> (bits * (j % per_byte))) & (2 ** bits - 1)
                          for j in range(numel)])
    assert offset == payload.numel(), (offset, payload.numel())
    return list(zip(code_sets, scale_sets))


def nesterov_by_hand(synced, momentum, average):
    """torch's SGD with Nesterov momentum (no dampening), written out: the buffer starts
    as the first gradient, then b <- mu b + g; the step is g + mu b, times the rate."""
    momentum = average.clone() if momentum is None else MOMENTUM * momentum + average
    return synced - LR * (average + MOMENTUM * momentum), momentum


# --- the checks ---------------------------------------------------------------------

def syncs_by_hand(comm, compression, bits=2, syncs=2):
    """Two synchronizations (period 1) of a Linear(10, 3) whose replica moves by a random
    delta of its own before each; checked against the rule by hand: what this rank
    sends, and the weights, error buffers and outer momentum every rank ends with."""
    n = comm.world_size
    torch.manual_seed(0)
    model = nn.Linear(10, 3)
    strategy = sync.create("muloco", **by_hand_options(compression, bits))
    strategy.setup(model, comm)
    params = list(model.parameters())
    numels = [p.numel() for p in params]
    synced = [p.detach().clone() for p in params]
    errors = [torch.zeros_like(p) for p in params]
    momenta = [None] * len(params)
    cost = strategy.cost(numels, n)
    for step in range(1, syncs + 1):
        deltas = move_replica(params, synced, step, comm.rank)
        comm.traffic.reset()
        with recorded_gathers() as gathers:
            strategy.after_step(model, step)
        assert comm.traffic.bytes_sent == cost.bytes, (comm.traffic.bytes_sent, cost)
        assert len(gathers) == cost.collectives == 1
        sent_bytes, gathered = gathers[0]
        check_the_gather(sent_bytes, gathered)
        on_the_wire = (read_topk_payload(sent_bytes, numels) if compression == "topk" else
                       read_quantized_payload(sent_bytes, numels, bits))

        sent = []
        for i, delta in enumerate(deltas):
            errors[i] = DECAY * errors[i] + delta                  # e <- beta e + delta
            if compression == "topk":
                positions, values, dense = topk_sent_by_hand(errors[i])
                wire_positions, wire_values = on_the_wire[i]
                assert wire_positions == positions, (i, wire_positions, positions)
                torch.testing.assert_close(wire_values, values)
            else:
                codes, scales, dense = quantized_sent_by_hand(errors[i], bits)
                wire_codes, wire_scales = on_the_wire[i]
                assert wire_codes == codes, (i, wire_codes, codes)
                torch.testing.assert_close(wire_scales, scales)
            errors[i] = errors[i] - dense                           # e <- e - C(e)
            sent.append(dense)
        for i, dense in enumerate(sent):                            # average, outer step
            synced[i], momenta[i] = nesterov_by_hand(synced[i], momenta[i],
                                                     summed_over_ranks(dense) / n)
        for mine, p, s, e, m, strategy_s, strategy_e in zip(
                momentum_buffers(strategy), params, synced, errors, momenta,
                strategy.synced[0], strategy.errors):
            torch.testing.assert_close(p.detach(), s)
            torch.testing.assert_close(strategy_s, s)
            torch.testing.assert_close(strategy_e, e)
            torch.testing.assert_close(mine, m)
        assert same_on_every_rank(params), "the replicas differ after a synchronization"
    return cost.bytes


def drops_a_non_finite_sync(comm, compression):
    """Rank 1's replica turns NaN, then inf, before two synchronizations: both are
    dropped on every rank (weights back to the synced ones; synced weights, error
    buffers and outer momentum as they were), and the next one is taken as usual."""
    torch.manual_seed(0)
    model = nn.Linear(10, 3)
    strategy = sync.create("muloco", **by_hand_options(compression, 2))
    strategy.setup(model, comm)
    params = list(model.parameters())

    def move(step, poison=None):
        move_replica(params, strategy.synced[0], step, comm.rank)
        if poison is not None and comm.rank == 1:
            with torch.no_grad():
                params[0][1, 2] = poison
        strategy.after_step(model, step)

    move(1)
    kept = [[t.clone() for t in tensors] for tensors in
            (strategy.synced[0], strategy.errors, momentum_buffers(strategy))]
    for step, poison in ((2, float("nan")), (3, float("inf"))):
        move(step, poison)
        now = (strategy.synced[0], strategy.errors, momentum_buffers(strategy))
        for what, tensors, before in zip(("synced", "errors", "momentum"), now, kept):
            assert all(torch.equal(t, b) for t, b in zip(tensors, before)), (step, what)
        assert all(torch.equal(p.detach(), s) for p, s in zip(params, kept[0])), step
    move(4)
    assert sync.finite(params) and not torch.equal(params[0].detach(), kept[0][0])
    assert not all(torch.equal(e, b) for e, b in zip(strategy.errors, kept[1]))
    assert strategy.dropped_syncs == 2
    return "ok"


def none_is_diloco(comm, syncs=2):
    """compression none is diloco (its all-reduce, its outer step), bit for bit; the
    bytes summed over the ranks are n times cost()'s (the ring's share differs by rank
    when the buffer does not split evenly)."""
    ends, sent = {}, {}
    for name, options in (("muloco", dict(compression="none")), ("diloco", {})):
        torch.manual_seed(0)
        model = nn.Linear(10, 3)
        strategy = sync.create(name, period=1, outer_lr=LR, outer_momentum=MOMENTUM,
                               algorithm="ring", **options)
        strategy.setup(model, comm)
        params = list(model.parameters())
        comm.traffic.reset()
        for step in range(1, syncs + 1):
            move_replica(params, strategy.synced[0], step, comm.rank)
            strategy.after_step(model, step)
        ends[name] = [p.detach().clone() for p in params]
        sent[name] = comm.traffic.bytes_sent
        if name == "muloco":
            cost = strategy.cost([p.numel() for p in params], comm.world_size)
            assert strategy.errors == [] and strategy.state_dict()["errors"] == []
    assert all(torch.equal(a, b) for a, b in zip(ends["muloco"], ends["diloco"]))
    assert sent["muloco"] == sent["diloco"], sent
    total = summed_over_ranks(torch.tensor(float(sent["muloco"]), dtype=torch.float64))
    assert total.item() == comm.world_size * cost.bytes * syncs, (total, cost)
    return "ok"


def errors_fed_back(strategy):
    """Something waits in the error buffers: the resume has it to carry."""
    assert any(e.abs().sum() > 0 for e in strategy.errors), "nothing fed back yet"


def resumes_bit_for_bit(comm, options, first, then):
    """The sparse methods' resume check (checks_lowcomm_sparse.py), with error buffers
    to carry: muloco's state is DiLoCo's (synced weights, outer momentum, steps done) and
    its error buffers."""
    return sparse_resumes_bit_for_bit(comm, "muloco", options, first, then,
                                      before_saving=errors_fed_back)


def every_check(comm):
    """All of the above on this rank; the bytes counted, for the test to compare."""
    loop = dict(period=2, chunk=512)
    return {
        "topk": syncs_by_hand(comm, "topk"),
        "quantize 2 bits": syncs_by_hand(comm, "quantize", bits=2),
        "quantize 4 bits": syncs_by_hand(comm, "quantize", bits=4),
        "topk non-finite": drops_a_non_finite_sync(comm, "topk"),
        "quantize non-finite": drops_a_non_finite_sync(comm, "quantize"),
        "none is diloco": none_is_diloco(comm),
        "topk loop": plain_loop_bytes(comm, "muloco", dict(loop, compression="topk"), 4),
        "quantize loop": plain_loop_bytes(comm, "muloco", loop, 4),
        "topk resume": resumes_bit_for_bit(
            comm, dict(loop, compression="topk", density=0.05, warmup_steps=1), 3, 3),
        "quantize resume": resumes_bit_for_bit(comm, dict(loop, warmup_steps=1), 3, 3),
    }
