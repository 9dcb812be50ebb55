"""Train with several sync strategies, ours and torch's, and compare them.

    python -m trainer.compare --dataset mnist --data-dir ../shared/data --nproc 4 \\
        --sync allreduce,ddp,local-sgd:period=8,ddp-localsgd:period=8,bf16,ddp-bf16 \\
        --epochs 4 --stop-at 0.95 --out docs/data/compare
    python -m trainer.compare --hosts 4 --bandwidth 100mbit ...   (the emulated cluster)
    python -m trainer.compare --hosts 4 --bandwidth 100mbit --cpu-share node3=0.5 \\
        --link node1=10mbit --pause node2@30:10 ...    (hosts not alike)
    python -m trainer.compare --launcher torchrun --nproc 2 ...
    python -m trainer.compare --model gpt-tiny --steps 400 --eval-every 50 \\
        --sync allreduce,local-sgd:period=16,diloco:period=32 --target 2.5   (text)

Each strategy runs as its own job, started by --launcher: `mpirun -np N python -m
trainer ... --sync NAME` (the mpirun that matches mpi4py; the default), torchrun, or
the emulated cluster (`python -m collectives.cluster --hosts H --ranks-per-host L
--bandwidth RATE -- python -m trainer ...`; --hosts alone picks it; --cpu-share, --link
and --pause pass on to it: a slower host, a slower link, a host frozen for a while,
python -m collectives.cluster --help), with every other
trainer flag the same. The names are our strategies and torch's peers (ddp,
ddp-fp16, ddp-bf16, ddp-powersgd, ddp-localsgd: trainer/torch_peers.py). A
strategy's options follow its name after a colon, as the trainer takes them:
`local-sgd:period=8:warmup_steps=10`; --sync-option KEY=VALUE gives one to every job.
Flags this command does not know are passed to the trainer unchanged (--stop-at SCORE
ends each job at the first evaluation that reaches SCORE).

The score is the task's, as the trainer's --model picks it (`Score`): test accuracy
for a ResNet (higher is better; --target default 0.95), held-out bits per byte for a
gpt-* (lower is better; --target default 2.5). The time to target is the training
time of the first evaluation that reaches --target. A language model's evaluations
come every --eval-every steps: they are its "epochs" below, and its throughput is in
tokens (bytes predicted) per second.

Time is training time: the sum of the epochs' training loops, without evaluation and
start-up. Bytes are what each rank sent (on the emulated cluster: its host's NIC).
Writes OUT.md (the table), OUT.png (the score against training time and against MiB
sent per rank, log; a torch peer dashed in the colour of our strategy with the same
math, as trainer/torch_peers.py OURS pairs them) and OUT.jsonl (each job's epochs as the
trainer's --metrics wrote them, one line per job), and prints the table:

    sync | final test acc | time to target (s) | training time (s) | epochs | images/s |
    MiB sent per rank per step | wall time (s)

(a language model's: final held-out bits/byte, evaluations, tokens/s.)

--baseline SYNC (one of the --sync entries, `ddp` say) measures every row against that
job, as the low-communication papers measure against synchronous training: two more
columns, how many times sooner than SYNC's training time a row reaches SYNC's final
score (at its first evaluation that does) and how many times fewer bytes each rank
sent over the whole run; and, below the table, SYNC's ideal speed-up: its step time
over its compute alone, 1 / (1 - the share of its training time it waited on the
network), what a strategy that hid every byte would gain (`against_baseline`).

A job that fails is one row, "failed after N epochs", with its error printed; the jobs
after it still run, and the command then exits with 1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional

from collectives.cluster.network import ClusterSpec
from collectives.cluster.options import (as_given, cpu_share_arg, link_arg, pause_arg,
                                         with_hosts_that_differ)
from collectives.launch.mpirun import mpirun_command

from . import torch_peers
from .loop.cli import build_parser as trainer_parser
from .loop.cli import build_sync, parse_sync as parse_spec, sync_option
from .tasks import kind_of


class Score(NamedTuple):
    """What a comparison scores its jobs by: the task's held-out figure, as the trainer's
    --metrics records it, and how the table and the plot show it."""
    key: str                # each record's: "test_acc", "test_bpb"
    column: str             # the table's heading for the last one
    axis: str               # the plot's y axis
    lower_is_better: bool
    default_target: float   # --target where it is not given
    throughput_key: str     # each record's throughput: "images_per_s", "tokens_per_s"
    throughput: str         # its heading
    epochs: str             # what the records are: epochs, or evaluations every N steps

    def reached(self, value: float, target: float) -> bool:
        return value <= target if self.lower_is_better else value >= target

    def text(self, value: float) -> str:
        return f"{value:.3f}" if self.lower_is_better else f"{value:.2%}"

    def target_text(self, target: float) -> str:
        return f"{target:g} bits/byte" if self.lower_is_better else f"{target:.0%}"

    def plotted(self, value: float) -> float:
        """The plot's y: a percentage, or bits per byte as they are."""
        return value if self.lower_is_better else 100 * value


