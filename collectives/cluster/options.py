"""The options that make one emulated host differ, read from the command line.

    --cpu-share HOST=FRACTION        cpu_share_arg     node3=0.5  -> ("node3", 0.5)
    --link HOST=RATE                 link_arg          1=10mbit   -> ("1", "10mbit")
    --pause HOST@SECONDS:DURATION    pause_arg         node2@5:10 -> ("node2", 5.0, 10.0)
    --cut HOST@SECONDS:DURATION      pause_arg         (the same form)
    --kill HOST@SECONDS              kill_arg          node1@30   -> ("node1", 30.0)

Each is an argparse `type`: a bad value is one usage error naming it. `as_given` keeps
the text instead (a command that passes the options on, as trainer.compare does), and
`with_hosts_that_differ` puts the values into a ClusterSpec, where a host that does not
exist, a host named twice or overlapping pauses are a ValueError.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Iterable, Tuple

from .faults import Cut, Kill
from .network import LATEST_PAUSE_END, ClusterSpec, Pause, rate_bits


def _split(text: str, sign: str, form: str) -> Tuple[str, str]:
    host, found, value = text.partition(sign)
    if not found or not host or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: write {form}")
    return host, value


def cpu_share_arg(text: str) -> Tuple[str, float]:
    """--cpu-share HOST=FRACTION -> (HOST, FRACTION), 0 < FRACTION <= 1."""
    host, value = _split(text, "=", "HOST=FRACTION, e.g. node1=0.5")
    try:
        fraction = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: FRACTION must be a number") from None
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: FRACTION must be in (0, 1]")
    return host, fraction


def link_arg(text: str) -> Tuple[str, str]:
    """--link HOST=RATE -> (HOST, RATE), RATE in tc's units."""
    host, rate = _split(text, "=", "HOST=RATE, e.g. node1=10mbit")
    try:
        rate_bits(rate)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return host, rate


def kill_arg(text: str) -> Tuple[str, float]:
    """--kill HOST@SECONDS -> (HOST, SECONDS), SECONDS >= 0."""
    host, at = _split(text, "@", "HOST@SECONDS, e.g. node1@30")
    try:
        seconds = float(at)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be a number") from None
    if not 0 <= seconds <= LATEST_PAUSE_END:
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be in [0, "
                                         f"{LATEST_PAUSE_END:.0f}]")
    return host, seconds


def pause_arg(text: str) -> Tuple[str, float, float]:
    """--pause HOST@SECONDS:DURATION -> (HOST, SECONDS, DURATION); the pause must end
    by LATEST_PAUSE_END seconds after the ranks start. (--cut takes the same form.)"""
    form = "HOST@SECONDS:DURATION, e.g. node1@5:10"
    host, times = _split(text, "@", form)
    at, _, duration = times.partition(":")
    try:
        at, duration = float(at), float(duration)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write {form}") from None
    if not (0 <= at and 0 < duration):  # written so that nan fails too
        raise argparse.ArgumentTypeError(f"{text!r}: SECONDS must be 0 or more and "
                                         "DURATION more than 0")
    if not at + duration <= LATEST_PAUSE_END:
        raise argparse.ArgumentTypeError(f"{text!r}: the pause must end by "
                                         f"{LATEST_PAUSE_END:.0f} s (SECONDS + DURATION)")
    return host, at, duration


def as_given(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse `type` that checks a value with `parse` and keeps its text."""
    def check(text: str) -> str:
        parse(text)
        return text
    check.__name__ = parse.__name__
    return check


def with_hosts_that_differ(spec: ClusterSpec, cpu_share: Iterable = (),
                           link: Iterable = (), pauses: Iterable = ()) -> ClusterSpec:
    """`spec` with the hosts that differ, from the parsed options' values. ValueError
    (naming the option) for a host that does not exist or is named twice, and for
    what ClusterSpec refuses (overlapping pauses of one host)."""
    return dataclasses.replace(
        spec, link=_per_host(spec, "--link", link),
        cpu_share=_per_host(spec, "--cpu-share", cpu_share),
        pauses=tuple(Pause(_host(spec, "--pause", host), at, seconds)
                     for host, at, seconds in pauses))


def host_faults(spec: ClusterSpec, kills: Iterable = (), cuts: Iterable = ()):
    """([Kill], [Cut]) from the parsed --kill and --cut values; ValueError (naming the
    option) for a host that does not exist."""
    cuts = sorted(Cut(_host(spec, "--cut", host), at, seconds) for host, at, seconds in cuts)
    for first, second in zip(cuts, cuts[1:]):
        if first.host == second.host and second.at < first.at + first.seconds:
            raise ValueError(f"--cut: the cuts of {spec.hostname(first.host)} overlap")
    return [Kill(_host(spec, "--kill", host), at) for host, at in kills], cuts


def _host(spec: ClusterSpec, option: str, name: str) -> int:
    try:
        return spec.host_index(name)
    except ValueError as error:
        raise ValueError(f"{option}: {error}") from None


def _per_host(spec: ClusterSpec, option: str, entries) -> dict:
    """{host index: value} from (HOST, value) pairs; a host named twice is an error."""
    out = {}
    for host, value in entries:
        index = _host(spec, option, host)
        if index in out:
            raise ValueError(f"{option} names {spec.hostname(index)} twice")
        out[index] = value
    return out
