"""The "collectives" backend against gloo on the same seeded programs of mixed calls
(tests/differential.py): every result checked against the true value, ours never
worse than gloo, at 2 and 3 ranks. The programs hold tensors of one count in a shape
of each rank's own, arguments refused on every rank alike, and, after them, calls
refused on one rank alone. A few seeds here; many more with
`python tests/differential.py --seeds 30 --world-sizes 2,3` (docs/torch_backend.md)."""
import pytest

import differential


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size, seeds", [(2, (0, 1, 2)), (3, (0, 1))])
def test_ours_is_never_worse_than_gloo(world_size, seeds):
    counts, better, worse = differential.run_seeds(seeds, world_size, calls=150,
                                                   timeout_seconds=30, world_timeout=130,
                                                   lone=3, lone_timeout=2)
    assert not worse, "\n".join(f"seed {s} rank {r}: gloo {g}, ours {o}: {call}"
                                for s, call, r, g, o in worse[:20])
    ours, lone = counts["collectives"], counts["collectives lone"]
    assert ours["wrong"] == ours["broken"] == lone["wrong"] == 0, (ours, lone)
    # the program mostly runs
    assert ours["right"] + ours["returned"] > 0.7 * sum(ours.values()), ours
    assert sum(lone.values()) == 3 * len(seeds) * world_size, lone
    assert better, "no call where gloo failed and ours did not: the program drew none"
