"""Fault injection: kill, stall or mislead a rank and see how the others fail.

Each case returns a list of Outcome (one per run) saying whether every surviving rank
failed the way it should (a clear error, non-zero, naming what it waited for) and how
long that took. tests/test_faults.py runs each case once; this file, run directly,
repeats them and prints the table in docs/reliability.md:

    python tests/fault_injection.py --runs 5
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import _rank_context, run_world  # noqa: E402
from launchers import mpirun, python, rank_env, run, trainer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 5.0  # the init timeout the cases run with


@dataclass
class Outcome:
    ok: bool
    seconds: float  # from the fault to the last surviving rank's error
    detail: str


# --- helpers that run on the ranks -------------------------------------------------------
def _kill_self_after(delay: float, stamp: str) -> None:
    """SIGKILL this process `delay` seconds from now, writing the time first."""
    def kill():
        with open(stamp, "w") as out:
            out.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(delay, kill).start()


def _failure(error: BaseException) -> tuple:
    return (type(error).__name__, str(error).splitlines()[0][:300], time.time())


def _big_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])


def rank_kill_during_all_reduce(comm, stamp):
    import collectives
    if comm.rank == 1:
        _kill_self_after(0.3, stamp)
    try:
        for _ in range(10000):
            collectives.all_reduce(torch.ones(1 << 20), algorithm="ring", check=False)
    except Exception as error:
        return _failure(error)
    return None


def rank_kill_during_backward(comm, stamp):
    import collectives
    model = collectives.DistributedDataParallel(_big_model(), comm=comm)
    if comm.rank == 1:  # die inside backward, once the last layer's gradient exists
        model.module[-1].weight.register_hook(lambda grad: _kill_self_after(0.0, stamp))
    try:
        for _ in range(100):
            model(torch.randn(64, 512)).sum().backward()
    except Exception as error:
        return _failure(error)
    return None


def rank_kill_during_startup_broadcast(comm, stamp):
    import collectives
    from collectives import ddp
    if comm.rank == 1:
        def die(*args, **kwargs):
            _kill_self_after(0.0, stamp)
            time.sleep(10)
        ddp.broadcast_coalesced = die
    try:  # the root may finish its sends before noticing; it fails at its first step
        model = collectives.DistributedDataParallel(_big_model(), comm=comm)
        model(torch.randn(64, 512)).sum().backward()
    except Exception as error:
        return _failure(error)
    return None


def rank_stall_during_all_reduce(comm, stamp):
    """Rank 1 hangs: alive, connected, silent, until every other rank has given up (each
    leaves a file saying so next to `stamp`), or 60 s."""
    import collectives
    gave_up = os.path.join(os.path.dirname(stamp), "gave up by rank {}")
    if comm.rank == 1:
        with open(stamp, "w") as out:
            out.write(repr(time.time()))
        others, deadline = [r for r in range(comm.world_size) if r != 1], time.time() + 60
        while time.time() < deadline and not all(os.path.exists(gave_up.format(r))
                                                 for r in others):
            time.sleep(0.1)
        return None
    try:
        collectives.all_reduce(torch.ones(1 << 16), algorithm="ring", check=False)
    except Exception as error:
        failure = _failure(error)
        open(gave_up.format(comm.rank), "w").close()
        return failure
    return None


def rank_mismatch(comm, stamp, kind):
    import collectives
    started = time.time()
    if comm.rank == 0:
        with open(stamp, "w") as out:
            out.write(repr(started))
    try:
        if kind == "numel":
            collectives.all_reduce(torch.ones(100 + comm.rank))
        elif kind == "dtype":
            collectives.all_reduce(torch.ones(100, dtype=torch.float32 if comm.rank else
                                              torch.float64))
        elif kind == "shape":
            collectives.all_reduce(torch.ones((10, 20) if comm.rank else (20, 10)))
        elif kind == "model":
            collectives.DistributedDataParallel(nn.Linear(10, 10 + comm.rank), comm=comm)
        elif kind == "buckets":
            collectives.DistributedDataParallel(_big_model(), comm=comm,
                                                bucket_cap_mb=1 + comm.rank)
        elif kind == "debug-divergence":  # rank 1 skips a call: debug mode names it
            if comm.rank != 1:
                collectives.all_reduce(torch.ones(8), check=False)
            collectives.broadcast(torch.ones(8), check=False)
    except Exception as error:
        return _failure(error)
    return None


# --- the cases, as seen from outside -------------------------------------------------------
def _run_rank_case(function, extra=(), world_size=3, expect=("PeerError",), words=("rank",),
                   debug=False, victim=1, some_say=""):
    """Run `function` on every rank; rank `victim` is the one that dies or stalls (None:
    nobody does). Every other rank must fail with `expect`, its message holding `words`,
    and at least one message must hold `some_say`."""
    with tempfile.TemporaryDirectory() as folder:
        stamp = os.path.join(folder, "fault_time")
        if debug:
            os.environ["COLLECTIVES_DEBUG"] = "DETAIL"
        try:
            results = run_world(function, world_size, (stamp, *extra), timeout=60,
                                init_timeout=TIMEOUT,
                                may_die=() if victim is None else (victim,))
        finally:
            os.environ.pop("COLLECTIVES_DEBUG", None)
        with open(stamp) as text:
            fault_time = float(text.read())
    survivors = [r for rank, r in enumerate(results) if rank != victim]
    said = [r[1].lower() for r in survivors if r is not None]
    ok = all(r is not None and r[0] in expect and all(w in r[1] for w in words)
             for r in survivors) and any(some_say.lower() in message for message in said)
    seconds = max(r[2] for r in survivors if r is not None) - fault_time if survivors else 0.0
    detail = next((r[1] for r in survivors if r is not None), "no error")
    return Outcome(ok, seconds, detail)


def case_kill_during_all_reduce():
    return _run_rank_case(rank_kill_during_all_reduce, words=("all_reduce (ring", "rank"))


def case_kill_during_backward():
    return _run_rank_case(rank_kill_during_backward, words=("all_reduce", "rank"))


def case_kill_during_startup_broadcast():
    # Survivors fail in the broadcast, or (if gloo's broadcast reached them first) in the
    # next start-up step, the bucket agreement check: both are named. gloo's own
    # collectives report the peer's socket address, not its rank.
    return _run_rank_case(rank_kill_during_startup_broadcast, words=())


def case_stall_during_all_reduce():
    # Each survivor names the rank it was waiting on: rank 2 times out on rank 1; rank 0,
    # waiting on rank 2, times out too or sees rank 2's connection close when it exits.
    return _run_rank_case(rank_stall_during_all_reduce, words=("all_reduce (ring", "rank"),
                          some_say="timed out")


MPI_STALL = """
import sys, time, torch, collectives
comm = collectives.init(backend="mpi", timeout={timeout})
if comm.rank == 1:
    time.sleep(60)  # a hung rank
