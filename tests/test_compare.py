"""The comparison study's tools: torch's peers, honest periodic timing, the launchers."""
import argparse
import importlib.util
import json
import os
import sys
import time

import pytest
import torch

from checks_peers import (background_when_the_window_closes, bytes_sent_per_step,
                          diloco_equals_torchft, hier_local_sgd_equals_torchs_averager,
                          hier_peer_refuses_ranks_dealt_round_robin,
                          powersgd_peer_on_a_model_of_two_buckets,
                          streaming_diloco_with_one_fragment_and_no_delay_is_diloco,
                          every_peer_learns, ours_equal_torch_where_the_math_is_the_same)
from distributed import run_world
from launchers import LAUNCH_VARIABLES, python, rank_env, run
from trainer import bench, compare
from trainer.bench import aligned_warmup
from trainer.tasks import text
from trainer.timing import WaitClock


@pytest.mark.timeout(150)
def test_every_torch_peer_trains():
    losses = run_world(every_peer_learns, 2, timeout=120)[0]
    assert set(losses) == {"ddp", "ddp-collectives", "ddp-fp16", "ddp-bf16", "ddp-powersgd",
                           "ddp-localsgd", "ddp-hier-localsgd", "torchft-diloco"} - (
        set() if importlib.util.find_spec("torchft") else {"torchft-diloco"})
    for name, (first, last) in losses.items():
        assert last < 0.95 * first, (name, first, last)


@pytest.mark.timeout(150)
def test_torchs_powersgd_peer_trains_a_model_of_two_buckets_on_4_ranks():
    """torch's hook issues its second and third all-reduce from callbacks; unordered, the
    next bucket's first all-reduce overtook them on some ranks and gloo failed on the
    sizes. Every rank must run all steps and end with the same parameters."""
    for losses, same_everywhere in run_world(powersgd_peer_on_a_model_of_two_buckets, 4,
                                             timeout=120):
        assert len(losses) == 5 and losses[-1] < losses[0], losses
        assert same_everywhere


@pytest.mark.timeout(150)
def test_ours_and_torchs_compute_the_same_where_the_math_is_the_same():
    differences = run_world(ours_equal_torch_where_the_math_is_the_same, 2, timeout=120)[0]
    for pair, difference in differences.items():
        if pair.startswith("fp16"):  # torch divides in 16 bits, we in 64 then cast
            assert difference < 1e-4, (pair, difference)
        else:
            assert difference == 0.0, (pair, difference)


@pytest.mark.timeout(150)
def test_hier_local_sgd_equals_torchs_hierarchical_averager_on_two_hosts():
    # 4 ranks: the sums of 4 numbers may be taken in other orders by gloo and by our
    # hierarchical all-reduce, so the last bits may differ (the 2-rank pairs are exact).
    differences = run_world(hier_local_sgd_equals_torchs_averager, 4, timeout=120)[0]
    assert len(differences) == 3
    for setting, difference in differences.items():
        assert difference < 1e-12, (setting, difference)


@pytest.mark.timeout(150)
def test_torchs_hierarchical_averager_refuses_ranks_dealt_round_robin_and_ours_does_not():
    for error, with_host_partner, with_other_host in run_world(
            hier_peer_refuses_ranks_dealt_round_robin, 4, timeout=120):
        assert error is not None and "consecutive" in error, error
        assert with_host_partner and not with_other_host


@pytest.mark.timeout(150)
def test_diloco_equals_torchft_plain_and_streaming():
    pytest.importorskip("torchft", reason="torchft is an optional extra: pip install torchft")
    differences = run_world(diloco_equals_torchft, 2, timeout=120)[0]
    assert differences and all(d == 0.0 for d in differences.values()), differences


@pytest.mark.timeout(120)
def test_streaming_diloco_with_one_fragment_and_no_delay_is_plain_diloco():
    """Also with a synchronous warm-up: allreduce's steps, then DiLoCo from their end."""
    assert run_world(streaming_diloco_with_one_fragment_and_no_delay_is_diloco, 2,
                     timeout=100) == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.timeout(120)
