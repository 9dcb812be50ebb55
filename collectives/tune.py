"""Measure which all-reduce is quickest on this machine, and write the table auto follows.

    python -m collectives.tune --nproc 4                  # 4 ranks here, gloo (+shm)
    python -m collectives.tune --nproc 4 --backend mpi    # started by mpi4py's mpirun
    mpirun -np 8 python -m collectives.tune               # under any launcher
    python -m collectives.cluster --hosts 4 --bandwidth 1gbit -- python -m collectives.tune

Each all-reduce algorithm (ring, halving-doubling, tree, naive, the backend's own, and
the hierarchy where hosts hold several ranks) is timed at a ladder of sizes, 4 KiB to
64 MiB by default, as `collectives.bench --in-turns` times them (call by call in
turns, so that the machine's drift falls on all alike; the slowest rank's mean, the
median of trials), in about a minute; where the quickest changes between two rungs, the
size halfway between them is timed too. The quickest at each size becomes a rule, and the rules a
table (collectives/algorithms/tuning.py) for this world on this machine: its key is
the transport, the ranks' placement, the cores and the links' rate. It goes to the
cache folder (on every host: each host's first rank writes it), or to --out; from then
on `collectives.init()` finds it for a world of that key and `auto` follows it.

NCCL keeps its own tuning: there is nothing to write for --backend nccl.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from . import bench
from .algorithms import tuning
from .launch.environment import add_local_rank_argument

LADDER = "4K,16K,64K,256K,1M,4M,16M,64M"  # x4 a rung, and those between: about a minute


def rank_main(args) -> None:
    import collectives
    comm = collectives.init(backend=args.backend, shm=args.shm)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    if comm.backend == "nccl":
        say("collectives.tune: nccl keeps NCCL's own tuning; nothing to measure")
        collectives.destroy()
        return
    candidates = tuning.candidates(comm.topology)
    key = tuning.key_for(comm.name, comm.world_size, comm.topology)
    say(f"# collectives.tune: {comm.name}, {comm.world_size} ranks on {key['hosts']} "
        f"host(s), {key['cores']} cores" + (f", links of {key['link_bits'] / 1e6:g} Mbit/s"
                                             if key["link_bits"] else ""))
    runner = bench.Runner(comm, torch.float32, min_iters=args.min_iters,
                          seconds_per_row=args.seconds_per_row, trials=args.trials)
    say(f"{'size(B)':>12} " + " ".join(f"{name:>16}" for name in candidates) + "  quickest")
    measured = {}  # size -> {algorithm: microseconds per call}

    def measure(nbytes: int) -> None:
        rows = runner.measure_in_turns("all_reduce", candidates, nbytes)
        for row in rows:
            if row["wrong"]:
                raise RuntimeError(f"{row['algorithm']} gave {row['wrong']} wrong values "
                                   f"at {nbytes} B")
        measured[nbytes] = {row["algorithm"]: row["time_us"] for row in rows}  # slowest rank's
        times = measured[nbytes]
        say(f"{nbytes:>12} " + " ".join(f"{times[name]:>16.1f}" for name in candidates)
            + f"  {min(times, key=times.get)}", flush=True)

    for nbytes in args.sizes:
        measure(nbytes)
    for nbytes in tuning.between_winners(measured):  # where the quickest changes: look closer
        measure(nbytes)
    sizes = sorted(measured)
    times = {name: [measured[nbytes][name] for nbytes in sizes] for name in candidates}
    path = args.out or os.path.join(tuning.cache_folder(), tuning.file_name(key))
    writes = comm.rank == 0 if args.out else comm.topology.local_rank(comm.rank) == 0
    if writes:
        table = tuning.write(key, sizes, times, path)
    comm.barrier()  # every host's table is written before anyone says so
    if comm.rank == 0:
        rules = ", ".join(f"{algorithm} below {below} B" if below else f"{algorithm} above"
                          for below, algorithm in table.rules)
        print(f"# rules: {rules}")
        print(f"# written to {path}" + ("" if args.out else " on every host") +
              (": collectives.init() finds it there" if not args.out else
               f": set COLLECTIVES_TUNING={path} for auto to follow it"))
    collectives.destroy()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m collectives.tune",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    bench.add_launch_arguments(p, ["auto", "gloo", "mpi"])
    p.add_argument("--sizes", type=bench.parse_sizes, default=bench.parse_sizes(LADDER),
                   help=f"the ladder of sizes in bytes (default {LADDER})")
    p.add_argument("--seconds-per-row", type=float, default=0.5,
                   help="timing per algorithm and size, about (default 0.5)")
    p.add_argument("--trials", type=int, default=3, help="timed loops each (default 3)")
    p.add_argument("--min-iters", type=int, default=2, help="calls per loop at least")
    p.add_argument("--out", metavar="FILE",
                   help="write the table here instead of the cache folder (rank 0 only)")
    add_local_rank_argument(p)  # torch.distributed.launch passes --local-rank=N
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.nproc is not None and args.nproc < 2:
        p.error(f"--nproc must be at least 2, got {args.nproc}")
    if len(args.sizes) < 1 or min(args.trials, args.min_iters) < 1:
        p.error("--sizes needs one size at least; --trials and --min-iters at least 1")
    return bench.run_ranks(p, args, argv, "collectives.tune", rank_main)


if __name__ == "__main__":
    sys.exit(main())
