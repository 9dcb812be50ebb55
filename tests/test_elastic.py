"""Elastic training as processes live it: a member killed, a newcomer, too few left.

Each test starts the members of a small job (tests/elastic_trainer.py: a linear model,
gradients all-reduced, collectives.elastic's State and run) against a membership
store of its own, and reads what each member saved at the end."""
import json
import os
import subprocess
import time

import numpy as np
import pytest
import torch

from collectives.elastic.store import serve
from distributed import run_world
from launchers import ROOT, TESTS, mpirun, python, rank_env, run, trainer


class Job:
    def __init__(self, folder):
        self.store, self.folder, self.members = serve(0), folder, {}

    def start(self, name, *flags):
        self.members[name] = subprocess.Popen(
            python(os.path.join(TESTS, "elastic_trainer.py"), str(self.store.port), name,
                   str(self.folder / f"{name}.pt"), *flags),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env())

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
    for name in "ab":
        job.start(name, "--expected", "2", "--epochs", "5")
    # d starts with them (its imports take seconds) and comes once they trained 2 epochs
    job.start("d", "--epochs", "5", "--join-after", str(tmp_path / "a.pt.epoch2"))
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
        job.start(name, "--expected", "3", "--min-ranks", "3", "--timeout", "10",
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


def sync_sends_only_where_commits_differ(comm, alike):
    """Every rank commits the same steps; `alike` False: rank 2's weights differ (as a
    newcomer resumed from another run's checkpoint with as many commits would). Returns
    whether sync sent the whole state (a torch.save payload: uint8), the weight and the
    running mean it ended with."""
    from collectives.elastic import state as elastic_state
    model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.BatchNorm1d(1))
    with torch.no_grad():
        model[0].weight.fill_(2.0 if comm.rank == 2 and not alike else 1.0)
        model[1].running_mean.fill_(comm.rank)  # each rank's own statistics: not state
    state = elastic_state.State(model, torch.optim.SGD(model.parameters(), lr=0.1), step=0)
    state.step += 1
    state.commit()
    dtypes, broadcast = [], elastic_state.api.broadcast
    elastic_state.api.broadcast = lambda *a, **k: dtypes.append(a[0].dtype) or broadcast(*a, **k)
    try:
        state.sync(comm)
    finally:
        elastic_state.api.broadcast = broadcast
    return (torch.uint8 in dtypes, model[0].weight.detach().clone(),
            model[1].running_mean.detach().clone())


def test_the_digest_tells_apart_what_feeds_the_same_values():
    from collectives.elastic.state import _digest
    pairs = [([12, 3], [1, 23]), ([[1], 2], [1, [2]]), ({}, []), ((1, 2), [1, 2]),
             (torch.zeros(2, dtype=torch.float32), torch.zeros(1, dtype=torch.float64)),
             (torch.zeros(2, 3), torch.zeros(3, 2)), ({"a": 1}, {"a": 1.0}),
             (np.zeros(2000), np.concatenate([np.zeros(1999), [1e-9]])),
             (np.float64(0.1234567891), np.float64(0.1234567892))]
    for one, other in pairs:
        assert _digest(one) != _digest(other), (one, other)
    assert _digest({"b": torch.ones(3), "a": [1, 2.5]}) == \
        _digest({"a": [1, 2.5], "b": torch.ones(3)})  # the same state, keys in any order


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alike", [True, False])
def test_sync_sends_the_state_only_where_members_hold_different_commits(alike):
    results = run_world(sync_sends_only_where_commits_differ, 3, timeout=100, args=(alike,))
    for sent_state, weight, running_mean in results:
        assert sent_state == (not alike), results
        assert torch.equal(weight, torch.ones(1, 3)), results  # rank 0's, on every rank
        assert torch.equal(running_mean, torch.zeros(1)), results  # and its buffers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["dropper", "holder"])
