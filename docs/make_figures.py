"""Draw every figure of docs/ again from the measurements saved in docs/data/.

    python docs/make_figures.py
    python docs/make_figures.py compare.png compare_1gbit.png   (only these)

Each figure is drawn by the tool that made it in the first place, from the rows that
tool saved: `collectives.bench --json` rows through `collectives.bench.plot`, and
`trainer.compare`'s per-job records through `trainer.compare.summarize` and
`trainer.compare.plot`, a `--trace` run's merged trace.json through
`collectives.trace.picture.draw`. A figure whose measurements were not saved, or that
was measured before a fix that changes it, cannot be made from data: for each of those
this prints the command that measures it again instead. Nothing is measured here.

After measuring a figure again, drop its `stale` note below.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, Dict, List, NamedTuple

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DOCS))  # the project's own tools, run from anywhere

DATA = os.path.join(DOCS, "data")
FIGURES = os.path.join(DOCS, "figures")

CLUSTER_100MBIT = "python -m collectives.cluster --hosts 4 --bandwidth 100mbit --"
COMPARE_SYNCS = ("ddp,allreduce,ddp-bf16,bf16,ddp-fp16,fp16,ddp-powersgd,powersgd,"
                 "ddp-localsgd,local-sgd,ddp-hier-localsgd,hier-local-sgd,torchft-diloco,"
                 "diloco,diloco:fragments=4:delay=1,topk,async-avg,delayed,gossip")


class Figure(NamedTuple):
    picture: str                    # file in docs/figures/
    data: str                       # file in docs/data/ it is drawn from
    draw: Callable[[str, str], None]  # draw(data_path, picture_path)
    measure: str                    # the command that writes `data` again
    stale: str = ""                 # why the saved measurement no longer stands, if so


def read_rows(path: str) -> List[Dict]:
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def draw_bench(data: str, picture: str) -> None:
    """busbw against size, one line per algorithm: `collectives.bench --plot`."""
    from collectives import bench
    bench.plot(read_rows(data), picture)


def draw_compare(data: str, picture: str, target: float = 0.95) -> None:
    """Test accuracy against training time and bytes: what `trainer.compare` draws."""
    from trainer import compare
    compare.plot([compare.summarize(job, target) for job in read_rows(data)], picture, target)


def with_reruns(jobs: List[Dict], reruns: List[str]) -> List[Dict]:
    """`jobs`, each in its place replaced by the job of the same sync in a rerun's
    records (files in docs/data/: jobs run again on their own, after a fix)."""
    again = {job["sync"]: job for path in reruns for job in read_rows(os.path.join(DATA, path))}
    return [again.get(job["sync"], job) for job in jobs]


def draw_compare_against(data: str, picture: str, baseline: str, reruns=()) -> None:
    """As draw_compare, the dotted line at the final score of the job `baseline` (what
    `trainer.compare --baseline` measures every row against)."""
    from trainer import compare
    rows = [compare.summarize(job, 0.0) for job in with_reruns(read_rows(data), list(reruns))]
    final = compare.against_baseline(rows, baseline)["final"]
    compare.plot(rows, picture, final)


def draw_with_runs(data: str, picture: str, runs, wanted=None) -> None:
    """The jobs of `data` (those whose sync is in `wanted`, if given) and of the runs
    made beside it on the same cluster (files in docs/data/study_lm_20261129/, without
    .jsonl): one picture, the dotted line at DDP's final score."""
    from trainer import compare
    jobs = [job for job in read_rows(data) if wanted is None or job["sync"] in wanted]
    for run in runs:
        jobs += read_rows(os.path.join(DATA, "study_lm_20261129", run + ".jsonl"))
    rows = [compare.summarize(job, 0.0) for job in jobs]
    compare.plot(rows, picture, compare.against_baseline(rows, "ddp")["final"])


def draw_lowcomm(data: str, picture: str) -> None:
    """DDP's and DiLoCo's jobs of the language model's study (`data`), and the newest
    methods' jobs, run beside them (LOWCOMM_RUNS: one run per optimizer, and MuLoCo
    uncompressed on its own): one picture."""
    draw_with_runs(data, picture, LOWCOMM_RUNS, wanted=("ddp", "diloco:period=30"))


