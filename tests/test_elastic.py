"""Elastic training as processes live it: a member killed, a newcomer, too few left.

Each test starts the members of a small job (tests/elastic_trainer.py: a linear model,
gradients all-reduced, collectives.elastic's State and run) against a membership
store of its own, and reads what each member saved at the end."""
import os
import subprocess
import sys
import time

import pytest
import torch

from collectives.elastic.store import serve
from distributed import run_world

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Job:
    def __init__(self, folder):
        self.store, self.folder, self.members = serve(0), folder, {}

    def start(self, name, *flags):
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        self.members[name] = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "elastic_trainer.py"), str(self.store.port),
             name, str(self.folder / f"{name}.pt"), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def finish(self, timeout=150):
        """{name: (exit code, stderr)}; kills every member if one outlives `timeout`."""
        ended, deadline = {}, time.monotonic() + timeout
        try:
            for name, process in self.members.items():
                _, err = process.communicate(timeout=max(deadline - time.monotonic(), 1))
                ended[name] = (process.returncode, err)
        finally:
            for process in self.members.values():
                process.kill()
        return ended

    def saved(self, name):
        return torch.load(self.folder / f"{name}.pt", weights_only=False)


@pytest.mark.timeout(200)
def test_survivors_of_a_killed_member_train_the_rest_of_the_data_and_agree(tmp_path):
    job = Job(tmp_path)
    for name in "abc":
        job.start(name, "--expected", "3", *(["--die-at", "10"] if name == "c" else []))
    ended = job.finish()
    assert ended["c"][0] == 9 and ended["a"][0] == ended["b"][0] == 0, ended
    a, b = job.saved("a"), job.saved("b")
    assert a["generations"] == b["generations"] == [(0, 3), (1, 2)]
    # epoch 1: 10 steps of 3 x 8 images, the other 240 in 15 steps of 2 x 8; epoch 2: 30
    assert a["steps"] == b["steps"] == 10 + 15 + 30
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.timeout(200)
def test_a_newcomer_takes_the_state_and_ends_bitwise_equal_to_the_others(tmp_path):
    job = Job(tmp_path)
    for name in "ab":  # long enough for a newcomer's start (its imports take seconds)
        job.start(name, "--expected", "2", "--epochs", "30")
    deadline = time.monotonic() + 60
    while not (tmp_path / "a.pt.started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # a and b are training
    job.start("d", "--epochs", "30")
    ended = job.finish()
    assert all(code == 0 for code, _ in ended.values()), ended
    a, b, d = (job.saved(name) for name in "abd")
    assert a["generations"][0] == (0, 2) and a["generations"][-1][1] == 3, a["generations"]
    assert d["generations"] == [a["generations"][-1]]
    assert a["steps"] == b["steps"] == d["steps"]
    for other in (b, d):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], other["params"]))


@pytest.mark.timeout(200)
def test_below_min_ranks_every_survivor_ends_with_one_clear_line(tmp_path):
    job = Job(tmp_path)
    for name in "abc":
        job.start(name, "--expected", "3", "--min-ranks", "3", "--timeout", "15",
                  *(["--die-at", "5"] if name == "c" else []))
    ended = job.finish()
    for name in "ab":
        code, err = ended[name]
        assert code == 1, ended
        ours = [line for line in err.splitlines() if line.startswith("elastic_trainer: error")]
        assert len(ours) == 1 and "2 member(s) left, fewer than the 3 needed (min_ranks)" \
            in ours[0], err[-2000:]


def furthest_commit_wins(comm):
    """Ranks 0, 1, 2 committed 1, 2, 2 steps: after sync all hold rank 1's (the most
    commits; of those, the lowest rank)."""
    from collectives.elastic.state import State
    torch.manual_seed(comm.rank)  # different weights on each rank
    model = torch.nn.Linear(3, 1)
    state = State(model, torch.optim.SGD(model.parameters(), lr=0.1), step=0)
    for _ in range(1 + min(comm.rank, 1)):
        with torch.no_grad():
            model.weight.add_(1.0)
        state.step += 1
        state.commit()
    with torch.no_grad():
        model.weight.add_(100.0)  # after the last commit: lost
    state.sync(comm)
    return state.step, state.commits, model.weight.detach().clone()


@pytest.mark.timeout(120)
def test_sync_gives_every_member_the_furthest_commit_not_rank_0s():
    results = run_world(furthest_commit_wins, 3, timeout=100)
    torch.manual_seed(1)
    expected = torch.nn.Linear(3, 1).weight.detach() + 2.0
    for step, commits, weight in results:
        assert (step, commits) == (2, 2) and torch.equal(weight, expected), (step, weight)


@pytest.mark.timeout(120)
def test_a_member_that_drops_its_communicator_ends_a_peers_wait_at_once(tmp_path):
    store = serve(0)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    members = [subprocess.Popen([sys.executable, os.path.join(HERE, "elastic_blocked.py"),
                                 str(store.port), role], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
               for role in ("waiter", "dropper")]
    try:
        out, err = members[0].communicate(timeout=100)
    finally:
        for member in members:
            member.kill()
    waited = [line for line in out.splitlines() if line.startswith("waited")]
    assert waited, out + err[-2000:]
    assert float(waited[0].split()[1]) < 5.0, waited[0]  # not the 60 s timeout
