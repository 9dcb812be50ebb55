"""`auto`: pick an algorithm from the message size, world size and backend.

The rules below summarise `python -m collectives.bench` on a 2-core machine over
loopback, gloo and MPICH, 2 and 4 ranks (tables in docs/benchmarks.md). Every rank
computes the same choice from the same numbers, so the ranks always agree.

- Small messages are latency-bound. With few ranks, `naive` (everyone sends straight
  to rank 0, which sends the result straight back) needs the fewest message hops and
  beat gloo's own all-reduce 2-5x at 4 ranks (1.0 vs 5.2 ms at 1 KiB); with more ranks
  rank 0's link becomes the bottleneck and the binomial `tree` takes over. With 2 ranks
  below 64 KiB every algorithm is one exchange and gloo's own is as quick: native.
  MPICH's own all-reduce is quickest below 8 KiB.
- Medium messages (to 2 MiB): the `tree` (log2 n full-size hops, no chunking overhead).
- Then the backend's own collective, up to where our pipelined `ring` wins: from
  16 MiB on gloo, 8 MiB on MPICH (where it reached 1.8 GB/s busbw against MPICH's
  0.9 at 64 MiB).

Through shared memory ("gloo+shm", "mpi+shm": ranks of one host) a message costs tens
of microseconds instead of a trip through the kernel, and every algorithm built from
send/recv beats gloo's own all-reduce 2-10x at every size (docs/benchmarks.md).
There: with 2 ranks the ring, at every size (every algorithm is one exchange each way;
they tie within the noise). With 4, `naive`/`tree` up to 2 MiB and the `tree` above:
4 dependent hops instead of the ring's 6 steps, and on 2 oversubscribed cores every
step waits for a rank to be woken (tree 1.2-1.6 GB/s busbw against the ring's
1.0-1.5 at 16-64 MiB, three runs). Beyond 4 ranks (not measured here) the ring from
16 MiB: the tree moves the whole buffer log2(n) times, the ring 2(n-1)/n times.

Ranks on several hosts (comm.topology; measured on the emulated cluster, 100 Mbit/s
links, docs/cluster.md): from 64 KiB the links decide. With one rank per host, the
ring: it keeps every link busy both ways and matched gloo's own (0.95-1.08x at 16-64
MiB on 2 and 4 hosts), while tree and naive send one way at a time, at a half to a
third of the rate. With several ranks on a host, `hierarchical`: each link then carries
2(H-1)/H of the buffer instead of 2(n-1)/n (1.4-1.7x the flat ring on 2 hosts of 2 and
4 ranks). Below 64 KiB the tree (2 hosts of 2 ranks: 1.6 ms at 16 KiB, against 2.9
for naive and 8.1 for the ring).

Beyond what was measured (more than 4 ranks on one host, more than 4 hosts or more
than 4 ranks on a host), auto asks the cost model instead, as NCCL's tuner does: the
algorithm whose cost() is least for this size and shape (`model_choice`), with the
constants in $COLLECTIVES_MODEL (a file `python -m collectives.model calibrate`
wrote) or else the ones calibrated on this machine's emulated cluster
(calibrated.json, docs/model.md). collectives.bench says so when it happens.

NCCL is the exception, on one host and across hosts alike: `native`. NCCL already
runs its own hierarchy across nodes (rings and trees over NVLink inside a node and
the network between nodes, chosen by its own tuning), and none of ours has been
measured against it (no GPU here). Ours would also be unsafe there: the pipelined
`hierarchical` drives a second communicator from a second thread while the first
is in use, and NCCL documents concurrent operations on several communicators from
several threads as a possible deadlock (its kernels may wait on each other on the
GPU). So nccl keeps NCCL's own collectives until a measurement says otherwise.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

from ..transport.topology import Topology
from .costs import Shape

KiB, MiB = 1 << 10, 1 << 20
# Ranks on several hosts: from this size the links' bandwidth decides. Over a shaped
# link the ring (one rank per host) and the hierarchy (several) keep every link busy
# both ways; the tree and naive send one way at a time, at half the rate. Below it
# the binomial tree's few hops win (docs/cluster.md).
ACROSS_HOSTS_FROM = 64 * KiB


SMALL = "naive or tree"  # naive with at most 4 ranks, else tree (rank 0's link saturates)
LARGE = "tree or ring"   # tree with at most 4 ranks, else ring

# For each transport (comm.name): (messages below this many bytes, use this), in order.
SHARED_MEMORY = [(2 * MiB, SMALL), (16 * MiB, "tree"), (None, LARGE)]
LADDERS = {
    "gloo+shm": SHARED_MEMORY,
    "mpi+shm": [(8 * KiB, "native")] + SHARED_MEMORY,  # MPICH's own is as quick below 8 KiB
    "mpi": [(8 * KiB, "native"), (512 * KiB, SMALL), (2 * MiB, "tree"), (8 * MiB, "native"),
            (None, "ring")],
    "gloo": [(512 * KiB, SMALL), (2 * MiB, "tree"), (16 * MiB, "native"), (None, "ring")],
    "nccl": [(None, "native")],  # NCCL's own kernels: not measured here (no GPU), kept
}


# The largest worlds the rules below were measured on (docs/benchmarks.md, cluster.md).
MEASURED_ONE_HOST = 4       # ranks on a single host
MEASURED_HOSTS = 4          # hosts
MEASURED_PER_HOST = 4       # ranks on one host of several
CALIBRATED = os.path.join(os.path.dirname(__file__), "calibrated.json")


def shape_of(world_size: int, topology: Optional[Topology]) -> Shape:
    """The model's view of where the ranks are (hosts of unequal size: the largest)."""
    if topology is None:
        return Shape(1, world_size)
    hosts = topology.hosts
    return Shape(len(hosts), max(map(len, hosts)))