def test_ddp_on_our_backend_counts_the_bytes_our_transport_sends_as_allreduce_does():
    """On one host our transport goes through shared memory: no TCP socket sees it.
    torch's DDP on our backend sends what our allreduce sends, and both are counted:
    one model's bytes per step (2 ranks, a ring)."""
    for sent, model_bytes in run_world(bytes_sent_per_step, 2, timeout=100):
        for name, per_step in sent.items():
            assert abs(per_step - model_bytes) < 0.05 * model_bytes, (name, sent, model_bytes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["delayed", "async-avg"])
def test_bench_drains_background_communication_before_a_window_closes(name):
    """With a slow communication thread, a background strategy's round of trainer.bench
    ends with nothing in flight: its compute-only sample overlaps no communication, and
    its window counted every byte its steps sent."""
    for unfinished, counted, sent, sent_later in run_world(
            background_when_the_window_closes, 2, args=(name,), timeout=100):
        assert unfinished == 0
        assert sent > 0 and counted == sent and sent_later == 0, (counted, sent, sent_later)


class _Sleep(torch.autograd.Function):
    """Identity whose backward takes `seconds`: compute that runs before the gradients
    of the parameters below it are computed."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def _accumulate_grad_node(param):
    """The autograd node that accumulates `param`'s gradient (torch's Reducer hooks it;
    whoever does must hold it, as the param holds it only weakly)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("ddp_hook", ["post-accumulate, as ours", "accumulator, as torch's"])
def test_the_wait_clock_starts_when_the_last_gradient_is_computed(ddp_hook):
    """A DDP's work on the last gradient (here a 0.1 s hook, registered where our
    bucketer's or torch's Reducer's are, before the clock) is waiting; backward's compute
    before it (a 0.3 s layer) is not."""
    layer, held = torch.nn.Linear(4, 4), []
    for param in layer.parameters():
        if ddp_hook.startswith("post-accumulate"):
            param.register_post_accumulate_grad_hook(lambda p: time.sleep(0.1))
        else:
            held.append(_accumulate_grad_node(param))
            held[-1].register_hook(lambda *_: time.sleep(0.1))
    clock = WaitClock(layer)
    clock.backward(_Sleep.apply(layer(torch.randn(2, 4)), 0.3).sum())
    assert 0.1 <= clock.waited < 0.3, clock.waited


def test_warmup_is_aligned_to_whole_periods():
    assert aligned_warmup(2, 1, 0) == 2
    assert aligned_warmup(2, 8, 0) == 8    # events after steps 8, 16, ...: time from 8 on
    assert aligned_warmup(9, 8, 0) == 16
    assert aligned_warmup(1, 4, 10) == 10  # after a 10-step synchronous warm-up
    assert aligned_warmup(11, 4, 10) == 14


def test_bench_trains_every_model_of_the_trainer_as_its_task_does():
    """A gpt-* trains on windows of random bytes (16 by default), each position's next
    byte its target, with AdamW at the language task's defaults; a ResNet on random
    images (32), with SGD; the loss is the tasks' cross-entropy either way."""
    from trainer.tasks import MODELS
    assert bench.parse_args(["--model", "gpt-nano"]).batch_size == 16
    assert bench.parse_args([]).batch_size == 32
    assert bench.parse_args(["--model", "gpt-tiny", "--batch-size", "3"]).batch_size == 3
    assert all(bench.build_parser().parse_args(["--model", name]).model == name
               for name in MODELS)
    work = bench.build_workload("gpt-nano", 3, torch.device("cpu"))
    assert work.inputs.shape == work.targets.shape == (3, 32)
    assert work.inputs.dtype == torch.int64 and 0 <= int(work.inputs.min()) <= int(
        work.inputs.max()) < 256
    (group,) = work.optimizer.param_groups
    assert isinstance(work.optimizer, torch.optim.AdamW)
    assert (group["lr"], group["weight_decay"]) == (3e-3, 0.1)
    outputs = work.model(work.inputs)
    expected = torch.nn.functional.cross_entropy(outputs.reshape(-1, 256),
                                                 work.targets.reshape(-1))
    assert torch.equal(work.loss(outputs), expected)
    assert (work.units, work.units_per_sample, work.throughput_key) == (
        "tok", 32, "tokens_per_s")
    images = bench.build_workload("resnet18", 2, torch.device("cpu"))
    assert images.inputs.shape == (2, 1, 28, 28) and images.targets.shape == (2,)
    assert isinstance(images.optimizer, torch.optim.SGD)
    assert (images.units_per_sample, images.throughput_key) == (1, "images_per_s")