ACCURACY = Score("test_acc", "final test acc", "test accuracy (%)", False, 0.95,
                 "images_per_s", "images/s", "epochs")
BITS_PER_BYTE = Score("test_bpb", "final held-out bits/byte", "held-out bits per byte",
                      True, 2.5, "tokens_per_s", "tokens/s", "evaluations")
SCORES = {"images": ACCURACY, "language": BITS_PER_BYTE}  # by tasks.kind_of


def score_of_flags(trainer_flags: List[str]) -> Score:
    """The score of the jobs these trainer flags start: their --model's task, read by the
    trainer's own parser, so that --arch, --model=NAME and an abbreviation read as the
    trainer reads them. A value the trainer would refuse (a model it does not have)
    raises argparse.ArgumentError: refused once here, not once per job."""
    reading = trainer_parser()
    reading.exit_on_error = False  # its error is raised, for this command to print
    flags, _ = reading.parse_known_args(trainer_flags)
    return SCORES[kind_of(flags.arch)]


def score_of_records(records: List[Dict], otherwise: Score = ACCURACY) -> Score:
    """The score a job's records hold (`otherwise` where they hold none)."""
    for score in SCORES.values():
        if any(score.key in record for record in records):
            return score
    return otherwise


# Options of the emulated cluster that make one host differ, passed on as given, and
# checked as the cluster checks them (a typo is one usage error here, not one per job).
CLUSTER_HOST_OPTIONS = {
    "--cpu-share": ("HOST=FRACTION", cpu_share_arg,
                    "the host gets FRACTION of its fair share of the cores"),
    "--link": ("HOST=RATE", link_arg, "the host's link runs at RATE, not --bandwidth"),
    "--pause": ("HOST@SECONDS:DURATION", pause_arg,
                "the host is frozen for DURATION seconds, SECONDS after the ranks start"),
}


def check_cluster_hosts(args) -> None:
    """ValueError unless the cluster would take the hosts that differ: each names a host
    it has, once, and one host's pauses do not overlap."""
    spec = ClusterSpec([args.ranks_per_host] * args.hosts)
    values = {option: [parse(text) for text in getattr(args, option[2:].replace("-", "_"))
                       or []]
              for option, (_, parse, _) in CLUSTER_HOST_OPTIONS.items()}
    with_hosts_that_differ(spec, values["--cpu-share"], values["--link"], values["--pause"])


def parse_sync(entry: str, sync_options=()):
    """'local-sgd:period=8' -> ('local-sgd', ['--sync', 'local-sgd:period=8']): the
    strategy's name and the trainer flags that pick it, its options and the
    --sync-option pairs given to every job. The name and every option are checked
    first, as the trainer will read them (ValueError or TypeError: the line to print),
    so that a typo is one usage error here, not a failed job each."""
    name, options = parse_spec(entry, sync_options)
    build_sync(name, options)
    flags = ["--sync", entry]
    for key, value in sync_options:
        flags += ["--sync-option", f"{key}={value}"]
    return name, flags


