"""Measure the cost model's constants here: a short sweep, then a least-squares fit.

    python -m collectives.cost_model calibrate --out here.json          # under any launcher
    python -m collectives.cluster --hosts 2 --ranks-per-host 2 --bandwidth 1gbit -- \\
        python -m collectives.cost_model calibrate --out cluster.json

The sweep times all-reduces of a few sizes with every algorithm on three sets of ranks,
so that each route is seen alone as well as mixed:

    world     every rank: every algorithm and the backend's own (`native`)
    host      the ranks of the first host only (the local route: shared memory)
    leaders   one rank per host (the network route), when hosts have several ranks

A set that does not exist here is skipped (one host: no network; one rank per host: no
host set), and the constants no point depends on are reported as not measured and
kept at their starting values. Timing is collectives.bench's: the slowest rank's mean
over a loop, the median of a few loops.

The fit minimises the squared log of predicted / measured time over every point, so a
64 KiB call counts as much as a 64 MiB one and every error is relative. The parameters
are fitted as logarithms, so they stay positive. A message's latency alpha and our
overhead o of an algorithm always appear as alpha + o, so only their sum is measured:
a weak pull toward the starting values (1 % of a point's weight) keeps the fit defined,
and what is reported is the sum's split that stays nearest those values. Python's
share is the difference between an algorithm of ours and the backend's own ("native")
on the same route.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import algorithms, api
from ..launch import links
from ..algorithms.costs import Constants, Route, Shape
from ..transport.group import Group
from . import save

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB]
WORLD_ALGORITHMS = ["ring", "tree", "naive", "halving-doubling", "hierarchical", "native"]
GROUP_ALGORITHMS = ["ring", "tree", "naive", "halving-doubling"]

# Where the fit starts, and what an unmeasured constant keeps: a loopback-class host.
OURS = ["ring", "tree", "naive", "halving-doubling", "hierarchical", "native"]
START = Constants(local=Route(50e-6, 1 / 2e9), network=Route(100e-6, 1 / 1e9),
                  gamma=1 / 4e9, native=Route(100e-6, 1 / 1e9),
                  overhead={"default": 20e-6, **{f"{a}{where}": 20e-6 for a in OURS
                                                  for where in ("", "@network")}})
ROUTES = ("local", "network", "native")
PARAMETERS = ([f"{route}.{term}" for route in ROUTES for term in ("alpha", "beta")]
              + ["gamma"] + [f"overhead.{a}{where}" for a in OURS for where in ("", "@network")])
PRIOR_WEIGHT = 0.01


@dataclass
class Point:
    """One measured call: `seconds` for an all-reduce of `nbytes` with `algorithm` on
    ranks placed as `shape` (`ranks`: which set of the sweep)."""
    algorithm: str
    nbytes: int
    hosts: int
    ranks_per_host: int
    seconds: float
    ranks: str = "world"
    collective: str = "all_reduce"

    @property
    def shape(self) -> Shape:
        return Shape(self.hosts, self.ranks_per_host)


# ---- the sweep (collective: every rank runs every line) ---------------------------------

def _slowest(comm, seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    comm.native_all_reduce(value, "max")
    return value.item()


def time_call(comm, call: Optional[Callable[[], None]], trials: int, seconds_per_row: float,
              min_iters: int = 1) -> float:
    """Seconds per call of `call` on the ranks that have one (None: this rank only keeps
    time with the others): the median over `trials` loops of the slowest rank's mean."""
    run = call or (lambda: None)
    run()  # warm up: connections, first-touch allocations
    comm.barrier()
    started = time.perf_counter()
    run()
    once = _slowest(comm, time.perf_counter() - started)
    iters = max(min_iters, min(100, int(seconds_per_row / trials / max(once, 1e-6))))
    means = []
    for _ in range(trials):
        comm.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            run()
        means.append(_slowest(comm, (time.perf_counter() - started) / iters))
    return sorted(means)[len(means) // 2]


def rank_sets(comm) -> List[Tuple[str, List[int], Shape]]:
    """The sets of ranks the sweep times: (name, members, shape)."""
    hosts = comm.topology.hosts
    per_host = max(len(h) for h in hosts)
    sets = [("world", list(range(comm.world_size)), Shape(len(hosts), per_host))]
    if per_host > 1 and len(hosts) > 1:  # (with one host, the world is the host)
        sets.append(("host", hosts[0], Shape(1, len(hosts[0]))))
    if len(hosts) > 1 and per_host > 1:
        sets.append(("leaders", [h[0] for h in hosts], Shape(len(hosts), 1)))
    return sets


def sweep(comm, sizes=SIZES, trials: int = 3, seconds_per_row: float = 0.5,
          say=print) -> List[Point]:
    """Time every (set of ranks, algorithm, size) of the module's notes."""
    points = []
    for name, members, shape in rank_sets(comm):
        mine = comm.rank in members
        if name == "world":
            names = [a for a in WORLD_ALGORITHMS
                     if a != "hierarchical" or (shape.hosts > 1 and shape.ranks_per_host > 1)]
            run_on = comm
        else:
            names = GROUP_ALGORITHMS
            run_on = Group(comm, members) if mine else None
        for algorithm in names:
            for nbytes in sizes:
                flat = torch.zeros(nbytes // 4, dtype=torch.float32)
                call = None
                if name == "world":
                    def call(flat=flat, algorithm=algorithm):
                        api.all_reduce(flat, "sum", algorithm, comm, check=False)
                elif mine:
                    function = algorithms.ALL_REDUCE[algorithm]

                    def call(flat=flat, function=function):
                        function(run_on, flat, "sum")
                seconds = time_call(comm, call, trials, seconds_per_row)
                point = Point(algorithm, nbytes, shape.hosts, shape.ranks_per_host, seconds, name)
                points.append(point)
                say(f"{name:>8} {shape.hosts}x{shape.ranks_per_host} {algorithm:>16} "
                    f"{nbytes:>10} B {seconds * 1e3:10.3f} ms", flush=True)
    return points


# ---- the fit (one process, no communication) --------------------------------------------

def _get(c: Constants, name: str) -> float:
    """A constant by name: "local.alpha", "gamma", "overhead.ring"."""
    head, _, tail = name.partition(".")
    if head == "overhead":
        algorithm, _, where = tail.partition("@")
        return c.per_message(algorithm, network=where == "network")
    return getattr(getattr(c, head), tail) if tail else getattr(c, head)


def _with(c: Constants, values: Dict[str, float]) -> Constants:
    """`c` with the named constants set to new values."""
    routes = {route: Route(values.get(f"{route}.alpha", getattr(c, route).alpha),
                           values.get(f"{route}.beta", getattr(c, route).beta))
              for route in ROUTES}
    overhead = dict(c.overhead)
    overhead.update({k.split(".", 1)[1]: v for k, v in values.items()
                     if k.startswith("overhead.")})
    return replace(c, **routes, overhead=overhead, gamma=values.get("gamma", c.gamma))


def measured_parameters(points: List[Point], start: Constants) -> List[str]:
    """The constants some point's predicted time depends on (a 10 % nudge moves it)."""
    used = []
    for name in PARAMETERS:
        nudged = _with(start, {name: _get(start, name) * 1.1})
        if any(abs(predict_point(p, nudged) - predict_point(p, start)) > 1e-3 * predict_point(p, start)
               for p in points):
            used.append(name)
    return used


def predict_point(point: Point, c: Constants) -> float:
    return algorithms.COSTS[point.collective][point.algorithm](point.nbytes, point.shape, c)


def fit(points: List[Point], start: Constants = START) -> Tuple[Constants, List[str]]:
    """The constants that best predict `points` (relative error), and the names of the
    ones that were measured (the rest keep `start`'s values)."""
    from scipy.optimize import least_squares
    free = measured_parameters(points, start)
    x0 = np.log([_get(start, name) for name in free])
    measured = np.log([p.seconds for p in points])

    def residuals(x):
        c = _with(start, dict(zip(free, np.exp(x))))
        predicted = np.log([max(predict_point(p, c), 1e-12) for p in points])
        return np.concatenate([predicted - measured, math.sqrt(PRIOR_WEIGHT) * (x - x0)])

    if free:
        solution = least_squares(residuals, x0, method="trf", x_scale=1.0)
        start = _with(start, dict(zip(free, np.exp(solution.x))))
    return start, free


def errors(points: List[Point], c: Constants) -> List[float]:
    """Relative errors (predicted - measured) / measured, one per point."""
    return [(predict_point(p, c) - p.seconds) / p.seconds for p in points]


def summary(errs: List[float]) -> Dict[str, float]:
    """Median and 90th percentile of |error| (as collectives.cost_model check reports)."""
    size = np.abs(np.array(errs))
    return {"points": len(errs), "median_abs_error": float(np.median(size)),
            "p90_abs_error": float(np.percentile(size, 90))}


def describe(c: Constants, measured: List[str]) -> str:
    """The constants as a reader wants them: microseconds, GB/s."""
    def mark(name):
        return "" if name in measured else "   (not measured here: the starting value)"
    lines = [f"transport {c.transport or '?'}" + (f", link {c.link_rate * 8 / 1e6:g} Mbit/s"
                                                 if c.link_rate else ""),
             f"  local    alpha {c.local.alpha * 1e6:9.1f} us   1/beta {1e-9 / c.local.beta:8.3f} GB/s"
             f"{mark('local.alpha') or mark('local.beta')}",
             f"  network  alpha {c.network.alpha * 1e6:9.1f} us   1/beta {1e-9 / c.network.beta:8.3f} GB/s"
             f"{mark('network.alpha') or mark('network.beta')}",
             f"  gamma    1/gamma {1e-9 / c.gamma:.3f} GB/s reduced{mark('gamma')}",
             f"  native   alpha {c.native.alpha * 1e6:9.1f} us   1/beta {1e-9 / c.native.beta:8.3f} GB/s"
             f"   (the backend's own collectives inside a host){mark('native.alpha')}",
             "  per message, by algorithm, inside a host / between hosts:",
             "    " + ", ".join(
                 f"{a} {c.per_message(a) * 1e6:.0f}{'' if f'overhead.{a}' in measured else '*'}"
                 f" / {c.per_message(a, True) * 1e6:.0f}"
                 f"{'' if f'overhead.{a}@network' in measured else '*'} us"
                 for a in OURS) + "   (*: not measured here)"]
    return "\n".join(lines)


def calibrate(comm, sizes=SIZES, trials: int = 3, seconds_per_row: float = 0.5,
              say=print) -> Tuple[Constants, List[Point], List[str]]:
    """Collective: sweep on every rank; every rank gets the same fit back."""
    points = sweep(comm, sizes, trials, seconds_per_row, say)
    rate = links.link_rate_bytes() or 0.0
    # Ranks that share one machine share its cores: one host, or the emulated cluster
    # (its hosts are namespaces of this machine). On real hosts each rank has its own.
    shared = rate or len(comm.topology.hosts) == 1
    start = replace(START, link_rate=rate, burst=links.bucket_bytes(rate) if rate else 0.0,
                    transport=comm.name, cores=(os.cpu_count() or 1) if shared else 0)
    constants, measured = fit(points, start)
    return constants, points, measured


def report(constants: Constants, points: List[Point], measured: List[str], out: str,
           **extra) -> None:
    """Print every point's fit and the constants; write them to `out`."""
    errs = errors(points, constants)
    print("# fit: predicted against measured, every point")
    print(f"{'ranks':>8} {'shape':>5} {'algorithm':>16} {'bytes':>10} {'measured':>10} "
          f"{'model':>10} {'error':>7}")
    for point, err in zip(points, errs):
        print(f"{point.ranks:>8} {point.hosts}x{point.ranks_per_host:<3} "
              f"{point.algorithm:>16} {point.nbytes:>10} {point.seconds * 1e3:8.3f}ms "
              f"{predict_point(point, constants) * 1e3:8.3f}ms {err:+7.1%}")
    stats = summary(errs)
    print(f"# fit error over {stats['points']} points: median |error| "
          f"{stats['median_abs_error']:.1%}, 90th percentile {stats['p90_abs_error']:.1%}")
    print(describe(constants, measured))
    save(constants, out, measured=measured, fit=stats, points=[vars(p) for p in points],
         **extra)
    print(f"# wrote {out}")


def refit(path: str, out: str) -> None:
    """Fit again the points an earlier calibrate saved (with the model as it is now)."""
    import json
    with open(path) as source:
        saved = json.load(source)
    points = [Point(**point) for point in saved["points"]]
    was = saved["constants"]
    rate = was.get("link_rate", 0.0)
    start = replace(START, link_rate=rate, transport=was.get("transport", ""),
                    burst=was.get("burst", links.bucket_bytes(rate) if rate else 0.0),
                    cores=was.get("cores", (os.cpu_count() or 1)
                                  if rate or all(p.hosts == 1 for p in points) else 0))
    constants, measured = fit(points, start)
    report(constants, points, measured, out, refitted_from=path)


def rank_main(args) -> None:
    import collectives
    comm = collectives.init(backend=args.backend)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"# collectives.cost_model calibrate: {comm.name}, {comm.world_size} ranks on "
        f"{len(comm.topology.hosts)} host(s)", flush=True)
    constants, points, measured = calibrate(comm, args.sizes, args.trials,
                                            args.seconds_per_row, say)
    if comm.rank == 0:
        report(constants, points, measured, args.out)
    collectives.destroy()