def draw_time_to_ddp(data: str, picture: str) -> None:
    """DDP's 400 steps (`data`), and DiLoCo given up to 1000 steps, stopped at DDP's
    final score (TIME_TO_DDP_RUNS): how soon each gets there."""
    draw_with_runs(data, picture, TIME_TO_DDP_RUNS)


LOWCOMM_RUNS = ("lowcomm_adamw", "lowcomm_sign", "lowcomm_muon", "lowcomm_muon_none")
TIME_TO_DDP_RUNS = ("time_to_ddp_diloco1000", "time_to_ddp_diloco1000_m05")


def draw_timeline(data: str, picture_path: str) -> None:
    """Per rank and thread, what each sync did: `python -m collectives.trace DIR`."""
    from collectives.trace import picture, summary
    picture.draw(summary.load(data), picture_path)


def bench_command(nproc: int, backend: str, shm: str, data: str) -> str:
    flags = f"--nproc {nproc}" + (f" --backend {backend}" if backend != "gloo" else "")
    flags += " --shm off" if shm == "off" else ""
    return (f"python -m collectives.bench {flags} --sizes 1K,16K,64K,256K,1M,4M,16M,64M "
            f"--trials 3 --seconds-per-row 0.6 --json docs/data/{data}")


LM_SYNCS = ("ddp,allreduce,ddp-bf16,bf16,ddp-fp16,fp16,ddp-powersgd,powersgd,ddp-localsgd,"
            "local-sgd,torchft-diloco:period=30,diloco:period=30,"
            "diloco:period=30:fragments=3:delay=1,diloco:period=10,diloco:period=100,topk,"
            "async-avg,delayed,gossip")


