"""Hosts that fail while the job runs: killed, or cut off the network for a while.

    --kill HOST@SECONDS              every process of HOST is SIGKILLed (a host that dies)
    --cut HOST@SECONDS:DURATION      HOST's cable is unplugged for DURATION seconds: its
                                     NIC goes down, nothing in or out, then up again

Times count from the ranks' start, as --pause does. The schedule runs on a daemon
thread, like the pauses' (cgroups.PauseSchedule); stop() ends it and plugs every cut
cable back in, so a job that ends first never leaves a host cut off while the cluster
is removed. A killed host stays dead: its ranks' exit status does not count in the
job's (it was asked for), the survivors' does.

An elastic job (`python -m trainer --elastic`) needs a membership store that no host's
failure takes down: `--elastic-store` runs one on the switch (`Network.serve_store`).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import List, NamedTuple, Sequence, Set


class Kill(NamedTuple):
    host: int      # the host's index
    at: float      # seconds after the ranks start


class Cut(NamedTuple):
    host: int
    at: float
    seconds: float  # how long its link stays down


class FaultSchedule:
    """Kills hosts and cuts their links on time (see the module docstring)."""

    def __init__(self, network, kills: Sequence[Kill] = (), cuts: Sequence[Cut] = ()):
        self.network = network
        events = ([(k.at, 2, "kill", k.host) for k in kills]
                  + [(c.at, 1, "cut", c.host) for c in cuts]
                  + [(c.at + c.seconds, 0, "plug", c.host) for c in cuts])
        self.events = sorted(events)  # at one time: plug back, then cut, then kill
        self.killed: Set[int] = set()
        self.cut: Set[int] = set()
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # one change at a time, stop() included
        self.thread = threading.Thread(target=self._run, daemon=True, name="faults")

    def start(self) -> "FaultSchedule":
        self.started = time.monotonic()
        if self.events:
            self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as error:  # the run is being removed, or a command failed
            _say(f"faults stopped: {type(error).__name__}: {error}")
        finally:
            with self.lock:
                self._plug_all()

    def _follow(self) -> None:
        name = self.network.spec.hostname
        for at, _, action, host in self.events:
            if self.stopped.wait(max(0.0, self.started + at - time.monotonic())):
                return
            with self.lock:
                if self.stopped.is_set():
                    return
                now = f"{time.monotonic() - self.started:.1f} s"
                if action == "kill":
                    self.killed.add(host)  # before: a rank dying of it must not count
                    self.network.kill_host(host)
                    _say(f"{name(host)} killed at {now}")
                elif action == "cut":
                    self.cut.add(host)
                    self.network.set_link(host, up=False)
                    _say(f"{name(host)} cut off at {now}")
                else:
                    self.network.set_link(host, up=True)
                    self.cut.discard(host)
                    _say(f"{name(host)} plugged back in at {now}")

    def _plug_all(self) -> None:
        """Every cut link up again, each whatever happens to another (lock held)."""
        for host in sorted(self.cut):
            try:
                self.network.set_link(host, up=True)
            except Exception as error:
                _say(f"cannot plug {self.network.spec.hostname(host)} back in: {error}")
            self.cut.discard(host)

    def stop(self) -> None:
        """End the schedule and plug every cut link back in. Never raises: it runs in
        clean-up, which must go on."""
        self.stopped.set()
        with self.lock:
            self._plug_all()
        if self.thread.is_alive():
            self.thread.join(5.0)


def describe(spec, kills: List[Kill], cuts: List[Cut]) -> List[str]:
    """The faults, for the run's first line."""
    return ([f"{spec.hostname(k.host)} killed at {k.at:g}s" for k in sorted(kills)]
            + [f"{spec.hostname(c.host)} cut at {c.at:g}s for {c.seconds:g}s"
               for c in sorted(cuts)])


def _say(line: str) -> None:
    try:
        print(f"collectives.cluster: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
