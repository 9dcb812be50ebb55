"""Tuning tables: which all-reduce algorithm is quickest at each size, measured here.

    python -m collectives.tune --nproc 4          # about a minute; writes the table
    comm = collectives.init()                     # finds it; auto then follows it

A table is what `python -m collectives.tune` measured on one machine for one world:
each algorithm timed at a ladder of sizes (4 KiB to 64 MiB), and the rules that follow,
one algorithm per stretch of sizes, switching halfway (geometrically) between two rungs
whose winners differ:

    {"key": {"transport": "gloo+shm", "world_size": 4, "hosts": 1, "ranks_per_host": 4,
             "cores": 16, "link_bits": 0},
     "rules": [[24576, "naive"], [3145728, "tree"], [null, "ring"]],
     "sizes": [...], "times_us": {"ring": [...], ...}, "measured": "2026-11-27T01:02:03"}

What decides the key is what changes the answer: the transport (gloo, gloo+shm, mpi,
...), how the ranks are placed, the machine's cores (ranks that outnumber them wait
to be woken at every step) and, on the emulated cluster, the links' rate. A table whose
key differs is not used. As NCCL's tuner plugins, Open MPI's coll/tuned dynamic rules
file and MPICH's JSON tuning files do, the table overrides the built-in choice only
where it was measured for.

Where tables are: `$COLLECTIVES_TUNING` (a file, or a folder of them), else the cache
folder (`$XDG_CACHE_HOME/collectives/tuning`, ~/.cache/... by default), one file per key.
The ranks must all follow the same rules, or they would run different algorithms and
wait on each other: at init every rank finds its table, and the ranks compare digests
(one small all-reduce); if any rank has another table, or none, nobody uses one and
rank 0 says why in one line.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..launch.links import link_rate_bytes
from ..transport.topology import Topology

VERSION = 1
# The algorithms a table chooses among: every all-reduce but the hierarchy, which runs
# only where ranks share hosts of several (its key says so: hosts > 1).
CANDIDATES = ("ring", "halving-doubling", "tree", "naive", "native")


def candidates(topology: Optional[Topology]) -> List[str]:
    """The all-reduce algorithms worth timing for ranks placed as `topology` says:
    CANDIDATES, and the hierarchy where it has two levels (hosts of several ranks)."""
    two_levels = (topology is not None and not topology.single_host
                  and not topology.one_rank_per_host)
    return list(CANDIDATES) + (["hierarchical"] if two_levels else [])


def key_for(transport: str, world_size: int, topology: Optional[Topology]) -> Dict:
    """What decides a table's rules, for this world on this machine."""
    hosts = topology.hosts if topology is not None else [list(range(world_size))]
    rate = link_rate_bytes()
    return {"transport": transport, "world_size": world_size, "hosts": len(hosts),
            "ranks_per_host": max(map(len, hosts)), "cores": os.cpu_count() or 1,
            "link_bits": int(rate * 8) if rate else 0}


def file_name(key: Dict) -> str:
    name = (f"{key['transport']}-{key['world_size']}ranks-{key['hosts']}hosts-"
            f"{key['cores']}cores")
    return name + (f"-{key['link_bits']}bps" if key["link_bits"] else "") + ".json"


def cache_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "collectives", "tuning")


@dataclass(frozen=True)
class Table:
    key: Dict
    rules: Tuple[Tuple[Optional[int], str], ...]  # (below this many bytes, algorithm)
    path: str = ""

    def choose(self, nbytes: int) -> str:
        for below, algorithm in self.rules:
            if below is None or nbytes < below:
                return algorithm
        return self.rules[-1][1]

    @property
    def digest(self) -> int:
        """A number equal on two ranks exactly when their tables give the same rules."""
        text = json.dumps([self.key, [list(rule) for rule in self.rules]], sort_keys=True)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")

    @classmethod
    def load(cls, path: str) -> "Table":
        with open(path) as source:
            data = json.load(source)
        if data.get("version") != VERSION:
            raise ValueError(f"version {data.get('version')}, not {VERSION}")
        rules = tuple((None if below is None else int(below), str(algorithm))
                      for below, algorithm in data["rules"])
        if not rules or rules[-1][0] is not None:
            raise ValueError("its rules must end with one for every larger size (null)")
        return cls(dict(data["key"]), rules, path)


