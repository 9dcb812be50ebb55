"""Work as torch.distributed defines it, run in order on one thread per process group.

torch.distributed hands every collective to the backend and gets back a Work: the
caller may wait() on it (a blocking call does so at once), ask is_completed(), or chain
on get_future() (torch's DDP does, from inside backward). A backend must therefore
start the operation and return before it finishes. Here each process group owns a
`Worker`: one thread that runs the group's collectives one after another, in the order
they were issued. Every rank issues them in the same order, so every rank's worker
runs the same sequence and their messages match.

A blocking call (async_op=False, which torch passes as opts.asyncOp) runs on the
caller's own thread when nothing of the group is queued or running: the result is the
same, and it saves the hand-over to the worker and back, which costs most on a
machine whose cores are all busy.

Jobs run in the order they were admitted (`Worker.submit` takes them in turn), on this
thread or the caller's. Collectives issued from several threads of one rank at once run
in whatever order those threads reached the group, as on gloo: a program that issues
them so must itself make that order the same on every rank.

Callbacks chained on a Work's future (`get_future().then(...)`) run on the thread that
finishes the Work: the worker. torch's PowerSGD hook (and any hook that chains
collectives) issues the next all-reduce from inside such a callback and waits for it:

    worker:  run all_reduce A  ->  finish A  ->  callback(A): all_reduce B, wait(B)
                                                               |
                        queued behind the callback, B would never run: a deadlock

So a collective issued from the thread that is running one of this group's operations
runs right there, nested, before the worker takes the next one from its queue. That is
the same point in every rank's sequence (after A, before whatever was queued behind
it), so the ranks still agree on the order. Waiting there on an operation that is
still queued could never end: it raises at once instead.

One rule follows, which torch's hooks keep: chain such a callback before issuing the
group's next collective. Chained later, it runs nested where A is still running
(before the later one) and at once on the caller's thread where A has finished (after
it): the ranks' orders could then differ.

`Work` is ours, not torch's `_create_work_from_future`: a Work built from a failed
future still returns True from wait() and ignores the timeout, so a dead peer looks
like success. Ours re-raises the error from wait() and from get_future()'s value, and
wait(timeout) raises when the timeout passes first. torch 2.14 passes only wait() and
get_future() on to a Work made in Python (is_completed() reads False through it), so
those are all it has.

A collective that fails leaves the group's ranks out of step (some messages were sent,
some not), so the worker refuses every later collective of that group with the first
error, as NCCL aborts a communicator; the job should end, or make a new group. The one
exception is `Refused`: a call whose ranks all learned, in step, that it would not run
(scatter's ranks, told by a root that refused its own input list): it fails, and the
group goes on.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..transport import PeerError


class Refused(ValueError):
    """A call that failed on every rank in step, its messages all matched: the group
    stays usable (the worker does not refuse later calls after it)."""


class Work(dist._Work):
    """One operation of a process group: finished by the worker, waited on by the caller."""

    def __init__(self, what: str, outputs: List[torch.Tensor], timeout: timedelta,
                 queued: bool = True, worker: Optional["Worker"] = None):
        super().__init__()
        self._what = what
        self._worker = worker            # to refuse a wait that could never end
        self._outputs = outputs          # what get_future() yields, as torch's backends
        self._timeout = timeout         # the group's: used when wait() is given none
        self._error: Optional[BaseException] = None
        self._finished = False
        # A Work run on the caller's thread is finished before anyone can wait on it:
        # it needs no event, and its future is made only if asked for (both cost
        # microseconds on every blocking call). A queued one is waited on across threads.
        self._done = threading.Event() if queued else None
        self._future = torch.futures.Future() if queued else None

    # --- the worker's side ---------------------------------------------------------------
    def finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._finished = True
        if self._done is not None:
            self._done.set()
        if self._future is not None:
            self._settle(self._future)

    def _settle(self, future: torch.futures.Future) -> None:
        # Callbacks chained with then() run here, on the worker (DDP copies its bucket
        # back into the gradients this way).
        if self._error is None:
            future.set_result(self._outputs)
        else:
            future.set_exception(self._error)

    def describe(self) -> str:
        return self._what

    # --- torch's side ------------------------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done; raise its error, or PeerError if `timeout` (zero: the
        group's timeout) passes first."""
        if not self._finished:  # (a blocking call's Work is finished: skip the rest)
            if self._worker is not None and self._worker.running_here():
                raise RuntimeError(
                    f"{self._what} was waited on from inside an operation (or a callback "
                    "chained on one) of the same process group, and is queued behind it: it "
                    "could never finish. Issue it from the callback, or wait outside.")
            limit = timeout if timeout > timedelta(0) else self._timeout
            if not self._done.wait(limit.total_seconds()):
                raise PeerError(f"{self._what} did not complete within "
                                f"{limit.total_seconds():g} s (a peer stalled or died)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:  # run on the caller's thread: finished already
            self._future = torch.futures.Future()
            self._settle(self._future)
        return self._future


class Worker:
    """A thread that runs one process group's operations in the order they came."""

    def __init__(self, name: str, timeout: timedelta):
        self.timeout = timeout
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.broken: Optional[BaseException] = None  # the first failure; refuses the rest
        self.lock = threading.Lock()      # guards `pending`
        self.pending = 0                  # submitted and not yet finished
        # Held while a job runs, here or in the caller; re-entered by a job nested in it.
        self.running = threading.RLock()
        self._running_on: Optional[int] = None  # the thread running a job now, if any
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, what: str, run: Callable[[], None], outputs: List[torch.Tensor],
               inline: bool = False) -> Work:
        """Queue `run` (which fills `outputs`) and return its Work at once; or run it
        on this thread and return it finished: when `inline` and nothing is pending, and
        always when issued from inside a running job (a chained callback, see above)."""
        if self.stopped:
            raise RuntimeError(f"{what}: the process group was destroyed")
        nested = self.running_here()
        with self.lock:
            # Run here only holding `running`, taken before `lock` is let go: a job
            # admitted after this one, by another thread, then waits for it on the
            # worker. (Taken after, the worker could run that later job first.) Taken
            # only where nothing is running: pending can read 0 while the worker, its
            # count already lowered, still holds it; then this job queues behind.
            here = nested or (inline and self.pending == 0
                              and self.running.acquire(blocking=False))
            self.pending += 1
            work = Work(what, outputs, self.timeout, queued=not here, worker=self)
            if not here:
                self.jobs.put((work, run))
        if here:
            try:
                self._execute(work, run)
            finally:
                if not nested:
                    self.running.release()
        return work

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self._execute(*job)

    def running_here(self) -> bool:
        """Whether the calling thread is running one of this group's operations (or a
        callback that finishing one set off)."""
        return self._running_on == threading.get_ident()

    def _execute(self, work: Work, run: Callable[[], None]) -> None:
        with self.running:
            outer, self._running_on = self._running_on, threading.get_ident()
            try:
                if self.broken is not None:
                    work.finish(RuntimeError(
                        f"{work.describe()}: refused, an earlier operation of this process "
                        f"group failed: {self.broken}"))
                    return
                try:
                    run()
                except Refused as error:
                    work.finish(error)
                except BaseException as error:  # noqa: BLE001 -- handed to the waiter
                    self.broken = error
                    work.finish(error)
                else:
                    work.finish()
            finally:
                self._running_on = outer
                with self.lock:
                    self.pending -= 1

    def stop(self) -> None:
        """Let queued operations finish, then end the thread; refuse new ones."""
        self.stopped = True
        self.jobs.put(None)

    def join(self, seconds: float) -> None:
        self.thread.join(seconds)
