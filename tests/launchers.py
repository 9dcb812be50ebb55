"""Commands that start ranks, as users type them, and one way to run them from a test.

A test that watches real processes from outside (a launcher, the trainer's command line,
a job that must fail with one line) builds its command from the pieces here and hands
it to `run`:

    run(mpirun(2, *trainer("--epochs", "1")), cwd=tmp_path)   # mpirun -np 2 python -m trainer
    run(torchrun(4, "--no-python", sys.executable, "-c", code))  # torchrun, 4 ranks
    run(LAUNCHERS[name](2, trainer(*flags)), cwd=tmp_path)     # each launch mode in turn

`run` gives every command a timeout and the environment a launched rank should see
(`rank_env`), and fails with the command and the tail of what it printed, whether it
exited non-zero or ran past its time; a command past its time is ended with everything
it started. Tests that call a function on ranks inside the test process use
tests/distributed.py's run_world instead: this module is for commands. A command that
only joins a job and computes can run that way too (`as_launched`), without a fresh
interpreter per rank; one test of each command's own start-up keeps the command itself.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from collectives.launch.mpirun import find_mpirun
from ports import free_port

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

TIMEOUT = 240  # seconds a command may take, unless its test says otherwise
SHOWN = 3000  # characters of each stream that a failure shows (their ends: errors are last)
STOP_GRACE = 5  # seconds a launcher gets to end its ranks before everything is killed

# What torchrun sets for each rank. One inherited from the shell that runs pytest would
# tell a command that it is a rank of some other job, even under mpirun (collectives.launch
# reads torchrun's variables before MPI's).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def rank_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> Dict[str, str]:
    """`base` (os.environ if None) as a launched rank should see it, with `extra` added:
    no launcher's variables, one OpenMP thread per rank (the ranks share the machine's
    cores), and this checkout first on PYTHONPATH."""
    base = os.environ if base is None else base
    env = {name: value for name, value in base.items() if name not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, base.get("PYTHONPATH")]))
    env.update(extra)
    return env


def python(*args: str) -> List[str]:
    """`python args`, with the interpreter that runs the tests."""
    return [sys.executable, *args]


def trainer(*flags: str) -> List[str]:
    """`python -m trainer flags`: one process; a launcher below makes it a job."""
    return python("-m", "trainer", *flags)


def mpirun(nprocs: int, *command: str) -> List[str]:
    """`mpirun -np N command`, with the mpirun of the MPI that mpi4py was built with."""
    return [find_mpirun()[0], "-np", str(nprocs), *command]


def launch_mpi_sh(nprocs: int, *command: str) -> List[str]:
    """The checkout's launch_mpi.sh, which finds that mpirun itself."""
    return [os.path.join(ROOT, "launch_mpi.sh"), "-np", str(nprocs), "--", *command]


def torchrun(nprocs: int, *args: str) -> List[str]:
    """`torchrun --nproc-per-node N args`, where `args` is what follows `python` in the
    command (torchrun starts python itself, unless args begin with --no-python). Its
    rendezvous is on a free port (ports.py), so that jobs running side by side do not
    meet."""
    return python("-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
                  "--master-port", str(free_port()), *args)


# The ways a user starts a python command on `nprocs` ranks: launcher(nprocs, command),
# for a command that begins with the interpreter (python(...) or trainer(...)).
LAUNCHERS: Dict[str, Callable[[int, Sequence[str]], List[str]]] = {
    "plain": lambda nprocs, command: list(command),  # one process, no launcher
    "mpirun": lambda nprocs, command: mpirun(nprocs, *command),
    "launch_mpi.sh": lambda nprocs, command: launch_mpi_sh(nprocs, *command),
    "torchrun": lambda nprocs, command: torchrun(nprocs, *command[1:]),
}


def as_launched(comm, module: str, argv: Sequence[str]) -> str:
    """`python -m module argv` as one rank of a launcher's job, in this process, for
    run_world(as_launched, N, backend=None, args=(module, argv)): its ranks have the
    variables torchrun sets and the command joins the job itself, as it does under a
    launcher (its --nproc would start a fresh interpreter per rank instead: seconds of
    imports each). Its main() must return 0; returns what the rank printed."""
    import contextlib
    import importlib
    import io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = importlib.import_module(module).main(list(argv))
    assert code in (0, None), f"python -m {module}: exit {code}\n{printed.getvalue()}"
    return printed.getvalue()


def run(argv: Sequence[str], cwd: Optional[str] = ROOT, timeout: float = TIMEOUT,
        env: Optional[Mapping[str, str]] = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run `argv` to its end and return what it printed (text) and its exit status.

    env: the command's whole environment (rank_env() if None). check: fail the test
    unless it exits 0. A command past `timeout` seconds always fails the test, after
    it and every process it started are ended."""
    # In a session of its own, so that a job past its time ends whole: launcher and ranks.
    with subprocess.Popen(list(argv), cwd=cwd, env=dict(rank_env() if env is None else env),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as late:
            _stop(job)
            raise AssertionError(failure(argv, f"ran past its {timeout:g} s timeout",
                                         _text(late.output), _text(late.stderr))) from None
        except BaseException:  # the test itself ended (its own timeout, Ctrl-C)
            _stop(job)
            raise
    if check and job.returncode != 0:
        raise AssertionError(failure(argv, f"exited {job.returncode}", stdout, stderr))
    return subprocess.CompletedProcess(list(argv), job.returncode, stdout, stderr)


# What a reader takes for a failure: torch's C++ log lines ("[E1129 05:21:20 ...] ...",
# "[W..."), its Python logging ("W1129 ..."), a traceback, any program's error or warning.
ERROR_LOOKING = re.compile(r"^\[?[EWF]\d{4} |Traceback|error|warning", re.IGNORECASE)


def error_looking_lines(text: str) -> List[str]:
    """The lines of `text` (what a clean run printed) that a reader would take for an
    error or a warning."""
    return [line for line in text.splitlines() if ERROR_LOOKING.search(line)]


def failure(argv: Sequence[str], what: str, stdout: str, stderr: str) -> str:
    """The message of a command that failed: the command, what went wrong, and the last
    SHOWN characters of each stream."""
    return (f"{' '.join(map(str, argv))}\n{what}\n--- stdout (its end) ---\n{stdout[-SHOWN:]}"
            f"\n--- stderr (its end) ---\n{stderr[-SHOWN:]}")


def _stop(job: subprocess.Popen) -> None:
    """End `job` and its session: SIGTERM first, so that a launcher can end the ranks it
    started in sessions of their own (torchrun does), then SIGKILL for what is left.
    Its output is not read again: a rank that outlived it may still hold the pipes."""
    for signal_number, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(job.pid, signal_number)
        except ProcessLookupError:  # nothing of the session is left
            break
        try:
            job.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    job.wait()


def _text(output) -> str:
    """Output a timed-out command printed before it was stopped (bytes, however the
    command was started) as text."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