started = time.time()
try:
    collectives.all_reduce(torch.ones(1 << 16), algorithm="ring", check=False)
except collectives.PeerError as error:
    line = f"rank {{comm.rank}} after {{time.time() - started:.2f}} s: {{error}}\\n"
    sys.stderr.write(line)
    with open({report!r}, "a") as report:  # mpirun may drop output as MPI_Abort ends it
        report.write(line)
    collectives.abort(1)  # MPI_Abort: mpirun ends the hung rank too
"""


def case_mpi_stall_under_mpirun():
    """The mpi backend under real mpirun: a hung rank, the others time out and exit 1."""
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "errors.txt")
        result = run(mpirun(3, *python("-c", MPI_STALL.format(timeout=TIMEOUT, report=report))),
                     timeout=120, check=False)
        seconds = time.time() - started
        lines = open(report).read().splitlines() if os.path.exists(report) else []
    ok = (result.returncode != 0 and 1 <= len(lines) <= 2  # the first abort may end the other
          and all("all_reduce (ring" in line and "timed out" in line for line in lines))
    return Outcome(ok, seconds, lines[0] if lines else result.stderr[-300:])


def _mismatch_case(kind, words, debug=False):
    def case():
        return _run_rank_case(rank_mismatch, (kind,), world_size=2, expect=("RuntimeError",),
                              words=words, debug=debug, victim=None)
    return case


def save_checkpoints_until_killed(path: str) -> None:
    """Save checkpoint after checkpoint (16 MB each, about 0.1 s) to `path`, for ever."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from trainer.loop import checkpoint
    for version in range(10**6):
        checkpoint.save_atomically({"version": version,
                                    "weights": torch.full((4_000_000,), float(version))}, path)


def case_checkpoint_killed_during_saves(runs=10):
    """SIGKILL a process that keeps saving checkpoints, at random moments; load after.
    The writer is forked from run_world's server, which has imported torch: it starts
    in a fraction of a second."""
    outcomes = []
    for trial in range(runs):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "checkpoint.pt")
            writer = _rank_context().Process(target=save_checkpoints_until_killed,
                                             args=(path,), daemon=True)
            writer.start()
            deadline = time.time() + 60
            while not os.path.exists(path) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(random.uniform(0.0, 0.6))  # then die at a random moment of a save
            writer.kill()  # SIGKILL
            writer.join()
            started = time.time()
            from trainer.loop import checkpoint
            try:
                state = checkpoint.load(path)
                ok = bool((state["weights"] == state["version"]).all())
                detail = f"loaded version {state['version']}"
            except Exception as error:  # a torn file would land here
                ok, detail = False, f"{type(error).__name__}: {error}"
            if ok:  # the next save removes the temporary file a killed save left
                checkpoint.save_atomically(state, path)
            leftovers = [name for name in os.listdir(folder) if name != "checkpoint.pt"]
            outcomes.append(Outcome(ok and not leftovers, time.time() - started,
                                    detail + (f", temporary files left after the next save: "
                                              f"{leftovers}" if leftovers else "")))
    return outcomes


