"""Does every run end cleanly? Start small jobs under each launcher and count the exits.

    python tests/exit_cleanly.py --runs 100                 # every launcher, 100 jobs each
    python tests/exit_cleanly.py --runs 20 --launchers torchrun --cases end,raise

A job's ranks init, run one all-reduce, and then end in one of these ways, none of
them calling collectives.destroy():

    end        every rank reaches the end of the script             expect exit 0
    ddp        one DDP training step (the comm thread is running)    expect exit 0
    async      async-avg started, never closed (a round in flight)   expect exit 0
    raise      rank 1 raises before the next all-reduce              expect the job to fail
    sys-exit   rank 1 calls sys.exit(3) before the next all-reduce   expect the job to fail
    interrupt  rank 1 gets KeyboardInterrupt there                   expect the job to fail

A failing job must fail for the reason given (rank 1's error is on screen), every rank
must be gone within the timeout, and none may abort ("terminate called ...", SIGABRT)
or leave a file in /dev/shm. The same file is the rank program: `exit_cleanly.py rank
CASE BACKEND` is what each launcher starts.

Launchers: torchrun (gloo), mpirun-gloo, mpirun-mpi (our mpi4py backend), single (one
plain process, no launcher). The tests (test_exit.py) run a few jobs of each; the
100-run table in docs/reliability.md comes from this script.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RANK_TIMEOUT = 10      # seconds: collectives.init(timeout=...) in every rank
JOB_LIMIT = 120        # seconds before a job counts as hung
CASES = ("end", "ddp", "async", "raise", "sys-exit", "interrupt")
CLEAN_CASES = ("end", "ddp", "async")
LAUNCHERS = ("torchrun", "mpirun-gloo", "mpirun-mpi", "single")
ABORT_SIGNS = ("terminate called", "core dumped", "SIGABRT", "exitcode: -6", "Aborted")


# --- the rank program ----------------------------------------------------------------------
def rank_main(case: str, backend: str) -> None:
    """Run the case; a rank that fails also writes its error to $EXIT_CLEANLY_DIR, since
    mpirun can drop a rank's last output when MPI_Abort ends the job."""
    try:
        _rank_case(case, backend)
    except BaseException as error:
        folder = os.environ.get("EXIT_CLEANLY_DIR")
        if folder and not (isinstance(error, SystemExit) and not error.code):
            with open(os.path.join(folder, f"error-{os.getpid()}"), "w") as out:
                out.write(f"{type(error).__name__}: {error}\n")
        raise


def _rank_case(case: str, backend: str) -> None:
    import torch
    import collectives
    from collectives import sync

    comm = collectives.init(backend=backend, timeout=RANK_TIMEOUT)
    collectives.all_reduce(torch.ones(1000), op="sum")
    if case == "ddp":
        model = collectives.DistributedDataParallel(torch.nn.Linear(20, 4), comm=comm)
        model(torch.randn(8, 20)).sum().backward()
    elif case == "async":
        strategy = sync.create("async-avg")
        model = collectives.DistributedDataParallel(torch.nn.Linear(200, 200), sync=strategy,
                                                    comm=comm)
        for step in range(1, 4):
            model(torch.randn(8, 200)).sum().backward()
            strategy.after_step(model.module, step)
    elif comm.rank == 1 or comm.world_size == 1:
        if case == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        if case == "sys-exit":
            sys.exit(3)
        if case == "interrupt":
            raise KeyboardInterrupt
    if case in ("raise", "sys-exit", "interrupt"):
        collectives.all_reduce(torch.ones(1000))  # rank 1 never comes: a PeerError here
    print(f"rank {comm.rank} done", flush=True)


# --- the driver ------------------------------------------------------------------------------
@dataclass
class Outcome:
    launcher: str
    case: str
    returncode: int
    seconds: float
    output: str
    leftovers: list

    @property
    def aborted(self) -> bool:
        return self.returncode in (-6, 134) or any(s in self.output for s in ABORT_SIGNS)

    @property
    def ok(self) -> bool:
        """Did the job end the way its case must?"""
        if self.aborted or self.leftovers or self.returncode is None:
            return False
        if self.case in CLEAN_CASES:
            return self.returncode == 0
        reason = {"raise": "rank 1 failed on purpose", "sys-exit": "",
                  "interrupt": "KeyboardInterrupt"}[self.case]
        return self.returncode != 0 and reason in self.output

    def describe(self) -> str:
        state = "hung" if self.returncode is None else f"exit {self.returncode}"
        tail = "\n".join(self.output.strip().splitlines()[-8:])
        return f"{self.launcher} {self.case}: {state} after {self.seconds:.1f} s\n{tail}"


def command(launcher: str, case: str, nprocs: int) -> list:
    rank = [sys.executable, os.path.join(HERE, "exit_cleanly.py"), "rank", case]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(nprocs), "--no-python", *rank, "gloo"]
    if launcher.startswith("mpirun"):
        from collectives.mpi_launcher import find_mpirun
        return [find_mpirun()[0], "-np", str(nprocs), *rank, launcher.split("-")[1]]
    return [*rank, "gloo"]


def _shm_files() -> set:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("collectives-")}
    except OSError:
        return set()


def run_job(launcher: str, case: str, nprocs: int = 2) -> Outcome:
    errors = tempfile.mkdtemp(prefix="exit-cleanly-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, EXIT_CLEANLY_DIR=errors)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    before = _shm_files()
    started = time.monotonic()
    try:
        done = subprocess.run(command(launcher, case, nprocs), capture_output=True, text=True,
                              env=env, timeout=JOB_LIMIT, cwd=HERE)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as hung:
        returncode = None
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                         for part in (hung.stdout or "", hung.stderr or ""))
    seconds = time.monotonic() - started
    for name in sorted(os.listdir(errors)):  # the ranks' errors, as they wrote them
        with open(os.path.join(errors, name)) as file:
            output += f"\n[error file] {file.read()}"
    shutil.rmtree(errors, ignore_errors=True)
    return Outcome(launcher, case, returncode, seconds, output, sorted(_shm_files() - before))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="jobs per launcher and case")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks per job")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    launchers, cases = args.launchers.split(","), args.cases.split(",")
    for name in launchers + cases:
        if name not in LAUNCHERS + CASES:
            parser.error(f"unknown launcher or case {name!r}")
    print(f"{'launcher':12} {'case':10} {'runs':>5} {'ok':>5} {'aborts':>7} {'worst s':>8}")
    failed = 0
    for launcher in launchers:
        for case in cases:
            outcomes = [run_job(launcher, case, args.nprocs) for _ in range(args.runs)]
            bad = [o for o in outcomes if not o.ok]
            failed += len(bad)
            print(f"{launcher:12} {case:10} {len(outcomes):5} {len(outcomes) - len(bad):5} "
                  f"{sum(o.aborted for o in outcomes):7} "
                  f"{max(o.seconds for o in outcomes):8.1f}", flush=True)
            for outcome in bad[:2]:
                print("  " + outcome.describe().replace("\n", "\n  "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