def launch_command(args, trainer_argv: List[str]):
    """(argv, env) that start `python -m trainer TRAINER_ARGV` on every rank."""
    if args.launcher == "mpirun":
        return mpirun_command(args.nproc, [sys.executable, "-m", "trainer", *trainer_argv])
    if args.launcher == "torchrun":
        return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                 str(args.nproc), "-m", "trainer", *trainer_argv], dict(os.environ))
    cluster = [sys.executable, "-m", "collectives.cluster", "--hosts", str(args.hosts),
               "--ranks-per-host", str(args.ranks_per_host)]
    if args.bandwidth:
        cluster += ["--bandwidth", args.bandwidth]
    for option in CLUSTER_HOST_OPTIONS:
        for value in getattr(args, option[2:].replace("-", "_"), None) or []:
            cluster += [option, value]
    return [*cluster, "--", sys.executable, "-m", "trainer", *trainer_argv], dict(os.environ)


def run_one(entry: str, args, trainer_flags: List[str], folder: str) -> Dict:
    _, option_flags = parse_sync(entry, args.sync_option)
    metrics = os.path.join(folder, f"{entry.replace(':', '_')}.jsonl")
    argv, env = launch_command(args, [*option_flags, "--metrics", metrics, *trainer_flags])
    started = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    epochs = []
    if os.path.exists(metrics):  # a job that failed keeps the epochs it finished
        with open(metrics) as lines:
            for line in lines:
                try:
                    epochs.append(json.loads(line))
                except json.JSONDecodeError:
                    if result.returncode == 0:
                        raise
                    break  # killed while it wrote this line
    job = {"sync": entry, "epochs": epochs, "wall_s": wall}
    if result.returncode != 0 or not epochs:
        job["failed"] = (f"exit {result.returncode}{'' if epochs else ', no epoch recorded'} "
                         f"({' '.join(argv)}):\n{result.stderr[-2000:]}")
    return job


def summarize(run: Dict, target: float, score: Optional[Score] = None) -> Dict:
    """Cumulative training time, bytes and samples after each epoch (a language model's:
    each evaluation); time to target. The score is the one the records hold (test
    accuracy or held-out bits per byte; `score` where they hold none). A job that
    failed is summarized as such, whatever epochs it finished aside."""
    score = score_of_records(run["epochs"], score or ACCURACY)
    if run.get("failed"):
        return {"sync": run["sync"], "failed": True, "epochs": len(run["epochs"]),
                "wall_s": run["wall_s"], "score": score.key}
    seconds = bytes_sent = samples = steps = waited = 0.0
    reached = None
    curve = []
    for record in run["epochs"]:
        seconds += record["train_seconds"]
        waited += (record.get("waited_share") or 0.0) * record["train_seconds"]
        bytes_sent += record["comm_bytes"]
        samples += record[score.throughput_key] * record["train_seconds"]
        steps += record["steps"]
        curve.append((seconds, bytes_sent / 2**20, record[score.key]))
        if reached is None and score.reached(record[score.key], target):
            reached = seconds
    return {"sync": run["sync"], "score": score.key, "final": run["epochs"][-1][score.key],
            "wall_s": run["wall_s"], "train_s": seconds, "per_s": samples / seconds,
            "mib_per_step": bytes_sent / 2**20 / max(steps, 1), "epochs": len(run["epochs"]),
            "time_to_target_s": reached, "curve": curve, "sent_mib": bytes_sent / 2**20,
            "waited_share": waited / seconds if seconds else 0.0}


