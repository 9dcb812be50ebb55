"""Does every run end cleanly? Start small jobs under each launcher and count the exits.

    python tests/exit_cleanly.py --runs 100                 # every launcher, 100 jobs each
    python tests/exit_cleanly.py --runs 20 --launchers torchrun --cases end,raise

A job's ranks init, run one all-reduce, and then end in one of these ways, none of
them calling collectives.destroy():

    end        every rank reaches the end of the script             expect exit 0
    ddp        one DDP training step (the comm thread is idle again) expect exit 0
    stall      rank 0 ends with a bucket's reduction still waiting   expect exit 0
               for rank 1, which stalls past rank 0's exit grace
    async      async-avg started, never closed (a round in flight)   expect exit 0
    init-fail  rank 1 fails inside init(), while the shared-memory   expect the job to fail
               files exist
    raise      rank 1 raises before the next all-reduce              expect the job to fail
    sys-exit   rank 1 calls sys.exit(3) before the next all-reduce   expect the job to fail
    interrupt  rank 1 gets KeyboardInterrupt there                   expect the job to fail

A job must end with its case's exit status, exactly (FAILED_STATUS; under torchrun, also
rank 1's own status in torchrun's report), with rank 1's error on screen when it fails.
No rank may die of a signal nobody sent it (a SIGSEGV, a SIGABRT: "terminate called
..."), every rank must be gone within the timeout, and no file may be left in /dev/shm.
Files exist there only while init() connects the ranks, so init-fail is the case that
can leave one; it also reports how many it saw, so that check is known to have looked.
stall and init-fail need a peer: the single launcher skips them. The same file is the
rank program: `exit_cleanly.py rank CASE BACKEND` is what each launcher starts.

Launchers: torchrun (gloo), mpirun-gloo, mpirun-mpi (our mpi4py backend), single (one
plain process, no launcher). The tests (test_exit.py) run a few jobs of each; the
100-run table in docs/reliability.md comes from this script.
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_TIMEOUT = 10      # seconds: collectives.init(timeout=...) in every rank
JOB_LIMIT = 120        # seconds before a job counts as hung
CASES = ("end", "ddp", "stall", "async", "init-fail", "raise", "sys-exit", "interrupt")
CLEAN_CASES = ("end", "ddp", "stall", "async")
LAUNCHERS = ("torchrun", "mpirun-gloo", "mpirun-mpi", "single")
ABORT_SIGNS = ("terminate called", "core dumped", "SIGABRT", "Aborted")
MULTI_RANK_CASES = ("stall", "init-fail")  # need a peer: not run by the single launcher
# The exit status of a failing job: torchrun ends any job whose worker failed with 1 (and
# reports each worker's own status: RANK1_STATUS), mpirun passes on the code of the
# MPI_Abort that ended the job, and one plain process exits as Python does.
FAILED_STATUS = {  # case: (torchrun, mpirun, single)
    "init-fail": (1, 1, None),
    "raise": (1, 1, 1),
    "sys-exit": (1, 1, 3),  # mpirun: the survivor's PeerError aborts the job with 1
    "interrupt": (1, 130, -signal.SIGINT),  # Python ends itself by SIGINT, as shells expect
}
RANK1_STATUS = {"init-fail": 1, "raise": 1, "sys-exit": 3, "interrupt": -signal.SIGINT}
FAILURE_SIGNS = {"init-fail": "rank 1 failed during init on purpose",
                 "raise": "rank 1 failed on purpose", "sys-exit": "SystemExit: 3",
                 "interrupt": "KeyboardInterrupt"}
# How a launcher says a rank ended on a signal: torchrun's worker report, mpirun's (MPICH's
# hydra, Open MPI's). SIGTERM and SIGKILL are the launchers' own way to stop survivors.
SIGNAL_REPORTS = (re.compile(r"exitcode\s*:\s*-(\d+)"), re.compile(r"\(signal (\d+)\)"),
                  re.compile(r"exited on signal (\d+)"))
STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL)
EXIT_NOTE = "still waiting on a peer"  # the exit hook's note (launch/exit.py) when it leaves the communicator open


# --- the rank program ----------------------------------------------------------------------
def rank_main(case: str, backend: str) -> None:
    """Run the case; a rank that fails also writes its error to $EXIT_CLEANLY_DIR: an
    error Python does not print (sys.exit(3)) is checked there, and a failed check shows
    what each rank raised."""
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

    _record_created_segments()
    if case == "init-fail":
        _fail_while_the_segments_exist()
    if case == "stall":
        _shorten_the_exit_grace_and_mark_its_end()
    comm = collectives.init(backend=backend, timeout=RANK_TIMEOUT)
    collectives.all_reduce(torch.ones(1000), op="sum")
    if case == "stall":
        _stall_with_a_reduction_in_flight(comm)
    elif case == "ddp":
        model = collectives.DistributedDataParallel(torch.nn.Linear(20, 4), comm=comm)
        model(torch.randn(8, 20)).sum().backward()
    elif case == "async":
        strategy = sync.create("async-avg")
        model = collectives.DistributedDataParallel(torch.nn.Linear(200, 200), sync=strategy,
                                                    moments="loop", comm=comm)
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


def _record_created_segments() -> None:
    """Write the path of every shared-memory file this rank creates to
    $EXIT_CLEANLY_DIR before creating it: the driver checks those, and only those, are
    gone (other jobs on the machine have files of their own)."""
    from collectives.transport import shm
    make_segment = shm._Segment.__init__

    def recorded(segment, path, local_size, slots, slot_bytes, create):
        if create:
            with open(os.path.join(os.environ["EXIT_CLEANLY_DIR"],
                                   f"segments-created-{os.getpid()}"), "a") as out:
                out.write(path + "\n")
        make_segment(segment, path, local_size, slots, slot_bytes, create)

    shm._Segment.__init__ = recorded


def _created_segments(folder: str) -> list:
    """The shared-memory files the job's ranks recorded creating."""
    paths = []
    for name in os.listdir(folder):
        if name.startswith("segments-created-"):
            with open(os.path.join(folder, name)) as recorded:
                paths += recorded.read().split()
    return paths