def test_a_member_that_drops_its_communicator_ends_a_peers_wait_at_once(tmp_path, role):
    store = serve(0)
    members = [subprocess.Popen(python(os.path.join(TESTS, "elastic_blocked.py"),
                                       str(store.port), role), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=rank_env())
               for role in ("waiter", role)]
    try:
        out, err = members[0].communicate(timeout=100)
        _, dropped = members[1].communicate(timeout=60)  # closes its stdin: it may end
    finally:
        for member in members:
            member.kill()
    waited = [line for line in out.splitlines() if line.startswith("waited")]
    assert waited, out + err[-2000:]
    assert float(waited[0].split()[1]) < 5.0, waited[0]  # not the 60 s timeout
    assert members[1].returncode == 0, dropped[-2000:]  # and the one that let go lives on


# --- python -m trainer --elastic ---------------------------------------------------------
TRAINER_FLAGS = ("--train-samples", "240", "--test-samples", "64", "--batch-size", "8",
                 "--epochs", "3", "--progress", "off", "--timeout", "20")


# python -c NEWCOMER TEXT FILE... -- ARGS: a newcomer's start. Its imports take seconds;
# done, it waits until one of FILES holds TEXT, then runs `python -m trainer ARGS`.
NEWCOMER = """
import sys, time
from trainer.loop.train import main
end = sys.argv.index("--")
text, logs = sys.argv[1], sys.argv[2:end]
while not any(text in open(log).read() for log in logs):
    time.sleep(0.1)
main(sys.argv[end + 1:])
"""


class TrainerJob:
    """Ranks of `python -m trainer --elastic` against a store of the test's own; the first
    ones are started as a launcher does (RANK, WORLD_SIZE), newcomers without."""

    def __init__(self, folder, launched):
        self.store, self.folder, self.launched, self.ranks = serve(0), folder, launched, []

    def start(self, *flags, rank=None, once=None):
        """once: a newcomer that comes once some rank has printed `once` (started now,
        so that its imports are done by then)."""
        env = rank_env()
        if rank is not None:
            env.update(RANK=str(rank), WORLD_SIZE=str(self.launched))
        command = trainer("--elastic", "--store", f"127.0.0.1:{self.store.port}",
                          "--metrics", str(self.folder / "metrics.jsonl"), *TRAINER_FLAGS,
                          *flags)
        if once is not None:  # the ranks' outputs, then what follows `python -m trainer`
            command = python("-c", NEWCOMER, once, *(str(self.folder / f"out-{i}.txt")
                                                     for i in range(len(self.ranks))),
                             "--", *command[3:])
        out = open(self.folder / f"out-{len(self.ranks)}.txt", "w+")
        self.ranks.append((subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, cwd=ROOT), out))

    def output(self, index):
        with open(self.folder / f"out-{index}.txt") as out:
            return out.read()

    def wait_for(self, text, timeout=90):
        """Until some rank has printed `text`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in self.output(i) for i in range(len(self.ranks))):
                return
            time.sleep(0.2)
        raise AssertionError(f"no rank printed {text!r}")

    def finish(self, timeout=150):
        """Every rank's exit code; kills them all if one outlives `timeout`."""
        codes, deadline = [], time.monotonic() + timeout
        try:
            for process, _ in self.ranks:
                codes.append(process.wait(timeout=max(deadline - time.monotonic(), 1)))
        finally:
            for process, out in self.ranks:
                process.kill()
                out.close()
        return codes

    def records(self):
        with open(self.folder / "metrics.jsonl") as lines:
            return [json.loads(line) for line in lines]


@pytest.mark.timeout(300)
def test_a_rank_that_comes_joins_at_the_next_step_and_the_job_outlives_a_killed_one(tmp_path):
    """Two ranks launched; a third comes and joins them at their next step; then one of
    the first two is killed, and the newcomer and the other end every epoch (the two
    behaviours in one job: each job's start, 3 trainers' imports, is most of its time)."""
    job = TrainerJob(tmp_path, launched=2)
    for rank in range(2):
        job.start("--min-ranks", "2", rank=rank)
    job.start("--min-ranks", "2", once="generation 0: 2 rank(s)")
    job.wait_for("generation 1: 3 rank(s)")
    time.sleep(2)  # into its steps
    job.ranks[1][0].kill()
    codes = job.finish()
    outputs = "\n".join(job.output(i) for i in range(3))
    assert codes[0] == codes[2] == 0, outputs[-3000:]
    assert "generation 2: 2 rank(s)" in outputs, outputs[-3000:]
    records = job.records()
    assert [r["epoch"] for r in records] == [1, 2, 3], records
    assert records[-1]["world_size"] == 2 and records[-1]["test_acc"] > 0.2, records
    assert "done in" in outputs


