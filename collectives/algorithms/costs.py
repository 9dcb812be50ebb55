r"""What a collective costs: the words every algorithm's `cost()` is written in.

Each algorithm file states its cost in its docstring in the alpha-beta-gamma form and
has a `cost()` function beside it that evaluates the same formula; this file holds
what they share. Like NCCL's tuner (`src/graph/tuning.cc`), the model is a few
constants and one formula per algorithm:

    a message of K bytes on a route:  alpha + o + K beta     (o: the algorithm's overhead)
    reducing K bytes:                 K gamma

Routes, as the ranks are placed (`Shape`: H hosts of L ranks each, ranks of a host
numbered together):

    local    between ranks of one host (shared memory, or loopback TCP)
    network  between hosts: a host's link, each way; f streams that leave one host
             at once share it, so each moves at 1/f of its rate: alpha + f K beta
    native   the backend's own collectives between ranks of one host (gloo's TCP over
             loopback, where ours go through shared memory)

A step whose ranks use both routes at once (a ring step where one pair crosses hosts
and the others do not) lasts as long as its slowest message.

`overhead` is what each message costs the algorithm's code on top of the route
(posting it, waking the thread that waits on it), per algorithm and route: a ring
step posts a receive, a send and a forward, a tree level one receive, and over TCP a
message whose receive was posted just in time waits for the receiver's notice to
cross the link first. NCCL's tuner, too, keeps a base latency per algorithm and per
kind of link. Keys: "ring" inside a host (and between hosts unless "ring@network" is
given), "default" and "default@network" for the rest; "native" for the backend's own.

When more ranks are busy than there are cores (one machine, or the emulated cluster,
whose hosts all share this machine's `cores`), a step waits for its ranks to be
scheduled: each rank's own work in the step (alpha and overhead) queues for the cores
with the others', while bytes in flight need none. A step lasts its work plus its
transfer, or busy ranks / cores times its work if that is longer (`step`): the queue
shows in small calls and hides behind the transfer of large ones. Real hosts give each
rank a core: `cores` 0, no such term.

However the messages fall, no link carries more than its rate allows: a call takes at
least the bytes its busiest link carries in one direction times beta (`link_bound`),
and each algorithm's cost is the larger of its steps' sum and that bound. The bound
decides when links are slow; the steps when they are fast or the messages small.

A shaped link (the emulated cluster's tbf) holds a bucket of `burst` bytes: after
being idle, it passes that many at once before its rate applies. A call saves the
wire's time for those bytes once per stretch of traffic on a link (`burst_saving`):
once for a ring, whose links stay busy from its first step to its last, once per level
for a tree, whose links rest between levels. Calls back to back leave the bucket no
time to fill, which the bound above keeps honest. A real NIC has no bucket: 0.

The constants are measured, not assumed: `python -m collectives.cost_model calibrate`
fits them to a sweep of collectives.bench (docs/cost_model.md), and a file of them can be
written by hand for a machine we do not have.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Dict

# Ethernet + IP + TCP headers: 1448 bytes of payload in a 1514-byte frame. A link of
# R bytes/s moves R x WIRE_EFFICIENCY bytes of a message per second.
WIRE_EFFICIENCY = 1448 / 1514


@dataclass(frozen=True)
class Route:
    alpha: float  # seconds per message (latency, wake-ups)
    beta: float   # seconds per byte

    def message(self, nbytes: float, streams: int = 1) -> float:
        """One message of `nbytes`, sharing the route with `streams` - 1 others."""
        return self.alpha + streams * nbytes * self.beta


@dataclass(frozen=True)
class Constants:
    local: Route             # between ranks of one host
    network: Route           # between hosts, per host link and direction
    gamma: float             # seconds per reduced byte
    overhead: Dict[str, float]  # seconds per message, per algorithm: "ring", "ring@network"
    native: Route            # the backend's own collectives, between ranks of one host
    link_rate: float = 0.0   # bytes/s of the link `network` was measured on (0: unshaped)
    burst: float = 0.0       # bytes an idle shaped link passes at once (0: a real NIC)
    cores: int = 0           # cores every rank shares (the emulated cluster's machine; 0: one each)
    transport: str = ""      # what it was measured on ("gloo+shm", ...), or the job's

    @property
    def shared_memory(self) -> bool:
        """Whether ranks of one host talk through shared memory (gloo+shm, mpi+shm), where
        a reduced receive can write its sum straight into an outgoing message."""
        return self.transport.endswith("+shm")

    def per_message(self, algorithm: str, network: bool = False) -> float:
        """Seconds per message that `algorithm` adds to the route, inside a host or
        between hosts ("native": the backend's own collectives, which add their own)."""
        keys = [algorithm, "default"]
        if network:
            keys = [f"{algorithm}@network", algorithm, "default@network", "default"]
        return next((self.overhead[key] for key in keys if key in self.overhead), 0.0)

    def crowding(self, busy_ranks: int) -> float:
        """How much longer a step's fixed costs take with `busy_ranks` sharing the cores."""
        return max(1.0, busy_ranks / self.cores) if self.cores else 1.0

    def step(self, fixed: float, transfer: float, busy_ranks: int) -> float:
        """A step in which each of `busy_ranks` ranks spends `fixed` seconds of its own
        work (alpha, overhead) and `transfer` seconds waiting for bytes to move: with more
        busy ranks than cores, their work queues for the cores while bytes are in flight."""
        return max(fixed + transfer, self.crowding(busy_ranks) * fixed)

    def link_bound(self, link_bytes: float) -> float:
        """The least time for a call whose busiest link carries `link_bytes` one way."""
        return link_bytes * self.network.beta

    def burst_saving(self, link_bytes: float) -> float:
        """Seconds a transfer of `link_bytes` over an idle shaped link saves: its bucket's
        bytes do not wait for the wire's rate."""
        if not self.burst or not self.link_rate:
            return 0.0
        return min(self.burst, link_bytes) * min(wire_beta(self.link_rate), self.network.beta)

    def with_link(self, rate: float = 0.0, latency: float = 0.0,
                  burst: float = 0.0) -> "Constants":
        """The same machine on another network: a link of `rate` bytes/s each way
        (0: keep the measured one, and its bucket), `latency` seconds more per message,
        and a bucket of `burst` bytes (0: a real NIC's link, none).

        The measured beta is the wire's share (1 / (link_rate x WIRE_EFFICIENCY)) plus
        what the hosts spend per byte (copies, the TCP stack); the hosts' share is kept
        and the wire's replaced."""
        beta, alpha = self.network.beta, self.network.alpha + latency
        if rate:
            host_share = beta - wire_beta(self.link_rate) if self.link_rate else 0.0
            beta = max(host_share, 0.0) + wire_beta(rate)
        return replace(self, network=Route(alpha, beta), link_rate=rate or self.link_rate,
                       burst=burst if rate else self.burst)

    def for_job(self, rate: float = 0.0, latency: float = 0.0, burst: float = 0.0,
                shared_cores: int = 0, transport: str = "") -> "Constants":
        """These constants for a job's machines: links of `rate` bytes/s each way (0: as
        measured) holding tbf's `burst` (0: real NICs), `latency` seconds more per
        message between hosts, ranks sharing `shared_cores` cores (0: a core each), the
        job's `transport` (a comm.name; "": the one measured on)."""
        return replace(self.with_link(rate, latency), burst=burst, cores=shared_cores,
                       transport=transport or self.transport)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Constants":
        fields = dict(data)
        fields["local"] = Route(**fields["local"])
        fields["network"] = Route(**fields["network"])
        fields["native"] = Route(**fields["native"])
        if not isinstance(fields["overhead"], dict):  # one figure for every algorithm
            fields["overhead"] = {"default": float(fields["overhead"])}
        known = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in fields.items() if key in known})