def _fail_while_the_segments_exist() -> None:
    """Have rank 1 fail inside init() at the moment every shared-memory file is in
    /dev/shm: just after it has mapped rank 0's segment (ranks remove their files only
    once every rank has mapped them). It writes how many it saw, so the driver knows its
    leftover check looked at a job that had files to leave."""
    from collectives.transport import shm
    map_segment = shm._Segment.__init__

    def failing(segment, path, local_size, slots, slot_bytes, create):
        map_segment(segment, path, local_size, slots, slot_bytes, create)
        if not create and path.endswith("-0"):  # rank 1 (of 2) maps rank 0's segment
            folder = os.environ["EXIT_CLEANLY_DIR"]
            with open(os.path.join(folder, "segments-seen"), "w") as out:
                out.write(str(sum(map(os.path.exists, _created_segments(folder)))))
            raise RuntimeError("rank 1 failed during init on purpose")

    shm._Segment.__init__ = failing


STALL_GRACE_SECONDS = 2.0  # the stall case's exit grace: any wait shows the same thing


def _shorten_the_exit_grace_and_mark_its_end() -> None:
    """For the stall case, before init(): the exit's grace (EXIT_GRACE_SECONDS) becomes
    STALL_GRACE_SECONDS, since the reduction waits on a peer that never comes however
    long it is given; and an exit handler writes $EXIT_CLEANLY_DIR/past-grace-<pid>
    once the exit hook has given the comm thread its grace and chosen to close or not.
    Registered before init() installs the exit hook, it runs after it (atexit runs the
    last registered first), so the stalled peer can stop waiting as soon as the exit it
    stalls is past that choice."""
    from collectives.launch import exit as launch_exit
    launch_exit.EXIT_GRACE_SECONDS = STALL_GRACE_SECONDS
    marker = os.path.join(os.environ["EXIT_CLEANLY_DIR"], f"past-grace-{os.getpid()}")
    atexit.register(lambda: open(marker, "w").close())


