"""`sparseloco` and `demo`: each synchronization against the paper's rule worked by
hand on 2 and 3 ranks (what each rank sends, what every rank ends with), the bytes
counted against cost(), a non-finite round that leaves no trace, a plain torch loop,
and a resume bit for bit (checks_lowcomm_sparse.py); and their pieces, in one process."""
import math

import pytest
import torch

from checks_lowcomm_sparse import dct_by_hand, every_check
from collectives import sync
from collectives.sync import demo, sparseloco
from distributed import run_world


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sparseloco_and_demo_follow_their_papers_rules_and_count_their_bytes(world_size):
    per_rank = run_world(every_check, world_size, timeout=100)
    for results in per_rank:
        assert results == per_rank[0]  # every rank sent as many bytes
        assert results["sparseloco non-finite"] == results["demo non-finite"] == "ok"
        assert results["sparseloco resume"] == results["demo resume"] == "ok"


def test_defaults_are_the_papers_and_options_go_by_name():
    s = sync.create("sparseloco")
    assert (s.period, s.error_decay, s.density, s.chunk, s.bits, s.outer_lr) == (
        30, 0.95, 0.02, 4096, 2, 1.0)
    assert s.replicas_differ and not s.uses_buckets
    assert sync.create("sparseloco:period=15:bits=32").period == 15
    d = sync.create("demo")
    assert (d.beta, d.chunk, d.topk) == (0.999, 64, 32)
    assert not d.uses_buckets and d.gradient_divisor() is None and not d.replicas_differ
    assert sync.create("demo:topk=8:chunk=16").topk == 8
    with pytest.raises(ValueError, match=r"^sparseloco: bits must be one of 2, 4, 8, 32, "
                                         r"got 3$"):
        sync.create("sparseloco", bits=3)
    with pytest.raises(ValueError, match=r"^demo: momentum must be in \[0, 1\), got 1.0$"):
        sync.create("demo:momentum=1")
    with pytest.raises(TypeError, match="sparseloco takes no option 'H'"):
        sync.create("sparseloco:H=30")


def test_codes_pack_8_over_bits_to_a_byte_first_in_the_low_bits():
    assert sparseloco.pack(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [
        1 | 2 << 2 | 3 << 4, 3]
    generator = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        codes = torch.randint(0, 2 ** bits, (37,), generator=generator).to(torch.uint8)
        packed = sparseloco.pack(codes, bits)
        assert packed.numel() == math.ceil(37 * bits / 8)
        assert torch.equal(sparseloco.unpack(packed, bits, 37), codes)


def test_the_quantizer_codes_two_levels_exactly_and_a_nan_as_nan():
    two_levels = torch.tensor([3.0, -1.0, 3.0, -1.0, -1.0, 3.0])
    codes, scales = sparseloco.quantize(two_levels, 2)
    assert torch.equal(sparseloco.dequantize(codes, scales), two_levels)
    alike = torch.full((5,), 0.25)
    assert torch.equal(sparseloco.dequantize(*sparseloco.quantize(alike, 2)), alike)
    one = torch.tensor([-7.0])
    assert torch.equal(sparseloco.dequantize(*sparseloco.quantize(one, 2)), one)
    spread = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    codes, scales = sparseloco.quantize(spread, 2)
    assert codes.max() == 3 and scales.numel() == 5  # the shift and 4 codebook entries
    assert (sparseloco.dequantize(codes, scales) - spread).abs().mean() < 0.5
    codes, scales = sparseloco.quantize(torch.tensor([1.0, float("nan"), 2.0]), 2)
    assert sparseloco.dequantize(codes, scales).isnan().all()


def test_the_dct_is_the_orthonormal_dct_ii():
    for size in (1, 4, 64):
        basis = demo.dct_matrix(size, torch.float64, torch.device("cpu"))
        torch.testing.assert_close(basis, dct_by_hand(size))
        torch.testing.assert_close(basis @ basis.T, torch.eye(size, dtype=torch.float64))


def test_tiles_are_cut_as_the_papers_code_cuts_them():
    assert demo.tiling((512, 128), 64, 32) == demo.Tiling(512, 128, 64, 64, 32)
    assert demo.tiling((512, 128), 64, 32).tiles == 16
    assert demo.tiling((97, 12), 64, 32) == demo.Tiling(97, 12, 1, 12, 12)  # a prime
    assert demo.tiling((10, 3, 5, 5), 64, 32) == demo.Tiling(10, 75, 10, 25, 32)  # a conv
    assert demo.tiling(384, 64, 32) == demo.Tiling(1, 384, 1, 64, 32)
    assert demo.tiling((5,), 64, 32) == demo.Tiling(1, 5, 1, 5, 5)


def test_cost_is_the_bytes_of_the_rule():
    # sparseloco: 10000 entries in 3 chunks of 4096 (82 kept of each), 100 in one (2 kept);
    # 2-bit codes, int16 positions, a shift and 4 codebook entries per parameter.
    first, second = 3 * 82, 2
    payload = (first * 2 + math.ceil(first * 2 / 8) + 20) + (second * 2 + 1 + 20)
    cost = sync.create("sparseloco").cost([10000, 100], 4)
    assert cost == (3 * payload / 30, 1 / 30)
    payload = first * (2 + 4) + second * (2 + 4)  # float32 values
    assert sync.create("sparseloco", bits=32, period=1).cost([10000, 100], 2) == (payload, 1)
    # a chunk too long for int16 positions: int32; 200 of 10000 kept
    assert sync.create("sparseloco", chunk=40000, period=1).cost([10000], 3) == (
        2 * (200 * 4 + 50 + 20), 1)
    # demo: 16 tiles of 64 x 64 and 6 runs of 64, 32 coefficients each, 6 bytes apiece
    assert sync.create("demo").cost([(512, 128), (384,)], 3) == (2 * (16 + 6) * 32 * 6, 1)
    assert sync.create("demo").cost([384], 3) == sync.create("demo").cost([(384,)], 3)
    # tiles of 200 x 200 (40000 entries): int32 positions
    assert sync.create("demo", chunk=200).cost([(400, 400)], 2) == (4 * 32 * 8, 1)
    assert sync.create("demo").cost([(512, 128)], 1).bytes == 0


def test_a_16_bit_model_keeps_its_momentum_and_errors_in_float32():
    """In bfloat16, m * 0.999 rounds back to m: DeMo's momentum would never decay, and
    SparseLoCo's error buffer would lose small changes. A world of one."""
    from datetime import timedelta
    from collectives.transport.local import LocalTransport
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).bfloat16()
    strategy = sync.create("demo", chunk=4, topk=3, algorithm="ring")
    strategy.setup(model, comm)
    assert {m.dtype for m in strategy.momenta} == {torch.float32}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    strategy.after_backward(model)
    assert {m.dtype for m in strategy.momenta} == {torch.float32}
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in model.parameters())
    strategy = sync.create("sparseloco", period=1, chunk=8, density=0.25, algorithm="ring")
    strategy.setup(model, comm)
    assert {e.dtype for e in strategy.errors} == {torch.float32}
    strategy = sync.create("muloco", period=1, algorithm="ring")
    strategy.setup(model, comm)
    assert {e.dtype for e in strategy.errors} == {torch.float32}
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01)
    strategy.after_step(model, 1)  # the outer step takes the average in the model's dtype
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all()
               for p in model.parameters())