@pytest.mark.timeout(240)
def test_bench_times_local_sgd_over_whole_periods_with_its_averaging(tmp_path):
    """2 timed steps asked for: a period-8 strategy is timed over 8, and the bytes show
    that its one averaging round fell inside the window (ours and torch's); streaming
    DiLoCo's events count its fragments' synchronizations. On the smallest model
    (gpt-nano, 35k parameters): what is timed and counted does not depend on it."""
    out = tmp_path / "bench.jsonl"
    run(python("-m", "trainer.bench", "--nproc", "2", "--sync",
               "local-sgd,ddp-localsgd,diloco:period=4:fragments=2", "--model", "gpt-nano",
               "--batch-size", "2", "--steps", "2", "--rounds", "1", "--warmup", "1",
               "--json", str(out)),
        timeout=220)
    rows = {row["sync"]: row for row in map(json.loads, out.read_text().splitlines())}
    # float32 parameters; 2 ranks: a ring sends one model's bytes
    model_mb = sum(p.numel() for p in bench.build_model("gpt-nano").parameters()) * 4 / 1e6
    for name in ("local-sgd", "ddp-localsgd"):
        assert rows[name]["steps"] == 8 and rows[name]["events"] == 1, rows[name]
        assert 0.7 * model_mb / 8 < rows[name]["mb_per_step"] < 1.5 * model_mb / 8, \
            rows[name]
        assert rows[name]["waited_ms"] > 0
        assert 0 <= rows[name]["thread_cpu_ms"] <= rows[name]["cpu_ms"], rows[name]
    # torch's averaging reaches this rank through gloo's TCP loop: a thread of its own
    assert rows["ddp-localsgd"]["thread_cpu_ms"] > 0, rows["ddp-localsgd"]
    # streaming DiLoCo syncs a fragment every period / fragments steps: 2 in its 4
    streaming = rows["diloco:period=4:fragments=2"]
    assert streaming["steps"] == 4 and streaming["events"] == 2, streaming


def test_compare_starts_each_job_with_the_chosen_launcher():
    base = dict(nproc=4, hosts=None, ranks_per_host=1, bandwidth=None)
    argv, _ = compare.launch_command(argparse.Namespace(launcher="torchrun", **base),
                                     ["--sync", "ddp"])
    assert argv[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "-m"]
    assert argv[-3:] == ["trainer", "--sync", "ddp"]
    argv, _ = compare.launch_command(
        argparse.Namespace(launcher="cluster", **dict(base, hosts=2, ranks_per_host=2,
                                                      bandwidth="100mbit")), ["--sync", "ddp"])
    assert argv[1:10] == ["-m", "collectives.cluster", "--hosts", "2", "--ranks-per-host", "2",
                          "--bandwidth", "100mbit", "--"]
    argv, _ = compare.launch_command(argparse.Namespace(launcher="mpirun", **base), ["--sync",
                                                                                    "ddp"])
    assert "-np" in argv and argv[argv.index("-np") + 1] == "4"
    with pytest.raises(SystemExit):
        compare.main(["--sync", "allreduce", "--hosts", "2", "--launcher", "torchrun"])
    with pytest.raises(SystemExit):
        compare.main(["--sync", "no-such-sync"])


