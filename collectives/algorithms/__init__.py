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
    costs.py              what a call costs: the constants every cost() is written in

The tables below map the names users pass (`algorithm="ring"`) to functions. All
functions take (comm, flat, ...) where `flat` is a 1-D contiguous tensor, in place.
COSTS maps the same names to each algorithm's cost(nbytes, shape, constants), the
seconds its docstring's formula gives (costs.py); `fastest` is the argmin over them.
"""
from . import auto, halving_doubling, hierarchical, naive, native, pairwise, ring, tree
from .average import average
from .costs import Constants, Shape

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


COSTS = {
    "all_reduce": {
        "ring": ring.cost,
        "halving-doubling": halving_doubling.cost,
        "tree": tree.cost,
        "naive": naive.cost,
        "hierarchical": hierarchical.cost,
        "native": native.cost,
    },
    "broadcast": {
        "tree": tree.broadcast_cost,
        "naive": naive.broadcast_cost,
        "native": native.broadcast_cost,
    },
    "reduce_scatter": {"ring": ring.reduce_scatter_cost},
    "all_gather": {"ring": ring.all_gather_cost},
    "all_to_all": {"pairwise": pairwise.cost},
}


def fastest(collective: str, nbytes: float, shape: Shape, constants: Constants) -> str:
    """The algorithm the cost model says is quickest for this call (as NCCL's tuner)."""
    table = COSTS[collective]
    return min(table, key=lambda name: table[name](nbytes, shape, constants))


def names(collective: str) -> list:
    """Algorithm names a collective accepts, "auto" first."""
    return ["auto"] + list(TABLES[collective])