def against_baseline(rows: List[Dict], baseline: str) -> Dict:
    """Every row measured against the row named `baseline`: {"final": its final score,
    "ideal": its ideal speed-up, "waited_share": the share of its training time it
    waited, "rows": {sync: (times sooner to its final score or None, times fewer bytes
    per rank or None)}}. Sooner: the baseline's training time over the training time of
    the row's first evaluation that reaches the baseline's final score. The ideal: the
    baseline's step time over its compute alone, 1 / (1 - waited share)."""
    base = next(row for row in rows if row["sync"] == baseline)
    if base.get("failed"):
        raise ValueError(f"the baseline {baseline} failed: nothing to measure against")
    score = score_of_rows([base])
    measured = {}
    for row in rows:
        if row.get("failed"):
            continue
        reached = next((seconds for seconds, _, value in row["curve"]
                        if score.reached(value, base["final"])), None)
        sooner = base["train_s"] / reached if reached else None
        fewer = base["sent_mib"] / row["sent_mib"] if row["sent_mib"] > 0 else None
        measured[row["sync"]] = (sooner, fewer)
    waited = base["waited_share"]
    return {"final": base["final"], "waited_share": waited,
            "ideal": 1.0 / (1.0 - waited) if waited < 1 else float("inf"), "rows": measured}


def score_of_rows(rows: List[Dict]) -> Score:
    """The score the summarized rows were scored by (test accuracy where none says)."""
    keys = [row["score"] for row in rows if "score" in row]
    return next((s for s in SCORES.values() if keys and s.key == keys[0]), ACCURACY)


def table(rows: List[Dict], target: float, baseline: Optional[str] = None) -> str:
    """The comparison's table (module docstring); with `baseline`, two more columns
    and its ideal speed-up below (against_baseline)."""
    score = score_of_rows(rows)
    extra = against_baseline(rows, baseline) if baseline else None
    heading = (f"| sync | {score.column} | time to {score.target_text(target)} (s) | "
               f"training time (s) | {score.epochs} | {score.throughput} | MiB sent per rank "
               "per step | wall time (s) |")
    rule = "|---|---|---|---|---|---|---|---|"
    if extra:
        heading += (f" to {baseline}'s final {score.text(extra['final'])}: x sooner | "
                    f"bytes per rank: x fewer than {baseline} |")
        rule += "---|---|"
    lines = [heading, rule]
    for row in rows:
        if row.get("failed"):
            unit = score.epochs[:-1] if row["epochs"] == 1 else score.epochs  # 1 epoch
            finished = f"{row['epochs']} {unit}"
            lines.append(f"| {row['sync']} | failed after {finished} "
                         f"| | | | | | {row['wall_s']:.0f} |" + (" | |" if extra else ""))
            continue
        reached = (f"{row['time_to_target_s']:.0f}" if row["time_to_target_s"] is not None
                   else "not reached")
        line = (f"| {row['sync']} | {score.text(row['final'])} | {reached} | "
                f"{row['train_s']:.0f} | {row['epochs']} | {row['per_s']:.1f} | "
                f"{row['mib_per_step']:.2f} | {row['wall_s']:.0f} |")
        if extra:
            sooner, fewer = extra["rows"][row["sync"]]
            line += (f" {'not reached' if sooner is None else f'{sooner:.2f}'} | "
                     f"{'-' if fewer is None else f'{fewer:.1f}'} |")
        lines.append(line)
    if extra:
        lines += ["", f"{baseline}'s ideal speed-up: {extra['ideal']:.2f}x (it waited on the "
                      f"network {extra['waited_share']:.1%} of its training time: its step "
                      "time over its compute alone)"]
    return "\n".join(lines)


# Twenty colours that tell apart at a glance: tab10's, then tab20's lighter shades.
# A family (our strategy and torch's peers with the same math) takes the next one in
# the order its first row appears; past twenty they repeat.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
           "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5")
# (linestyle, marker): ours solid with circles, torch's dashed with squares; a second row
# of the same side in one family (ddp and ddp-collectives both pair with allreduce)
# takes the next, and so on, round again past the last.
OUR_STYLES = (("-", "o"), ("-.", "D"), ("-", "v"), ("-.", "*"), ("-", "X"), ("-.", "h"))
PEER_STYLES = (("--", "s"), (":", "^"), ("--", "P"), (":", "<"), ("--", ">"), (":", "d"))