def test_compare_refuses_a_bad_option_before_any_job(monkeypatch, capsys):
    def job(*_):
        raise AssertionError("a job started: the bad option was not refused first")

    monkeypatch.setattr(compare, "run_one", job)
    for syncs, message in (
            ("allreduce,local-sgd:period=abc", "local-sgd: period must be a whole number"),
            ("ddp,ddp-localsgd:period=0", "ddp-localsgd: period, local_period and rank must"),
            ("allreduce:overlap=sideways", "allreduce: overlap must be one of backward, "),
            ("local-sgd:perod=8", "local-sgd takes no option 'perod'")):
        with pytest.raises(SystemExit) as stopped:
            compare.main(["--sync", syncs, "--launcher", "torchrun"])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_compare_passes_hosts_that_differ_on_to_the_cluster():
    args = argparse.Namespace(launcher="cluster", nproc=2, hosts=2, ranks_per_host=1,
                              bandwidth="100mbit", cpu_share=["node1=0.5"],
                              link=["0=10mbit", "node1=20mbit"], pause=["1@5:2"])
    argv, _ = compare.launch_command(args, ["--sync", "ddp"])
    cluster = argv[:argv.index("--")]
    assert cluster[-8:] == ["--cpu-share", "node1=0.5", "--link", "0=10mbit", "--link",
                            "node1=20mbit", "--pause", "1@5:2"]
    for option in (["--cpu-share", "1=0.5"], ["--link", "1=10mbit"], ["--pause", "1@1:1"]):
        with pytest.raises(SystemExit):  # not without the emulated cluster
            compare.main(["--sync", "allreduce", "--launcher", "torchrun", *option])
    for option in (["--cpu-share", "node1=2"], ["--link", "1=fast"], ["--pause", "1@x"],
                   ["--cpu-share", "node5=0.5"], ["--pause", "1@1:5", "--pause", "1@2:1"]):
        with pytest.raises(SystemExit) as stopped:  # checked as the cluster checks them:
            compare.main(["--sync", "allreduce", "--hosts", "2", *option])  # before any job
        assert stopped.value.code == 2


def test_compare_writes_table_plot_and_every_jobs_epochs(tmp_path, monkeypatch):
    """The files a comparison leaves (jobs stood in for: each would train for minutes)."""
    def fake_job(entry, args, trainer_flags, folder):
        accuracy = {"ddp": (0.80, 0.96), "bf16": (0.95, 0.97)}[entry]
        epochs = [dict(epoch=e + 1, train_seconds=10.0, comm_bytes=2**20 * 30, steps=30,
                       images_per_s=12.0, test_acc=a) for e, a in enumerate(accuracy)]
        return {"sync": entry, "epochs": epochs, "wall_s": 25.0}
    monkeypatch.setattr(compare, "run_one", fake_job)
    out = tmp_path / "cmp"
    assert compare.main(["--sync", "ddp,bf16", "--launcher", "torchrun", "--out", str(out)]) == 0
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert lines[0].startswith("Made by `python -m trainer.compare --sync ddp,bf16")
    assert "| ddp | 96.00% | 20 | 20 | 2 | 12.0 | 1.00 | 25 |" in lines
    assert "| bf16 | 97.00% | 10 | 20 | 2 | 12.0 | 1.00 | 25 |" in lines
    jobs = [json.loads(line) for line in open(tmp_path / "cmp.jsonl")]
    assert [job["sync"] for job in jobs] == ["ddp", "bf16"]
    assert [e["test_acc"] for e in jobs[1]["epochs"]] == [0.95, 0.97]
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def language_records(bits_per_byte):
    """A language model's --metrics records, one per evaluation (every 50 steps)."""
    return [dict(epoch=e + 1, step=50 * (e + 1), train_seconds=10.0, comm_bytes=2**20 * 50,
                 steps=50, tokens_per_s=1000.0, test_bpb=b, test_loss=b * 0.693,
                 test_ppl=2 ** b, sent_total=2**20 * 50 * (e + 1),
                 train_seconds_total=10.0 * (e + 1))
            for e, b in enumerate(bits_per_byte)]