FIGURES_OF_THE_DOCS = [
    Figure("bench_gloo_shm_2.png", "bench_gloo_shm_2.jsonl", draw_bench,
           bench_command(2, "gloo", "on", "bench_gloo_shm_2.jsonl")),
    Figure("bench_gloo_shm_4.png", "bench_gloo_shm_4.jsonl", draw_bench,
           bench_command(4, "gloo", "on", "bench_gloo_shm_4.jsonl")),
    Figure("bench_mpi_shm_4.png", "bench_mpi_shm_4.jsonl", draw_bench,
           bench_command(4, "mpi", "on", "bench_mpi_shm_4.jsonl")),
    Figure("bench_gloo_2.png", "gloo2.jsonl", draw_bench,
           bench_command(2, "gloo", "off", "gloo2.jsonl")),
    Figure("bench_gloo_4.png", "gloo4.jsonl", draw_bench,
           bench_command(4, "gloo", "off", "gloo4.jsonl")),
    Figure("bench_mpi_4.png", "mpi4.jsonl", draw_bench,
           bench_command(4, "mpi", "off", "mpi4.jsonl")),
    Figure("compare_1gbit.png", "compare_1gbit.jsonl", draw_compare,
           "python -m trainer.compare --hosts 4 --bandwidth 1gbit --dataset mnist "
           "--data-dir ../shared/data --epochs 3 --stop-at 0.95 --out docs/data/compare_1gbit "
           "--sync ddp,allreduce,ddp-bf16,bf16,powersgd,local-sgd,topk,async-avg"),
    Figure("compare.png", "compare_20261126/compare_100mbit.jsonl", draw_compare,
           "python -m trainer.compare --hosts 4 --bandwidth 100mbit --dataset mnist "
           "--data-dir ../shared/data --epochs 3 --stop-at 0.95 "
           f"--out docs/data/compare_20261126/compare_100mbit --sync {COMPARE_SYNCS}"),
    Figure("compare_diloco.png", "study_20261125/diloco.jsonl", draw_compare,
           "python -m trainer.compare --hosts 4 --bandwidth 100mbit --dataset mnist "
           "--data-dir ../shared/data --epochs 3 --stop-at 0.95 --out diloco "
           "--sync local-sgd:period=8,diloco:period=8,torchft-diloco:period=8,"
           "diloco:period=8:fragments=4:delay=1,"
           "diloco:period=8:outer_lr=1.0:outer_momentum=0.5,"
           "diloco:period=8:outer_lr=1.0:outer_momentum=0.3 "
           "&& cp diloco.jsonl docs/data/study_20261125/"),
    Figure("compare_straggler.png", "study_20261125/straggler.jsonl", draw_compare,
           "python -m trainer.compare --hosts 4 --bandwidth 100mbit --cpu-share node3=0.5 "
           "--dataset mnist --data-dir ../shared/data --epochs 3 --stop-at 0.95 "
           "--out straggler --sync ddp,allreduce,ddp-bf16,bf16,ddp-fp16,fp16,powersgd,"
           "ddp-localsgd:period=8,local-sgd:period=8,diloco:period=8,"
           "torchft-diloco:period=8,topk,async-avg,delayed,gossip "
           "(made in three sittings: docs/compare.md)"),
    Figure("compare_lm_50mbit.png", "study_lm_20261129/compare_50mbit.jsonl",
           lambda data, picture: draw_compare_against(
               data, picture, "ddp", ["study_lm_20261129/compare_50mbit_ddp_powersgd.jsonl"]),
           "python -m trainer.compare --hosts 4 --bandwidth 50mbit --model gpt-tiny "
           "--steps 400 --eval-every 50 --baseline ddp "
           f"--out docs/data/study_lm_20261129/compare_50mbit --sync {LM_SYNCS} "
           "(ddp-powersgd, which failed in it, again on its own after its fix: "
           "--sync ddp-powersgd --out docs/data/study_lm_20261129/compare_50mbit_ddp_powersgd)"),
    Figure("compare_lm_lowcomm.png", "study_lm_20261129/compare_50mbit.jsonl", draw_lowcomm,
           "the language model's study (above), then, on the same cluster: "
           "python -m trainer.compare --hosts 4 --bandwidth 50mbit --model gpt-tiny "
           "--steps 400 --eval-every 50 --out docs/data/study_lm_20261129/RUN ..., RUN one of "
           f"{', '.join(LOWCOMM_RUNS)} (their commands: docs/compare.md)"),
    Figure("compare_lm_time_to_ddp.png", "study_lm_20261129/time_to_ddp_ddp400.jsonl",
           draw_time_to_ddp,
           "python -m trainer.compare --hosts 4 --bandwidth 50mbit --model gpt-tiny "
           "--steps 400 --eval-every 50 --out docs/data/study_lm_20261129/time_to_ddp_ddp400 "
           "--sync ddp, then, on the same cluster, --steps 1000 --stop-at 2.747 --target "
           "2.747 --out docs/data/study_lm_20261129/RUN ..., RUN one of "
           f"{', '.join(TIME_TO_DDP_RUNS)} (their commands: docs/compare.md)"),
    Figure("timeline.png", "timeline_trace.json", draw_timeline,
           f"{CLUSTER_100MBIT} python -m trainer.bench --sync ddp,allreduce,powersgd "
           "--steps 3 --rounds 1 --warmup 2 --trace run && "
           "cp run/trace.json docs/data/timeline_trace.json"),
]


def main(argv=None) -> int:
    """Draw the figures named in ARGV (files in docs/figures/), or all of them."""
    names = sys.argv[1:] if argv is None else argv
    known = [figure.picture for figure in FIGURES_OF_THE_DOCS]
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"no figure {', '.join(unknown)}: choose from {', '.join(known)}", file=sys.stderr)
        return 2
    os.makedirs(FIGURES, exist_ok=True)
    to_measure = []
    for figure in FIGURES_OF_THE_DOCS:
        if names and figure.picture not in names:
            continue
        data = os.path.join(DATA, figure.data)
        if not os.path.exists(data):
            why = f"no saved measurements (docs/data/{figure.data})"
            to_measure.append((figure, why + (f"; the figure shown {figure.stale}"
                                              if figure.stale else "")))
            continue
        figure.draw(data, os.path.join(FIGURES, figure.picture))
        print(f"drew docs/figures/{figure.picture} from docs/data/{figure.data}")
        if figure.stale:
            to_measure.append((figure, f"drawn, but {figure.stale}"))
    if to_measure:
        print("\nto be measured again (each command writes the data; then run this again):")
        for figure, why in to_measure:
            print(f"\ndocs/figures/{figure.picture}: {why}\n    {figure.measure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
