"""Rates, latencies and sizes as people write them: 25gbit, 100mbit, 10us, 2ms, 16M.

Rates follow tc's spelling (bits per second, decimal prefixes): `100mbit` is 100e6
bits/s, 12.5e6 bytes/s. Sizes are binary, as collectives.bench's: `16M` is 16 MiB.
"""
from __future__ import annotations

import argparse
import re

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """'25gbit' -> bytes per second (3.125e9). A rate of 0 is refused: a link that moves
    nothing is no link (and callers take 0 to mean "the measured one")."""
    match = re.fullmatch(r"(\d+\.?\d*|\.\d+)\s*([kmgt]?bit)(/s|ps)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(
            f"bad rate {text!r}: write it as tc does, e.g. 100mbit, 1gbit, 25gbit")
    rate = float(match.group(1)) * RATE_UNITS[match.group(2)] / 8
    if rate <= 0:
        raise argparse.ArgumentTypeError(
            f"bad rate {text!r}: a link's rate must be more than 0 (e.g. 100mbit); leave "
            "--bandwidth out for the measured link")
    return rate


def parse_latency(text: str) -> float:
    """'10us' -> seconds (1e-5)."""
    match = re.fullmatch(r"([\d.]+)\s*(s|ms|us|ns)", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"bad latency {text!r}: e.g. 10us, 2ms, 30ms")
    return float(match.group(1)) * TIME_UNITS[match.group(2)]


def format_rate(bytes_per_second: float) -> str:
    """12.5e6 -> '100mbit' (the largest unit that keeps a whole number when it can)."""
    bits = bytes_per_second * 8
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= RATE_UNITS[unit]:
            return f"{bits / RATE_UNITS[unit]:g}{unit}"
    return f"{bits:g}bit"

