"""delayed: a one-step-stale gradient, its compensation, and that it still trains."""
from datetime import timedelta

import pytest
import torch

from checks_delayed import delayed_against_allreduce
from checks_sync import mlp
from collectives import sync
from collectives.transport.local import LocalTransport
from distributed import run_world


def test_unknown_compensation_is_refused():
    with pytest.raises(ValueError, match="compensate must be one of momentum, dc, none"):
        sync.create("delayed", compensate="nesterov")


def test_momentum_compensation_lowers_only_its_own_models_optimizer_and_puts_it_back():
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    model, other = mlp(), mlp()
    strategy = sync.create("delayed", warmup_steps=0)
    strategy.setup(model, comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bystander = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):  # lowered once, however many steps
        model(torch.randn(4, 20, dtype=torch.float64)).sum().backward()
        strategy.after_backward(model)
        optimizer.step()
        bystander.step()
    assert optimizer.param_groups[0]["momentum"] == pytest.approx(0.4)
    assert optimizer.param_groups[0]["explicit_momentum"] == 0.9
    assert bystander.param_groups[0]["momentum"] == 0.9
    strategy.close()
    assert optimizer.param_groups[0]["momentum"] == 0.9
    assert "explicit_momentum" not in optimizer.param_groups[0]


def test_warmup_steps_apply_their_own_average_and_later_steps_the_one_before():
    comm = LocalTransport(torch.device("cpu"), timedelta(seconds=30))
    model = mlp()
    strategy = sync.create("delayed", warmup_steps=2, compensate="none")
    strategy.setup(model, comm)
    computed, applied = [], []
    for step in range(4):
        model.zero_grad()
        model(torch.randn(4, 20, dtype=torch.float64)).sum().backward()
        computed.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        strategy.after_backward(model)
        applied.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    strategy.close()
    for step, expected in [(0, computed[0]), (1, computed[1]),   # synchronous
                           (2, torch.zeros_like(computed[2])),   # late: nothing yet
                           (3, computed[2])]:                     # step 3's, a step late
        assert torch.equal(applied[step], expected), f"step {step + 1}"


# A small BatchNorm network on the embedded shapes, 2 ranks, 48 steps of the trainer's
# optimizer: at lr 0.5 it is as sharp, for a stale gradient, as the trainer's ResNet-18
# at 0.05. Measured over seeds 0-4 (this test runs seed 0, deterministic): allreduce
# 86-97 %; delayed at its defaults (32 synchronous steps, then 16 late ones at the
# lowered momentum) from 0.6 points below it to 5 above (seed 0: 0.6 below); late from
# the first step and uncompensated, 25-66 points below (seed 0: 66).
RUNS = {"allreduce": ("allreduce", {}), "delayed": ("delayed", {}),
        "uncompensated": ("delayed", {"compensate": "none", "warmup_steps": 0})}


@pytest.mark.timeout(150)
def test_delayed_at_its_defaults_ends_within_a_few_points_of_allreduce():
    accuracy = run_world(delayed_against_allreduce, 2, (RUNS, 0.5), timeout=130)[0]
    assert accuracy["allreduce"] > 0.9, accuracy
    assert accuracy["uncompensated"] < accuracy["allreduce"] - 0.2, accuracy  # the failure
    assert accuracy["delayed"] >= accuracy["allreduce"] - 0.06, accuracy
