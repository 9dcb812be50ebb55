r"""Replay a traced training step on a cluster we do not have: the cost model at work.

    python -m trainer.bench --nproc 2 --sync allreduce,bf16,powersgd,local-sgd,ddp \
        --trace run                                     # measure: a few traced steps
    python -m trainer.replay --trace run --constants here.json \
        --ranks 8,64,256,1024 --ranks-per-host 8 --bandwidth 25gbit --latency 10us
    python -m trainer.bench --nproc 2 --model gpt-small --sync allreduce,powersgd \
        --trace lm && python -m trainer.replay --trace lm --constants here.json

A data-parallel step is computation (which does not change with the number of ranks)
plus communication (which does). The trace tells the first, measured: when each piece
of compute ran and when each gradient bucket became ready. The cost model
(collectives/algorithms/costs.py, every algorithm's cost()) tells the second for any
cluster. Put together, one step is simulated per strategy and per rank count.

1. The traced step (`profile_from_trace`: a TracedStep per sync). Per sync in the
   trace, per rank, per traced step:

       forward     the forward span, less the collectives inside it (our DDP's
                   broadcast of rank 0's buffers: kept as `collectives` and priced)
       backward    backward's compute: the backward span less its communication tail
                   ("waiting on communication", from the last gradient computed)
       buckets     each gradient bucket: when it became ready, from backward's start
                   (our buckets: the span's start less its queued_ms; torch's: the
                   hook's call, its span's start), its bytes, and the CPU work the
                   strategy did on it outside the all-reduce (the bucket span less the
                   all-reduce span inside it: a division by the world size, bf16's
                   casts; torch's hooks run in C++: none separable, 0)
       writeback   from the later of the last gradient and the last bucket's end to
                   backward()'s return: the DDP copying reduced buckets into .grad
       moment      the strategy's own CPU work in after_backward / after_step, less
                   the collectives inside them (PowerSGD's matrix products and QR),
                   and those collectives' bytes
       optimizer   the optimizer span

   Each figure is the median over the traced steps; the slowest rank (the most compute
   per step) sets the pace, as in a real job every rank waits for it.

2. The simulation (`simulate`), one step, times in seconds; every compute figure above
   divided by the compute scale X (--compute-scale; --step-time S picks X so that
   forward + backward + optimizer take S):

       training thread:  forward | backward ............ | wait | writeback | moment | optimizer
       comm thread:                  [bucket 0] [bucket 1]  [bucket 2]
                                     ^ready 0   ^ready 1    ^ready 2 (queued behind 1)

   Buckets enter the communication thread when ready, in order, one at a time:
   start_k = max(ready_k, end_{k-1}), end_k = start_k + work_k + cost(bytes_k). The
   training thread finishes backward's compute at forward + backward and then waits
   for the last bucket: waited = max(0, end_last - (forward + backward)). Collectives on
   the training thread (buffer broadcasts, PowerSGD's, local SGD's averaging) are
   waited on in full. cost() is that of the algorithm our `auto` would pick (its
   measured rules where they hold, the model's fastest beyond them), or gloo's own
   (`native`) for torch's DDP.

   step = forward + backward + waited + writeback + moment + optimizer (+ training-
   thread collectives); throughput = ranks x batch x units per sample / step;
   scaling efficiency = throughput over ranks x the throughput of one rank computing
   alone (forward + backward + optimizer, no DDP at all) = (forward + backward +
   optimizer) / step.

   What a row counts follows from the traced model (trainer.bench writes its --model
   into every traced step): images/s for a ResNet; tokens/s for a gpt-*, each sample a
   window of its context's bytes (`Throughput`). A trace that names no model (one
   trainer.bench made before it named them, which traced only ResNets; the trainer's
   own --trace) is taken for images, unless --model names it. The batch likewise: the
   trace's, else trainer.bench's default (32 images, 16 windows), or --batch-size.

What each strategy is, in that picture (STRATEGIES below):

    allreduce      every bucket, full bytes, auto's algorithm, plus its measured work
    allreduce:overlap=forward   the same buckets from plain allreduce's trace, reduced in
                   chunks by priority while the next forward runs (replay_forward.py)
    bf16 / fp16    the same buckets at half the bytes, plus the measured casts
    powersgd       no buckets; after backward, on the training thread, the all-reduces
                   the trace shows (uncompressed vectors, all P's, all Q's: their bytes
                   depend on the model and the rank r, not on the number of ranks;
                   powersgd_bytes(model, r) computes them from the layers),
                   plus the measured matrix work between them
    local-sgd      buckets carry nothing; every H steps (--period, 8 as the strategy's
                   default) one all-reduce of all parameters and float buffers on the
                   training thread: the step is averaged over a period, as trainer.bench
                   times it (a traced averaging's bytes, else the buckets' bytes)
    ddp, ddp-bf16, ddp-fp16   torch's buckets as traced (its layout, not ours), gloo's
                   own all-reduce (COSTS["all_reduce"]["native"]); bf16/fp16 at half
                   the bytes, their casts not separable from the hook's span (left out)
    ddp-collectives  torch's buckets on our backend: auto's algorithm
    ddp-localsgd   as local-sgd, with gloo's all-reduce of the parameters

Not modelled (printed as such, never as a number): async-avg and delayed (their
communication overlaps whole later steps, on a thread of its own: one traced step does
not say how the rounds interleave), gossip (point-to-point exchanges with ring
neighbours: no cost() in COSTS), topk (an all-gather whose summing grows with the ranks
and was measured at the traced rank count only), ddp-powersgd (torch compresses inside
its comm hook per bucket: the trace shows each bucket's matrix work and three
all-reduces as one span, so neither P/Q bytes nor the matrix time can be separated).

Also left out: congestion between jobs, gloo running two buckets at once (modelled one
at a time), compute slowed by communication's CPU use (measured in the profile at the
traced rank count, and kept), stragglers beyond the traced slowest rank, and torch's
buffer broadcast (inside its forward, kept as measured).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field, replace
from typing import Dict, List, NamedTuple, Optional, Tuple

from collectives.algorithms import COSTS, fastest
from collectives.algorithms.costs import Constants, Shape
from collectives.cost_model import load, on_cluster
from collectives.cost_model.units import parse_latency, parse_rate
from collectives.priority import chunk_bytes
from .replay_forward import simulate_forward_overlap

US = 1e-6  # trace timestamps are microseconds


# --- what a step is made of -----------------------------------------------------------

@dataclass
class TracedBucket:
    """One gradient bucket of a traced step: when it was ready and what it carried. Not
    the bucketer's Bucket (collectives/bucketer.py), which holds the gradients
    themselves: this is what the trace saw of one."""
    ready_s: float      # when it became ready, from backward's start
    nbytes: int         # as traced: the float32 gradients it holds
    work_s: float = 0.0  # the strategy's CPU work on it, outside the all-reduce


@dataclass
class TracedStep:
    """One rank's step, as the trace measured it (seconds, medians over traced steps):
    what the replay re-times on another cluster. Not collectives/bucket_sizes.py's
    StepProfile, which is a synced step as the bucketer saw it, gradient by gradient."""
    sync: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: List[TracedBucket] = field(default_factory=list)
    writeback_s: float = 0.0
    moment_s: float = 0.0           # after_backward + after_step CPU work
    # collectives on the training thread: (collective, algorithm as traced, bytes)
    collectives: List[Tuple[str, str, int]] = field(default_factory=list)
    averaging_bytes: int = 0        # periodic strategies: what one averaging sends
    batch: int = 0                  # samples per rank (0: not in the trace)
    model: str = ""                 # trainer.bench's --model ("": not in the trace)
    rank: int = 0
    steps: int = 0

    @property
    def compute_s(self) -> float:
        """The compute-only step: forward, backward, optimizer (no DDP, no strategy)."""
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass
class Result:
    step_s: float     # one step (a periodic strategy's: averaged over its period)
    waited_s: float   # of which the training thread waited on communication
    compute_s: float  # forward + backward + optimizer, scaled
    algorithms: Tuple[str, ...] = ()  # what the model picked, in order of first use


# --- reading the trace ----------------------------------------------------------------

def _load_events(path: str) -> List[dict]:
    file = os.path.join(path, "trace.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no trace.json in {path} (make one with trainer.bench "
                                "--trace DIR)")
    with open(file) as source:
        return [e for e in json.load(source)["traceEvents"] if e.get("ph") == "X"]


def _inside(events, lo, hi, tid=None, cat=None):
    return [e for e in events if lo <= e["ts"] < hi and (tid is None or e["tid"] == tid)
            and (cat is None or e["cat"] == cat)]


def _collectives_in(events, span) -> List[dict]:
    """Our collectives ("all_reduce ring", "broadcast native") inside a span, same thread;
    the outermost only (a hierarchical all-reduce runs others inside its own span)."""
    found = [e for e in _inside(events, span["ts"], span["ts"] + span["dur"], span["tid"], "comm")
             if e is not span and not e["name"].startswith("bucket")]
    return [e for e in found if not any(
        o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
        and (o["ts"], -o["dur"]) < (e["ts"], -e["dur"]) for o in found)]


def _one_step(events, step) -> TracedStep:
    """The profile of one traced step (in seconds)."""
    lo, hi, tid = step["ts"], step["ts"] + step["dur"], step["tid"]
    mine = _inside(events, lo, hi)
    named = lambda name: [e for e in mine if e["tid"] == tid and e["name"] == name]  # noqa: E731
    if len(named("forward")) != 1 or len(named("backward")) != 1:
        raise ValueError(f"{step['name']} of {step['args'].get('sync')!r} on rank "
                         f"{step['pid']} has {len(named('forward'))} forward and "
                         f"{len(named('backward'))} backward spans: one of each expected "
                         "(a trainer.bench trace)")
    forward, backward = named("forward")[0], named("backward")[0]
    tail = sum(e["dur"] for e in named("waiting on communication"))
    collectives = []
    in_forward = _collectives_in(events, forward)
    for e in in_forward:
        collective, _, algorithm = e["name"].partition(" ")
        collectives.append((collective, algorithm, int(e["args"].get("bytes", 0))))
    moment, averaging = 0.0, 0
    for e in named("after_backward") + named("after_step"):
        inner = _collectives_in(events, e)
        moment += e["dur"] - sum(c["dur"] for c in inner)
        for c in inner:
            collective, _, algorithm = c["name"].partition(" ")
            if e["name"] == "after_step":  # a periodic averaging, when one was traced
                averaging += int(c["args"].get("bytes", 0))
            else:
                collectives.append((collective, algorithm, int(c["args"].get("bytes", 0))))
    bw_start = backward["ts"]
    backward_compute = backward["dur"] - tail
    buckets, last_end = [], None
    # a bucket's span starts in this step's backward, on any thread of this rank
    spans = [e for e in events if e["pid"] == step["pid"] and e["name"].startswith("bucket ")
             and bw_start <= e["ts"] - e["args"].get("queued_ms", 0) * 1e3 < hi]
    for e in sorted(spans, key=lambda e: int(e["name"].split()[1])):
        inner = _collectives_in(events, e)
        ready = e["ts"] - e["args"].get("queued_ms", 0) * 1e3 - bw_start
        work = e["dur"] - sum(c["dur"] for c in inner) if inner else 0.0
        buckets.append(TracedBucket(min(max(ready, 0.0), backward_compute) * US,
                              int(e["args"].get("bytes", 0)), work * US))
        last_end = max(last_end or 0, e["ts"] + e["dur"])
    backward_end = backward["ts"] + backward["dur"]
    from_when = max(backward_end - tail, last_end or 0)
    optimizer = named("optimizer")
    return TracedStep(
        sync=step["args"].get("sync", ""), rank=step["pid"], steps=1,
        forward_s=(forward["dur"] - sum(e["dur"] for e in in_forward)) * US,
        backward_s=backward_compute * US, optimizer_s=optimizer[0]["dur"] * US if optimizer else 0,
        buckets=buckets, writeback_s=max(0.0, backward_end - from_when) * US,
        moment_s=moment * US, collectives=collectives, averaging_bytes=averaging,
        batch=int(step["args"].get("batch", 0)), model=step["args"].get("model", ""))


def _median(profiles: List[TracedStep]) -> TracedStep:
    """Field by field, the median over steps (bucket by bucket; layout of the first)."""
    counts = [len(p.buckets) for p in profiles]  # a step whose bucket count differs: left out
    profiles = [p for p in profiles if len(p.buckets) == max(set(counts), key=counts.count)]
    first = profiles[0]
    med = lambda get: statistics.median(get(p) for p in profiles)  # noqa: E731
    buckets = [TracedBucket(med(lambda p: p.buckets[k].ready_s), b.nbytes,
                      med(lambda p: p.buckets[k].work_s))
               for k, b in enumerate(first.buckets)]
    return replace(first, steps=len(profiles), buckets=buckets,
                   forward_s=med(lambda p: p.forward_s), backward_s=med(lambda p: p.backward_s),
                   optimizer_s=med(lambda p: p.optimizer_s),
                   writeback_s=med(lambda p: p.writeback_s), moment_s=med(lambda p: p.moment_s),
                   averaging_bytes=max(p.averaging_bytes for p in profiles))


def profile_from_trace(path: str) -> Dict[str, TracedStep]:
    """{sync: the slowest rank's median step} from DIR/trace.json (or a trace file)."""
    events = _load_events(path)
    by_sync: Dict[str, Dict[int, List[TracedStep]]] = {}
    for step in (e for e in events if e["cat"] == "step"):
        mine = [e for e in events if e["pid"] == step["pid"]]
        profile = _one_step(mine, step)
        by_sync.setdefault(profile.sync, {}).setdefault(profile.rank, []).append(profile)
    result = {}
    for sync, ranks in by_sync.items():
        medians = [_median(steps) for steps in ranks.values()]
        pace = max(medians, key=lambda p: p.compute_s + p.moment_s + p.writeback_s)
        if not pace.averaging_bytes:  # no averaging traced: the parameters, as bucketed
            pace.averaging_bytes = sum(b.nbytes for b in pace.buckets)
        result[sync] = pace
    return result


def powersgd_bytes(model, rank: int = 2) -> Tuple[int, int, int]:
    """The bytes of our PowerSGD's three all-reduces for `model` at rank r, as
    collectives/sync/powersgd.py lays them out: the tensors it sends whole (vectors,
    and matrices n x m too small to gain: r(n + m) >= nm), then every P (n x r), then
    every Q (m x r). None depends on the number of ranks; the trace's own
    after_backward all-reduces should show the same three numbers for the traced
    model (trainer.bench.build_model(profile.model) builds it again)."""
    whole = ps = qs = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        size = p.element_size()
        n, m = (p.shape[0], p[0].numel()) if p.dim() >= 2 else (0, 0)
        if p.dim() < 2 or rank * (n + m) >= n * m:
            whole += p.numel() * size
        else:
            ps, qs = ps + n * rank * size, qs + m * rank * size
    return whole, ps, qs


# --- what a row counts -----------------------------------------------------------------

class Throughput(NamedTuple):
    """What the replay's throughput counts for one traced model."""
    key: str              # the row's key: "images_per_s" or "tokens_per_s"
    label: str            # the table's column: "img/s" or "tok/s"
    axis: str             # the plot's: "images/s" or "tokens/s"
    per_sample: int       # units in one sample: 1 image, or a window's context bytes
    default_batch: int    # samples per rank where neither trace nor flag says: bench's


IMAGES = Throughput("images_per_s", "img/s", "images/s", 1, 32)


def trainer_models() -> Tuple[List[str], Dict]:
    """(every --model name, the gpt-* sizes by name). Imported when first asked, not with
    this module: trainer.tasks brings torchvision, seconds to import, which a replay of
    a trace that names no model, or one that stops at a bad flag, does without."""
    from .tasks import MODELS
    from .tasks.gpt import SIZES
    return MODELS, SIZES


def throughput_of(model: str) -> Throughput:
    """A gpt-*'s tokens (bytes predicted; a window of its context per sample), or images
    for a ResNet and for a trace that names no model (trainer.bench traced only ResNets
    before it named them)."""
    if not model:
        return IMAGES
    _, gpt_sizes = trainer_models()
    if model in gpt_sizes:
        return Throughput("tokens_per_s", "tok/s", "tokens/s", gpt_sizes[model].context, 16)
    return IMAGES


def counted_in(rows: List[dict]) -> Throughput:
    """What the modelled rows count (one trace: one model)."""
    return throughput_of(next((r["model"] or "" for r in rows if r["modelled"]), ""))


# --- the strategies -------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    """How one sync communicates, in the simulator's terms."""
    family: str                 # what it computes (a torch peer and ours share one)
    algorithm: str = "auto"     # "auto": the model's fastest; or a name in COSTS
    buckets: bool = True        # gradient buckets reduced on the communication thread
    byte_factor: float = 1.0    # bytes on the wire per traced bucket byte (16-bit: 0.5)
    bucket_work: bool = True    # add the measured CPU work per bucket
    periodic: bool = False      # one averaging every --period steps on the training thread
    torch: bool = False         # torch's DDP (dashed in the plot)
    overlap_forward: bool = False  # the next forward under the last buckets (replay_forward.py)


STRATEGIES = {
    "allreduce": Strategy("allreduce"),
    "allreduce:overlap=forward": Strategy("allreduce", overlap_forward=True),
    "bf16": Strategy("bf16", byte_factor=0.5),
    "fp16": Strategy("fp16", byte_factor=0.5),
    "powersgd": Strategy("powersgd", buckets=False),
    "local-sgd": Strategy("local-sgd", buckets=False, periodic=True),
    "ddp": Strategy("allreduce", "native", torch=True),
    "ddp-collectives": Strategy("allreduce", "auto", torch=True),
    "ddp-bf16": Strategy("bf16", "native", byte_factor=0.5, torch=True),
    "ddp-fp16": Strategy("fp16", "native", byte_factor=0.5, torch=True),
    "ddp-localsgd": Strategy("local-sgd", "native", buckets=False, periodic=True, torch=True),
}
NOT_MODELLED = {
    "async-avg": "averages in background rounds that overlap later steps; one traced "
                 "step does not say how rounds and steps interleave",
    "delayed": "step t's all-reduce overlaps all of step t+1 on its own thread; one "
               "traced step does not say how they interleave",
    "gossip": "point-to-point exchanges with ring neighbours: no cost() in COSTS",
    "topk": "an all-gather whose summing grows with the ranks, measured at the traced "
            "rank count only",
    "ddp-powersgd": "torch compresses inside its comm hook: matrix work and P/Q bytes "
                    "are one span per bucket in the trace, not separable",
}


def auto_choice(nbytes: float, shape: Shape, c: Constants) -> str:
    """What our `auto` picks for this call on a cluster we do not have (no tuning table
    was measured there): the model's fastest (collectives/algorithms/auto.py)."""
    return fastest("all_reduce", nbytes, shape, c)


def _reduce(nbytes: float, algorithm: str, shape: Shape, c: Constants,
            used: List[str]) -> float:
    """Seconds for one all-reduce of `nbytes` (auto: what our auto picks)."""
    if algorithm == "auto":
        algorithm = auto_choice(nbytes, shape, c)
    if algorithm not in used:
        used.append(algorithm)
    return COSTS["all_reduce"][algorithm](nbytes, shape, c)


def _training_thread(profile: TracedStep, s: Strategy, shape: Shape, c: Constants,
                     used: List[str]) -> float:
    """Seconds of the collectives on the training thread (buffer broadcasts, PowerSGD's
    all-reduces), waited on in full."""
    seconds = 0.0
    for collective, algorithm, nbytes in profile.collectives:
        if collective == "all_reduce":
            seconds += _reduce(nbytes, s.algorithm, shape, c, used)
        elif algorithm in COSTS.get(collective, {}):
            seconds += COSTS[collective][algorithm](nbytes, shape, c)
    return seconds


def simulate(profile: TracedStep, shape: Shape, constants: Constants, scale: float = 1.0,
             period: int = 8, strategy: Optional[Strategy] = None) -> Result:
    """One step of `profile`'s sync on `shape`, compute divided by `scale`."""
    s = strategy or STRATEGIES[profile.sync]
    used: List[str] = []
    if s.overlap_forward:  # several steps, until the schedule repeats
        before = _training_thread(profile, s, shape, constants, [])  # on the comm thread here
        agreement = _reduce(8, "auto", shape, constants, [])  # auto's choice, 8 bytes
        costs: Dict[float, float] = {}  # chunks come in few sizes: price each once

        def reduce(nbytes: float) -> float:
            if nbytes not in costs:
                costs[nbytes] = _reduce(nbytes, s.algorithm, shape, constants, used)
            return costs[nbytes]
        step, waited = simulate_forward_overlap(
            profile, scale, chunk_bytes(shape, constants), reduce, agreement, before)
        return Result(step, waited, profile.compute_s / scale, tuple(used))
    forward, backward = profile.forward_s / scale, profile.backward_s / scale
    # the communication thread: buckets in order, each when ready and after the last
    comm_end = 0.0
    if s.buckets:
        for bucket in profile.buckets:
            start = max(forward + bucket.ready_s / scale, comm_end)
            work = bucket.work_s / scale if s.bucket_work else 0.0
            comm_end = start + work + _reduce(bucket.nbytes * s.byte_factor, s.algorithm,
                                              shape, constants, used)
    waited = max(0.0, comm_end - (forward + backward))
    waited += _training_thread(profile, s, shape, constants, used)
    if s.periodic:  # one averaging per period, spread over its steps
        waited += _reduce(profile.averaging_bytes, s.algorithm, shape, constants, used) / period
    step = (forward + backward + waited
            + (profile.writeback_s + profile.moment_s + profile.optimizer_s) / scale)
    return Result(step, waited, profile.compute_s / scale, tuple(used))


# --- the command ----------------------------------------------------------------------

NEEDS_ALLREDUCE = ("replayed from plain allreduce's buckets: trace --sync allreduce with it")


def profile_for(profiles: Dict[str, TracedStep], sync: str) -> Optional[TracedStep]:
    """The traced step a sync is replayed from: its own; overlap=forward's is plain
    allreduce's (the same buckets, launched at the same moments; its own trace has them
    in chunks, under the next step's forward), so a trace of allreduce alone answers
    for it too. None: not in the trace."""
    if STRATEGIES.get(sync, Strategy("")).overlap_forward:
        return profiles.get("allreduce")
    return profiles.get(sync)


def _ranks(text: str) -> List[int]:
    try:
        ranks = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --ranks {text!r}: e.g. 8,64,256")
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"bad --ranks {text!r}: rank counts are 1 or more")
    return ranks


