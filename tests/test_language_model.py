"""The language model: its text, its task in the trainer's loop, and resume bit for bit
with AdamW under every sync strategy (spawned gloo ranks, in process)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from checks_language import both_tasks, resumed_language_runs
from distributed import run_world
from test_trainer import RESUMABLE, assert_same
from trainer.tasks import text


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """A small folder of real text: 60 of the standard library's modules (about 1 MB),
    so that runs read little and one in twenty files is still held out."""
    folder = tmp_path_factory.mktemp("text")
    root = os.path.dirname(os.__file__)
    for name in text.stdlib_files(root)[:400:5]:
        target = folder / name.replace(os.sep, "_")
        target.write_bytes(open(os.path.join(root, name), "rb").read())
    return str(folder)


SPLIT_DIGEST = ("import hashlib, trainer.tasks.text as t; s = t.read_text('stdlib', None); "
                "print(s.files, len(s.train), len(s.test), "
                "hashlib.sha1(s.test.tobytes()).hexdigest())")


def test_the_split_is_the_same_in_every_process_and_held_out_files_are_never_trained_on():
    # Python's hash() is salted per process: the split must not depend on it
    seen = {subprocess.run([sys.executable, "-c", SPLIT_DIGEST], capture_output=True,
                           text=True, check=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(seen) == 1, seen
    names = text.stdlib_files()
    held = [name for name in names if text.held_out(name)]
    assert 0.02 < len(held) / len(names) < 0.1  # about one in twenty
    assert not any(part in text.TEST_FOLDERS for name in names
                   for part in name.split(os.sep)[:-1])
    split = text.read_text("stdlib", None)
    assert split.files == (len(names) - len(held), len(held))
    assert len(split.train) > 5_000_000 and len(split.test) > 100_000


def test_ranks_draw_disjoint_windows_the_same_way_again_and_new_ones_each_epoch():
    def drawn(rank, epoch):
        sampler = text.WindowSampler(10_000_000, per_rank=50, rank=rank, world_size=3, seed=7)
        sampler.set_epoch(epoch)
        return list(sampler)
    ranks = [drawn(rank, 1) for rank in range(3)]
    assert all(len(offsets) == 50 for offsets in ranks)
    assert not set(ranks[0]) & set(ranks[1]) and not set(ranks[1]) & set(ranks[2])
    assert drawn(1, 1) == ranks[1]          # a resumed run draws the same
    assert drawn(1, 2) != ranks[1]          # another epoch, other windows
    windows = text.TrainingWindows(np.arange(100, dtype=np.uint8), context=8)
    inputs, targets = windows[5]
    assert inputs.tolist() == list(range(5, 13)) and targets.tolist() == list(range(6, 14))
    held = text.HeldOutWindows(np.arange(100, dtype=np.uint8), context=8, count=4)
    starts = [int(held[i][0][0]) for i in range(len(held))]
    assert len(held) == 4 and all(s % 8 == 0 for s in starts) and starts == sorted(starts)


@pytest.mark.timeout(240)
def test_both_tasks_train_through_the_same_loop_and_the_language_model_learns(
        tmp_path, text_dir):
    result = run_world(both_tasks, 2, (str(tmp_path), text_dir), timeout=220)[0]
    images, language = result["images"], result["language"]
    assert [r["epoch"] for r in images["records"]] == [1, 2]
    assert "test acc" in images["printed"] and "img/s" in images["printed"]
    records = language["records"]
    assert [r["step"] for r in records] == [20, 40, 60]
    bpb = [r["test_bpb"] for r in records]
    # from a uniform guess (8 bits per byte) it learns the bytes' frequencies and more
    assert bpb[0] < 6.5 and bpb[-1] < bpb[0] - 0.3, bpb
    assert all(r["tokens_per_s"] > 0 and r["sent_total"] > 0 for r in records)
    assert records[-1]["sent_total"] > records[0]["sent_total"]
    assert "bits/byte" in language["printed"] and "tok/s" in language["printed"]
    assert "gpt-nano (0.03 M parameters, context 32)" in language["printed"]
    for tag in ("by_step/held_out_bpb", "by_MiB_sent/held_out_bpb",
                "by_seconds/held_out_bpb", "train/loss"):
        assert tag in result["tags"], result["tags"]
    assert result["train_steps"] == list(range(1, 61))


# Every resumable strategy, with AdamW (the language model's default): epochs of 6 steps
# (streaming DiLoCo: 7, its fragment in flight at the save after step 7, as in
# test_trainer.py), two of them straight and the second again from the first's
# checkpoint. torchft's DiLoCo is an optional extra.
def language_cases():
    cases = []
    for case, flags in RESUMABLE.items():
        sync = case.split()[0]
        if sync == "torchft-diloco":
            try:
                import torchft  # noqa: F401
            except ImportError:
                continue
        flags = [flag for flag in flags]
        if "--train-samples" in flags:  # the image task's way to make 7 steps an epoch
            at = flags.index("--train-samples")
            del flags[at:at + 2]
            steps = ["--steps", "14", "--eval-every", "7"]
        else:
            steps = ["--steps", "12", "--eval-every", "6"]
        cases.append((case, ["--sync", sync, *flags, *steps]))
    return cases


@pytest.mark.timeout(280)
def test_resume_continues_every_rank_bit_for_bit_with_adamw_for_every_strategy(
        tmp_path, text_dir):
    cases = language_cases()
    run_world(resumed_language_runs, 2, (str(tmp_path), text_dir, cases), timeout=260)
    for case, _ in cases:
        folder = tmp_path / case.replace(" ", "_")
        straight = torch.load(folder / "straight" / "checkpoint.pt", weights_only=False)
        resumed = torch.load(folder / "resumed" / "checkpoint.pt", weights_only=False)
        assert straight["epoch"] == resumed["epoch"] == 2, case
        # AdamW, but for 1-bit Adam, whose Adam is in the strategy (SGD takes its update)
        adam_in_strategy = case == "onebit-adam"
        assert straight["args"]["optimizer"] == ("sgd" if adam_in_strategy else "adamw"), case
        for key in ("model", "step", "test_bpb"):
            assert_same(straight[key], resumed[key], f"{case}: {key}")
        for rank, (expected, actual) in enumerate(zip(straight["ranks"], resumed["ranks"])):
            assert_same(expected, actual, f"{case}: rank {rank}")
        if adam_in_strategy:  # its variance, frozen after the warm-up
            assert straight["ranks"][0]["strategy"]["v"].abs().sum() > 0, case
        else:
            assert "exp_avg_sq" in str(straight["ranks"][0]["optimizer"]), case  # AdamW's
