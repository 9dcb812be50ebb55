"""The timeline: traced runs give valid traces with the right spans; tracing off does no work."""
import json

import pytest

from checks_trainer import printed_by_runs
from collectives.trace import summary
from distributed import run_world
from launchers import as_launched

# 2 ranks x 3 steps of 8 images: steps 2 and 3 are traced
TINY = ["--train-samples", "48", "--test-samples", "16", "--batch-size", "8", "--epochs", "1"]


def _inside(event, outer):
    return outer["ts"] <= event["ts"] and event["ts"] + event["dur"] <= outer["ts"] + outer["dur"]


@pytest.mark.timeout(240)
def test_a_traced_training_run_shows_every_step_and_bucket_per_rank(tmp_path, capsys):
    # the trainer with its own ResNet-18 on 2 spawned ranks (checks_trainer.py)
    folder = tmp_path / "trace"
    (outcome,) = run_world(printed_by_runs, 2, timeout=200, args=(str(tmp_path), [[
        *TINY, "--trace", str(folder), "--trace-steps", "2:3"]], None))[0]
    assert outcome["code"] == 0, outcome
    merged = json.loads((folder / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in merged if e["name"] == "process_name"}
    assert sorted(names) == [0, 1] and names[1].startswith("rank 1")
    for rank in (0, 1):
        offset = json.loads((folder / f"rank{rank}.json").read_text())["otherData"]
        assert abs(offset["clock_offset_us"]) < 5000  # one machine: one clock, measured so
        mine = [e for e in merged if e["pid"] == rank and e["ph"] == "X"]
        steps = sorted((e for e in mine if e["cat"] == "step"), key=lambda e: e["ts"])
        assert [s["args"]["step"] for s in steps] == [2, 3]
        buckets = {e["name"] for e in mine if e["name"].startswith("bucket")}
        assert len(buckets) >= 2  # ResNet-18: a small first bucket, then 25 MiB ones
        for step in steps:
            inside = [e for e in mine if _inside(e, step)]
            kinds = [e["name"] for e in inside]
            for expected in ("forward", "backward", "optimizer", "waiting on communication"):
                assert kinds.count(expected) == 1, (expected, kinds)
            assert {e["name"] for e in inside if e["name"].startswith("bucket")} == buckets
            backward = next(e for e in inside if e["name"] == "backward")
            first = min((e for e in inside if e["name"].startswith("bucket")),
                        key=lambda e: e["ts"])
            assert first["tid"] != step["tid"]  # on the communication thread
            assert backward["ts"] < first["ts"] < backward["ts"] + backward["dur"]  # overlap
            assert first["args"]["bytes"] > 0 and "queued_ms" in first["args"]
    # `python -m collectives.trace DIR`, through its main() in this process: it only
    # reads the files and draws
    from collectives.trace.__main__ import main
    capsys.readouterr()
    assert main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert "allreduce: 2 traced step(s), 2 rank(s)" in out and "slowest rank:" in out
    assert (folder / "timeline.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_the_summary_agrees_with_trainer_bench_on_steps_and_the_hidden_share(tmp_path):
    folder, rows = tmp_path / "trace", tmp_path / "bench.jsonl"
    # trainer.bench as a launcher's 2 ranks run it (launchers.as_launched)
    run_world(as_launched, 2, backend=None, timeout=280, args=("trainer.bench", [
        "--sync", "allreduce,ddp,allreduce:overlap=forward",
        "--batch-size", "4", "--steps", "3", "--rounds", "1", "--warmup", "1",
        "--trace", str(folder), "--trace-steps", "3", "--json", str(rows)]))
    bench = {row["sync"]: row for row in map(json.loads, rows.read_text().splitlines())}
    traced = summary.figures(summary.load(str(folder)))
    for sync in ("allreduce", "ddp"):
        ranks = traced[sync]
        assert sorted(ranks) == [0, 1] and all(r.steps == 3 for r in ranks.values())
        mean_hidden = sum(r.hidden_share for r in ranks.values()) / 2
        # same definition, measured once by the bench's counters and once from spans
        assert abs(mean_hidden - bench[sync]["hidden_share"]) < 0.05, (sync, mean_hidden,
                                                                        bench[sync])
    # the training thread waits only inside steps: a round's last step ends with its
    # drain (with overlap=forward, the wait the next forward would have had), inside
    # its traced span as inside its time
    events = summary.load(str(folder))
    steps = [e for e in events if e["cat"] == "step"]
    for wait in (e for e in events if e["cat"] == "wait"):
        assert any(s["pid"] == wait["pid"] and s["tid"] == wait["tid"]
                   and s["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= s["ts"] + s["dur"]
                   for s in steps), wait
    for sync in ("allreduce", "ddp", "allreduce:overlap=forward"):
        traced_ms = max(r.step_ms for r in traced[sync].values())
        assert traced_ms == pytest.approx(bench[sync]["step_ms"], rel=0.1), (sync, traced_ms)


def train_a_few_steps(comm, folder):
    """3 steps untraced, then 1 traced: the trace work done after each."""
    import torch
    import torch.nn.functional as F
    import collectives
    from collectives import trace
    torch.manual_seed(0)
    model = collectives.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), comm=comm,
        bucket_cap_mb=0.0001)

    def step():
        F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()

    for _ in range(3):
        step()
    off = trace.work_done()
    trace.start(comm, folder)
    step()
    trace.finish(comm)
    return off, trace.work_done()


@pytest.mark.timeout(120)
def test_tracing_off_does_no_trace_work(tmp_path):
    for off, on in run_world(train_a_few_steps, 2, args=(str(tmp_path),), timeout=100):
        assert off == 0
        assert on > 0  # the same steps traced: spans for the buckets and the collectives