def rows_for(profiles: Dict[str, TracedStep], syncs: List[str], ranks: List[int],
             per_host: int, constants: Constants, compute_scale: Optional[float] = None,
             step_time: Optional[float] = None, period: int = 8,
             batch: Optional[int] = None, model: Optional[str] = None) -> List[dict]:
    """One row per (modelled sync, rank count); a not-modelled sync gets one row with
    its reason and no numbers. Each row's throughput counts what its traced model
    trains on (`model`, where given, stands for the trace's)."""
    rows = []
    for sync in syncs:
        if sync not in STRATEGIES:
            rows.append(dict(sync=sync, modelled=False,
                             reason=NOT_MODELLED.get(sync, "no model for this strategy")))
            continue
        profile = profile_for(profiles, sync)
        if profile is None:
            rows.append(dict(sync=sync, modelled=False, reason=NEEDS_ALLREDUCE))
            continue
        scale = profile.compute_s / step_time if step_time else (compute_scale or 1.0)
        traced_model = model or profile.model
        counted = throughput_of(traced_model)
        samples = batch or profile.batch or counted.default_batch
        for n in ranks:
            shape = Shape(n // per_host, per_host)
            result = simulate(profile, shape, constants, scale, period, STRATEGIES[sync])
            rows.append(dict(
                sync=sync, modelled=True, ranks=n, hosts=shape.hosts, ranks_per_host=per_host,
                step_ms=result.step_s * 1e3, waited_ms=result.waited_s * 1e3,
                compute_ms=result.compute_s * 1e3, model=traced_model or None,
                batch_size=samples,
                **{counted.key: n * samples * counted.per_sample / result.step_s},
                efficiency=result.compute_s / result.step_s, compute_scale=scale,
                algorithms=list(result.algorithms)))
    return rows


def print_table(rows: List[dict], out=None) -> None:
    out = out or sys.stdout
    w = max([13] + [len(row["sync"]) for row in rows])  # the sync column fits every name
    counted = counted_in(rows)
    print(f"{'sync':>{w}} {'ranks':>6} {'hosts x ranks':>13} {'step ms':>9} {'waited ms':>9} "
          f"{counted.label:>9} {'efficiency':>10}  algorithms", file=out)
    for row in rows:
        if not row["modelled"]:
            print(f"{row['sync']:>{w}}  not modelled: {row['reason']}", file=out)
            continue
        layout = f"{row['hosts']} x {row['ranks_per_host']}"
        print(f"{row['sync']:>{w}} {row['ranks']:>6} {layout:>13} {row['step_ms']:>9.1f} "
              f"{row['waited_ms']:>9.1f} {row[counted.key]:>9.1f} "
              f"{row['efficiency']:>10.0%}  {','.join(row['algorithms']) or '-'}", file=out)


def plot(rows: List[dict], path: str, title: str) -> None:
    """Images/s (or a gpt-*'s tokens/s) against ranks (log x): ours solid, torch's
    dashed, a pair alike in colour; overlap=forward dotted, in plain allreduce's colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    families = list(dict.fromkeys(STRATEGIES[r["sync"]].family for r in rows if r["modelled"]))
    colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    counted = counted_in(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sync in dict.fromkeys(r["sync"] for r in rows if r["modelled"]):
        mine = [r for r in rows if r["modelled"] and r["sync"] == sync]
        s = STRATEGIES[sync]
        style = "--" if s.torch else ":" if s.overlap_forward else "-"
        ax.plot([r["ranks"] for r in mine], [r[counted.key] for r in mine], marker="o",
                linestyle=style, color=colours[s.family], label=sync)
    ax.set_xscale("log")
    ax.set_yscale("log")  # linear scaling is then a straight line
    ax.set_xlabel("ranks")
    ax.set_ylabel(f"{counted.axis} (modelled)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.replay",
                                description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:3]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, metavar="DIR", help="a trainer.bench --trace DIR")
    p.add_argument("--constants", required=True, metavar="FILE.json",
                   help="the cost model's constants (collectives.cost_model calibrate --out)")
    p.add_argument("--ranks", type=_ranks, default=[8, 64, 256, 1024],
                   help="comma list of rank counts (default 8,64,256,1024)")
    p.add_argument("--ranks-per-host", type=int, default=8, help="default 8")
    p.add_argument("--bandwidth", type=parse_rate, help="each host's link, e.g. 25gbit")
    p.add_argument("--latency", type=parse_latency, help="added per message, e.g. 10us")
    p.add_argument("--emulated", action="store_true",
                   help="hosts as collectives.cluster makes them here (tbf's bucket on each "
                        "link, every rank sharing this machine's cores), to compare with "
                        "trainer.bench there; default: real hosts")
    p.add_argument("--sync", type=lambda s: s.split(","),
                   help="comma list of the trace's syncs (default: all it holds)")
    scaling = p.add_mutually_exclusive_group()
    scaling.add_argument("--compute-scale", type=float, metavar="X",
                         help="divide every compute time by X (a faster device)")
    scaling.add_argument("--step-time", type=float, metavar="SECONDS",
                         help="pick X so that forward + backward + optimizer take this long")
    p.add_argument("--period", type=int, default=8,
                   help="local SGD's averaging period H (default 8, as the strategies')")
    p.add_argument("--model", metavar="MODEL",
                   help="the traced model, as trainer.bench's --model names it, for a "
                        "trace that does not (the trainer's own --trace): what throughput "
                        "counts, a ResNet's images or a gpt-*'s tokens (default: the "
                        "trace's, else images)")
    p.add_argument("--batch-size", type=int,
                   help="samples per rank: images, or a gpt-*'s windows (default: from the "
                        "trace, else trainer.bench's: 32 images, 16 windows)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the throughput (images/s or tokens/s) against ranks")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per row")
    args = p.parse_args(argv)

    if args.ranks_per_host < 1:
        p.error("--ranks-per-host must be at least 1")
    bad = [n for n in args.ranks if n % args.ranks_per_host]
    if bad:
        p.error(f"--ranks {','.join(map(str, bad))}: not a multiple of --ranks-per-host "
                f"{args.ranks_per_host} (hosts are filled whole)")
    if args.model and args.model not in trainer_models()[0]:
        p.error(f"--model {args.model}: not a model of the trainer (choose from "
                f"{', '.join(trainer_models()[0])})")
    for name, value in (("--compute-scale", args.compute_scale), ("--step-time", args.step_time),
                        ("--period", args.period), ("--batch-size", args.batch_size)):
        if value is not None and value <= 0:
            p.error(f"{name} must be positive")
    try:
        profiles = profile_from_trace(args.trace)
    except (OSError, ValueError, KeyError, IndexError) as error:
        p.error(f"--trace {args.trace}: {error}")
    if not profiles:
        p.error(f"--trace {args.trace}: no traced steps in it")
    syncs = args.sync or list(profiles)
    missing = [s for s in syncs if s not in profiles and profile_for(profiles, s) is None]
    if missing:
        p.error(f"sync {', '.join(missing)} not in the trace: it holds {', '.join(profiles)}")
    try:
        constants = load(args.constants)
    except (OSError, ValueError, KeyError, TypeError) as error:
        p.error(f"--constants {args.constants}: {error}")
    constants = on_cluster(constants, args.bandwidth or 0.0, args.latency or 0.0,
                           args.emulated)
    traced = [profile_for(profiles, s) for s in syncs]  # None: a row not modelled
    named = sorted({step.model for step in traced if step is not None and step.model})
    if len(named) > 1:
        p.error(f"--trace {args.trace}: steps of several models ({', '.join(named)})")
    if args.model and named and named != [args.model]:
        p.error(f"--model {args.model}: the trace is of {named[0]}")
    model = args.model or (named[0] if named else None)
    counted = throughput_of(model or "")
    batch = args.batch_size or (None if all(step is None or step.batch for step in traced)
                                else counted.default_batch)

    rows = rows_for(profiles, syncs, args.ranks, args.ranks_per_host, constants,
                    args.compute_scale, args.step_time, args.period, batch, model)
    link = f"{args.bandwidth * 8 / 1e9:g} Gbit/s links" if args.bandwidth else "the measured links"
    if args.latency:
        link += f" (+{args.latency * 1e6:g} us)"
    scaling = (f"compute scaled to {args.step_time:g} s a step" if args.step_time
               else f"compute scale {args.compute_scale or 1.0:g}")
    print(f"# trainer.replay: {args.trace} ({model or 'a model not named'}), "
          f"{args.ranks_per_host} ranks per host, {link}, {scaling}, local SGD period "
          f"{args.period}")
    if model is None:
        print("# the trace does not name its model: images assumed (--model)")
    if batch and not args.batch_size:
        samples = ("images" if counted.per_sample == 1
                   else f"windows of {counted.per_sample} bytes")
        print(f"# the trace does not say the batch: {batch} {samples} per rank assumed "
              "(--batch-size)")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    if args.plot:
        plot(rows, args.plot, f"{args.trace}: modelled, {args.ranks_per_host} ranks/host, {link}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
