"""`auto`: pick an algorithm from the message size, the world and the machine it runs on.

Every rank computes the same choice from the same numbers, so the ranks always agree.
The choice comes, in this order, from:

1. A tuning table for this world on this machine (tuning.py): what
   `python -m collectives.tune` measured here, each algorithm at a ladder of sizes.
   init() finds it (in $COLLECTIVES_TUNING or the cache) and the ranks check that
   they all hold the same one.
2. Else the cost model (costs.py): the algorithm whose cost() is least for this size
   and placement, with the constants in $COLLECTIVES_MODEL (a file
   `python -m collectives.cost_model calibrate` wrote) or else the shipped ones
   (calibrated.json, docs/cost_model.md), for this machine's cores: ranks that outnumber
   the cores wait to be woken at every step, which favours few steps.

No size threshold is fixed here: which algorithm is quickest depends on the machine
(few steps win where ranks share few cores, the ring's bandwidth where cores are
many), so thresholds measured on one machine can pick the slowest algorithm on
another. `python -m collectives.bench` prints, per size, what auto chose, from which
source, and the quickest fixed algorithm. Measured: docs/library.md, "auto: measured
where it runs".

NCCL is the exception, on one host and across hosts alike: `native`. NCCL already
runs its own hierarchy across nodes (rings and trees over NVLink inside a node and
the network between nodes, chosen by its own tuning), and none of ours has been
measured against it (docs/library.md, "On a GPU").
"""
from __future__ import annotations

import functools
import os
from typing import Optional

from ..transport.topology import Topology
from .costs import Shape

CALIBRATED = os.path.join(os.path.dirname(__file__), "calibrated.json")


def shape_of(world_size: int, topology: Optional[Topology]) -> Shape:
    """The model's view of where the ranks are (hosts of unequal size: the largest)."""
    if topology is None:
        return Shape(1, world_size)
    hosts = topology.hosts
    return Shape(len(hosts), max(map(len, hosts)))


def model_constants_path() -> str:
    return os.environ.get("COLLECTIVES_MODEL") or CALIBRATED


def job_constants(path: str, shape: Shape, emulated_rate: float = 0.0, transport: str = ""):
    """The constants at `path`, for this job's machines: the emulated cluster's links
    (`emulated_rate` bytes/s each way, with tbf's bucket) or real ones (no bucket); ranks
    that share one machine (one host, or the emulated cluster) share its cores; the
    job's `transport` (comm.name; "": the one the constants were measured on)."""
    from ..launch.links import bucket_bytes
    from .costs import load_constants
    try:
        c = load_constants(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"auto: cannot read the cost model's constants from {path} "
                         f"($COLLECTIVES_MODEL): {error}") from None
    shared = emulated_rate or shape.hosts == 1  # ranks of one machine share its cores
    return c.for_job(emulated_rate, burst=bucket_bytes(emulated_rate) if emulated_rate else 0.0,
                     shared_cores=(os.cpu_count() or 1) if shared else 0, transport=transport)


@functools.lru_cache(maxsize=1024)
def model_choice(nbytes: int, hosts: int, ranks_per_host: int, path: str,
                 emulated_rate: float = 0.0, transport: str = "") -> str:
    """The all-reduce algorithm the cost model says is quickest (the constants at `path`,
    for this job's machines and transport: `job_constants`)."""
    from . import fastest
    shape = Shape(hosts, ranks_per_host)
    return fastest("all_reduce", nbytes, shape,
                   job_constants(path, shape, emulated_rate, transport))


def all_reduce_choice(nbytes: int, world_size: int, transport: str,
                      topology: Optional[Topology] = None, table=None) -> str:
    """The algorithm for an all-reduce of `nbytes` over `transport` (a comm.name) on
    ranks placed as `topology` says (None: all on one host): the tuning `table`'s (a
    tuning.Table the ranks agreed on), else the cost model's quickest."""
    if world_size == 1:
        return "native"
    if transport.split("+")[0] == "nccl":
        return "native"  # NCCL's own ladder, across hosts too (see the notes above)
    if table is not None:
        return table.choose(nbytes)
    shape = shape_of(world_size, topology)
    from ..launch.links import link_rate_bytes  # the emulated cluster's links, if there
    return model_choice(nbytes, shape.hosts, shape.ranks_per_host, model_constants_path(),
                        link_rate_bytes() or 0.0, transport)


def broadcast_choice(nbytes: int, world_size: int, transport: str, topology=None,
                     table=None) -> str:
    return "native"


def reduce_scatter_choice(nbytes: int, world_size: int, transport: str, topology=None,
                          table=None) -> str:
    return "ring"  # native has no reduce-scatter here: it would all-reduce everything


def all_gather_choice(nbytes: int, world_size: int, transport: str, topology=None,
                      table=None) -> str:
    return "ring"  # native has no all-gather here: it would broadcast n times
