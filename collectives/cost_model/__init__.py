"""A cost model of the collectives: calibrated here, asked about clusters we do not have.

    python -m collectives.cost_model calibrate --out here.json       # under any launcher
    python -m collectives.cost_model predict --constants here.json --algorithm all \\
        --hosts 128 --ranks-per-host 8 --size 16M --bandwidth 25gbit --latency 10us

The formulas live beside the algorithms (each algorithm file's `cost()`, in the
constants of collectives/algorithms/costs.py); this package measures the constants
(calibrate.py: a sweep of collectives.bench and a least-squares fit) and answers
questions with them (__main__.py). trainer.replay replays a traced training step on
the same model.
"""
from __future__ import annotations

import json

from ..algorithms import COSTS, fastest
from ..algorithms.costs import Constants, Route, Shape, load_constants

__all__ = ["COSTS", "Constants", "Route", "Shape", "fastest", "load", "on_cluster", "save",
           "predict"]


def load(path: str) -> Constants:
    """Constants from a file `calibrate --out` wrote (or one written by hand)."""
    return load_constants(path)


def save(constants: Constants, path: str, **extra) -> None:
    """Write `constants` (and `extra` keys, such as the fit's residuals) as JSON."""
    with open(path, "w") as out:
        json.dump({"constants": constants.as_dict(), **extra}, out, indent=2)
        out.write("\n")


def on_cluster(constants: Constants, bandwidth: float = 0.0, latency: float = 0.0,
               emulated: bool = False) -> Constants:
    """The constants for a cluster described by its links: `bandwidth` bytes/s each way
    (0: as measured), `latency` seconds more per message between hosts. Real hosts by
    default: links without tbf's bucket, a core for every rank. `emulated`: hosts as
    collectives.cluster makes them on this machine (each link's tbf bucket, every
    rank sharing this machine's cores), to compare with runs there."""
    import os
    from ..launch.links import bucket_bytes
    rate = bandwidth or constants.link_rate
    if not emulated:
        return constants.for_job(bandwidth, latency)
    return constants.for_job(bandwidth, latency, burst=bucket_bytes(rate) if rate else 0.0,
                             shared_cores=os.cpu_count() or 1)


def predict(collective: str, algorithm: str, nbytes: float, shape: Shape,
            constants: Constants) -> float:
    """Seconds for one call, as the algorithm's cost() says."""
    table = COSTS[collective]
    if algorithm not in table:
        raise ValueError(f"no cost model for {collective} {algorithm!r}: "
                         f"choose from {', '.join(table)}")
    return table[algorithm](nbytes, shape, constants)