@functools.lru_cache(maxsize=64)  # asked on every call: a job has one or two worlds
def measured(world_size: int, topology: Optional[Topology] = None) -> bool:
    """Whether the rules below were measured on a world like this one."""
    shape = shape_of(world_size, topology)
    if shape.hosts == 1:
        return world_size <= MEASURED_ONE_HOST
    return shape.hosts <= MEASURED_HOSTS and shape.ranks_per_host <= MEASURED_PER_HOST


def model_constants_path() -> str:
    return os.environ.get("COLLECTIVES_MODEL") or CALIBRATED


def job_constants(path: str, shape: Shape, emulated_rate: float = 0.0):
    """The constants at `path`, for this job's machines: the emulated cluster's links
    (`emulated_rate` bytes/s each way, with tbf's bucket) or real ones (no bucket); ranks
    that share one machine (one host, or the emulated cluster) share its cores."""
    from ..launch.links import bucket_bytes
    from .costs import load_constants
    try:
        c = load_constants(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"auto: cannot read the cost model's constants from {path} "
                         f"($COLLECTIVES_MODEL): {error}") from None
    shared = emulated_rate or shape.hosts == 1  # ranks of one machine share its cores
    return c.for_job(emulated_rate, burst=bucket_bytes(emulated_rate) if emulated_rate else 0.0,
                     shared_cores=(os.cpu_count() or 1) if shared else 0)


@functools.lru_cache(maxsize=1024)
def model_choice(nbytes: int, hosts: int, ranks_per_host: int, path: str,
                 emulated_rate: float = 0.0) -> str:
    """The all-reduce algorithm the cost model says is quickest (the constants at `path`,
    for this job's machines: `job_constants`)."""
    from . import fastest
    shape = Shape(hosts, ranks_per_host)
    return fastest("all_reduce", nbytes, shape, job_constants(path, shape, emulated_rate))


def all_reduce_choice(nbytes: int, world_size: int, transport: str,
                      topology: Optional[Topology] = None) -> str:
    """The algorithm for an all-reduce of `nbytes` over `transport` (a comm.name) on
    ranks placed as `topology` says (None: all on one host)."""
    if world_size == 1:
        return "native"
    if transport.split("+")[0] == "nccl":
        return "native"  # NCCL's own ladder, across hosts too (see the notes above)
    if not measured(world_size, topology):
        shape = shape_of(world_size, topology)
        from ..launch.links import link_rate_bytes  # the emulated cluster's links, if there
        return model_choice(nbytes, shape.hosts, shape.ranks_per_host, model_constants_path(),
                            link_rate_bytes() or 0.0)
    if topology is not None and not topology.single_host:
        if nbytes < ACROSS_HOSTS_FROM:
            return "tree"
        return "ring" if topology.one_rank_per_host else "hierarchical"
    if transport.endswith("+shm") and world_size == 2:
        return "ring"
    if transport == "gloo" and world_size == 2 and nbytes < 64 * KiB:
        return "native"
    backend = transport.split("+")[0]
    for below, choice in LADDERS.get(transport, LADDERS.get(backend, LADDERS["gloo"])):
        if below is None or nbytes < below:
            if choice == SMALL:
                return "naive" if world_size <= 4 else "tree"
            if choice == LARGE:
                return "tree" if world_size <= 4 else "ring"
            return choice
    raise AssertionError("every ladder ends with an unbounded step")


def broadcast_choice(nbytes: int, world_size: int, transport: str, topology=None) -> str:
    return "native"


def reduce_scatter_choice(nbytes: int, world_size: int, transport: str, topology=None) -> str:
    return "ring"  # native has no reduce-scatter here: it would all-reduce everything


def all_gather_choice(nbytes: int, world_size: int, transport: str, topology=None) -> str:
    return "ring"  # native has no all-gather here: it would broadcast n times