def family(sync: str) -> str:
    """The strategy a row is measured against: 'ddp-localsgd:period=8' -> 'local-sgd'
    (torch's peer -> ours, as trainer/torch_peers.py OURS pairs them); ours -> itself."""
    name = sync.split(":")[0]
    return torch_peers.OURS.get(name, name)


def line_styles(syncs: List[str]) -> List[Dict]:
    """matplotlib's color, linestyle and marker for each row, in the rows' order: a
    family shares one colour, ours and torch's rows in it take OUR_STYLES and
    PEER_STYLES in turn."""
    colours: Dict[str, str] = {}
    drawn: Dict[tuple, int] = {}  # (family, is torch's) -> its rows so far
    styles = []
    for sync in syncs:
        name = family(sync)
        colour = colours.setdefault(name, PALETTE[len(colours) % len(PALETTE)])
        peer = sync.split(":")[0] in torch_peers.OURS
        turn = drawn.get((name, peer), 0)
        drawn[(name, peer)] = turn + 1
        choices = PEER_STYLES if peer else OUR_STYLES
        linestyle, marker = choices[turn % len(choices)]
        styles.append({"color": colour, "linestyle": linestyle, "marker": marker})
    return styles


def draw(rows: List[Dict], target: float):
    """The comparison's figure: the score (test accuracy, or held-out bits per byte)
    against training time (left) and against MiB sent per rank on a log axis (right),
    the legend to the right, grouped by family."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker
    score = score_of_rows(rows)
    rows = [row for row in rows if not row.get("failed")]  # a failed job has no line
    figure, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(13, 4.8))
    lines = []
    for row, style in zip(rows, line_styles([row["sync"] for row in rows])):
        seconds, mib, values = zip(*row["curve"])
        shown = [score.plotted(v) for v in values]
        lines.append(by_time.plot(seconds, shown, label=row["sync"], **style)[0])
        # A log axis has no zero: a line starts at its first epoch that sent anything.
        sent = [(m, v) for m, v in zip(mib, shown) if m > 0]
        if sent:
            by_bytes.plot(*zip(*sent), label=row["sync"], **style)
    for axis, label in ((by_time, "training time (s)"), (by_bytes, "MiB sent per rank")):
        axis.axhline(score.plotted(target), color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel(score.axis)
        axis.grid(True, alpha=0.3)
    positive = [m for row in rows for _, m, _ in row["curve"] if m > 0]
    if positive:
        by_bytes.set_xscale("log")
        by_bytes.set_xlim(left=min(positive) / 1.5, right=max(positive) * 1.5)
        # Ticks at 1, 2 and 5 of each decade, written plainly: matplotlib's own labels
        # every minor tick of a short log range, and they run into one another.
        by_bytes.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        by_bytes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        by_bytes.xaxis.set_minor_formatter(ticker.NullFormatter())
    families = [family(row["sync"]) for row in rows]
    grouped = sorted(range(len(rows)), key=lambda i: families.index(families[i]))
    by_bytes.legend([lines[i] for i in grouped], [rows[i]["sync"] for i in grouped],
                    title="solid: ours\ndashed: torch's peer", fontsize=8, title_fontsize=8,
                    loc="center left", bbox_to_anchor=(1.02, 0.5),
                    ncol=1 if len(rows) <= 18 else 2)
    figure.tight_layout()
    return figure


def plot(rows: List[Dict], path: str, target: float) -> None:
    """Draw the comparison (see draw) into PATH."""
    import matplotlib.pyplot as plt
    figure = draw(rows, target)
    figure.savefig(path, dpi=110, bbox_inches="tight")  # "tight" takes the legend in
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.compare",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4,
                        help="ranks per job (default 4; on the cluster: hosts x ranks per host)")
    parser.add_argument("--launcher", choices=["mpirun", "torchrun", "cluster"],
                        help="how each job starts (default mpirun; cluster when --hosts is given)")
    parser.add_argument("--hosts", type=int, help="emulated hosts (collectives.cluster)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks on each emulated host (default 1)")
    parser.add_argument("--bandwidth", metavar="RATE",
                        help="each emulated link's rate, e.g. 100mbit (default unshaped)")
    for option, (metavar, parse, text) in CLUSTER_HOST_OPTIONS.items():
        parser.add_argument(option, action="append", metavar=metavar, type=as_given(parse),
                            help=f"emulated cluster: {text} (repeatable)")
    parser.add_argument("--sync", required=True,
                        help="comma list of strategies, each NAME[:KEY=VALUE...]")
    parser.add_argument("--sync-option", action="append", default=[], metavar="KEY=VALUE",
                        type=sync_option, help="an option for every job's strategy, "
                        "repeatable, as if written after each name")
    parser.add_argument("--target", type=float,
                        help="the score of the time-to-target column: a test accuracy "
                             "(default 0.95), or held-out bits per byte for a --model "
                             "gpt-* (default 2.5)")
    parser.add_argument("--baseline", metavar="SYNC",
                        help="one of the --sync entries: every row measured against it "
                             "(x sooner to its final score, x fewer bytes; its ideal "
                             "speed-up)")
    parser.add_argument("--out", default="compare", help="writes OUT.md and OUT.png")
    args, trainer_flags = parser.parse_known_args(argv)
    try:
        score = score_of_flags(trainer_flags)
    except argparse.ArgumentError as error:
        parser.error(f"{error} (a flag for the trainer)")
    if args.target is None:
        args.target = score.default_target
    entries = args.sync.split(",")
    if args.baseline is not None and args.baseline not in entries:
        parser.error(f"--baseline {args.baseline} is not one of --sync's entries "
                     f"({', '.join(entries)})")
    for entry in entries:
        try:
            parse_sync(entry, args.sync_option)
        except (TypeError, ValueError, RuntimeError) as error:  # RuntimeError: a missing extra
            parser.error(str(error))
    args.launcher = args.launcher or ("cluster" if args.hosts else "mpirun")
    if args.launcher == "cluster":
        if not args.hosts or args.hosts < 1 or args.ranks_per_host < 1:
            parser.error("--launcher cluster needs --hosts N (and --ranks-per-host at least 1)")
        args.nproc = args.hosts * args.ranks_per_host
        try:
            check_cluster_hosts(args)
        except ValueError as error:
            parser.error(str(error))
    elif args.hosts or args.bandwidth or args.cpu_share or args.link or args.pause:
        parser.error(f"--hosts, --bandwidth, --cpu-share, --link and --pause are for the "
                     f"emulated cluster, not {args.launcher}")
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory() as folder, open(args.out + ".jsonl", "w") as jobs:
        for entry in entries:
            print(f"training with {entry} ...", flush=True)
            job = run_one(entry, args, trainer_flags, folder)
            jobs.write(json.dumps(job) + "\n")
            jobs.flush()  # on disk as soon as it ends, whatever happens to the next
            rows.append(summarize(job, args.target, score))
            if job.get("failed"):  # the other jobs still run: one failure costs one row
                print(f"{entry} failed, {job['failed']}", file=sys.stderr, flush=True)
            print(table(rows[-1:], args.target).splitlines()[-1], flush=True)
    try:
        text = table(rows, args.target, args.baseline)
    except ValueError as error:  # the baseline failed: the table without its columns
        print(error, file=sys.stderr)
        text = table(rows, args.target)
    command = "python -m trainer.compare " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(args.out + ".md", "w") as out:
        out.write(f"Made by `{command}`\n\n{text}\n")
    plot(rows, args.out + ".png", args.target)
    print(text)
    failed = [row["sync"] for row in rows if row.get("failed")]
    if failed:
        print(f"failed: {', '.join(failed)} (their errors above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
