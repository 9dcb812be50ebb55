"""The trainer as users run it: every launch mode, resume, what is evaluated, bad input."""
import importlib.util
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch

from checks_trainer import (case_folder, epoch_records, extended_by_resume,
                            overflowing_first_backward, printed_by_runs, resumed_runs,
                            train_then_eval_only)
from distributed import run_world
from launchers import LAUNCHERS, python, run, trainer
from ports import free_port

TINY = ["--train-samples", "32", "--test-samples", "16", "--batch-size", "16", "--epochs", "1"]


def read_metrics(path):
    with open(path) as lines:
        return [json.loads(line) for line in lines]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_short_run_in_each_launch_mode(launcher, tmp_path):
    world = 1 if launcher == "plain" else 2
    metrics = tmp_path / "metrics.jsonl"
    out = run(LAUNCHERS[launcher](world, trainer(*TINY, "--metrics", str(metrics))), tmp_path)
    assert f"with {world} rank(s)" in out.stdout, out.stdout
    assert "epoch 1/1: train loss" in out.stdout and "done in" in out.stdout
    (record,) = read_metrics(metrics)
    assert set(record) >= {"epoch", "train_loss", "test_acc", "images_per_s", "comm_bytes",
                           "seconds"}
    assert (record["comm_bytes"] > 0) == (world > 1)


@pytest.mark.timeout(180)
def test_the_tutorials_launcher_passes_local_rank_and_both_ranks_finish(tmp_path):
    # torch.distributed.launch (deprecated, still in torch) puts --local-rank=N before the
    # trainer's own flags; the launcher exits 0 only when every rank did.
    launch = python("-m", "torch.distributed.launch", "--nproc-per-node", "2",
                    "--master-port", str(free_port()), "--module", "trainer")
    one_step = ["--train-samples", "16", "--test-samples", "8", "--batch-size", "8",
                "--epochs", "1"]
    out = run([*launch, *one_step], tmp_path, timeout=150, check=False)
    assert "unrecognized arguments" not in out.stderr, out.stderr
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "with 2 rank(s)" in out.stdout and "done in" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_resume_equals_uninterrupted_run_bitwise(tmp_path):
    # Stopping after epoch 1 and resuming with --epochs 2 extends the run, so the lr must
    # not depend on --epochs: a constant schedule. (A run killed and resumed with the
    # same command under mpirun, cosine schedule included, is tests/fault_injection.py's
    # resume case.)
    flags = ["--train-samples", "32", "--test-samples", "16", "--batch-size", "8",
             "--schedule", "constant"]
    run_world(extended_by_resume, 2, (str(tmp_path), flags), timeout=100)
    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    resumed = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert straight["epoch"] == resumed["epoch"] == 2
    assert_same(straight["model"], resumed["model"], "model")
    for rank, (expected, actual) in enumerate(zip(straight["ranks"], resumed["ranks"])):
        assert_same(expected, actual, f"rank {rank}")


# Every strategy and torch peer that can resume bit for bit (async-avg cannot: its rounds
# go at the pace the ranks happen to run), with options that keep state across the epoch
# boundary. 2 ranks x 24 images / 4 per batch: 6 steps per epoch. Local SGD averages after
# steps 5, 9 (warm-up 1, period 4): at the save after step 6 the replicas differ, and the
# warm-up is long over (a resumed run that forgot its steps would average gradients).
# Hierarchical local SGD: inside the host after step 3, everywhere after step 5, ...
# Streaming DiLoCo, 2 fragments of period 8 with a delay of 2, 7 steps an epoch: fragment
# 0 is sent after step 2 and merged after step 4, fragment 1 sent after step 6, still in
# flight at the save after step 7, and merged after step 8.
LOCAL_SGD = ["--sync-option", "period=4", "--sync-option", "warmup_steps=1"]
HIER = [*LOCAL_SGD, "--sync-option", "local_period=2"]
STREAMING = ["--sync-option", "period=8", "--sync-option", "fragments=2",
             "--sync-option", "delay=2", "--train-samples", "56"]