def case_resume_after_kill():
    """Kill a 2-rank training run during epoch 2 (2 steps of each rank); resume; compare
    with a straight run."""
    flags = ["--train-samples", "64", "--test-samples", "32", "--batch-size", "16",
             "--epochs", "2", "--backend", "gloo"]
    with tempfile.TemporaryDirectory() as folder:
        def two_ranks(*extra):
            return mpirun(2, *trainer(*flags, *extra))
        run(two_ranks("--checkpoint-dir", "straight"), cwd=folder, timeout=300)
        job = subprocess.Popen(two_ranks("--checkpoint-dir", "killed"), cwd=folder,
                               env=rank_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        saved = os.path.join(folder, "killed", "checkpoint.pt")
        deadline = time.time() + 300
        while not os.path.exists(saved) and time.time() < deadline and job.poll() is None:
            time.sleep(0.1)
        time.sleep(0.5)  # into epoch 2
        os.killpg(job.pid, signal.SIGKILL)  # the whole job, mpirun and ranks
        job.wait()
        killed_in = torch.load(saved, weights_only=False)["epoch"] + 1  # epoch 1's: in 2
        if killed_in != 2:  # epoch 2's checkpoint came first: nothing would be resumed
            return Outcome(False, 0.0, f"killed in epoch {killed_in}, not during epoch 2")
        started = time.time()
        run(two_ranks("--checkpoint-dir", "killed", "--resume", "killed/checkpoint.pt"),
            cwd=folder, timeout=300)
        straight = torch.load(os.path.join(folder, "straight", "checkpoint.pt"),
                              weights_only=False)
        resumed = torch.load(saved, weights_only=False)
        same = all(torch.equal(t, mine["model"][k])  # every rank's replica
                   for theirs, mine in zip(straight["ranks"], resumed["ranks"])
                   for k, t in theirs["model"].items())
        return Outcome(same and resumed["epoch"] == 2, time.time() - started,
                       "bitwise equal to the uninterrupted run" if same else "differs")


def rank_nonfinite(comm, stamp):
    import collectives
    with open(stamp, "w") as out:
        out.write(repr(time.time()))
    torch.manual_seed(0)
    model = collectives.DistributedDataParallel(nn.Linear(8, 2), comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    skipped = 0
    for step in range(5):
        optimizer.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + comm.rank))
        if step == 2 and comm.rank == 1:
            x[0, 0] = float("nan")  # one rank's batch is poisoned
        F.mse_loss(model(x), torch.zeros(4, 2)).backward()
        if collectives.all_finite([p.grad for p in model.parameters()], comm):
            optimizer.step()
        else:
            skipped += 1
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return ("skipped", f"{skipped} skipped, finite={bool(torch.isfinite(weights).all())}, "
            f"sum={weights.sum().item():.9f}", time.time())


def case_nonfinite_skipped_together():
    with tempfile.TemporaryDirectory() as folder:
        stamp = os.path.join(folder, "t")
        results = run_world(rank_nonfinite, 2, (stamp,), timeout=60)
    details = {r[1] for r in results}
    ok = len(details) == 1 and details.pop().startswith("1 skipped, finite=True")
    return Outcome(ok, 0.0, results[0][1])


CASES = {
    "rank SIGKILLed during an all-reduce": case_kill_during_all_reduce,
    "rank SIGKILLed during backward (bucketed all-reduce)": case_kill_during_backward,
    "rank SIGKILLed during the start-up broadcast": case_kill_during_startup_broadcast,
    "rank stalls (alive, silent) during an all-reduce": case_stall_during_all_reduce,
    "mpi backend under mpirun: rank stalls": case_mpi_stall_under_mpirun,
    "numel differs": _mismatch_case("numel", ("numel=100", "numel=101")),
    "dtype differs": _mismatch_case("dtype", ("float64", "float32")),
    "shape differs (same numel)": _mismatch_case("shape", ("shape=(20, 10)", "shape=(10, 20)")),
    "a different model": _mismatch_case("model", ("the model differs across ranks",)),
    "bucket layout differs": _mismatch_case("buckets", ("the gradient buckets differ",)),
    "debug mode: a rank skips a call": _mismatch_case(
        "debug-divergence", ("call #0", "all_reduce", "broadcast"), debug=True),
    "SIGKILL during checkpoint saves": case_checkpoint_killed_during_saves,
    "resume after SIGKILL in epoch 2": case_resume_after_kill,
    "non-finite gradient on one rank (skip together)": case_nonfinite_skipped_together,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per case (default 5)")
    parser.add_argument("--cases", help="comma list of case-name substrings (default all)")
    args = parser.parse_args()
    print("| case | runs | outcome | time to error (max) | detail |\n|---|---|---|---|---|")
    for name, case in CASES.items():
        if args.cases and not any(part in name for part in args.cases.split(",")):
            continue
        outcomes = []
        once = case in (case_checkpoint_killed_during_saves, case_resume_after_kill)  # slow
        for _ in range(1 if once else args.runs):
            result = case()
            outcomes.extend(result if isinstance(result, list) else [result])
        good = sum(o.ok for o in outcomes)
        print(f"| {name} | {len(outcomes)} | {good}/{len(outcomes)} as expected | "
              f"{max(o.seconds for o in outcomes):.2f} s | {outcomes[-1].detail[:120]} |",
              flush=True)


if __name__ == "__main__":
    main()
