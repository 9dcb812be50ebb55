"""trainer.replay against trainer.bench: every traced run of runs.sh, step by step.

    python docs/data/model/check_steps.py [CONSTANTS.json]

For each steps_<H>x<L>_<link> run, the trace is replayed on the same shape and link as
the emulated cluster made it (`--emulated`: tbf's bucket, the shared cores) and the
predicted step beside the step trainer.bench measured. Writes check_steps.jsonl.
"""
import glob
import json
import os
import re
import sys

from collectives.cost_model import load, on_cluster
from collectives.cost_model.units import parse_rate
from trainer.replay import profile_from_trace, rows_for

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    constants = load(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "constants.json"))
    out = []
    print(f"{'run':>18} {'sync':>13} {'measured ms':>12} {'model ms':>9} {'error':>7}")
    for bench in sorted(glob.glob(os.path.join(HERE, "steps_*.jsonl"))):
        name = os.path.basename(bench)[:-len(".jsonl")]
        hosts, per_host, link = re.fullmatch(r"steps_(\d+)x(\d+)_(\w+)", name).groups()
        hosts, per_host = int(hosts), int(per_host)
        profiles = profile_from_trace(bench[:-len(".jsonl")] + ".trace")
        c = on_cluster(constants, parse_rate(link), emulated=True)
        for row in map(json.loads, open(bench)):
            if row["sync"] not in profiles:
                continue
            predicted = rows_for(profiles, [row["sync"]], [hosts * per_host], per_host, c)[0]
            if not predicted["modelled"]:
                continue
            error = (predicted["step_ms"] - row["step_ms"]) / row["step_ms"]
            out.append(dict(run=name, sync=row["sync"], measured_ms=row["step_ms"],
                            model_ms=predicted["step_ms"], error=error,
                            measured_waited_ms=row["waited_ms"],
                            model_waited_ms=predicted["waited_ms"]))
            print(f"{name:>18} {row['sync']:>13} {row['step_ms']:12.0f} "
                  f"{predicted['step_ms']:9.0f} {error:+7.1%}")
    worst = max(abs(r["error"]) for r in out)
    print(f"# {len(out)} steps: largest |error| {worst:.1%}")
    with open(os.path.join(HERE, "check_steps.jsonl"), "w") as rows:
        for row in out:
            rows.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
