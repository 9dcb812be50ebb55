"""python -m collectives.cost_model: calibrate the cost model, ask it, check it.

    python -m collectives.cost_model calibrate --out here.json [--nproc 4]    # or under a launcher
    python -m collectives.cost_model predict --constants here.json --algorithm all \\
        --hosts 3 --ranks-per-host 2 --size 16M --bandwidth 50mbit [--latency 2ms]
    python -m collectives.cost_model check --constants here.json runs/*.jsonl

`predict` prints the seconds per call the model gives (with `--algorithm all`, every
algorithm's, fastest first). `check` compares the model with rows collectives.bench
wrote (`--json`), on runs it was not fitted on, and prints every point's error with
the median and 90th percentile.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List

from . import calibrate as calibration
from . import load, on_cluster
from ..launch import links
from ..algorithms import COSTS
from ..algorithms.costs import Shape
from ..bench import parse_size, parse_sizes
from .units import format_rate, parse_latency, parse_rate

COLLECTIVES = list(COSTS)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m collectives.cost_model",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    commands = p.add_subparsers(dest="command", required=True)

    cal = commands.add_parser("calibrate", help="time a short sweep here and fit the constants")
    cal.add_argument("--out", required=True, metavar="FILE.json")
    cal.add_argument("--points", metavar="FILE.json",
                     help="fit again the sweep an earlier calibrate wrote, measuring nothing")
    cal.add_argument("--nproc", type=int, default=None,
                     help="spawn this many gloo ranks here (not needed under a launcher)")
    cal.add_argument("--backend", default="auto", choices=["auto", "gloo", "mpi"])
    cal.add_argument("--sizes", type=parse_sizes, default=calibration.SIZES,
                     help="all-reduce sizes (default 4K,64K,1M,8M)")
    cal.add_argument("--trials", type=int, default=3)
    cal.add_argument("--seconds-per-row", type=float, default=0.5)

    pre = commands.add_parser("predict", help="seconds per call on a cluster described here")
    pre.add_argument("--constants", required=True, metavar="FILE.json")
    pre.add_argument("--collective", default="all_reduce", choices=COLLECTIVES)
    pre.add_argument("--algorithm", default="all",
                     help="one algorithm, or all (every one, fastest first)")
    pre.add_argument("--hosts", type=int, required=True)
    pre.add_argument("--ranks-per-host", type=int, default=1)
    pre.add_argument("--size", type=parse_size, required=True, help="bytes: 64K, 16M, 1G")
    add_link_arguments(pre)

    chk = commands.add_parser("check", help="the model against collectives.bench --json rows")
    chk.add_argument("--constants", required=True, metavar="FILE.json")
    chk.add_argument("rows", nargs="+", metavar="ROWS.jsonl")
    chk.add_argument("--json", metavar="FILE", help="write every compared point")
    return p


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bandwidth", type=parse_rate, default=0.0,
                   help="each host's link, each way, as tc writes it: 50mbit, 25gbit "
                        "(default: the link the constants were measured on)")
    p.add_argument("--latency", type=parse_latency, default=0.0,
                   help="added to every message between hosts: 10us, 2ms")
    p.add_argument("--emulated", action="store_true",
                   help="hosts as collectives.cluster makes them here (tbf's bucket on "
                        "each link, every rank sharing this machine's cores); default: "
                        "real hosts")


# ---- calibrate ----------------------------------------------------------------------------

def run_calibrate(p, args) -> int:
    if args.points:
        try:
            calibration.refit(args.points, args.out)
        except (OSError, ValueError, KeyError, TypeError) as error:
            p.error(f"--points {args.points}: not a sweep calibrate wrote ({error!r})")
        return 0
    from ..launch import LaunchError, detect_launch
    try:
        info = detect_launch()
    except LaunchError as error:
        p.error(str(error))
    if info.world_size == 1 and (args.nproc or 1) == 1:
        p.error("calibrate needs 2 ranks or more: --nproc N, or start it under a launcher")
    if links.links_differ():  # the model has one link rate: a fit would mix them up
        if info.rank != 0:
            sys.exit(2)  # rank 0 says why, once
        p.error("calibrate fits one link rate, and this emulated cluster's links differ "
                "(--link): run it with every link alike (--bandwidth alone)")
    if info.world_size > 1:
        calibration.rank_main(args)
        return 0
    if args.backend == "mpi":
        p.error("--nproc spawns gloo ranks: start mpi ranks with mpirun instead")
    from ..launch.spawn import spawn
    spawn(calibration.rank_main, args.nproc, args)
    return 0


# ---- predict ------------------------------------------------------------------------------

def run_predict(p, args) -> int:
    try:
        constants = load(args.constants)
    except (OSError, ValueError, KeyError, TypeError) as error:
        p.error(f"cannot read constants from {args.constants}: {error}")
    constants = on_cluster(constants, args.bandwidth, args.latency, args.emulated)
    if args.hosts < 1 or args.ranks_per_host < 1:
        p.error("--hosts and --ranks-per-host must be at least 1")
    shape = Shape(args.hosts, args.ranks_per_host)
    table = COSTS[args.collective]
    if args.algorithm != "all" and args.algorithm not in table:
        p.error(f"no cost model for {args.collective} {args.algorithm!r}: "
                f"choose from all, {', '.join(table)}")
    names = list(table) if args.algorithm == "all" else [args.algorithm]
    times = sorted((table[name](args.size, shape, constants), name) for name in names)
    link = format_rate(constants.link_rate) if constants.link_rate else "unshaped"
    print(f"# {args.collective} of {args.size} B on {shape.hosts} host(s) x "
          f"{shape.ranks_per_host} rank(s), link {link}, "
          f"+{args.latency * 1e6:g} us latency ({args.constants})")
    print(f"{'algorithm':>16} {'seconds':>12} {'algbw(GB/s)':>12}")
    for seconds, name in times:
        print(f"{name:>16} {seconds:12.6f} {args.size / seconds / 1e9 if seconds else 0:12.4f}")
    return 0


# ---- check --------------------------------------------------------------------------------

def bench_points(paths: List[str]):
    """(Point, link rate in bytes/s) for every all-reduce row of collectives.bench --json."""
    out = []
    for path in paths:
        with open(path) as rows:
            for line in rows:
                row = json.loads(line)
                if row.get("op") not in COSTS or row["algorithm"] not in COSTS[row["op"]]:
                    continue
                if "hosts" not in row:
                    raise ValueError(f"{path}: rows without 'hosts' (an older collectives.bench)")
                point = calibration.Point(row["algorithm"], row["bytes"], row["hosts"],
                                          row["ranks_per_host"], row["time_us"] / 1e6,
                                          collective=row["op"])
                out.append((point, row.get("link_gbps", 0.0) * 1e9))
    return out


def run_check(p, args) -> int:
    try:
        constants = load(args.constants)
    except (OSError, ValueError, KeyError, TypeError) as error:
        p.error(f"cannot read constants from {args.constants}: {error!r}")
    try:
        points = bench_points(args.rows)
    except (OSError, ValueError, KeyError) as error:
        p.error(str(error))
    if not points:
        p.error("no rows the model covers in " + ", ".join(args.rows))
    print(f"{'shape':>5} {'link':>9} {'algorithm':>16} {'bytes':>10} {'measured':>11} "
          f"{'model':>11} {'error':>7}")
    errs, compared = [], []
    for point, rate in points:
        # rows from the emulated cluster: its links' rate, and their tbf bucket
        c = constants.with_link(rate, burst=links.bucket_bytes(rate)) if rate else constants
        model = calibration.predict_point(point, c)
        err = (model - point.seconds) / point.seconds
        errs.append(err)
        compared.append(dict(vars(point), link_rate=rate, model=model, error=err))
        link = format_rate(rate) if rate else "-"
        print(f"{point.hosts}x{point.ranks_per_host:<3} {link:>9} {point.algorithm:>16} "
              f"{point.nbytes:>10} {point.seconds * 1e3:9.2f}ms {model * 1e3:9.2f}ms {err:+7.1%}")
    stats = calibration.summary(errs)
    print(f"# {stats['points']} points: median |error| {stats['median_abs_error']:.1%}, "
          f"90th percentile {stats['p90_abs_error']:.1%}")
    if args.json:
        with open(args.json, "w") as out:
            for row in compared:
                out.write(json.dumps(row) + "\n")
    return 0


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    return {"calibrate": run_calibrate, "predict": run_predict,
            "check": run_check}[args.command](p, args)


if __name__ == "__main__":
    sys.exit(main())
