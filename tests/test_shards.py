"""--shards dynamic: each epoch's steps go to whichever rank asks, each image once."""
import itertools
import math
import threading
import time

import pytest
import torch

from distributed import run_world
from launchers import LAUNCHERS, run, trainer
from test_trainer import read_metrics
from trainer.loop.dynamic_shards import ClaimCounter, DynamicShards, progress_schedule


class LocalCounter:
    """ClaimCounter's contract in one process: each value to one caller."""

    def __init__(self):
        self.counters, self.lock = {}, threading.Lock()

    def take(self, key):
        with self.lock:
            counter = self.counters.setdefault(key, itertools.count())
            return next(counter)


def test_each_image_of_an_epoch_goes_to_exactly_one_rank_however_they_pace():
    counter = LocalCounter()
    size, batch, accum = 103, 4, 2  # 12 claims of 8 images; 7 images wait for next epoch
    ranks = [DynamicShards(size, batch, accum, seed=5, counter=counter, world_size=2)
             for _ in range(2)]
    for epoch in (1, 2):
        for shards in ranks:
            shards.set_epoch(epoch)
        streams, taken, done = [iter(shards) for shards in ranks], [[], []], [False, False]
        # rank 0 asks for three steps' images for each one rank 1 asks for
        for turn in itertools.cycle([0, 0, 0, 1]):
            if all(done):
                break
            if not done[turn]:
                try:
                    taken[turn].append([next(streams[turn]) for _ in range(accum)])
                except StopIteration:
                    done[turn] = True
        images = [i for steps in taken for step in steps for micro in step for i in micro]
        generator = torch.Generator()
        generator.manual_seed(5 + epoch)
        order = torch.randperm(size, generator=generator).tolist()
        assert sorted(images) == sorted(order[:12 * 8]), "an image lost or trained twice"
        assert all(len(micro) == batch for steps in taken for step in steps for micro in step)
        assert len(taken[0]) == 9 and len(taken[1]) == 3, [len(t) for t in taken]
        # the last claim (rank 1's) sets its position: claims of every epoch before
        assert ranks[1].position == (epoch - 1) * 12 + 11, ranks[1].position


def test_the_learning_rate_follows_the_claims_of_every_rank_not_the_steps_of_one():
    counter = LocalCounter()
    shards = DynamicShards(64, 4, 1, seed=0, counter=counter, world_size=4)  # 16 claims
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = progress_schedule(optimizer, shards, epochs=2, cosine=True)
    shards.set_epoch(2)
    for _ in range(10):  # other ranks took claims 0-9 of epoch 2
        counter.take("epoch 2")
    next(iter(shards))  # this rank's first step of the epoch: claim 10
    optimizer.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        0.5 * (1 + math.cos(math.pi * (16 + 10) / 32)))


def claims_of_a_fast_and_a_slow_rank(comm, claims):
    """Every rank takes claims from one ClaimCounter until they run out, the last rank
    ten times slower than the others. Returns the claims this rank took."""
    counter = ClaimCounter.open(comm, timeout=30)
    taken = []
    while True:
        claim = counter.take("epoch 1")
        if claim >= claims:
            break
        taken.append(claim)
        time.sleep(0.02 if comm.rank == comm.world_size - 1 else 0.002)
    comm.barrier()  # the store lives in rank 0: it stays up until every rank is done
    return taken


@pytest.mark.timeout(120)
def test_the_counter_is_shared_by_every_rank_and_a_slow_rank_takes_less():
    taken = run_world(claims_of_a_fast_and_a_slow_rank, 3, args=(300,), timeout=100)
    every = [claim for mine in taken for claim in mine]
    assert sorted(every) == list(range(300)), "a claim was taken twice, or by nobody"
    assert len(taken[2]) < min(len(taken[0]), len(taken[1])) / 2, [len(t) for t in taken]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_async_avg_trains_each_epoch_once_across_ranks_under_mpirun(backend, tmp_path):
    # 64 images, batch 16: 4 steps an epoch, dealt between the 2 ranks as they ask
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--train-samples", "64", "--test-samples", "32", "--batch-size", "16",
             "--epochs", "2", "--sync", "async-avg", "--backend", backend,
             "--metrics", str(metrics)]
    out = run(LAUNCHERS["mpirun"](2, trainer(*flags)), tmp_path)
    assert "shards dynamic" in out.stdout, out.stdout
    records = read_metrics(metrics)
    assert [sum(record["steps_by_rank"]) for record in records] == [4, 4], records


def dynamic_runs(comm, folder):
    """async-avg on dynamic shards, in process: 5 steps an epoch (odd, so the 2 ranks
    take unequal parts) with --skip-nonfinite (a per-step question the ranks must not
    ask each other); then resumed for a second epoch; then resumed with --shards static,
    which must refuse. Returns (first records, resumed records, the refusal's exit code)."""
    import os
    from checks_trainer import trainer_on
    from trainer.loop import train
    flags = ["--sync", "async-avg", "--train-samples", "80", "--test-samples", "16",
             "--batch-size", "16", "--skip-nonfinite", "--timeout", "30"]
    paths = [os.path.join(folder, name) for name in ("first.jsonl", "resumed.jsonl")]
    checkpoint = os.path.join(folder, "checkpoint.pt")
    with trainer_on(comm):
        train.train([*flags, "--epochs", "1", "--checkpoint-dir", folder,
                     "--metrics", paths[0]])
        comm.barrier()  # rank 0 has written the checkpoint
        train.train([*flags, "--epochs", "2", "--resume", checkpoint, "--metrics", paths[1]])
        try:
            train.train([*flags, "--epochs", "2", "--resume", checkpoint, "--shards", "static"])
            refused = None
        except SystemExit as exited:
            refused = exited.code
    if comm.rank != 0:
        return None, None, refused
    return read_metrics(paths[0]), read_metrics(paths[1]), refused


@pytest.mark.timeout(200)
def test_dynamic_shards_take_uneven_steps_skip_alone_and_resume(tmp_path):
    results = run_world(dynamic_runs, 2, args=(str(tmp_path),), timeout=180)
    first, resumed, refused = results[0]
    assert [r["epoch"] for r in first] == [1] and [r["epoch"] for r in resumed] == [2]
    assert sum(first[0]["steps_by_rank"]) == sum(resumed[0]["steps_by_rank"]) == 5
    assert [result[2] for result in results] == [2, 2], "resumed with other --shards"
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert saved["args"]["shards"] == "dynamic"
    assert [rank["step"] for rank in saved["ranks"]] == first[0]["steps_by_rank"]
