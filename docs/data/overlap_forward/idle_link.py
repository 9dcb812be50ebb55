"""Where a traced overlap=forward step leaves the link idle: for each rank, each step
that has a step before and after it in its round (the steady ones: not the round's
first, whose forward waits for nothing, nor its last, which drains; the traced steps
should be one round: trainer.bench --trace-steps at most --steps), the time the
communication thread spent reducing chunks and the gaps between them, long ones
(waiting for gradients that backward has not made yet) apart from short ones (the
agreement before each chunk, the hand-over between chunks).
    python docs/data/overlap_forward/idle_link.py TRACE_DIR [SYNC]"""
import json
import sys

LONG_MS = 50.0  # a gap this long waits for gradients; shorter ones are agreements


def spans(events, pid, pick):
    return sorted((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events
                  if e.get("ph") == "X" and e.get("pid") == pid and pick(e))


def main(path, sync="allreduce:overlap=forward"):
    with open(f"{path}/trace.json") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    print(f"{'rank':>4} {'step ms':>8} {'chunks ms':>9} {'idle ms':>8} "
          f"{'long gaps':>10} {'short gaps':>10} {'n short':>7}")
    for pid in pids:
        steps = spans(events, pid, lambda e: e.get("cat") == "step"
                      and e.get("args", {}).get("sync") == sync)
        chunks = spans(events, pid, lambda e: e.get("cat") == "comm"
                       and e["name"].startswith("bucket "))
        for lo, hi in steps[1:-1]:
            inside = [(max(a, lo), min(b, hi)) for a, b in chunks if b > lo and a < hi]
            edges = [lo] + [x for span in inside for x in span] + [hi]
            gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges), 2)]
            long = sum(g for g in gaps if g >= LONG_MS)
            short = [g for g in gaps if 0 < g < LONG_MS]
            busy = sum(b - a for a, b in inside)
            print(f"{pid:>4} {hi - lo:>8.0f} {busy:>9.0f} {hi - lo - busy:>8.0f} "
                  f"{long:>10.0f} {sum(short):>10.0f} {len(short):>7}")


if __name__ == "__main__":
    main(*sys.argv[1:])
