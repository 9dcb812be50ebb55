"""Collective algorithms built from point-to-point messages, one file each.

    ring.py               ring reduce-scatter, all-gather and all-reduce (pipelined)
    halving_doubling.py   Rabenseifner's recursive halving-doubling all-reduce
    tree.py               binomial-tree broadcast, reduce and all-reduce
    naive.py              gather to one rank, reduce, send back (teaching baseline)
    pairwise.py           all-to-all by pairwise exchange
    hierarchical.py       inside each host, then across hosts, then inside (topology)
    native.py             the backend's own collectives, for comparison
    average.py            avg as a sum that cannot overflow, around any of the above
    auto.py               which one to use for a given size and world

The tables below map the names users pass (`algorithm="ring"`) to functions. All
functions take (comm, flat, ...) where `flat` is a 1-D contiguous tensor, in place.
"""
from . import auto, halving_doubling, hierarchical, naive, native, pairwise, ring, tree
from .average import average

ALL_REDUCE = {
    "ring": ring.all_reduce,
    "halving-doubling": halving_doubling.all_reduce,
    "tree": tree.all_reduce,
    "naive": naive.all_reduce,
    "hierarchical": hierarchical.all_reduce,
    "native": native.all_reduce,
}
BROADCAST = {
    "tree": tree.broadcast,
    "naive": naive.broadcast,
    "native": native.broadcast,
}
REDUCE_SCATTER = {
    "ring": ring.reduce_scatter,
    "native": native.reduce_scatter,
}
ALL_GATHER = {
    "ring": ring.all_gather,
    "native": native.all_gather,
}
AUTO_CHOICE = {
    "all_reduce": auto.all_reduce_choice,
    "broadcast": auto.broadcast_choice,
    "reduce_scatter": auto.reduce_scatter_choice,
    "all_gather": auto.all_gather_choice,
}
TABLES = {"all_reduce": ALL_REDUCE, "broadcast": BROADCAST,
          "reduce_scatter": REDUCE_SCATTER, "all_gather": ALL_GATHER}


def names(collective: str) -> list:
    """Algorithm names a collective accepts, "auto" first."""
    return ["auto"] + list(TABLES[collective])
