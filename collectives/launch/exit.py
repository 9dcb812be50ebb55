"""Ending a job well: background threads first, then the communicator; one failing rank
ends an MPI job at once.

A script need not call `collectives.destroy()`. At exit, `install_exit_hooks` has the
interpreter:

1. stop every background thread that registered (`stop_at_exit`: the bucketer's,
   async strategies', an elastic member's heartbeat), giving them a few seconds to
   finish the round they are in with peers that are exiting too;
2. close the default communicator, unless one of those threads is still inside a
   collective (a stalled peer, a slow link): closing would free what it is using (with
   shared memory, unmap the segments it reads: a SIGSEGV instead of the script's exit
   status). The thread is a daemon, so the process exits all the same.

And under mpirun, an uncaught exception on one rank calls MPI_Abort (as `python -m
mpi4py` does), so mpirun ends every rank instead of leaving the peers to time out.
torchrun needs nothing of the kind: it ends the other workers when one fails. A rank
that fails only because a peer did waits a moment first, so the launcher sees the
peer, the cause, end first.

This file knows nothing of transports: `collectives.world` hands it the function that
closes the communicator, the question whether there is a job to abort, and the test
of whether an error came from another rank.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from typing import Callable

EXIT_GRACE_SECONDS = 5.0  # at exit, the longest wait for background threads to finish
ABORT_GRACE_SECONDS = 0.5  # before MPI_Abort, time for the traceback to reach mpiexec
PEER_GRACE_SECONDS = 1.0  # a rank failing because a peer did lets that peer end first

_background = weakref.WeakSet()  # threads of ours to stop before the communicator closes
_background_deadline = None  # set by the first stop at exit: the grace is given once
_installed = False  # the exit hooks (install_exit_hooks)
_stopping_installed = False  # the stop of the background threads alone (stop_at_exit)


def stop_at_exit(worker) -> None:
    """Have `worker` (with stop(), join(seconds) and its `thread`) stopped at exit, before
    the communicator closes. Background threads register here: communication threads
    (the bucketer's, async strategies'), and those that talk to a store.

    Python's shutdown ends a daemon thread that is still inside a C++ call (a store's,
    gloo's) by unwinding it from under that call, and the C++ runtime aborts the process
    ("terminate called without an active exception"): stopped here first, such threads
    are back in Python by then."""
    global _stopping_installed
    _background.add(worker)
    if not _stopping_installed:  # also where no communicator is closed at exit
        atexit.register(_stop_background, EXIT_GRACE_SECONDS)
        _stopping_installed = True


def _stop_background(seconds: float) -> bool:
    """Stop every registered worker, give them `seconds` in all to finish (counted from
    the first call: the exit waits this long once), and say whether any is still
    running.

    A job still running after that talks to a peer that has not come; it is left to its
    daemon thread (its own timeout ends it), since exiting must not wait on a peer.
    """
    global _background_deadline
    if _background_deadline is None:
        _background_deadline = time.monotonic() + seconds
    workers = list(_background)
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.join(max(0.0, _background_deadline - time.monotonic()))
    return any(worker.thread.is_alive() for worker in workers)


def _close_at_exit(close: Callable[[], None]) -> None:
    """Run `close` (the default communicator's) while the interpreter is still whole.

    Left to the interpreter's own shutdown, gloo's threads are destroyed while they
    still run and the C++ runtime aborts the process ("terminate called without an
    active exception", SIGABRT) after the script has finished: a job that did its work
    reports failure. Closing is local to this rank (nothing is sent), so it never waits
    on a peer, alive or gone. Runs after a normal end, sys.exit(), an uncaught exception
    and KeyboardInterrupt alike; not after os._exit(). Nothing is left in /dev/shm
    either way: its files are removed as soon as every rank has mapped them.
    """
    try:
        if _stop_background(EXIT_GRACE_SECONDS):
            print(f"collectives: at exit, communication is still waiting on a peer after "
                  f"{EXIT_GRACE_SECONDS:g} s; the communicator is left open under it and "
                  "goes with the process", file=sys.stderr)
            return
        close()
    except Exception as error:  # exiting anyway: say so, never turn an exit into a crash
        print(f"collectives: closing the communicator at exit failed: {error}",
              file=sys.stderr)


def close_at_exit(close: Callable[[], None]) -> None:
    """Have `close` run at exit as the default communicator's close does (for a
    communicator that init() built but could not finish)."""
    atexit.register(_close_at_exit, close)


def _let_the_cause_end_first() -> None:
    """This rank fails because a peer did (a PeerError: its connection closed, or it
    said nothing within the timeout). Give that peer a moment to end first: a launcher
    takes the first rank to end as the job's cause and stops the rest. torchrun reports
    that rank as the "Root Cause" (and, ending before it, the cause would be reported as
    killed by SIGTERM); under mpirun the first MPI_Abort ends every rank, the cause's
    traceback perhaps not yet printed."""
    sys.stderr.flush()
    time.sleep(PEER_GRACE_SECONDS)


def _on_uncaught(previous_hook, in_a_job: Callable[[], bool],
                 caused_elsewhere: Callable[[BaseException], bool]):
    """An excepthook: print as before; if another rank's failure caused this one, let
    that rank end first; then, inside an MPI job of several ranks, abort it.

    Once MPI is initialised (the mpi backend, or gloo whose rendezvous went over MPI),
    MPI_Finalize at exit can wait for the other ranks while they wait for this one
    until their timeout.
    """
    def hook(kind, error, trace):
        previous_hook(kind, error, trace)
        if caused_elsewhere(error):
            _let_the_cause_end_first()
        mpi = sys.modules.get("mpi4py.MPI")
        if (in_a_job() and mpi is not None and mpi.Is_initialized()
                and not mpi.Is_finalized()):
            _write_out_what_a_wrapping_hook_holds()
            sys.stderr.flush()
            # mpiexec forwards output through its proxies and may drop what is still on
            # the way when an abort tears the job down: give the traceback a moment.
            time.sleep(ABORT_GRACE_SECONDS)
            abort(130 if issubclass(kind, KeyboardInterrupt) else 1)
    return hook


def _write_out_what_a_wrapping_hook_holds() -> None:
    """Write to the process's stderr what this hook printed into a buffer of another's.

    An excepthook installed after ours may wrap it and collect what it prints:
    torch.distributed's (init_process_group sets it) swaps sys.stderr for a StringIO
    around the call, to write the traceback out with "[rankN]: " before each line once
    our hook returns. Ours does not return: it aborts the job. Without this, a rank's
    traceback under mpirun with the gloo backend would never reach the screen."""
    held = sys.stderr
    if held is not sys.__stderr__ and hasattr(held, "getvalue") and sys.__stderr__:
        sys.__stderr__.write(held.getvalue())
        held.seek(0)
        held.truncate()


def install_exit_hooks(close: Callable[[], None], in_a_job: Callable[[], bool],
                       caused_elsewhere: Callable[[BaseException], bool]) -> None:
    """Once per process: `close` at exit (after the background threads); on an uncaught
    exception that `caused_elsewhere` says another rank caused, a moment for that rank to
    end first; and MPI_Abort on any uncaught exception while `in_a_job()` says there are
    peers."""
    global _installed
    if not _installed:
        atexit.register(_close_at_exit, close)
        sys.excepthook = _on_uncaught(sys.excepthook, in_a_job, caused_elsewhere)
        _installed = True


def abort(code: int = 1, caused_elsewhere: bool = False) -> None:
    """End the job now, after a fatal communication error.

    Under MPI this is MPI_Abort: mpirun then ends every rank, a hung one included (a
    plain non-zero exit would leave mpirun waiting for it). Otherwise this process exits;
    torchrun ends the other workers when one fails. `caused_elsewhere`: the error came
    from another rank's failure (a PeerError), so that rank is given a moment to end
    first and be the one the launcher names.
    """
    if caused_elsewhere:
        _let_the_cause_end_first()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(code)
    os._exit(code)
