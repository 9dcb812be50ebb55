"""Spans of time on each thread, for a timeline of compute and communication.

    with tracing.span("bucket 3", cat="comm", bytes=4194304):
        ...reduce it...

A span is a named stretch of time on the thread that runs it. When this process is
tracing (`start(...)`, what `--trace DIR` does), spans are kept and written as a
Chrome / Perfetto trace; when the user runs torch's profiler, spans also enter
`torch.profiler.record_function`, so they show up in the user's own profile. When
neither is on, `span()` returns one shared do-nothing context: no clock is read and
nothing is stored (`work_done()` stays 0: tests count it).

Levels: 1 (the default) is steps, forward, backward, optimizer, waits and every
bucket; 2 adds each algorithm's steps (ring step s: send to r+1, receive from r-1).

Clocks: every rank stamps events with its own monotonic clock. Ranks on different
machines (or emulated hosts) do not share one, so at start-up every rank measures its
offset to rank 0's clock by ping-pong (the exchange with the shortest round trip wins,
as NTP does) and shifts its events by it before writing. `merge()` then puts every
rank's events into one trace, one process row per rank.

Nothing here knows what the spans mean; summary.py reads them.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Dict, List, Optional

import torch

_NULL = contextlib.nullcontext()
_events_recorded = 0  # spans kept by this process
_spans_made = 0  # span objects made (none while tracing and torch's profiler are off)


def work_done() -> int:
    """Trace work this process has done: span objects made plus events kept. It stays
    0 while tracing is off (tests count it instead of timing it)."""
    return _spans_made + _events_recorded


class Recorder:
    """The events of one rank, in microseconds of rank 0's clock."""

    def __init__(self, rank: int, folder: str, level: int, offset_us: float):
        self.rank, self.folder, self.level, self.offset_us = rank, folder, level, offset_us
        self.events: List[Dict] = []
        self.thread_names: Dict[int, str] = {}
        self.recording = True
        self.lock = threading.Lock()

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, args: Dict) -> None:
        global _events_recorded
        thread = threading.current_thread()
        with self.lock:
            self.thread_names.setdefault(thread.ident, thread.name)
            self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                                "tid": thread.ident, "ts": start_ns / 1e3 + self.offset_us,
                                "dur": (end_ns - start_ns) / 1e3, "args": args})
            _events_recorded += 1

    def write(self) -> str:
        """DIR/rank<R>.json: this rank's events, with process and thread names."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank} ({socket.gethostname()})"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": name}} for tid, name in self.thread_names.items()]
        path = os.path.join(self.folder, f"rank{self.rank}.json")
        with open(path, "w") as out:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                       "otherData": {"rank": self.rank, "clock_offset_us": self.offset_us}},
                      out)
        return path


_recorder: Optional[Recorder] = None


def _torch_profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


class _Span:
    __slots__ = ("name", "cat", "args", "start", "torch_range")

    def __init__(self, name: str, cat: str, args: Dict):
        global _spans_made
        self.name, self.cat, self.args = name, cat, args
        self.torch_range = None
        _spans_made += 1

    def __enter__(self):
        if _torch_profiling():
            self.torch_range = torch.profiler.record_function(self.name)
            self.torch_range.__enter__()
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        end = time.perf_counter_ns()
        if self.torch_range is not None:
            self.torch_range.__exit__(*exc)
        recorder = _recorder
        if recorder is not None and recorder.recording:
            recorder.add(self.name, self.cat, self.start, end, self.args)
        return False


def active(level: int = 1) -> bool:
    """True when spans of this level are kept (or torch's profiler is on)."""
    recorder = _recorder
    return (recorder is not None and recorder.recording and recorder.level >= level) \
        or _torch_profiling()


def span(name: str, cat: str = "", level: int = 1, **args):
    """A context that records `name` on this thread while tracing; otherwise nothing."""
    if not active(level):
        return _NULL
    return _Span(name, cat, args)


def add(name: str, cat: str, start_ns: int, end_ns: int, **args) -> None:
    """A span whose ends were measured elsewhere (perf_counter_ns values)."""
    recorder = _recorder
    if recorder is not None and recorder.recording:
        recorder.add(name, cat, start_ns, end_ns, args)


def clock_offset_us(comm, rounds: int = 8) -> float:
    """Microseconds to add to this rank's perf_counter to read rank 0's, measured by
    ping-pong with rank 0 (0 on rank 0). Collective: every rank calls it."""
    offset = 0.0
    stamp = torch.zeros(1, dtype=torch.float64)
    for peer in range(1, comm.world_size):
        best_round_trip = None
        for _ in range(rounds):
            if comm.rank == peer:
                sent = time.perf_counter_ns()
                comm.send(stamp, 0)
                comm.recv(stamp, 0)  # rank 0's clock, read between our two stamps
                back = time.perf_counter_ns()
                if best_round_trip is None or back - sent < best_round_trip:
                    best_round_trip = back - sent
                    offset = stamp.item() - (sent + back) / 2e3
            elif comm.rank == 0:
                comm.recv(stamp, peer)
                stamp.fill_(time.perf_counter_ns() / 1e3)
                comm.send(stamp, peer)
    return offset


def start(comm, folder: str, level: int = 1, recording: bool = True) -> Recorder:
    """Begin tracing on every rank (collective: it measures the clock offsets)."""
    global _recorder
    os.makedirs(folder, exist_ok=True)
    _recorder = Recorder(comm.rank, folder, level, clock_offset_us(comm))
    _recorder.recording = recording
    return _recorder


def pause() -> None:
    if _recorder is not None:
        _recorder.recording = False


def resume() -> None:
    if _recorder is not None:
        _recorder.recording = True


def finish(comm) -> Optional[str]:
    """Every rank writes its file; rank 0 merges them into DIR/trace.json (returned)."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is None:
        return None
    recorder.write()
    comm.barrier()
    if comm.rank != 0:
        return None
    return merge(recorder.folder, comm.world_size)


def merge(folder: str, world_size: int) -> str:
    """One trace, one process row per rank: DIR/trace.json, for Perfetto or chrome://tracing."""
    events = []
    for rank in range(world_size):
        with open(os.path.join(folder, f"rank{rank}.json")) as part:
            events += json.load(part)["traceEvents"]
    path = os.path.join(folder, "trace.json")
    with open(path, "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)
    return path