@pytest.mark.timeout(200)
def test_mpirun_is_refused_on_every_rank_with_one_line_before_training():
    """mpirun (MPICH's here, which names its ranks "mpich") ends every rank when one
    dies: nothing would be left to go on, so --elastic refuses it at once."""
    store = serve(0)  # where a run that was not refused would train
    done = run(mpirun(2, *trainer("--elastic", "--store", f"127.0.0.1:{store.port}",
                                  "--train-samples", "64", "--test-samples", "32",
                                  "--batch-size", "16", "--epochs", "1", "--progress", "off",
                                  "--timeout", "10")), timeout=150, check=False)
    refusal = ("trainer: error: --elastic: mpirun (mpich) ends every rank when one dies; "
               "start the ranks one by one, with collectives.cluster, or with one "
               "--standalone torchrun per host")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [refusal, refusal], done.stderr[-2000:]
    assert "generation" not in done.stdout, done.stdout


# --- on the emulated cluster: a host killed, a host cut off and back --------------------
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"],
                                        capture_output=True).returncode,
    reason="the emulated cluster needs root and iproute2")


@needs_root
@pytest.mark.xdist_group("machine")  # the emulated cluster: one such test at a time
@pytest.mark.timeout(300)
def test_on_the_cluster_a_killed_host_stays_out_and_a_cut_one_comes_back(tmp_path):
    """3 hosts, the store on the switch: node1 is killed at 20 s, node2's link is down
    from 30 s to 40 s, longer than the transport's timeout (6 s). The job goes on without node1, takes node2 back, and exits 0 (node1's status
    does not count); node0 and node2 end with the same parameters."""
    done = run(python("-m", "collectives.cluster", "--hosts", "3", "--elastic-store",
                      "--kill", "node1@20", "--cut", "node2@30:10", "--",
                      *python(os.path.join(TESTS, "elastic_trainer.py"), "env", "-",
                              str(tmp_path / "{host}.pt"), "--expected", "3", "--epochs",
                              "16", "--step-seconds", "0.1", "--timeout", "6")),
               timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "node1 killed at" in done.stderr and "node2 plugged back in" in done.stderr
    assert not (tmp_path / "node1.pt").exists()
    node0, node2 = (torch.load(tmp_path / f"{host}.pt", weights_only=False)
                    for host in ("node0", "node2"))
    sizes = [size for _, size in node0["generations"]]
    assert sizes[-1] == 2 and 1 in sizes[1:], sizes  # node0 alone while node2 was cut off
    assert node0["steps"] == node2["steps"]
    assert all(torch.equal(x, y) for x, y in zip(node0["params"], node2["params"]))


@pytest.mark.timeout(200)
def test_an_elastic_checkpoint_resumes_with_elastic_in_a_new_job_only(tmp_path):
    """--checkpoint-dir keeps the commit: --elastic --resume goes on from the next epoch
    (in a new job, with a store of its own); the finished job's store turns a rank away
    with one line."""
    def elastic_run(store, *flags):
        return run(trainer("--elastic", "--store", f"127.0.0.1:{store.port}",
                           "--train-samples", "32", "--test-samples", "16", "--batch-size",
                           "16", "--progress", "off", "--timeout", "10", "--checkpoint-dir",
                           str(tmp_path), *flags), timeout=150, check=False)

    first = serve(0)
    done = elastic_run(first, "--epochs", "1")
    assert done.returncode == 0 and "epoch 1/1" in done.stdout, done.stderr[-2000:]
    resumed = elastic_run(serve(0), "--epochs", "2", "--resume", str(tmp_path / "checkpoint.pt"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "from epoch 2, image 0, step 2" in resumed.stdout, resumed.stdout
    assert "epoch 1/2" not in resumed.stdout and "epoch 2/2" in resumed.stdout
    late = elastic_run(first, "--epochs", "2", "--resume", str(tmp_path / "checkpoint.pt"))
    assert late.returncode == 1
    assert late.stderr.strip().splitlines()[-1] == ("trainer: error: the job has finished: "
                                                    "there is nothing to join"), late.stderr