# DiLoCo after a warm-up of 5 synchronous steps, period 4: outer steps after steps 9, 13,
# ...; the save after step 6 is past the warm-up (a resumed run that forgot it would
# average gradients again), and the replicas differ at the end (step 12).
WARMED_UP = ["--sync-option", "warmup_steps=5", "--sync-option", "period=4"]
# The low-communication methods: syncs after steps 4, 8, 12, so the save after step 6
# holds replicas and error buffers that differ by rank (NoLoCo's pair is the whole world
# of 2: its slow weights and momentum are alike; its pairing on 3 ranks is resumed in
# test_lowcomm_pairs); DeMo every step; 1-bit Adam past its warm-up (3 steps) at the
# save, with the plain SGD it hands its update to.
PERIOD_4 = ["--sync-option", "period=4"]
ONEBIT = ["--sync-option", "freeze_step=3", "--optimizer", "sgd", "--momentum", "0",
          "--clip-grad", "0"]
RESUMABLE = {"allreduce": [], "fp16": [], "bf16": [], "topk": [], "powersgd": [],
             "delayed": ["--sync-option", "warmup_steps=1"],  # synchronous, then late
             "local-sgd": LOCAL_SGD, "gossip": [], "ddp": [],
             "ddp-collectives": [], "ddp-fp16": [], "ddp-bf16": [], "ddp-powersgd": [],
             "ddp-localsgd": LOCAL_SGD, "hier-local-sgd": HIER, "ddp-hier-localsgd": HIER,
             "diloco": STREAMING, "torchft-diloco": STREAMING, "diloco warm-up": WARMED_UP,
             "topk --amp fp16": ["--amp", "fp16"],  # residuals and a changing loss scale
             "sparseloco": PERIOD_4, "demo": [], "muloco": PERIOD_4, "noloco": PERIOD_4,
             "sparta": ["--sync-option", "diloco_period=4"], "onebit-adam": ONEBIT}


