"""The table of docs/strategies.md's overlap=forward section, from run.sh's rows: per
rate, each run's images/s of overlap=forward over ddp's and over allreduce's, their
medians, and each variant's median waited ms and share of communication hidden.
    python summary.py [DIR]       (DIR: where run.sh wrote, by default this folder)"""
import glob
import json
import os
import statistics
import sys

HERE = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))


def rows(path):
    with open(path) as lines:
        return {row["sync"]: row for row in map(json.loads, lines)}


for rate in ("100mbit", "1gbit"):
    runs = [rows(path) for path in sorted(glob.glob(os.path.join(HERE, f"{rate}_*.jsonl")))]
    if not runs:
        continue
    ahead = "allreduce:overlap=forward"
    over_ddp = [run[ahead]["images_per_s"] / run["ddp"]["images_per_s"] for run in runs]
    over_plain = [run[ahead]["images_per_s"] / run["allreduce"]["images_per_s"] for run in runs]
    print(f"{rate}: overlap=forward / ddp {', '.join(f'{r:.3f}' for r in over_ddp)} "
          f"(median {statistics.median(over_ddp):.3f}); / allreduce "
          f"{', '.join(f'{r:.3f}' for r in over_plain)} "
          f"(median {statistics.median(over_plain):.3f})")
    for sync in ("allreduce", ahead, "ddp"):
        pick = lambda key: statistics.median(run[sync][key] for run in runs)
        hidden = statistics.median(run[sync]["hidden_share"] for run in runs)
        print(f"    {sync:26} images/s {pick('images_per_s'):6.1f}  step ms "
              f"{pick('step_ms'):6.0f}  compute ms {pick('compute_ms'):6.0f}  waited ms "
              f"{pick('waited_ms'):6.0f}  comm ms {pick('comm_ms'):6.0f}  hidden {hidden:.0%}"
              f"  MB/step {pick('mb_per_step'):.2f}")