def test_compare_scores_a_language_model_by_held_out_bits_per_byte(tmp_path, monkeypatch,
                                                                   capsys):
    """--model gpt-*: the score is held-out bits per byte, lower is better, the target
    2.5 unless --target says; throughput in tokens/s; the plot's y axis bits per byte.
    The records decide too, where the flags do not name the model."""
    def fake_job(entry, args, trainer_flags, folder):
        assert trainer_flags[:2] == ["--model", "gpt-nano"]
        job = {"sync": entry, "wall_s": 25.0, "epochs": language_records(
            {"allreduce": (3.1, 2.4), "diloco": (2.7, 2.6), "ddp": (3.5,)}[entry])}
        if entry == "ddp":
            job["failed"] = "exit 1: rank 1 lost"
        return job
    monkeypatch.setattr(compare, "run_one", fake_job)
    out = tmp_path / "cmp"
    assert compare.main(["--sync", "allreduce,diloco,ddp", "--launcher", "torchrun",
                         "--model", "gpt-nano", "--out", str(out)]) == 1
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert lines[2] == ("| sync | final held-out bits/byte | time to 2.5 bits/byte (s) | "
                        "training time (s) | evaluations | tokens/s | MiB sent per rank per "
                        "step | wall time (s) |"), lines
    assert "| allreduce | 2.400 | 20 | 20 | 2 | 1000.0 | 1.00 | 25 |" in lines
    assert "| diloco | 2.600 | not reached | 20 | 2 | 1000.0 | 1.00 | 25 |" in lines
    assert "| ddp | failed after 1 evaluation | | | | | | 25 |" in lines
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    assert compare.main(["--sync", "diloco", "--launcher", "torchrun", "--model", "gpt-nano",
                         "--target", "2.65", "--out", str(out)]) == 0
    assert "| diloco | 2.600 | 20 | 20 | 2 | 1000.0 | 1.00 | 25 |" in (
        tmp_path / "cmp.md").read_text().splitlines()
    # from the records alone, and drawn: bits per byte as they are, the target's line
    row = compare.summarize({"sync": "allreduce", "wall_s": 1.0,
                             "epochs": language_records((3.1, 2.4))}, 2.5)
    assert (row["score"], row["final"], row["time_to_target_s"]) == ("test_bpb", 2.4, 20.0)
    by_time, by_bytes = compare.draw([row], 2.5).axes
    assert by_time.get_ylabel() == by_bytes.get_ylabel() == "held-out bits per byte"
    drawn = {tuple(line.get_ydata()) for line in by_time.get_lines()}
    assert (3.1, 2.4) in drawn and (2.5, 2.5) in drawn
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # the trainer's own reading, before any job
        compare.main(["--sync", "allreduce", "--launcher", "torchrun", "--model", "gpt-huge"])
    assert stopped.value.code == 2
    assert "invalid choice: 'gpt-huge'" in capsys.readouterr().err.splitlines()[-1]


def test_a_baseline_measures_every_row_by_its_final_score_bytes_and_ideal_speedup(
        tmp_path, monkeypatch, capsys):
    """--baseline ddp: each row's x sooner to ddp's final score (ddp's training time over
    the row's first evaluation that reaches it), x fewer bytes per rank over the run, and
    ddp's ideal speed-up, 1 / (1 - its waited share); a baseline not in --sync is refused
    before any job."""
    def fake_job(entry, args, trainer_flags, folder):
        records = language_records({"ddp": (3.0, 2.6, 2.4, 2.3),
                                    "diloco": (2.9, 2.3, 2.2, 2.1),
                                    "local-sgd": (3.2, 3.0, 2.9, 2.8)}[entry])
        for record in records:
            record["waited_share"] = 0.75 if entry == "ddp" else 0.1
            if entry == "diloco":
                record["comm_bytes"] = 2**20 * 50 / 40  # 40x fewer
            if entry == "local-sgd":
                record["comm_bytes"] = 0  # sent nothing: no ratio
        return {"sync": entry, "wall_s": 45.0, "epochs": records}
    monkeypatch.setattr(compare, "run_one", fake_job)
    out = tmp_path / "cmp"
    assert compare.main(["--sync", "ddp,diloco,local-sgd", "--launcher", "torchrun",
                         "--model", "gpt-nano", "--baseline", "ddp", "--out", str(out)]) == 0
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert lines[2].endswith("| to ddp's final 2.300: x sooner | bytes per rank: x fewer "
                             "than ddp |"), lines[2]
    assert lines[4].endswith("| 1.00 | 1.0 |"), lines[4]  # ddp reaches it at its end
    assert lines[5].endswith("| 2.00 | 40.0 |"), lines[5]  # 2.3 after 20 s of ddp's 40
    assert lines[6].endswith("| not reached | - |"), lines[6]
    assert "ddp's ideal speed-up: 4.00x (it waited on the network 75.0%" in lines[8]
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        compare.main(["--sync", "diloco", "--launcher", "torchrun", "--model", "gpt-nano",
                      "--baseline", "ddp"])
    assert stopped.value.code == 2
    assert "--baseline ddp is not one of --sync's entries (diloco)" in capsys.readouterr().err