def _stall_with_a_reduction_in_flight(comm) -> None:
    """Rank 0 ends its script while its comm thread is still inside a bucket's
    reduction: backward hands the bucket to the thread (a Bucketer, as DDP's, whose
    step never comes) and the script stops there. Rank 1 stalls past rank 0's exit
    grace (EXIT_GRACE_SECONDS), so that exit finds the reduction still waiting for
    rank 1, then ends without communicating. (Not the Horovod face: its engine tells
    the other ranks when one ends, and the reduction fails at once.)

    Rank 1 stalls until rank 0 is gone or past its exit hook's choice (the marker of
    _shorten_the_exit_grace_and_mark_its_end), or at most a few seconds past the grace:
    under mpirun, rank 0's MPI_Finalize waits for rank 1's."""
    import torch
    import collectives
    from collectives.bucketer import Bucketer, BucketOptions
    from collectives.launch.exit import EXIT_GRACE_SECONDS
    pids = torch.zeros(comm.world_size, dtype=torch.int64)
    pids[comm.rank] = os.getpid()
    collectives.all_reduce(pids, op="sum")  # every rank's pid
    model = torch.nn.Linear(20, 4)
    bucketer = Bucketer(list(model.parameters()), lambda flat: collectives.all_reduce(flat),
                        comm, BucketOptions(finish_after_backward=False, unused="zeros"))
    ending = os.path.join(os.environ["EXIT_CLEANLY_DIR"], "rank-0-ending")
    if comm.rank == 0:
        model(torch.randn(8, 20)).sum().backward()  # the bucket goes to the comm thread
        assert bucketer.in_flight
        open(ending, "w").close()
        return
    deadline = time.monotonic() + JOB_LIMIT / 2
    while not os.path.exists(ending) and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = min(deadline, time.monotonic() + EXIT_GRACE_SECONDS + 5)
    past_grace = os.path.join(os.environ["EXIT_CLEANLY_DIR"], f"past-grace-{int(pids[0])}")
    while (_alive(int(pids[0])) and not os.path.exists(past_grace)
           and time.monotonic() < deadline):
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


# --- the driver ------------------------------------------------------------------------------
@dataclass
class Outcome:
    launcher: str
    case: str
    returncode: int
    seconds: float
    output: str
    leftovers: list
    segments_seen: int = 0  # init-fail: collectives files in /dev/shm when rank 1 failed
    errors_written: str = ""  # what the failing ranks wrote to $EXIT_CLEANLY_DIR

    @property
    def expected_status(self) -> int:
        if self.case in CLEAN_CASES:
            return 0
        torchrun, mpirun, single = FAILED_STATUS[self.case]
        return {"torchrun": torchrun, "single": single}.get(self.launcher, mpirun)

    @property
    def signals(self) -> set:
        """The signals that ended a rank (or the launcher), as the launcher reports them."""
        found = {int(number) for pattern in SIGNAL_REPORTS
                 for number in pattern.findall(self.output)}
        if self.returncode is not None and self.returncode < 0:
            found.add(-self.returncode)
        return found

    @property
    def crashed(self) -> bool:
        """Did a rank die of a signal nobody sent it (SIGSEGV, SIGABRT...) or abort?
        (The interrupt case's rank 1 ends by SIGINT of its own, as Python does.)"""
        allowed = set(STOP_SIGNALS) | ({signal.SIGINT} if self.case == "interrupt" else set())
        return bool(self.signals - allowed) or any(s in self.output for s in ABORT_SIGNS)

    def rank_status(self, rank: int):
        """The rank's own exit status as torchrun reports it (None if not reported)."""
        found = re.search(rf"rank\s*:\s*{rank} \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)",
                          self.output)
        return int(found.group(1)) if found else None

    @property
    def problems(self) -> list:
        """What is wrong with how the job ended; empty when it ended the way its case must."""
        if self.returncode is None:
            return ["hung"]
        found = []
        if self.crashed:
            found.append(f"a rank crashed (signals {sorted(self.signals)})")
        if self.returncode != self.expected_status:
            found.append(f"exit {self.returncode}, expected {self.expected_status}")
        if self.leftovers:
            found.append(f"left in /dev/shm: {self.leftovers}")
        if self.case in FAILURE_SIGNS:
            # what Python prints (a traceback) must reach the launcher's output, under
            # mpirun too, where MPI_Abort ends the job; sys.exit(3) prints nothing
            seen = self.errors_written if self.case == "sys-exit" else self.output
            if FAILURE_SIGNS[self.case] not in seen:
                found.append(f"rank 1's error ({FAILURE_SIGNS[self.case]!r}) is not on "
                             f"screen (the ranks wrote: {self.errors_written.strip()!r})")
        if (self.launcher == "torchrun" and self.case in RANK1_STATUS
                and self.rank_status(1) != RANK1_STATUS[self.case]):
            found.append(f"rank 1 exited {self.rank_status(1)}, expected "
                         f"{RANK1_STATUS[self.case]}")
        if self.case == "init-fail" and not self.segments_seen:
            found.append("rank 1 saw no segment in /dev/shm: the leftover check checked nothing")
        if self.case == "stall" and self.launcher != "single" and EXIT_NOTE not in self.output:
            found.append("rank 0's exit did not note a reduction left waiting: the case "
                         "did not happen, or the exit closed under it")
        return found

    @property
    def ok(self) -> bool:
        """Did the job end the way its case must?"""
        return not self.problems

    def describe(self) -> str:
        tail = "\n".join(self.output.strip().splitlines()[-8:])
        return (f"{self.launcher} {self.case}: {'; '.join(self.problems) or 'ok'} after "
                f"{self.seconds:.1f} s\n{tail}")


