"""python -m collectives.trace DIR: draw a traced run and print where its time went.

    python -m trainer --trace run1                     (or trainer.bench / collectives.bench)
    python -m collectives.trace run1                   writes run1/timeline.png, prints:

    allreduce: 3 traced step(s), 2 rank(s); per step, in ms
    rank     step  computing  communicating   waited  hidden  waited longest on
       0     1210       1105            410      105     74%  bucket 0 (98 ms)
    ...

DIR/trace.json opens in https://ui.perfetto.dev (one process row per rank).
"""
from __future__ import annotations

import argparse
import os
import sys

from . import picture, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives.trace",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", metavar="DIR", help="what --trace DIR wrote")
    parser.add_argument("--png", help="where to write the picture (default DIR/timeline.png)")
    parser.add_argument("--steps", type=int, default=4, help="steps drawn per sync (default 4)")
    args = parser.parse_args(argv)
    path = os.path.join(args.folder, "trace.json")
    if not os.path.isfile(path):
        parser.error(f"{path}: no such file (run with --trace {args.folder} first)")
    events = summary.load(path)
    print(summary.report(summary.figures(events)))
    try:
        png = picture.draw(events, args.png or os.path.join(args.folder, "timeline.png"),
                           args.steps)
    except ValueError as error:
        parser.error(str(error))
    print(f"picture: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
