"""`noloco` (pairwise averaging, no all-reduce) and `sparta` (a random sliver of the
parameters averaged every step): each one's rule worked by hand, its bytes against
cost(), a resume bit for bit, a plain torch loop against the trainer's order, on 2 and
3 ranks (checks_lowcomm_pairs.py, one world each)."""
import pytest

from checks_lowcomm_pairs import every_check
from collectives import sync
from distributed import run_world


def test_both_are_registered_with_their_options_checked():
    assert {"noloco", "sparta"} <= set(sync.available())
    assert sync.create("noloco:period=8:gamma=0.5").period == 8
    assert sync.create("sparta:fraction=0.01:diloco_period=100").diloco.period == 100
    with pytest.raises(ValueError, match=r"^noloco: outer_momentum must be in \[0, 1\), got 1.0$"):
        sync.create("noloco", outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"^sparta: fraction must be in \(0, 1\], got 0.0$"):
        sync.create("sparta", fraction=0.0)


def test_cost_per_step_follows_the_formulas():
    numels = [1000, 24]  # P = 1024 float32 values
    assert tuple(sync.create("noloco", period=4).cost(numels, 2)) == (8 * 1024 / 4, 1 / 4)
    # of 5 ranks, 4 are paired at each sync: 4/5 of 8P per sync, on average
    assert sync.create("noloco", period=4).cost(numels, 5).bytes == pytest.approx(
        4 / 5 * 8 * 1024 / 4)
    k = round(0.005 * 1024)  # 5 values
    assert tuple(sync.create("sparta").cost(numels, 4)) == (2 * 3 / 4 * 4 * k, 1.0)
    assert tuple(sync.create("sparta", diloco_period=4).cost(numels, 2)) == (
        (3 * 4 * k + 4 * 1024) / 4, 1.0)
    for name in ("noloco", "sparta"):
        assert tuple(sync.create(name).cost(numels, 1)) == (0.0, 0.0)


def sums_to(per_rank, cost_bytes, world_size, steps):
    """Do the ranks' bytes add up to cost() (a per-rank average per step) exactly?"""
    return sum(per_rank) == pytest.approx(cost_bytes * world_size * steps, rel=1e-12)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_noloco_and_sparta_by_hand_bytes_resume_and_plain_loop(world_size):
    per_rank = run_world(every_check, world_size, timeout=75)
    n = world_size
    for check in ("noloco finite", "noloco resumes", "sparta finite", "sparta resumes"):
        assert [result[check] for result in per_rank] == ["ok"] * n, check

    # noloco, one sync per step: each rank's peer is its peer's peer, a rank without one
    # sends nothing, and the ranks' bytes add up to cost()
    records = [result["noloco by hand"][0] for result in per_rank]
    cost = per_rank[0]["noloco by hand"][1]
    for sync_index in range(len(records[0])):
        peers = [record[sync_index][0] for record in records]
        sent = [record[sync_index][1] for record in records]
        assert all(peer is None or peers[peer] == rank for rank, peer in enumerate(peers))
        assert peers.count(None) == n % 2, peers
        assert all((byte_count == 0) == (peer is None) for peer, byte_count in zip(peers, sent))
        assert len({b for b in sent if b}) == 1, sent  # every paired rank sends 8P
        assert sums_to(sent, cost[0], n, 1), (sent, cost)
    # two ranks hold the same slow weights after every sync (the pair is the world, as
    # in DiLoCo); with three, pairs change and the pull term has work to do
    pulls = [pull for record in records for _, _, pull in record]
    assert (max(pulls) > 0) == (n > 2), pulls
    sent, cost = zip(*(result["noloco plain loop"] for result in per_rank))
    assert sums_to(sent, cost[0][0], n, 6), (sent, cost[0])  # period 2, 6 steps

    # sparta: each rank sends the ring's bytes for k values, which average to cost()
    k, sent, ring, cost = zip(*(result["sparta by hand"] for result in per_rank))
    assert sent == ring, (sent, ring)
    assert sums_to(sent, cost[0][0], n, 1), (sent, cost[0])
    steps, cost = zip(*(result["sparta with diloco"] for result in per_rank))
    assert sums_to([sum(s) for s in steps], cost[0][0], n, 4), (steps, cost[0])
    sent, cost = zip(*(result["sparta plain loop"] for result in per_rank))
    assert sums_to(sent, cost[0][0], n, 6), (sent, cost[0])  # diloco_period 3, 6 steps
