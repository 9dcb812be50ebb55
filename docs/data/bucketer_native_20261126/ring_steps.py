"""How long each ring step of each bucket took, per rank, from a trainer.bench trace
taken with `--trace DIR --trace-level 2`:

    python docs/data/bucketer_native_20261126/ring_steps.py DIR/trace.json
"""
import collections
import json
import sys


def main(path):
    with open(path) as file:
        loaded = json.load(file)
    events = loaded["traceEvents"] if isinstance(loaded, dict) else loaded
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("comm", "comm.step")]
    by_rank = collections.defaultdict(list)
    for span in spans:
        by_rank[span["pid"]].append(span)
    print("rank  bucket  bytes      ms    ring steps, ms: reduce-scatter 0 1 2, all-gather 0 1 2")
    for rank, rank_spans in sorted(by_rank.items()):
        rank_spans.sort(key=lambda e: e["ts"])
        buckets = sorted({e["name"] for e in rank_spans if e["name"].startswith("bucket ")})
        for name in buckets:
            for bucket in (e for e in rank_spans if e["name"] == name):
                end = bucket["ts"] + bucket["dur"]
                steps = [e for e in rank_spans
                         if e["cat"] == "comm.step" and bucket["ts"] <= e["ts"] <= end]
                print(f"{rank:4}  {name[7:]:6}  {bucket['args'].get('bytes', ''):9}  "
                      f"{bucket['dur'] / 1e3:6.0f}   "
                      + " ".join(f"{step['dur'] / 1e3:4.0f}" for step in steps))


if __name__ == "__main__":
    main(sys.argv[1])
