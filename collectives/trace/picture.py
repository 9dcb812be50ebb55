"""The timeline as a picture: per rank, what the training thread and the communication
threads did over the traced steps.

One panel per sync (a trainer.bench trace holds several). In each, every rank has a
lane per thread: the training thread's forward, backward and optimizer in shades of
green with its waits in red over them; each communication thread's spans in blue
(buckets, collectives). Time starts at the panel's first step.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

COLOURS = {"forward": "#74c476", "backward": "#31a354", "optimizer": "#006d2c",
           "wait": "#de2d26", "comm": "#3182bd"}


def _colour(event: Dict) -> str:
    if event["cat"] == "wait":
        return COLOURS["wait"]
    if event["cat"] == "comm":
        return COLOURS["comm"]
    return COLOURS.get(event["name"], "#a1d99b")


def draw(events: List[Dict], path: str, max_steps: int = 4) -> str:
    """Write the PNG to `path` (the first `max_steps` traced steps of each sync)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels: Dict[str, List[Dict]] = defaultdict(list)  # sync -> its step spans
    for event in events:
        if event["cat"] == "step":
            panels[event["args"].get("sync", "")].append(event)
    if not panels:
        raise ValueError("the trace holds no steps: was it made with --trace?")
    figure, axes = plt.subplots(len(panels), 1, squeeze=False,
                                figsize=(12, 1.2 + 1.6 * len(panels) * len(
                                    {e["pid"] for e in events}) / 2))
    for axis, (sync, steps) in zip(axes[:, 0], panels.items()):
        first_ranks = defaultdict(list)
        for step in sorted(steps, key=lambda e: e["ts"]):
            first_ranks[step["pid"]].append(step)
        window = {rank: (mine[0]["ts"], mine[:max_steps][-1]["ts"] + mine[:max_steps][-1]["dur"])
                  for rank, mine in first_ranks.items()}
        origin = min(lo for lo, _ in window.values())
        labels, lane = [], 0
        for rank in sorted(window):
            lo, hi = window[rank]
            mine = [e for e in events if e["pid"] == rank and lo <= e["ts"] < hi
                    and e["cat"] in ("compute", "wait", "comm")]
            threads = sorted({e["tid"] for e in mine},
                             key=lambda t: 0 if any(e["tid"] == t and e["cat"] == "compute"
                                                    for e in mine) else 1)
            for thread in threads:
                on_thread = [e for e in mine if e["tid"] == thread]
                trainer = any(e["cat"] == "compute" for e in on_thread)
                # compute first, waits drawn over it; nested comm spans share the lane
                for event in sorted(on_thread, key=lambda e: e["cat"] == "wait"):
                    axis.broken_barh([((event["ts"] - origin) / 1e3, event["dur"] / 1e3)],
                                     (lane - 0.4, 0.8), facecolors=_colour(event),
                                     edgecolor="none")
                labels.append(f"rank {rank} {'train' if trainer else 'comm'}")
                lane += 1
        for step in steps:  # step boundaries
            axis.axvline((step["ts"] - origin) / 1e3, color="grey", linewidth=0.5, alpha=0.5)
        axis.set_yticks(range(lane))
        axis.set_yticklabels(labels, fontsize=8)
        axis.invert_yaxis()
        axis.set_title(sync or "steps", fontsize=10, loc="left")
        axis.set_xlim(0, max(hi for _, hi in window.values()) / 1e3 - origin / 1e3)
    axes[-1, 0].set_xlabel("ms since the first traced step")
    figure.legend(handles=[Patch(color=c, label=n) for n, c in COLOURS.items()],
                  loc="upper right", ncol=5, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(path, dpi=110)
    return path