def command(launcher: str, case: str, nprocs: int) -> list:
    from launchers import mpirun, python, torchrun  # not in the ranks: they need none
    rank = python(os.path.join(HERE, "exit_cleanly.py"), "rank", case)
    if launcher == "torchrun":
        return torchrun(nprocs, "--no-python", *rank, "gloo")
    if launcher.startswith("mpirun"):
        return mpirun(nprocs, *rank, launcher.split("-")[1])
    return [*rank, "gloo"]


def run_job(launcher: str, case: str, nprocs: int = 2) -> Outcome:
    errors = tempfile.mkdtemp(prefix="exit-cleanly-")
    from launchers import rank_env
    env = rank_env(EXIT_CLEANLY_DIR=errors)
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
    segments_seen, errors_written = 0, ""
    leftovers = sorted(path for path in _created_segments(errors) if os.path.exists(path))
    for name in sorted(os.listdir(errors)):  # the ranks' errors, as they wrote them
        with open(os.path.join(errors, name)) as file:
            if name == "segments-seen":
                segments_seen = int(file.read())
            elif name.startswith("error-"):
                errors_written += file.read()
    shutil.rmtree(errors, ignore_errors=True)
    return Outcome(launcher, case, returncode, seconds, output, leftovers, segments_seen,
                   errors_written)


def cases_for(launcher: str) -> list:
    return [case for case in CASES if launcher != "single" or case not in MULTI_RANK_CASES]


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
    print(f"{'launcher':12} {'case':10} {'runs':>5} {'ok':>5} {'crashes':>7} {'worst s':>8}")
    failed = 0
    for launcher in launchers:
        for case in [case for case in cases if case in cases_for(launcher)]:
            outcomes = [run_job(launcher, case, args.nprocs) for _ in range(args.runs)]
            bad = [o for o in outcomes if not o.ok]
            failed += len(bad)
            print(f"{launcher:12} {case:10} {len(outcomes):5} {len(outcomes) - len(bad):5} "
                  f"{sum(o.crashed for o in outcomes):7} "
                  f"{max(o.seconds for o in outcomes):8.1f}", flush=True)
            for outcome in bad[:2]:
                print("  " + outcome.describe().replace("\n", "\n  "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
