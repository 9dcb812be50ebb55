"""`muloco`: each synchronization against the rule worked by hand on 2 and 3 ranks, for
top-k and quantized compression (what each rank sends; the weights, error buffers and
outer momentum every rank ends with), the bytes counted against cost(), a non-finite
round that leaves no trace, compression none against diloco, a plain torch loop, and a
resume bit for bit (checks_muloco.py); and its options and cost, in one process."""
import pytest

from checks_muloco import every_check
from collectives import sync
from distributed import run_world


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_muloco_follows_its_rule_and_counts_its_bytes(world_size):
    per_rank = run_world(every_check, world_size, timeout=75)
    for results in per_rank:
        assert results == per_rank[0]  # every rank sent as many bytes, every check passed
    assert {key: value for key, value in per_rank[0].items() if value == "ok"}.keys() == {
        "topk non-finite", "quantize non-finite", "none is diloco", "topk resume",
        "quantize resume"}


def test_defaults_are_the_papers_and_options_go_by_name():
    s = sync.create("muloco")
    assert (s.period, s.compression, s.bits, s.density, s.chunk, s.error_decay) == (
        30, "quantize", 2, 0.02, 4096, 0.9)
    assert s.outer_options == dict(lr=0.7, momentum=0.9, nesterov=True)
    assert s.replicas_differ and not s.uses_buckets and s.warmup_steps == 0
    t = sync.create("muloco:compression=topk:density=0.05:period=10:warmup_steps=4")
    assert (t.compression, t.density, t.period, t.warmup_steps, t.uses_buckets) == (
        "topk", 0.05, 10, 4, True)
    assert sync.create("muloco", outer_momentum=0.0).outer_options["nesterov"] is False
    with pytest.raises(ValueError, match=r"^muloco: compression must be one of topk, "
                                         r"quantize, none, got 'sparse'$"):
        sync.create("muloco:compression=sparse")
    with pytest.raises(ValueError, match=r"^muloco: bits must be one of 2, 4, 8, got 32$"):
        sync.create("muloco", bits=32)
    with pytest.raises(TypeError, match="muloco takes no option 'H'"):
        sync.create("muloco:H=30")


def test_replicas_meet_during_the_warm_up_and_at_every_synchronization():
    s = sync.create("muloco", period=3, warmup_steps=2)
    assert [step for step in range(1, 12) if s.replicas_equal_after(step)] == [1, 2, 5, 8, 11]


def test_cost_is_the_bytes_of_the_rule():
    # quantize, 2 bits: a quarter byte per entry, and a shift and 4 codebook entries
    # (float32) per parameter; all-gathered, each of 4 ranks sends 3 payloads per 30 steps
    payload = (2500 + 20) + (25 + 20)
    assert sync.create("muloco").cost([10000, 100], 4) == (3 * payload / 30, 1 / 30)
    # 8 bits: a byte per entry, a shift and 256 codebook entries
    assert sync.create("muloco", bits=8, period=1).cost([(64, 32)], 2) == (2048 + 257 * 4, 1)
    # topk: 10000 entries in 3 chunks of 4096 (82 kept of each), 100 in one (2 kept);
    # int16 positions and float32 values
    assert sync.create("muloco", compression="topk").cost([10000, 100], 3) == (
        2 * (3 * 82 + 2) * 6 / 30, 1 / 30)
    # a chunk too long for int16 positions: int32; 200 of 10000 kept
    assert sync.create("muloco", compression="topk", chunk=40000, period=1).cost(
        [10000], 2) == (200 * 8, 1)
    # none: diloco's ring all-reduce of float32, 2(n-1)/n of it per rank on average
    assert sync.create("muloco", compression="none", period=2).cost([1000], 4) == (
        1.5 * 4000 / 2, 1 / 2)
    # an empty parameter sends nothing; nor does a world of one
    assert sync.create("muloco", period=1).cost([100, 0], 2).bytes == 25 + 20
    assert sync.create("muloco").cost([10000], 1).bytes == 0
