"""`onebit-adam`: the warm-up against Adam on torch.distributed's average (and torch's
own Adam), the compressed steps against the rule worked by hand on 2 and 3 ranks (what
each rank sends in the all-to-all and the all-gather, its worker and server errors,
m, v and the gradient it hands over), the bytes against cost(), fp16's loss scale
and non-finite steps leaving no trace, a plain torch loop, and a resume bit for bit
(checks_onebit_adam.py); and its pieces, in one process."""
from datetime import timedelta

import pytest
import torch

from checks_onebit_adam import every_check
from collectives import sync
from collectives.sync import onebit_adam
from collectives.transport.local import LocalTransport
from distributed import run_world


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_onebit_adam_follows_the_papers_rule_and_counts_its_bytes(world_size):
    per_rank = run_world(every_check, world_size, timeout=50)
    for results in per_rank:
        assert results == per_rank[0]  # every rank sent as many bytes, every check "ok"
        assert all(value == "ok" for key, value in results.items()
                   if key not in ("by hand", "loop"))


def test_defaults_are_deepspeeds_and_options_go_by_name():
    s = sync.create("onebit-adam")
    assert (s.beta1, s.beta2, s.eps, s.freeze_step, s.bias_correction) == (
        0.9, 0.999, 1e-8, 200, False)
    assert not s.uses_buckets and s.gradient_divisor() is None and not s.replicas_differ
    assert s.warmup_steps == 200  # benchmarks time the compressed steps
    assert sync.create("onebit-adam:freeze_step=20:beta2=0.95").freeze_step == 20
    with pytest.raises(ValueError, match=r"^onebit-adam: beta1 must be in \[0, 1\), got 1.0$"):
        sync.create("onebit-adam:beta1=1")
    with pytest.raises(ValueError, match=r"^onebit-adam: freeze_step must be at least 1, "
                                         r"got 0$"):
        sync.create("onebit-adam", freeze_step=0)
    with pytest.raises(TypeError, match="onebit-adam takes no option 'lr'"):
        sync.create("onebit-adam:lr=0.001")


def test_signs_pack_8_to_a_byte_first_in_the_low_bit_zero_as_plus():
    values = torch.tensor([1.0, -2.0, 0.0, -0.5, 3.0, 3.0, -1.0, 2.0, -1.0] + [1.0] * 7)
    packed = onebit_adam.pack_signs(values)
    assert packed.tolist() == [1 | 4 | 16 | 32 | 128, 0b11111110]
    assert torch.equal(onebit_adam.unpack_signs(packed, torch.float64),
                       torch.where(values >= 0, 1.0, -1.0).double())


def test_cost_is_the_bytes_of_the_rule():
    # 4 ranks: 2048 elements in chunks of 512 (64 bytes), 5 padded to 32 (chunks of 8,
    # 1 byte); each with a float32 scale; an all-to-all and an all-gather of 3 pieces
    piece = (4 + 64) + (4 + 1)
    assert sync.create("onebit-adam").cost([(64, 32), (5,)], 4) == (2 * 3 * piece, 2)
    assert onebit_adam.piece_bytes([2048, 5], 4) == piece
    # 3 ranks: 100 elements padded to 120, chunks of 40 (5 bytes)
    assert sync.create("onebit-adam").cost([100, 0], 3) == (2 * 2 * (4 + 5), 2)
    assert sync.create("onebit-adam").cost([(512, 128)], 1) == (0, 0)
    assert onebit_adam.chunk_length(16, 2) == 8 and onebit_adam.chunk_length(17, 2) == 16


@pytest.mark.parametrize("bias_correction", [False, True])
def test_one_rank_runs_adam_with_v_frozen_and_sends_nothing(bias_correction):
    """One rank compresses nothing (as DeepSpeed's): Adam whose v stops at step 2,
    and whose bias correction of v stops with it."""
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2).double()
    strategy = sync.create("onebit-adam", beta1=0.5, beta2=0.5, freeze_step=2,
                           bias_correction=bias_correction)
    strategy.setup(model, comm)
    generator = torch.Generator().manual_seed(0)
    m = v = torch.zeros(2, 6, dtype=torch.float64)
    for step in range(1, 5):
        g = torch.randn(2, 6, generator=generator, dtype=torch.float64)
        model.weight.grad, model.bias.grad = g.clone(), torch.zeros(2, dtype=torch.float64)
        strategy.after_backward(model)
        m = 0.5 * m + 0.5 * g
        if step <= 2:
            v = 0.5 * v + 0.5 * g * g
        if bias_correction:
            expected = (m / (1 - 0.5 ** step)) / ((v / (1 - 0.5 ** min(step, 2))).sqrt() + 1e-8)
        else:
            expected = m / (v.sqrt() + 1e-8)
        torch.testing.assert_close(model.weight.grad, expected)
        assert model.bias.grad.eq(0).all()  # never a gradient: v is 0, masked
    assert comm.traffic.bytes_sent == 0 and strategy.compressing