def assert_same(straight, resumed, where="checkpoint"):
    """Bitwise equality of two checkpoint parts, however nested: tensors (torch.equal),
    numpy arrays and random generators, dicts, lists and plain values."""
    assert type(straight) is type(resumed), f"{where}: {type(straight)} vs {type(resumed)}"
    if isinstance(straight, torch.Tensor):
        assert torch.equal(straight, resumed), f"{where} differs"
    elif isinstance(straight, dict):
        assert straight.keys() == resumed.keys(), f"{where}: {straight.keys()} vs {resumed.keys()}"
        for key in straight:
            assert_same(straight[key], resumed[key], f"{where}[{key!r}]")
    elif isinstance(straight, (list, tuple)):
        assert len(straight) == len(resumed), f"{where}: lengths differ"
        for index, (a, b) in enumerate(zip(straight, resumed)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(straight, np.ndarray):
        assert np.array_equal(straight, resumed), f"{where} differs"
    elif isinstance(straight, np.random.RandomState):  # torch's PowerSGD seeds Q from one
        assert_same(straight.get_state(), resumed.get_state(), where)
    else:
        assert straight == resumed, f"{where}: {straight!r} vs {resumed!r}"


def assert_resumed_bit_for_bit(folder, sync):
    """The checks of one case of the test below, on its folder's two last checkpoints."""
    straight = torch.load(folder / "straight" / "checkpoint.pt", weights_only=False)
    resumed = torch.load(folder / "resumed" / "checkpoint.pt", weights_only=False)
    assert straight["epoch"] == resumed["epoch"] == 2 and resumed["world_size"] == 2
    for key in ("model", "step", "test_acc"):
        assert_same(straight[key], resumed[key], key)
    for rank, (expected, actual) in enumerate(zip(straight["ranks"], resumed["ranks"])):
        assert_same(expected, actual, f"rank {rank}")
    if sync in ("local-sgd", "ddp-localsgd", "hier-local-sgd", "ddp-hier-localsgd", "diloco",
                "torchft-diloco"):  # the replicas did differ at the end
        models = [rank["model"] for rank in straight["ranks"]]
        assert any(not torch.equal(models[0][name], models[1][name]) for name in models[0]), \
            "the replicas were equal at the end"


@pytest.mark.timeout(400)
def test_resume_continues_every_rank_bit_for_bit(tmp_path):
    # For each case: two epochs straight, and the same command resumed from the straight
    # run's epoch-1 checkpoint: every rank's whole state at the end (replica, optimizer,
    # loss scale, schedule, strategy state, random generators) must be the same, bit for
    # bit. Every case in one spawned world, one after another (checks_trainer.py).
    cases = [case for case in RESUMABLE
             if case != "torchft-diloco" or importlib.util.find_spec("torchft")]
    if "torchft-diloco" not in cases:
        warnings.warn("torchft-diloco not checked: torchft is an optional extra "
                      "(pip install torchft)")
    run_world(resumed_runs, 2, (str(tmp_path), [
        (case, ["--train-samples", "48", "--test-samples", "16", "--batch-size", "4",
                "--sync", case.split()[0], *RESUMABLE[case]]) for case in cases]), timeout=360)
    wrong = {}
    for case in cases:
        try:
            assert_resumed_bit_for_bit(tmp_path / case_folder(case), case.split()[0])
        except AssertionError as error:
            wrong[case] = str(error)
    assert not wrong, wrong


@pytest.mark.timeout(120)
def test_an_epoch_counts_the_bytes_its_background_communication_sent(tmp_path):
    # delayed (late from the first step) all-reduces each step's gradients on a
    # background thread during the next step: the last step's is still in flight when
    # the loop ends. Counted in its epoch,
    # delayed sends what allreduce sends per step (the same gradients, once each); read
    # before it ends, the first epoch would miss a step's bytes (1 of the 3 here).
    flags = ["--train-samples", "24", "--test-samples", "4", "--batch-size", "4",
             "--epochs", "2"]
    per_step = {}
    for sync, options in (("allreduce", []), ("delayed", ["--sync-option", "warmup_steps=0"])):
        folder = tmp_path / sync
        folder.mkdir()
        records = run_world(epoch_records, 2,
                            (str(folder), [*flags, "--sync", sync, *options]), timeout=100)[0]
        per_step[sync] = [record["bytes_per_step"] for record in records]
    for epoch, (reference, delayed) in enumerate(zip(per_step["allreduce"], per_step["delayed"])):
        assert delayed == pytest.approx(reference, rel=0.05), (epoch + 1, per_step)


# Strategies whose replicas differ as the epoch ends: local SGD that last averaged a step
# before (3 steps, period 2), and gossip on 4 ranks (on 2 or 3 a gossip step averages
# every rank, which leaves the replicas equal).
REPLICAS_APART = {
    "local-sgd": (2, ["--sync", "local-sgd", "--sync-option", "period=2",
                      "--train-samples", "24", "--batch-size", "4"]),
    "gossip": (4, ["--sync", "gossip", "--train-samples", "16", "--batch-size", "2"]),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync", list(REPLICAS_APART))
def test_the_accuracy_printed_is_the_checkpoints_and_that_of_the_averaged_replicas(
        sync, tmp_path):
    world, flags = REPLICAS_APART[sync]
    results = run_world(train_then_eval_only, world, timeout=200,
                        args=([*flags, "--test-samples", "8"], str(tmp_path)))
    # evaluation scores a copy: no rank's training state changed
    assert [result["untouched"] for result in results] == [[True]] * world
    # the checkpoint's model is the mean of the replicas (integer buffers: rank 0's)
    replicas = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    assert any(not torch.equal(replicas[0][name], replicas[1][name]) for name in replicas[0]), \
        "the replicas are equal: this run cannot tell their average from rank 0's"
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["model"]
    for name, tensor in saved.items():
        if tensor.is_floating_point():
            mean = torch.stack([replica[name] for replica in replicas]).mean(0)
            torch.testing.assert_close(tensor, mean, msg=f"{name} is not the replicas' mean")
        else:
            assert torch.equal(tensor, replicas[0][name]), name
    # --eval-only on the checkpoint: exactly the accuracy (and loss) the epoch printed
    for result in results:
        (epoch_score, checkpoint_score) = result["scores"]
        assert checkpoint_score == epoch_score
    accuracy, printed = results[0]["scores"][0][0], results[0]["printed"]
    assert f"test acc {accuracy:.2%}" in printed, printed
    assert f"(epoch 1): test accuracy {accuracy:.2%}" in printed, printed
    assert "each epoch evaluates (and checkpoints) their average" in printed


@pytest.mark.timeout(120)
def test_eval_only_and_resuming_a_finished_run_report_the_checkpoints_accuracy(tmp_path):
    trained_run, eval_only, finished = run_world(printed_by_runs, 1, timeout=100, args=(
        str(tmp_path), [[*TINY, "--checkpoint-dir", "ckpt", "--metrics", "train.jsonl"],
                        ["--test-samples", "16", "--resume", "ckpt/checkpoint.pt",
                         "--eval-only", "--metrics", "eval.jsonl"],
                        [*TINY, "--resume", "ckpt/checkpoint.pt"]]))[0]
    assert [run["code"] for run in (trained_run, eval_only, finished)] == [0, 0, 0]
    (trained,) = read_metrics(tmp_path / "train.jsonl")
    (evaluated,) = read_metrics(tmp_path / "eval.jsonl")
    assert evaluated["eval_only"] and evaluated["test_acc"] == trained["test_acc"]
    assert f"test accuracy {trained['test_acc']:.2%}" in eval_only["stdout"]
    # The checkpoint ended epoch 1 of --epochs 1: nothing to train, and the last line
    # gives the accuracy it ended with (not the 0.00% of an epoch never run).
    out = finished["stdout"]
    assert "ended epoch 1 of --epochs 1: nothing left to train" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("done in") and f"test accuracy {trained['test_acc']:.2%}" in last


@pytest.mark.timeout(300)
def test_a_checkpoint_that_cannot_be_written_ends_the_job_with_one_line(tmp_path):
    # checkpoint.pt is a folder: rank 0's rename onto it fails. The job must end (the
    # other rank waits in the next collective) with one line, not a traceback.
    (tmp_path / "ckpt" / "checkpoint.pt").mkdir(parents=True)
    result = run(LAUNCHERS["mpirun"](2, trainer(*TINY, "--checkpoint-dir", "ckpt")),
                 tmp_path, check=False, timeout=200)
    assert result.returncode != 0
    assert "trainer: error: rank 0: cannot write the checkpoint ckpt/checkpoint.pt" in \
        result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert os.listdir(tmp_path / "ckpt") == ["checkpoint.pt"]  # no temporary file left


# A checkpoint that cannot be resumed, written directly (each keeps what the check needs).
RESUMABLE_KEYS = {"model": {}, "epoch": 1, "step": 2, "test_acc": 0.5, "args": {}}
UNRESUMABLE = {
    "saved by 2 ranks": ({**RESUMABLE_KEYS, "world_size": 2, "ranks": [{}, {}]},
                         "saved by 2 rank(s), resumed with 1: each rank continues its own "
                         "state, so resume with 2 rank(s)"),
    "older format": ({**RESUMABLE_KEYS, "optimizer": {}, "scaler": {}, "rng": {}},
                     "a checkpoint of an older format (no per-rank states"),
    "another sync": ({**RESUMABLE_KEYS, "world_size": 1,
                      "args": {"arch": "resnet18", "dataset": "shapes", "sync": "topk",
                               "sync_option": [], "amp": "off"},
                      "ranks": [dict.fromkeys(("model", "optimizer", "scaler", "schedule",
                                               "strategy", "rng"), {})]},
                     "saved with --sync topk, resumed with allreduce: its model and strategy "
                     "state belong to the flags that saved it"),
}


@pytest.mark.timeout(120)
def test_a_checkpoint_that_cannot_be_resumed_is_one_clear_line(tmp_path):
    for case, (saved, _) in UNRESUMABLE.items():
        torch.save(saved, tmp_path / f"{case}.pt")
    outcomes = run_world(printed_by_runs, 1, timeout=100, args=(
        str(tmp_path), [[*TINY, "--resume", f"{case}.pt"] for case in UNRESUMABLE]))[0]
    for (case, (_, message)), outcome in zip(UNRESUMABLE.items(), outcomes):
        assert outcome["code"] == 2, (case, outcome)
        last = outcome["stderr"].strip().splitlines()[-1]
        assert message in last and "Traceback" not in outcome["stderr"], (case, outcome)


# Saves a checkpoint and is SIGKILLed while torch.save writes it (pickling `Dies`).
KILLED_DURING_A_SAVE = """
import os, signal, sys, torch
from trainer.loop import checkpoint

class Dies:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

checkpoint.save_atomically({"weights": torch.zeros(1 << 20), "dies": Dies()}, sys.argv[1])
"""


@pytest.mark.timeout(120)
def test_a_save_removes_the_temporary_file_a_killed_save_left(tmp_path):
    from trainer.loop import checkpoint
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomically({"version": 1}, str(path))
    (tmp_path / ".tmp-someone-elses.pt").write_text("not ours")
    killed = run(python("-c", KILLED_DURING_A_SAVE, str(path)), tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr
    left = set(os.listdir(tmp_path)) - {"checkpoint.pt", ".tmp-someone-elses.pt"}
    assert len(left) == 1, f"the killed save left {left}"
    checkpoint.save_atomically({"version": 2}, str(path))
    assert sorted(os.listdir(tmp_path)) == [".tmp-someone-elses.pt", "checkpoint.pt"]
    assert checkpoint.load(str(path))["version"] == 2


# Flags a run must refuse before it connects or writes anything, and the line it says.
BAD_FLAGS = [
    (["--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["--lr", "-1"], "argument --lr: must be positive"),
    (["--sync", "bogus"], "invalid choice: 'bogus' (choose from 'allreduce'"),
    (["--algorithm", "butterfly"], "invalid choice: 'butterfly' (choose from 'auto', 'ring'"),
    (["--dataset", "mnist"], "--dataset mnist needs --data-dir"),
    (["--eval-only"], "--eval-only needs --resume"),
    (["--dataset", "mnist", "--data-dir", "missing"],
     "--dataset mnist: nothing at missing/MNIST/raw/train-images-idx3-ubyte"),
    (["--resume", "nowhere.pt"], "--resume nowhere.pt: no such checkpoint file"),
    (["--sync", "ddp", "--backend", "mpi"], "--sync ddp is torch's DDP: it runs on "
                                             "torch.distributed"),
    (["--sync", "ddp-fp16", "--sync-option", "period=2"], "ddp-fp16 takes no option(s) period"),
    (["--trace", "t", "--trace-steps", "4:2"], "need 1 <= FIRST <= LAST"),
    (["--shards", "dynamic"], "--shards dynamic: --sync allreduce meets every rank in a "
                              "collective every step"),
    (["--local-rank", "-1"], "argument --local-rank: must be 0 or more, got -1"),
    (["--elastic", "--sync", "topk"], "--elastic --sync topk: its ranks keep state of their "
                                      "own"),
    (["--elastic", "--accum-steps", "2"], "--elastic does not take --accum-steps"),
    (["--elastic"], "--elastic needs the membership store"),
    (["--elastic", "--store", "nohost"], "--store 'nohost': expected HOST:PORT"),
    (["--min-ranks", "2"], "--store and --min-ranks belong to --elastic"),
    (["--sync-option", "overlap=forward", "--amp", "fp16"],
     "--sync allreduce with overlap=forward does not take --amp fp16"),
    (["--sync-option", "overlap=sideways"], "allreduce: overlap must be one of backward, "
                                            "forward, got 'sideways'"),
    (["--sync", "onebit-adam", "--model", "gpt-nano"],  # the language task: AdamW, clip 1
     "--sync onebit-adam computes the whole update itself: it needs --optimizer sgd "
     "--momentum 0 --clip-grad 0 (got --optimizer adamw, --clip-grad 1.0)"),
    (["--sync", "onebit-adam", "--optimizer", "sgd", "--clip-grad", "0"],
     "(got --momentum 0.9)"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_input_is_one_clear_line_and_writes_nothing(flags, message, tmp_path, monkeypatch,
                                                         capsys):
    # In process: every check runs before train() connects (the command's own exit
    # status and stderr: the test below).
    from trainer.loop import train

    def connect(args):
        raise AssertionError("the run went on to connect: its flags were accepted")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "connect", connect)
    with pytest.raises(SystemExit) as exited:
        train.train([*flags, "--metrics", "m.jsonl", "--checkpoint-dir", "ckpt"])
    errors = capsys.readouterr().err
    assert exited.value.code == 2, errors
    assert message in errors.strip().splitlines()[-1], errors
    assert os.listdir(tmp_path) == [], "something was written before the arguments were valid"


@pytest.mark.timeout(120)
def test_a_bad_flag_ends_the_command_with_exit_2_and_one_line(tmp_path):
    flags, message = next(case for case in BAD_FLAGS if "--resume" in case[0])
    result = run(trainer(*flags, "--metrics", "m.jsonl"), tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr.strip().splitlines()[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


def assert_every_step_applied(saved, steps):
    """In one rank's part of a checkpoint: the optimizer stepped (SGD keeps a momentum
    buffer only after its first step) and nothing it holds is non-finite."""
    buffers = [state["momentum_buffer"] for state in saved["optimizer"]["state"].values()]
    assert buffers, "the optimizer never stepped"
    for name, tensor in [*saved["model"].items(), *enumerate(buffers)]:
        assert torch.isfinite(tensor.float()).all(), f"{name} is not finite"
    if saved["scaler"]:  # fp16: GradScaler counts the steps applied since its last skip
        assert saved["scaler"]["_growth_tracker"] == steps, saved["scaler"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_learns(amp, tmp_path):
    # Two steps on the same two images (autocast on the CPU is slow: 16-bit
    # convolutions), with the trainer's own ResNet-18, on one spawned rank. The first
    # step must lower the loss on them by more than half, as it does in fp32 (2.3 to
    # 0.2). fp16's gradients come scaled by the loss scale: one the optimizer got still
    # scaled, or unscaled without having been scaled, or not finite, would not.
    (outcome,) = run_world(printed_by_runs, 1, timeout=250, args=(str(tmp_path), [[
        "--train-samples", "2", "--test-samples", "2", "--batch-size", "2", "--epochs", "2",
        "--schedule", "constant", "--amp", amp, "--metrics", "m.jsonl",
        "--checkpoint-dir", "ckpt"]], None))[0]
    assert outcome["code"] == 0, outcome
    first, second = (record["train_loss"] for record in read_metrics(tmp_path / "m.jsonl"))
    assert second < 0.5 * first, f"{amp}: the loss went from {first:.3f} to {second:.3f}"
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["ranks"][0]
    assert_every_step_applied(saved, steps=2)
    if amp == "fp16":  # the losses were scaled by GradScaler's 2^16, and nothing overflowed
        assert saved["scaler"]["scale"] == 2.0 ** 16, saved["scaler"]
    else:  # bf16 has fp32's range: no loss scale
        assert saved["scaler"] == {}, saved["scaler"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", ["allreduce", "powersgd", "topk"])
def test_fp16_training_recovers_from_an_overflow(sync, tmp_path):
    # Three steps: the first overflows (its output's gradient made inf, what an fp16
    # overflow in backward does) and is skipped, the next two must be applied at the
    # halved scale, as they are with allreduce. A strategy that kept the inf in its state
    # (error feedback, warm start) would overflow at every step: scale falling, no error.
    run_world(overflowing_first_backward, 1, timeout=100, args=(str(tmp_path), [
        "--train-samples", "6", "--test-samples", "2", "--batch-size", "2", "--epochs", "1",
        "--amp", "fp16", "--sync", sync, "--checkpoint-dir", "ckpt"]))
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)["ranks"][0]
    scale = saved["scaler"]["scale"]
    assert scale == 2.0 ** 15, f"loss scale 2^{math.log2(scale):g} after 3 steps, not 2^15"
    assert_every_step_applied(saved, steps=2)


@pytest.mark.timeout(120)
def test_imagefolder_dataset(tmp_path):
    from PIL import Image
    generator = torch.Generator().manual_seed(0)
    for part, count in (("train", 24), ("val", 8)):
        for label, colour in (("dark", 40), ("light", 200)):
            folder = tmp_path / "images" / part / label
            folder.mkdir(parents=True)
            for index in range(count):
                noise = torch.randint(0, 30, (40, 40, 3), generator=generator)
                pixels = (noise + colour).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{index}.png")
    (out,) = run_world(printed_by_runs, 1, timeout=100, args=(str(tmp_path), [[
        "--dataset", "imagefolder", "--data-dir", "images", "--batch-size", "8", "--epochs",
        "1", "--metrics", "m.jsonl"]]))[0]
    assert out["code"] == 0, out
    assert "on imagefolder (48 images)" in out["stdout"]
    (record,) = read_metrics(tmp_path / "m.jsonl")
    assert 0.0 <= record["test_acc"] <= 1.0


@pytest.mark.parametrize("mode, env, to_file, expected", [
    ("auto", {}, False, "bar"),                        # a terminal, or a launcher's pipe
    ("auto", {}, True, "lines"),                       # stderr redirected to a file
    ("auto", {"ENVIRONMENT": "BATCH"}, False, "lines"),  # a Slurm batch job
    ("bar", {"ENVIRONMENT": "BATCH"}, True, "bar"),    # asked for: as asked
    ("off", {}, False, "off"),
])
def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(mode, env, to_file, expected,
                                                             tmp_path):
    from trainer.loop.progress import chosen_mode
    if to_file:
        stream = open(tmp_path / "log", "w")
    else:  # a pipe: what a launcher hands its ranks
        read_end, write_end = os.pipe()
        os.close(read_end)
        stream = os.fdopen(write_end, "w")
    with stream:
        assert chosen_mode(mode, stream, env) == expected


def test_progress_in_a_log_is_one_line_per_update_and_the_last_stays(tmp_path):
    from trainer.loop.progress import progress
    with open(tmp_path / "log", "w") as log:
        for _ in progress(range(5), "epoch 1/1", 5, "lines", show=True, stream=log):
            pass
    text = (tmp_path / "log").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("epoch 1/1:   0%") and lines[-1].startswith("epoch 1/1: 100%")
    assert all(len(line) <= 100 for line in lines), lines