def rules_from_times(sizes: Sequence[int], times: Dict[str, Sequence[float]]
                     ) -> List[Tuple[Optional[int], str]]:
    """The quickest algorithm at each size, switching halfway (geometrically) between
    two sizes whose winners differ; the last one for every larger size."""
    winners = [min(times, key=lambda name: times[name][index]) for index in range(len(sizes))]
    rules: List[Tuple[Optional[int], str]] = []
    for index, winner in enumerate(winners[:-1]):
        if winners[index + 1] != winner:
            rules.append((int((sizes[index] * sizes[index + 1]) ** 0.5), winner))
    rules.append((None, winners[-1]))
    return rules


def between_winners(measured: Dict[int, Dict[str, float]]) -> List[int]:
    """The sizes halfway (geometrically, a whole number of 4-byte elements) between two
    measured neighbours whose quickest algorithms differ, where that leaves room: the
    rule's switch lies somewhere in there, and a ladder of x4 rungs can put it a factor
    of two from where it belongs."""
    sizes = sorted(measured)
    quickest = [min(measured[size], key=measured[size].get) for size in sizes]
    between = []
    for (low, a), (high, b) in zip(zip(sizes, quickest), zip(sizes[1:], quickest[1:])):
        middle = int((low * high) ** 0.5) // 4 * 4
        if a != b and low < middle < high:
            between.append(middle)
    return between


def write(key: Dict, sizes: Sequence[int], times: Dict[str, Sequence[float]],
          path: str) -> Table:
    """Write the table measured as `times` (microseconds per call, per algorithm and
    size) to `path`, through a temporary file so that a reader never sees half."""
    rules = rules_from_times(sizes, times)
    data = {"version": VERSION, "key": key, "rules": [list(rule) for rule in rules],
            "sizes": list(sizes), "times_us": {name: list(t) for name, t in times.items()},
            "measured": datetime.datetime.now().isoformat(timespec="seconds")}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as out:
        json.dump(data, out, indent=1)
    os.replace(temporary, path)
    return Table(key, tuple(rules), path)


def find(key: Dict) -> Tuple[Optional[Table], str]:
    """(the table for `key`, or None; where auto's choice comes from, in words)."""
    given = os.environ.get("COLLECTIVES_TUNING", "").strip()
    if given and not os.path.isdir(given):
        candidates = [given]
    else:
        candidates = [os.path.join(given or cache_folder(), file_name(key))]
    for path in candidates:
        if not os.path.exists(path):
            continue
        try:
            table = Table.load(path)
        except (OSError, ValueError, KeyError, TypeError) as error:
            return None, f"the cost model (the table {path} is unreadable: {error})"
        if table.key != key:
            differ = ", ".join(f"{name} {table.key.get(name)} there, {key[name]} here"
                               for name in key if table.key.get(name) != key[name])
            return None, f"the cost model (the table {path} is for another world: {differ})"
        return table, f"the table {path}"
    return None, (f"the cost model ({key['cores']} cores; no table: "
                  "python -m collectives.tune writes one)")


def agree(comm, table: Optional[Table], source: str) -> Tuple[Optional[Table], str]:
    """Collective: the table every rank found, where all found the same; else none
    anywhere (ranks following different rules would run different algorithms)."""
    digest = table.digest if table is not None else -1
    both = torch.tensor([digest, -digest], dtype=torch.int64)
    comm.reduce_metadata(both, "max")
    if int(both[0]) == -int(both[1]):
        return table, source
    source = "the cost model (the ranks found different tuning tables, or some none)"
    if comm.rank == 0:
        print(f"collectives: auto: {source}; run python -m collectives.tune on every "
              "host, or set COLLECTIVES_TUNING on every rank", file=sys.stderr, flush=True)
    return None, source

