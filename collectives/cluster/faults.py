"""Hosts that fail while the job runs: killed, or cut off the network for a while.

    --kill HOST@SECONDS              every process of HOST is SIGKILLed (a host that dies)
    --cut HOST@SECONDS:DURATION      HOST's cable is unplugged for DURATION seconds: its
                                     NIC goes down, nothing in or out, then up again

Times count from the ranks' start, as --pause does. The schedule runs on a daemon
thread, as the pauses' (schedule.py); stop() ends it and plugs every cut
cable back in, so a job that ends first never leaves a host cut off while the cluster
is removed. A killed host stays dead: its ranks' exit status does not count in the
job's (it was asked for), the survivors' does.

An elastic job (`python -m trainer --elastic`) needs a membership store that no host's
failure takes down: `--elastic-store` runs one on the switch (`Network.serve_store`).
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence, Set

from .schedule import Schedule, say


class Kill(NamedTuple):
    host: int      # the host's index
    at: float      # seconds after the ranks start


class Cut(NamedTuple):
    host: int
    at: float
    seconds: float  # how long its link stays down


class FaultSchedule(Schedule):
    """Kills hosts and cuts their links on time (see the module docstring)."""
    what = "faults"

    def __init__(self, network, kills: Sequence[Kill] = (), cuts: Sequence[Cut] = ()):
        # at one time: plug back in (0), then cut (1), then kill (2)
        super().__init__(network, [(k.at, 2, "kill", k.host) for k in kills]
                         + [(c.at, 1, "cut", c.host) for c in cuts]
                         + [(c.at + c.seconds, 0, "plug", c.host) for c in cuts])
        self.killed: Set[int] = set()
        self.cut: Set[int] = set()

    def apply(self, action: str, host: int, now: str) -> None:
        name = self.network.spec.hostname(host)
        if action == "kill":
            self.killed.add(host)  # before: a rank dying of it must not count
            self.network.kill_host(host)
            say(f"{name} killed at {now}")
        elif action == "cut":
            self.cut.add(host)
            self.network.set_link(host, up=False)
            say(f"{name} cut off at {now}")
        else:
            self.network.set_link(host, up=True)
            self.cut.discard(host)
            say(f"{name} plugged back in at {now}")

    def undo(self) -> None:
        """Every cut link up again, each whatever happens to another."""
        for host in sorted(self.cut):
            try:
                self.network.set_link(host, up=True)
            except Exception as error:
                say(f"cannot plug {self.network.spec.hostname(host)} back in: {error}")
            self.cut.discard(host)


def describe(spec, kills: List[Kill], cuts: List[Cut]) -> List[str]:
    """The faults, for the run's first line."""
    return ([f"{spec.hostname(k.host)} killed at {k.at:g}s" for k in sorted(kills)]
            + [f"{spec.hostname(c.host)} cut at {c.at:g}s for {c.seconds:g}s"
               for c in sorted(cuts)])
