"""Train with several sync strategies for the same budget and compare them.

    python -m trainer.compare --dataset mnist --data-dir ../shared/data --nproc 4 \\
        --sync allreduce,local-sgd:period=8,async-avg,delayed,gossip,bf16,topk,powersgd \\
        --epochs 2 --out docs/compare

Each strategy runs as its own job (`mpirun -np N python -m trainer ... --sync NAME`,
with the mpirun that matches mpi4py), with every other trainer flag the same. A
strategy's options follow its name after a colon: `local-sgd:period=8:warmup_steps=10`.
Flags this command does not know are passed to the trainer unchanged.

Writes OUT.md (the table) and OUT.png (test accuracy against wall time and against
bytes sent per rank), and prints the table:

    sync | final test acc | wall time (s) | sent per rank (MiB) | time to target (s)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from collectives.mpi_launcher import mpirun_command


def parse_sync(entry: str):
    """'local-sgd:period=8' -> ('local-sgd', ['--sync-option', 'period=8'])."""
    name, *options = entry.split(":")
    flags = []
    for option in options:
        flags += ["--sync-option", option]
    return name, flags


def run_one(entry: str, nproc: int, trainer_flags: List[str], folder: str) -> Dict:
    name, option_flags = parse_sync(entry)
    metrics = os.path.join(folder, f"{entry.replace(':', '_')}.jsonl")
    command = [sys.executable, "-m", "trainer", "--sync", name, *option_flags,
               "--metrics", metrics, *trainer_flags]
    argv, env = mpirun_command(nproc, command)
    started = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{entry} failed:\n{result.stderr[-2000:]}")
    with open(metrics) as lines:
        epochs = [json.loads(line) for line in lines]
    return {"sync": entry, "epochs": epochs, "wall_s": wall}


def summarize(run: Dict, target: float) -> Dict:
    seconds = bytes_sent = 0.0
    reached = None
    curve = []
    for record in run["epochs"]:
        seconds += record["seconds"]
        bytes_sent += record["comm_bytes"]
        curve.append((seconds, bytes_sent / 2**20, record["test_acc"]))
        if reached is None and record["test_acc"] >= target:
            reached = seconds
    return {"sync": run["sync"], "final_acc": run["epochs"][-1]["test_acc"],
            "wall_s": run["wall_s"], "train_s": seconds, "mib_sent": bytes_sent / 2**20,
            "time_to_target_s": reached, "curve": curve}


def table(rows: List[Dict], target: float) -> str:
    lines = [f"| sync | final test acc | wall time (s) | training time (s) | sent per rank (MiB) "
             f"| time to {target:.0%} (s) |", "|---|---|---|---|---|---|"]
    for row in rows:
        reached = (f"{row['time_to_target_s']:.0f}" if row["time_to_target_s"] is not None
                   else "not reached")
        lines.append(f"| {row['sync']} | {row['final_acc']:.2%} | {row['wall_s']:.0f} | "
                     f"{row['train_s']:.0f} | {row['mib_sent']:.0f} | {reached} |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str, target: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows:
        seconds, mib, accuracy = zip(*row["curve"])
        by_time.plot(seconds, [100 * a for a in accuracy], marker="o", label=row["sync"])
        by_bytes.plot(mib, [100 * a for a in accuracy], marker="o", label=row["sync"])
    for axis, label in ((by_time, "training time (s)"), (by_bytes, "MiB sent per rank")):
        axis.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel("test accuracy (%)")
        axis.grid(True, alpha=0.3)
    by_bytes.set_xscale("symlog")
    by_time.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.compare",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="ranks per job (default 4)")
    parser.add_argument("--sync", required=True,
                        help="comma list of strategies, each NAME[:KEY=VALUE...]")
    parser.add_argument("--target", type=float, default=0.95,
                        help="test accuracy for the time-to-target column (default 0.95)")
    parser.add_argument("--out", default="compare", help="writes OUT.md and OUT.png")
    args, trainer_flags = parser.parse_known_args(argv)
    from collectives import sync
    entries = args.sync.split(",")
    for entry in entries:
        if parse_sync(entry)[0] not in sync.available():
            parser.error(f"unknown sync {parse_sync(entry)[0]!r}: choose from "
                         f"{', '.join(sync.available())}")
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for entry in entries:
            print(f"training with {entry} ...", flush=True)
            rows.append(summarize(run_one(entry, args.nproc, trainer_flags, folder), args.target))
            print(table(rows[-1:], args.target).splitlines()[-1], flush=True)
    text = table(rows, args.target)
    command = "python -m trainer.compare " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as out:
        out.write(f"Made by `{command}`\n\n{text}\n")
    plot(rows, args.out + ".png", args.target)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