@functools.lru_cache(maxsize=8)
def load_constants(path: str) -> Constants:
    """Constants from a JSON file `python -m collectives.cost_model calibrate` wrote."""
    with open(path) as source:
        data = json.load(source)
    return Constants.from_dict(data.get("constants", data))


def wire_beta(rate: float) -> float:
    """Seconds per payload byte on a link of `rate` bytes/s (0: no wire term)."""
    return 1.0 / (rate * WIRE_EFFICIENCY) if rate else 0.0


@dataclass(frozen=True)
class Shape:
    """Where the ranks are: `hosts` hosts of `ranks_per_host` ranks, a host's ranks
    numbered together (rank r is on host r // ranks_per_host)."""
    hosts: int
    ranks_per_host: int

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def pairs_step(self, pairs, nbytes: float, c: Constants, algorithm: str,
                   idle_link: bool = False) -> float:
        """One step of `algorithm` in which every (sender, receiver) pair moves `nbytes`
        at once: the slowest message, streams leaving one host sharing its link
        (`idle_link`: the links rested before it, so their buckets are full)."""
        leaving = {}
        crossing = False
        busy = len({rank for pair in pairs for rank in pair})
        for sender, receiver in pairs:
            if self.host(sender) != self.host(receiver):
                crossing = True
                leaving[self.host(sender)] = leaving.get(self.host(sender), 0) + 1
        if crossing:
            streams = max(leaving.values())
            saving = c.burst_saving(streams * nbytes) if idle_link else 0.0
            return c.step(c.per_message(algorithm, network=True) + c.network.alpha,
                          streams * nbytes * c.network.beta - saving, busy)
        return c.step(c.per_message(algorithm) + c.local.alpha, nbytes * c.local.beta, busy)

    def link_bytes(self, steps) -> float:
        """The bytes the busiest host link carries in one direction over `steps`, each
        (pairs of (sender, receiver), bytes per pair)."""
        out, into = {}, {}
        for pairs, nbytes in steps:
            for sender, receiver in pairs:
                a, b = self.host(sender), self.host(receiver)
                if a != b:
                    out[a] = out.get(a, 0.0) + nbytes
                    into[b] = into.get(b, 0.0) + nbytes
        return max(list(out.values()) + list(into.values()) + [0.0])

    def route(self, crosses_hosts: bool, c: Constants) -> Route:
        return c.network if crosses_hosts and self.hosts > 1 else c.local


def messages(nbytes: float, segment_bytes: float) -> int:
    """How many messages carry `nbytes` in pieces of at most `segment_bytes`."""
    return max(1, math.ceil(nbytes / segment_bytes)) if segment_bytes else 1
