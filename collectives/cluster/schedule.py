"""Changes made to hosts at set times while the job runs, on a daemon thread.

Pauses (cgroups.PauseSchedule: freeze, thaw) and failures (faults.FaultSchedule: kill,
cut, plug back in) are both a Schedule. An event is (seconds after start(), order,
action, host); events at one time go by `order`. A subclass says how to `apply` each
action and how to `undo` what must not outlast the job (a frozen host thawed, a cut
link plugged back in). `undo` runs when stop() is called and whenever the thread ends,
whatever ends it (an error, a closed stderr), with the lock held: so a job that ends
first never leaves a host frozen or cut off while the cluster is removed.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Iterable, Tuple

Event = Tuple[float, int, str, int]  # (at, order, action, host)


class Schedule:
    what = "schedule"        # its name in the line that says it stopped
    join_seconds = 5.0       # stop(): how long to wait for the thread

    def __init__(self, network, events: Iterable[Event]):
        self.network = network
        self.events = sorted(events)
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # one change at a time, stop() included
        self.thread = threading.Thread(target=self._run, daemon=True, name=self.what)

    def start(self):
        self.started = time.monotonic()
        if self.events:
            self.thread.start()
        return self

    def apply(self, action: str, host: int, now: str) -> None:
        """Make the change `action` to `host`, `now` ("12.3 s") after the start."""
        raise NotImplementedError

    def undo(self) -> None:
        """Put back whatever must not outlast the job (called with the lock held)."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as error:  # whatever it was, nothing may stay changed for it
            say(f"{self.what} stopped: {type(error).__name__}: {error}")
        finally:
            with self.lock:
                self.undo()

    def _follow(self) -> None:
        for at, _, action, host in self.events:
            if self.stopped.wait(max(0.0, self.started + at - time.monotonic())):
                return
            with self.lock:
                if self.stopped.is_set():
                    return
                self.apply(action, host, f"{time.monotonic() - self.started:.1f} s")

    def stop(self) -> None:
        """End the schedule and undo what must not outlast the job. Never raises: it
        runs in clean-up, which must go on."""
        self.stopped.set()
        with self.lock:
            self.undo()
        if self.thread.is_alive():
            self.thread.join(self.join_seconds)


def say(line: str) -> None:
    """One line on stderr; nothing if stderr is gone (a closed pipe, a closed file): the
    schedule must go on to undo what it changed."""
    try:
        print(f"collectives.cluster: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
