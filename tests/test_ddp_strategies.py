"""Our DistributedDataParallel runs every sync strategy in a plain torch loop as the
trainer runs it: the same weights on every rank, the same bytes sent (spawned gloo
ranks; checks_ddp_strategies.py)."""
import pytest

from checks_ddp_strategies import every_strategy_both_ways
from collectives import sync
from distributed import run_world


def assert_refused_in_one_line(refused, rank_0s):
    """What the wrapper refuses: the same line on every rank, naming what to do."""
    assert refused == rank_0s
    assert "moments='trainer'" in refused["moments"], refused["moments"]
    assert "moments=\"loop\"" in refused["called twice"], refused["called twice"]
    assert "after_backward" in refused["called twice"]
    assert "no backward" in refused["two optimizers"], refused["two optimizers"]
    assert "moments=\"loop\"" in refused["two optimizers"]
    assert "join()" in refused["join"] and "after_step" in refused["join"], refused["join"]
    assert all("\n" not in message for message in refused.values())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_strategy_in_a_plain_loop_ends_where_the_trainers_order_does(world_size):
    per_rank = run_world(every_strategy_both_ways, world_size, timeout=180)
    for rank, (results, refused) in enumerate(per_rank):
        assert_refused_in_one_line(refused, per_rank[0][1])
        assert sorted(results) == sync.available()
        for name, (plain_sent, trainer_sent, difference, digest) in results.items():
            what = f"{name}, rank {rank}"
            assert plain_sent > 0, f"{what}: the plain loop sent nothing"
            assert plain_sent == trainer_sent, f"{what}: {plain_sent} != {trainer_sent} bytes"
            assert difference == 0.0, f"{what}: the plain loop's weights are {difference:.3g} " \
                                      "away from the trainer order's"
            if not sync.create(name).replicas_differ:  # one model on every rank
                assert digest == per_rank[0][0][name][3], f"{what}: differs from rank 0"
