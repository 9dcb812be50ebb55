r"""What a collective costs: the words every algorithm's `cost()` is written in.

Each algorithm file states its cost in its docstring in the alpha-beta-gamma form and
has a `cost()` function beside it that evaluates the same formula; this file holds
what they share. Like NCCL's tuner (`src/graph/tuning.cc`), the model is a few
constants and one formula per algorithm:

    a message of K bytes on a route:  alpha + K beta        (+ our own overhead o)
    reducing K bytes:                 K gamma

Two routes, as the ranks are placed (`Shape`: H hosts of L ranks each, ranks of a
host numbered together):

    local    between ranks of one host (shared memory, or loopback TCP)
    network  between hosts: a host's link, each way; f streams that leave one host
             at once share it, so each moves at 1/f of its rate: alpha + f K beta

`overhead` is what each message costs our Python code on top of the route (posting
it, waking the thread that waits on it), per algorithm: a ring step posts a receive,
a send and a forward, a tree level one receive (NCCL's tuner, too, keeps a base
latency per algorithm). The backend's own collectives (`native`) pay
no such overhead, and inside a host they take their own route (`native`: gloo's TCP
over loopback where ours goes through shared memory). A step whose ranks use both
routes at once (a ring step where one pair crosses hosts and the others do not) lasts
as long as its slowest message.

The constants are measured, not assumed: `python -m collectives.model calibrate`
fits them to a sweep of collectives.bench (docs/model.md), and a file of them can be
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
    overhead: Dict[str, float]  # our own seconds per message, per algorithm ("default")
    native: Route            # the backend's own collectives, between ranks of one host
    link_rate: float = 0.0   # bytes/s of the link `network` was measured on (0: unshaped)
    transport: str = ""      # what it was measured on ("gloo+shm", ...)

    def per_message(self, algorithm: str) -> float:
        """Our own seconds per message of `algorithm` (the "default" entry otherwise)."""
        return self.overhead.get(algorithm, self.overhead.get("default", 0.0))

    def with_link(self, rate: float = 0.0, latency: float = 0.0) -> "Constants":
        """The same machine on another network: a link of `rate` bytes/s each way
        (0: keep the measured one) and `latency` seconds more per message.

        The measured beta is the wire's share (1 / (link_rate x WIRE_EFFICIENCY)) plus
        what the hosts spend per byte (copies, the TCP stack); the hosts' share is kept
        and the wire's replaced."""
        beta, alpha = self.network.beta, self.network.alpha + latency
        if rate:
            host_share = beta - wire_beta(self.link_rate) if self.link_rate else 0.0
            beta = max(host_share, 0.0) + wire_beta(rate)
        return replace(self, network=Route(alpha, beta), link_rate=rate or self.link_rate)

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
    """Constants from a JSON file `python -m collectives.model calibrate` wrote."""
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

    def pairs_step(self, pairs, nbytes: float, c: Constants, overhead: float) -> float:
        """One step in which every (sender, receiver) pair moves `nbytes` at once:
        the slowest message, streams leaving one host sharing its link."""
        leaving = {}
        crossing = False
        for sender, receiver in pairs:
            if self.host(sender) != self.host(receiver):
                crossing = True
                leaving[self.host(sender)] = leaving.get(self.host(sender), 0) + 1
        if crossing:
            return overhead + c.network.message(nbytes, max(leaving.values()))
        return overhead + c.local.message(nbytes)

    def route(self, crosses_hosts: bool, c: Constants) -> Route:
        return c.network if crosses_hosts and self.hosts > 1 else c.local


def messages(nbytes: float, segment_bytes: float) -> int:
    """How many messages carry `nbytes` in pieces of at most `segment_bytes`."""
    return max(1, math.ceil(nbytes / segment_bytes)) if segment_bytes else 1