def small_text_folder(folder) -> str:
    """40 of the standard library's modules under `folder`, two of them held out (the
    trainer holds out a file by a checksum of its name): a few hundred KB to read, where
    the default dataset reads 12 MB a run."""
    root = os.path.dirname(os.__file__)
    flat = lambda name: name.replace(os.sep, "_")  # noqa: E731
    names = text.stdlib_files(root)
    held = [name for name in names if text.held_out(flat(name))][:2]
    kept = [name for name in names[::10] if not text.held_out(flat(name))][:38]
    os.makedirs(folder, exist_ok=True)
    for name in held + kept:
        with open(os.path.join(root, name), "rb") as source, \
                open(os.path.join(folder, flat(name)), "wb") as copy:
            copy.write(source.read())
    return str(folder)


@pytest.mark.timeout(200)
def test_compare_runs_language_model_jobs_on_a_text_folder(tmp_path, monkeypatch):
    """One real job: gpt-nano on 2 ranks, 4 steps, an evaluation every 2; the table
    scores it by the held-out bits per byte the trainer recorded, against 2.5. (The
    comparison's own driver runs in this process: it only starts the job, under
    mpirun, with the environment a launched command gets, and reads what it wrote.)"""
    data, out = small_text_folder(tmp_path / "text"), tmp_path / "cmp"
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in rank_env().items():
        monkeypatch.setenv(name, value)
    assert compare.main(["--launcher", "mpirun", "--nproc", "2", "--sync", "allreduce",
                         "--model", "gpt-nano", "--dataset", "text", "--data-dir", str(data),
                         "--steps", "4", "--eval-every", "2", "--batch-size", "4",
                         "--test-samples", "8", "--out", str(out)]) == 0
    (job,) = [json.loads(line) for line in open(tmp_path / "cmp.jsonl")]
    assert [record["step"] for record in job["epochs"]] == [2, 4]
    bpb = [record["test_bpb"] for record in job["epochs"]]
    assert all(0 < b < 9 for b in bpb), bpb
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert "| final held-out bits/byte | time to 2.5 bits/byte (s) |" in lines[2]
    cells = [cell.strip() for cell in lines[4].split("|")[1:-1]]
    assert cells[0] == "allreduce" and cells[1] == f"{bpb[-1]:.3f}" and cells[4] == "2", cells
    assert float(cells[5]) > 0  # tokens/s
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_a_failed_job_is_a_row_and_the_jobs_after_it_still_run(tmp_path, monkeypatch):
    """One job's crash (torch's PowerSGD hook under a straggler did) does not lose the
    comparison: its row says so, the next job runs, the plot and records are written,
    and the exit status says something failed."""
    ran = []

    def fake_job(entry, args, trainer_flags, folder):
        ran.append(entry)
        epochs = [dict(epoch=1, train_seconds=10.0, comm_bytes=2**20 * 30, steps=30,
                       images_per_s=12.0, test_acc=0.9)]
        job = {"sync": entry, "epochs": epochs, "wall_s": 25.0}
        if entry == "ddp-powersgd":
            job["failed"] = "exit 1: Received data size doesn't match expected size"
        return job
    monkeypatch.setattr(compare, "run_one", fake_job)
    out = tmp_path / "cmp"
    assert compare.main(["--sync", "ddp-powersgd,powersgd", "--launcher", "torchrun",
                         "--out", str(out)]) == 1
    assert ran == ["ddp-powersgd", "powersgd"]
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert "| ddp-powersgd | failed after 1 epoch | | | | | | 25 |" in lines
    assert "| powersgd | 90.00% | not reached | 10 | 1 | 12.0 | 1.00 | 25 |" in lines
    jobs = [json.loads(line) for line in open(tmp_path / "cmp.jsonl")]
    assert "doesn't match" in jobs[0]["failed"] and "failed" not in jobs[1]
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_a_job_killed_mid_epoch_keeps_the_epochs_it_finished(tmp_path, monkeypatch):
    """The job itself: a process that wrote one epoch, half of the next line, and died.
    Its row keeps the finished epoch and says why it failed; a job that exits 0 but
    wrote no epoch is a failure too, not a crash of the comparison."""
    def stand_in(lines, code):
        def launch_command(args, trainer_argv):
            metrics = trainer_argv[trainer_argv.index("--metrics") + 1]
            script = (f"import sys; open({metrics!r}, 'w').write({lines!r}); "
                      f"sys.stderr.write('rank 2 lost'); sys.exit({code})")
            return [sys.executable, "-c", script], dict(os.environ)
        return launch_command
    epoch = json.dumps(dict(epoch=1, train_seconds=1.0, comm_bytes=0, steps=1,
                            images_per_s=1.0, test_acc=0.5))
    monkeypatch.setattr(compare, "launch_command", stand_in(epoch + '\n{"epoch": 2, "tr', 1))
    job = compare.run_one("allreduce", argparse.Namespace(sync_option=[]), [], str(tmp_path))
    assert [e["epoch"] for e in job["epochs"]] == [1]
    assert job["failed"].startswith("exit 1 (") and job["failed"].endswith("rank 2 lost")
    monkeypatch.setattr(compare, "launch_command", stand_in("", 0))
    job = compare.run_one("bf16", argparse.Namespace(sync_option=[]), [], str(tmp_path))
    assert job["epochs"] == [] and job["failed"].startswith("exit 0, no epoch recorded")


