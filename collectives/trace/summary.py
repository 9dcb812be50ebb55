"""Reading a merged trace: per step, how long each rank computed, communicated and waited.

Definitions, per rank and traced step (a "step" span, from the first forward to the
end of the strategy's after_step; in trainer.bench a round's last step runs on to the
end of its drain, the wait for what it left in the background):

    waited          the "wait" spans inside the step: the training thread could not go
                    on until communication finished
    computing       the step minus waited
    communicating   the union of the "comm" spans (buckets, collectives) inside the step
                    on threads other than the training thread
    hidden          the share of communicating that did not cost the training thread
                    any time: 1 - waited / communicating, clipped at 0 (what
                    trainer.bench reports as hidden_share, from the same measurements)

The slowest rank is the one that computed longest per step (the others wait for it);
"waited longest on" is the bucket that was last to finish during the training
thread's waits, summed over the steps.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

Interval = Tuple[float, float]


def load(path: str) -> List[Dict]:
    """The complete ("X") events of a trace file, or of DIR/trace.json."""
    if os.path.isdir(path):
        path = os.path.join(path, "trace.json")
    with open(path) as source:
        return [e for e in json.load(source)["traceEvents"] if e.get("ph") == "X"]


def union(intervals: List[Interval]) -> List[Interval]:
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: List[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def clip(intervals: List[Interval], lo: float, hi: float) -> List[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


@dataclass
class RankFigures:
    """Per-step means for one rank, in milliseconds."""
    steps: int = 0
    step_ms: float = 0.0
    computing_ms: float = 0.0
    communicating_ms: float = 0.0
    waited_ms: float = 0.0
    waited_on: Dict[str, float] = field(default_factory=dict)  # bucket -> ms in all steps

    @property
    def hidden_share(self):
        """None when the steps hardly communicate (under 1 ms per step)."""
        if self.communicating_ms < 1:
            return None
        return max(0.0, 1 - self.waited_ms / self.communicating_ms)

    @property
    def waited_longest_on(self):
        if not self.waited_on:
            return None
        name = max(self.waited_on, key=self.waited_on.get)
        return name, self.waited_on[name] / max(self.steps, 1)


def figures(events: List[Dict]) -> Dict[str, Dict[int, RankFigures]]:
    """{sync name: {rank: RankFigures}} from a merged trace's events."""
    by_rank: Dict[int, List[Dict]] = defaultdict(list)
    for event in events:
        by_rank[event["pid"]].append(event)
    result: Dict[str, Dict[int, RankFigures]] = defaultdict(dict)
    for rank, mine in sorted(by_rank.items()):
        training = {e["tid"] for e in mine if e["cat"] == "step"}
        # Only communication on other threads can be hidden. Waiting is what the wait
        # spans say (as trainer.bench counts it); a collective that blocks the training
        # thread outside them (DDP's small buffer broadcast in forward) is left out of both.
        waits = [e for e in mine if e["cat"] == "wait"]
        comm = union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                      if e["cat"] == "comm" and e["tid"] not in training])
        buckets = [e for e in mine if e["cat"] == "comm" and e["name"].startswith("bucket")]
        for step in (e for e in mine if e["cat"] == "step"):
            lo, hi = step["ts"], step["ts"] + step["dur"]
            sync = step["args"].get("sync", "")
            row = result[sync].setdefault(rank, RankFigures())
            inside = [w for w in waits if lo <= w["ts"] < hi]
            waited = union([(w["ts"], w["ts"] + w["dur"]) for w in inside])
            communicating = clip(comm, lo, hi)
            row.steps += 1
            row.step_ms += (hi - lo) / 1e3
            row.waited_ms += length(waited) / 1e3
            row.computing_ms += (hi - lo - length(waited)) / 1e3
            row.communicating_ms += length(communicating) / 1e3
            for wait in inside:  # which bucket finished last while we waited
                end = wait["ts"] + wait["dur"]
                finishing = [b for b in buckets if wait["ts"] <= b["ts"] + b["dur"] <= end + 1]
                if finishing:
                    last = max(finishing, key=lambda b: b["ts"] + b["dur"])
                    row.waited_on[last["name"]] = (row.waited_on.get(last["name"], 0.0)
                                                   + wait["dur"] / 1e3)
    for ranks in result.values():
        for row in ranks.values():
            for name in ("step_ms", "computing_ms", "communicating_ms", "waited_ms"):
                setattr(row, name, getattr(row, name) / max(row.steps, 1))
    return dict(result)


def report(result: Dict[str, Dict[int, RankFigures]]) -> str:
    """The summary as text: per sync, one line per rank, the slowest rank."""
    lines = []
    for sync, ranks in result.items():
        steps = max(row.steps for row in ranks.values())
        lines.append(f"{sync or 'steps'}: {steps} traced step(s), {len(ranks)} rank(s); "
                     "per step, in ms")
        lines.append(f"{'rank':>4} {'step':>8} {'computing':>10} {'communicating':>13} "
                     f"{'waited':>8} {'hidden':>7}  waited longest on")
        for rank, row in sorted(ranks.items()):
            hidden = "-" if row.hidden_share is None else f"{row.hidden_share:.0%}"
            longest = row.waited_longest_on
            longest = "-" if longest is None else f"{longest[0]} ({longest[1]:.0f} ms)"
            lines.append(f"{rank:>4} {row.step_ms:>8.0f} {row.computing_ms:>10.0f} "
                         f"{row.communicating_ms:>13.0f} {row.waited_ms:>8.0f} {hidden:>7}  "
                         f"{longest}")
        slowest = max(ranks, key=lambda r: ranks[r].computing_ms)
        lines.append(f"slowest rank: {slowest} (computing {ranks[slowest].computing_ms:.0f} ms "
                     "per step; the others wait for it)")
        lines.append("")
    return "\n".join(lines)
