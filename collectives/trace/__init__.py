"""A timeline of compute and communication, per rank: record it, merge it, look at it.

    record.py     spans on each thread, clock offsets between ranks, one trace per job
    summary.py    reading a merged trace: per step, computing, communicating, waiting
    picture.py    the timeline as a PNG: per rank, compute and communication bars
    __main__.py   python -m collectives.trace DIR: the picture and the summary

Code that does work marks it with `trace.span(name, cat=...)`; tools that take
`--trace DIR` call `trace.start(comm, DIR)` and `trace.finish(comm)`. Categories the
summary reads: "step" (one training step), "compute" (forward, backward, optimizer),
"wait" (the training thread waiting on communication) and "comm" (a collective or a
bucket, on whichever thread runs it).
"""
from .record import active, add, finish, merge, pause, resume, span, start, work_done

__all__ = ["active", "add", "finish", "merge", "pause", "resume", "span", "start", "work_done"]