def test_compare_plot_pairs_each_torch_peer_with_our_strategy():
    """Drawn from rows built by hand: a pair shares a colour, ours solid and torch's
    dashed; families differ in colour; the bytes axis is logarithmic and positive."""
    from trainer import torch_peers
    syncs = ["ddp", "allreduce", "ddp-collectives", "bf16", "ddp-bf16",
             "ddp-localsgd:period=8", "local-sgd:period=8", "topk", "async-avg", "gossip"]
    rows = [{"sync": sync, "curve": [(10.0 * (i + 1), 0.0, 0.5), (20.0 * (i + 1), 2.0**i, 0.9)]}
            for i, sync in enumerate(syncs)]
    figure = compare.draw(rows, 0.95)
    by_time, by_bytes = figure.axes
    lines = {line.get_label(): line for line in by_time.get_lines() if line.get_label() in syncs}
    peers = [sync for sync in syncs if sync.split(":")[0] in torch_peers.OURS]
    for peer in peers:
        ours = [sync for sync in syncs
                if sync.split(":")[0] == torch_peers.OURS[peer.split(":")[0]]]
        assert ours, peer
        for mine in ours:
            assert lines[mine].get_color() == lines[peer].get_color(), (mine, peer)
            assert lines[mine].get_linestyle() == "-"
        assert lines[peer].get_linestyle() in ("--", ":")
    assert lines["ddp"].get_linestyle() == "--"
    # two peers of allreduce still tell apart, by line style and marker
    assert ((lines["ddp"].get_linestyle(), lines["ddp"].get_marker())
            != (lines["ddp-collectives"].get_linestyle(), lines["ddp-collectives"].get_marker()))
    families = {compare.family(sync): lines[sync].get_color() for sync in syncs}
    assert len(set(families.values())) == len(families) == 6
    assert by_bytes.get_xscale() == "log" and by_bytes.get_xlim()[0] > 0
    sent = [line for line in by_bytes.get_lines() if line.get_label() in syncs]
    assert len(sent) == len(syncs)  # each from its first epoch that sent anything
    assert all(list(line.get_xdata()) == [2.0**syncs.index(line.get_label())] for line in sent)
