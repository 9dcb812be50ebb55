"""Measure the collectives like nccl-tests' all_reduce_perf, and check every answer.

    python -m collectives.bench --nproc 4                       # spawns 4 gloo ranks
    python -m collectives.bench --nproc 4 --backend mpi         # starts mpirun itself
    mpirun -np 4 python -m collectives.bench --backend mpi      # or under any launcher
    torchrun --nproc-per-node 4 -m collectives.bench

For every collective, size and algorithm it prints one row: size, count, dtype,
algorithm, time (us), algbw, busbw, #wrong.

    algbw = bytes / time
    busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for reduce-scatter and
            all-gather, x 1 for broadcast: the bytes each rank's link really carries,
            so busbw is comparable across world sizes and with link speed.

Besides the algorithms it measures two references: `native` (the backend's own
collective) and, for all-reduce, `p2p-ring`: the ring all-reduce's exact message
schedule (2(n-1) sendrecv steps of one chunk each) with no reduction, which is the
practical limit of any ring on this transport. `handshake` is the argument check that
collectives.all_reduce runs before each call unless check=False, where it needs a
message of its own (api.py); it is timed alone. `--check-cost` times what the check adds
to a call as a user makes it: collectives.all_reduce(algorithm="auto") with the check
(`checked`) and with check=False (`unchecked`), call by call in turns so that both see
the same machine, and prints checked / unchecked.

Through torch.distributed (`--torch-api`, all-reduce only), three more rows: `api`
(collectives.all_reduce as a user calls it, auto and the argument check included),
`torch:collectives` (dist.all_reduce on a group of this project's torch.distributed
backend, which makes that same call) and `torch:gloo` (dist.all_reduce on gloo's own).

On the emulated cluster (`python -m collectives.cluster ... -- python -m
collectives.bench`) two columns are added: `link`, the busbw the links allow (each
link's rate each way: a bandwidth-optimal flat algorithm cannot beat it), and `nic`,
the megabytes that the busiest host's NIC really sent per call (Ethernet, IP and TCP
headers included: about 5 % over the payload).

Timing: each rank runs the collective back to back and the slowest rank's mean is
reported. The timed buffers hold zeros so repeated sums cannot overflow; #wrong comes
from a separate run on data whose result is known exactly. `--in-turns` times the
algorithms of a size together instead, call by call in a random order each round, so
that a machine whose speed drifts treats them alike: the way to compare them. Then,
per all-reduce size, a line says what auto would run from each of its sources (the
tuning table, if one; the cost model) and that algorithm's time over the quickest's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from typing import Dict, List

import torch

from . import algorithms, api, trace
from .algorithms import tuning
from .launch import links
from .launch import add_local_rank_argument

BUS_FACTOR = {  # busbw / algbw, as nccl-tests
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
TORCH_API_ROWS = ("api", "torch:collectives", "torch:gloo")  # --torch-api


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4K, 16M, 1G")
    return int(match.group(1)) * UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> List[int]:
    """'1K:64M' (doubling, as nccl-tests -f 2) or '1K,1M,16M'."""
    if ":" in text:
        low, high = (parse_size(part) for part in text.split(":"))
        if low < 1 or high < low:
            raise argparse.ArgumentTypeError(f"bad size range {text!r}")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 2
        return sizes
    return [parse_size(part) for part in text.split(",")]


def _pattern(rank: int, count: int, dtype) -> torch.Tensor:
    return ((torch.arange(count) % 7) + rank).to(dtype)


class Runner:
    """One rank's view of the benchmark: builds buffers, runs and times one row."""

    def __init__(self, comm, dtype, min_iters, seconds_per_row, trials):
        self.comm, self.dtype = comm, dtype
        self.min_iters, self.seconds_per_row, self.trials = min_iters, seconds_per_row, trials
        self.nic_bytes_per_call = None  # on the emulated cluster: the busiest host's NIC
        self.trace_calls = 0  # --trace: calls traced per row
        self.torch_groups = {}  # --torch-api: row name -> torch.distributed group

    def _slowest(self, seconds: float) -> float:
        return self._slowest_each([seconds])[0]

    def _slowest_each(self, values: List[float]) -> List[float]:
        """Each value's largest over the ranks (one small all-reduce)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        self.comm.native_all_reduce(tensor, "max")
        return tensor.tolist()

    def _trace(self, step, label: str) -> None:
        """With --trace: a few extra calls, each a "step" span named by the row, recorded
        outside the timed loops so that tracing cannot change the figures."""
        trace.resume()
        for call in range(self.trace_calls):
            self.comm.barrier()
            started = time.perf_counter_ns()
            step()
            ended = time.perf_counter_ns()
            trace.add(f"call {call + 1}", "step", started, ended, sync=label)
            trace.add("blocking call", "wait", started, ended)  # nothing to overlap with
        trace.pause()

    def _finished(self, step):
        """`step`, ending only when the GPU has done its work (a call on the GPU
        returns once its work is queued)."""
        if self.comm.device.type != "cuda":
            return step

        def finished():
            step()
            torch.cuda.synchronize(self.comm.device)
        return finished

    def _time(self, step, label: str = "") -> float:
        """Seconds per call: the median over trials of the slowest rank's mean.

        A shared machine is noisy, so the row's time is the median of `trials` timed
        loops, each of an iteration count that every rank agrees on.
        """
        step()  # warm up: first-touch allocations, connections
        if self.trace_calls:
            self._trace(step, label)
        nic_before = links.link_bytes()
        seconds, iters = self._trials([step])
        if nic_before is not None:  # barriers and the timing all-reduces: a few hundred bytes
            sent = links.link_bytes()["sent"] - nic_before["sent"]
            self.nic_bytes_per_call = self._slowest(sent / (iters * self.trials))
        return seconds[0]

    def _trials(self, steps) -> tuple:
        """([seconds per call of each step], iterations per timed loop): each step's
        median over trials, the steps' loops taking turns within every trial."""
        started = time.perf_counter()
        for step in steps:
            step()
        once = self._slowest((time.perf_counter() - started) / len(steps))
        budget = self.seconds_per_row / self.trials
        iters = max(self.min_iters, min(200, int(budget / max(once, 1e-6))))
        means = [[] for _ in steps]
        for _ in range(self.trials):
            for step, times in zip(steps, means):
                self.comm.barrier()
                started = time.perf_counter()
                for _ in range(iters):
                    step()
                times.append(self._slowest((time.perf_counter() - started) / iters))
        return [sorted(times)[len(times) // 2] for times in means], iters

    def in_turns(self, steps) -> List[float]:
        """Seconds per call of each step, the steps timed call by call in turns.

        Rows timed one after another see a machine whose speed drifts (on 2 shared
        cores the same algorithm, timed a row apart, came out 0.5x to 2.8x itself):
        here every round calls each step once, in an order drawn afresh each round
        (the same on every rank, which must make the same calls), each call timed
        alone. A trial is `iters` rounds; per trial the slowest rank's mean per step;
        the median over trials. Each step has been called once before (warmed up).
        """
        _, iters = self._trials(steps)  # how many calls fill a loop
        shuffle = random.Random(len(steps) * 7919 + iters).shuffle  # alike on every rank
        order = list(range(len(steps)))
        spent = [[] for _ in steps]
        for _ in range(self.trials):
            totals = [0.0] * len(steps)
            self.comm.barrier()
            for _ in range(iters):
                shuffle(order)
                for index in order:
                    started = time.perf_counter()
                    steps[index]()
                    totals[index] += time.perf_counter() - started
            for index, seconds in enumerate(self._slowest_each([t / iters for t in totals])):
                spent[index].append(seconds)
        return [sorted(times)[len(times) // 2] for times in spent]

    def check_cost(self, nbytes: int) -> List[Dict]:
        """Rows `checked` and `unchecked`: collectives.all_reduce(algorithm="auto") of
        `nbytes` with and without the check, timed in turns."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        count = max(1, nbytes // element)
        zeros = torch.zeros(count, dtype=self.dtype)
        steps = [lambda: api.all_reduce(zeros, "sum", "auto", self.comm),
                 lambda: api.all_reduce(zeros, "sum", "auto", self.comm, check=False)]
        for step in steps:
            step()  # warm up
        seconds = self.in_turns(steps)
        return [dict(self.measure_row("all_reduce", name, count, element, value, wrong=0),
                     in_turns=True) for name, value in zip(("checked", "unchecked"), seconds)]

    def measure_in_turns(self, op: str, algorithms_: List[str], nbytes: int) -> List[Dict]:
        """A row per algorithm at `nbytes`, the algorithms timed in turns (in_turns):
        the way to compare them on a noisy machine. On the emulated cluster, `nic` is
        from the checked call of each."""
        count, element = self._count(op, nbytes)
        steps, wrongs, nics = [], [], []
        for algorithm in algorithms_:
            nic_before = links.link_bytes()
            step, wrong = self._build(op, algorithm, count)  # one checked call
            if nic_before is not None:
                nics.append(self._slowest(links.link_bytes()["sent"] - nic_before["sent"]))
            steps.append(self._finished(step))
            wrongs.append(wrong)
            steps[-1]()  # warm up
        rows = []
        for index, seconds in enumerate(self.in_turns(steps)):
            if nics:
                self.nic_bytes_per_call = nics[index]
            row = self.measure_row(op, algorithms_[index], count, element, seconds,
                                   wrongs[index])
            rows.append(dict(row, in_turns=True))
        return rows

    def _count(self, op: str, nbytes: int) -> tuple:
        """(elements, bytes per element) of a buffer of about `nbytes` for `op`."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        count = max(1, nbytes // element)
        if op in ("reduce_scatter", "all_gather"):
            count = max(self.comm.world_size, count - count % self.comm.world_size)
        return count, element

    def measure(self, op: str, algorithm: str, nbytes: int) -> Dict:
        count, element = self._count(op, nbytes)
        step, wrong = self._build(op, algorithm, count)
        seconds = self._time(self._finished(step), f"{op} {algorithm} {count * element} B")
        return self.measure_row(op, algorithm, count, element, seconds, wrong)

    def measure_row(self, op: str, algorithm: str, count: int, element: int,
                    seconds: float, wrong: int) -> Dict:
        comm, n = self.comm, self.comm.world_size
        algbw = count * element / seconds / 1e9
        shape = algorithms.auto.shape_of(n, comm.topology)
        row = dict(op=op, algorithm=algorithm, backend=comm.backend, transport=comm.name,
                   world_size=n, hosts=shape.hosts, ranks_per_host=shape.ranks_per_host,
                   bytes=count * element, count=count, dtype=str(self.dtype).split(".")[-1],
                   time_us=seconds * 1e6, algbw_gbps=algbw,
                   busbw_gbps=algbw * BUS_FACTOR.get(op, lambda n: 2 * (n - 1) / n)(n),
                   wrong=wrong)
        link = links.link_rate_bytes()
        if link is not None:
            row.update(link_gbps=link / 1e9, nic_mb_per_call=self.nic_bytes_per_call / 1e6)
        return row

    def _build(self, op: str, algorithm: str, count: int):
        """(a zero-argument timed step, #wrong from one checked run)."""
        comm, n, rank, dtype = self.comm, self.comm.world_size, self.comm.rank, self.dtype
        zeros = torch.zeros(count, dtype=dtype, device=comm.device)
        if op == "all_reduce" and algorithm == "p2p-ring":
            chunk = max(1, count // n)
            send, receive = zeros[:chunk], torch.empty(chunk, dtype=dtype, device=comm.device)
            right, left = (rank + 1) % n, (rank - 1) % n

            def step():
                for _ in range(2 * (n - 1)):
                    comm.sendrecv(send, right, receive, left)
            return step, 0
        if op == "all_reduce" and algorithm in TORCH_API_ROWS:
            return self._build_torch_api(algorithm, count)
        if op == "handshake":
            row = api.call_signature(comm, "all_reduce", zeros, "sum", "ring", -1)
            return (lambda: api.agree_on_call(comm, "all_reduce", row)), 0
        if op == "all_reduce":
            data = _pattern(rank, count, dtype).to(self.comm.device)
            api.all_reduce(data, "sum", algorithm, comm, check=False)
            expected = (torch.arange(count) % 7) * n + n * (n - 1) // 2
            wrong = int((data.double().cpu() != expected.double()).sum())
            return (lambda: api.all_reduce(zeros, "sum", algorithm, comm, check=False)), wrong
        if op == "broadcast":
            data = _pattern(rank, count, dtype).to(self.comm.device)
            api.broadcast(data, 0, algorithm, comm, check=False)
            wrong = int((data.cpu() != _pattern(0, count, dtype)).sum())
            return (lambda: api.broadcast(zeros, 0, algorithm, comm, check=False)), wrong
        if op == "reduce_scatter":
            out = torch.empty(count // n, dtype=dtype, device=comm.device)
            data = _pattern(rank, count, dtype).to(self.comm.device)
            api.reduce_scatter(out, data, "sum", algorithm, comm, check=False)
            mine = torch.arange(rank * (count // n), (rank + 1) * (count // n))
            expected = (mine % 7) * n + n * (n - 1) // 2
            wrong = int((out.double().cpu() != expected.double()).sum())
            return (lambda: api.reduce_scatter(out, zeros, "sum", algorithm, comm,
                                               check=False)), wrong
        if op == "all_gather":
            out = torch.empty(count, dtype=dtype, device=comm.device)
            part = count // n
            api.all_gather(out, _pattern(rank, part, dtype).to(comm.device), algorithm, comm,
                           check=False)
            expected = torch.cat([_pattern(r, part, dtype) for r in range(n)])
            wrong = int((out.cpu() != expected).sum())
            return (lambda: api.all_gather(out, zeros[:part], algorithm, comm,
                                           check=False)), wrong
        raise ValueError(f"unknown op {op}")


    def _build_torch_api(self, row: str, count: int):
        """An all-reduce as a user's script makes it: ours, or torch.distributed's."""
        import torch.distributed as dist
        n, rank, dtype = self.comm.world_size, self.comm.rank, self.dtype
        if row == "api":
            def reduce(tensor):
                api.all_reduce(tensor, "sum", "auto", self.comm)
        else:
            group = self.torch_groups[row]

            def reduce(tensor):
                dist.all_reduce(tensor, group=group)
        data = _pattern(rank, count, dtype).to(self.comm.device)
        reduce(data)
        expected = (torch.arange(count) % 7) * n + n * (n - 1) // 2
        wrong = int((data.double().cpu() != expected.double()).sum())
        zeros = torch.zeros(count, dtype=dtype, device=self.comm.device)
        return (lambda: reduce(zeros)), wrong


def torch_api_groups() -> Dict:
    """--torch-api: a group of the collectives backend and one of gloo, over all ranks
    (torch.distributed is initialised: init() made its gloo group)."""
    import torch.distributed as dist
    from . import torch_backend
    torch_backend.register()
    return {"torch:collectives": dist.new_group(backend=torch_backend.NAME),
            "torch:gloo": dist.new_group(backend="gloo")}


def _gbps(value: float) -> str:
    return f"{value:>7.3f}" if value >= 0.1 else f"{value:>7.4f}"  # slow links: 4 decimals


def format_row(row: Dict) -> str:
    text = (f"{row['bytes']:>12} {row['count']:>11} {row['dtype']:>8} {row['op']:>14} "
            f"{row['algorithm']:>16} {row['time_us']:>11.1f} {_gbps(row['algbw_gbps'])} "
            f"{_gbps(row['busbw_gbps'])} {row['wrong']:>6}")
    if "link_gbps" in row:
        text += f" {_gbps(row['link_gbps'])} {row['nic_mb_per_call']:>8.2f}"
    return text


def links_text(slowest: float) -> str:
    """The emulated cluster's links, for the header: one rate when they are alike;
    where hosts differ (--link), the slowest and every host's, the link column being
    the slowest link's."""
    if not links.links_differ():
        return f"links of {slowest * 8 / 1e6:g} Mbit/s each way"
    hosts = ", ".join(f"node{host} {'unshaped' if rate is None else f'{rate * 8 / 1e6:g}'}"
                      for host, rate in enumerate(links.link_rates_bytes()))
    return (f"links differ, slowest link {slowest * 8 / 1e6:g} Mbit/s each way "
            f"(Mbit/s: {hosts}); the link column is the slowest")


def header(on_cluster: bool) -> str:
    names = (f"{'size(B)':>12} {'count':>11} {'type':>8} {'op':>14} {'algorithm':>16} "
             f"{'time(us)':>11} {'algbw':>7} {'busbw':>7} {'#wrong':>6}")
    units = f"{'':>12} {'':>11} {'':>8} {'':>14} {'':>16} {'':>11} {'(GB/s)':>7} {'(GB/s)':>7}"
    if on_cluster:
        names += f" {'link':>7} {'nic':>8}"
        units += f" {'':>6} {'(GB/s)':>7} {'(MB)':>8}"
    return names + "\n" + units


def default_algorithms(comm) -> List[str]:
    """What tune times here (the hierarchy only where it has two levels), auto, and
    the ring's message schedule as a reference."""
    return tuning.candidates(comm.topology) + ["auto", "p2p-ring"]


def run_benchmark(comm, args) -> List[Dict]:
    runner = Runner(comm, DTYPES[args.dtype], args.min_iters, args.seconds_per_row, args.trials)
    if args.torch_api:
        runner.torch_groups = torch_api_groups()
    if args.trace:
        runner.trace_calls = args.trace_steps
        trace.start(comm, args.trace, level=args.trace_level, recording=False)
    rows = []
    measured = args.algorithms or default_algorithms(comm)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"# collectives.bench: {comm.name}, {comm.world_size} ranks, "
        f"dtype {args.dtype}, ring segment {comm.segment_bytes // 1024} KiB")
    link = links.link_rate_bytes()
    if link is not None:
        say(f"# emulated cluster: {links_text(link)}; nic = MB the busiest host's NIC sent "
            "per call")
    if "auto" in measured and "all_reduce" in args.ops and comm.backend != "nccl":
        source = comm.tuning_source
        if comm.tuning is None:
            source += f"; constants: {algorithms.auto.model_constants_path()}"
        say(f"# auto follows {source}")
    say(header(link is not None))
    for op in args.ops:
        wanted = [a for a in measured if a in algorithms.names(op) or
                  (a == "p2p-ring" and op == "all_reduce")]
        if args.torch_api and op == "all_reduce":
            wanted += list(TORCH_API_ROWS)
        for nbytes in args.sizes:
            if args.in_turns:
                for row in runner.measure_in_turns(op, wanted, nbytes):
                    rows.append(row)
                    say(format_row(row), flush=True)
                continue
            for algorithm in wanted:
                row = runner.measure(op, algorithm, nbytes)
                rows.append(row)
                say(format_row(row), flush=True)
    for nbytes in args.sizes if args.check_cost else ():
        checked, unchecked = runner.check_cost(nbytes)
        rows += [checked, unchecked]
        say(format_row(checked) + "\n" + format_row(unchecked))
        say(f"# the check: checked / unchecked = "
            f"{checked['time_us'] / unchecked['time_us']:.3f}", flush=True)
    if args.handshake:
        row = runner.measure("handshake", "agree_on_call", 1)
        row.update(bytes=0, count=0, algbw_gbps=0.0, busbw_gbps=0.0)
        rows.append(row)
        say(format_row(row), flush=True)
    for line in auto_against_the_quickest(comm, rows):
        say(line)
    bad = sum(row["wrong"] for row in rows)
    say(f"# out of bounds values: {bad} {'OK' if bad == 0 else 'FAILED'}")
    if args.trace:
        say(f"# trace: {trace.finish(comm)} (`python -m collectives.trace {args.trace}`)")
    return rows


def auto_against_the_quickest(comm, rows: List[Dict]) -> List[str]:
    """Per all-reduce size measured with fixed algorithms: what auto chooses from each
    source it has (the tuning table, if one; the cost model always), and how the time of
    that algorithm's row compares with the quickest fixed algorithm's at that size
    (`auto`'s own row too, where measured). A verdict needs the rows timed in turns."""
    fixed = set(algorithms.ALL_REDUCE)
    reduces = [r for r in rows if r["op"] == "all_reduce"]
    lines = []
    for nbytes in dict.fromkeys(r["bytes"] for r in reduces):
        at_size = {r["algorithm"]: r for r in reduces if r["bytes"] == nbytes}
        peers = [r for name, r in at_size.items() if name in fixed]
        if len(peers) < 2:
            continue
        quickest = min(peers, key=lambda r: r["time_us"])
        sources = [("table", comm.tuning)] if comm.tuning is not None else []
        said = []
        for source, table in sources + [("model", None)]:
            chosen = api.auto_choice("all_reduce", nbytes, comm, table)
            if chosen not in at_size:
                said.append(f"{source} {chosen} (not measured)")
                continue
            ratio = at_size[chosen]["time_us"] / quickest["time_us"]
            said.append(f"{source} {chosen} {ratio:.2f}")
            for row in (at_size.get("auto"), at_size[chosen]):
                if row is not None:
                    row.setdefault("auto_over_quickest", {})[source] = ratio
                    row["quickest"] = quickest["algorithm"]
        if "auto" in at_size:
            own = at_size["auto"]["time_us"] / quickest["time_us"]
            said.append(f"auto's own row {own:.2f}")
        lines.append(f"# at {nbytes:>10} B quickest {quickest['algorithm']:>16} "
                     f"{quickest['time_us']:>11.1f} us; chosen / quickest: " + ", ".join(said))
    if lines and not all(r.get("in_turns") for r in reduces):
        lines.append("# (rows timed one after another: --in-turns times them call by call "
                     "in turns, as a verdict needs on a noisy machine)")
    return lines


def plot(rows: List[Dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = list(dict.fromkeys(row["op"] for row in rows if row["op"] != "handshake"))
    figure, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for axis, op in zip(axes[0], ops):
        for algorithm in dict.fromkeys(r["algorithm"] for r in rows if r["op"] == op):
            points = [(r["bytes"], r["busbw_gbps"]) for r in rows
                      if r["op"] == op and r["algorithm"] == algorithm]
            axis.plot(*zip(*points), marker="o", label=algorithm,
                      linestyle="--" if algorithm in ("native", "p2p-ring") else "-")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel("busbw (GB/s)")
        first = rows[0]
        axis.set_title(f"{op}: {first.get('transport', first['backend'])}, "
                       f"{first['world_size']} ranks")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def add_launch_arguments(p: argparse.ArgumentParser, backends: List[str]) -> None:
    """--nproc, --backend and --shm: where the ranks come from and how they talk
    (run_ranks reads them)."""
    p.add_argument("--nproc", type=int, default=None,
                   help="spawn this many ranks here (not needed under mpirun/torchrun)")
    p.add_argument("--backend", default="auto", choices=backends)
    p.add_argument("--shm", default=None, choices=["auto", "on", "off"],
                   help="point-to-point through shared memory between ranks of this host "
                        "(default: $COLLECTIVES_SHM, else auto = when possible)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m collectives.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    add_launch_arguments(p, ["auto", "gloo", "nccl", "mpi"])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1K:64M"),
                   help="sizes in bytes: a doubling range '1K:64M' or a list '4K,16M'")
    p.add_argument("--ops", type=lambda s: s.split(","), default=["all_reduce"],
                   help="comma list of all_reduce, reduce_scatter, all_gather, broadcast "
                        "(default all_reduce)")
    p.add_argument("--algorithms", type=lambda s: s.split(","), default=None,
                   help="comma list; each op runs the ones it has (default: all, "
                        "hierarchical where hosts hold several ranks)")
    p.add_argument("--torch-api", action="store_true",
                   help="add all-reduce rows through torch.distributed: api, "
                        "torch:collectives, torch:gloo (gloo backend only)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--min-iters", type=int, default=3,
                   help="timed calls per trial at least (default 3)")
    p.add_argument("--trials", type=int, default=5,
                   help="timed loops per row; the median is reported (default 5)")
    p.add_argument("--seconds-per-row", type=float, default=1.0,
                   help="aim for about this much timing per row (default 1.0)")
    p.add_argument("--segment-kb", type=int, default=None,
                   help="ring segment size in KiB (default: the library's)")
    p.add_argument("--in-turns", action="store_true",
                   help="time the algorithms of each size call by call in turns (in a "
                        "random order each round) rather than a row after another: "
                        "to compare them on a noisy machine")
    p.add_argument("--check-cost", action="store_true",
                   help="also time collectives.all_reduce with and without its argument "
                        "check, in turns")
    p.add_argument("--no-handshake", dest="handshake", action="store_false",
                   help="skip timing the argument-check handshake")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size")
    p.add_argument("--trace", metavar="DIR", help="trace a few extra calls of every row "
                   "(outside the timed loops) into DIR/trace.json")
    p.add_argument("--trace-steps", type=int, default=2, metavar="N",
                   help="calls traced per row (default 2)")
    p.add_argument("--trace-level", type=int, choices=[1, 2], default=2,
                   help="2 (default): each algorithm's steps too; 1: whole collectives")
    add_local_rank_argument(p)  # torch.distributed.launch passes --local-rank=N
    return p


def validate(p: argparse.ArgumentParser, args) -> None:
    for op in args.ops:
        if op not in BUS_FACTOR:
            p.error(f"unknown op {op!r}: choose from {', '.join(BUS_FACTOR)}")
    known = set(algorithms.ALL_REDUCE) | set(algorithms.BROADCAST) | {"auto", "p2p-ring"}
    for name in args.algorithms or []:
        if name not in known:
            p.error(f"unknown algorithm {name!r}: choose from {', '.join(sorted(known))}")
    if args.torch_api and args.backend not in ("auto", "gloo"):
        p.error("--torch-api compares with torch's gloo: use --backend gloo")
    if args.in_turns and args.trace:
        p.error("--trace times rows one after another: drop --in-turns to trace")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.min_iters < 1 or args.trials < 1:
        p.error("--min-iters and --trials must be at least 1")


def rank_main(args) -> None:
    import collectives
    comm = collectives.init(backend=args.backend, shm=args.shm)
    if args.segment_kb:
        comm.segment_bytes = args.segment_kb * 1024
    rows = run_benchmark(comm, args)
    if comm.rank == 0:
        if args.json:
            with open(args.json, "w") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")
        if args.plot:
            plot(rows, args.plot)
    collectives.destroy()


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    validate(p, args)
    return run_ranks(p, args, argv, "collectives.bench", rank_main)


def run_ranks(p: argparse.ArgumentParser, args, argv, module: str, rank_main) -> int:
    """rank_main(args) on every rank: under the launcher that started us, or on
    --nproc ranks started here (by the mpirun that matches mpi4py for --backend mpi,
    which runs `python -m module` again)."""
    from .launch import LaunchError, detect_launch
    try:
        info = detect_launch()
    except LaunchError as error:
        p.error(str(error))
    launched = info.world_size > 1
    if launched and args.nproc is not None and args.nproc != info.world_size:
        p.error(f"--nproc {args.nproc} but the launcher ({info.launcher}) started "
                f"{info.world_size} ranks: drop --nproc under a launcher")
    if args.nproc and args.nproc > 1 and not launched:
        if args.backend == "mpi":  # let the matching mpirun start the ranks
            from .launch.mpirun import mpirun_command
            argv = list(sys.argv[1:] if argv is None else argv)
            cut = argv.index("--nproc")
            rest = argv[:cut] + argv[cut + 2:]
            command, env = mpirun_command(args.nproc, [sys.executable, "-m", module, *rest])
            os.execvpe(command[0], command, env)
        from .launch.spawn import spawn
        spawn(rank_main, args.nproc, args)
        return 0
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
