"""What a rank knows of its host's link, from the environment it was started in.

On the emulated cluster (`python -m collectives.cluster`) each rank's launcher sets

    COLLECTIVES_CLUSTER_IFACE   its host's NIC (the kernel counts what crosses it)
    COLLECTIVES_CLUSTER_RATE    each link's rate, bits/s each way (the slowest shaped one)
    COLLECTIVES_CLUSTER_LINKS   every host's rate, in host order ("0": unshaped)

Off the cluster none is set and every answer here is "nothing known". The library
reads its links here, like the rank and world size (environment.py): the cluster that
sets the variables is a launcher, and the library knows nothing of how it builds them.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

# TCP hands a veth segments of up to 64 KiB and lets the NIC cut them into frames (TSO/GSO).
# tbf cuts, in software, every packet larger than its bucket: with a smaller bucket the
# kernel would cut each segment on the cores the ranks compute on, which a real NIC
# does in hardware. Measured: docs/cluster.md, "The shaper costs no CPU of its own".
TSO_BURST = 128 << 10


def bucket_bytes(bytes_per_second: float) -> int:
    """tbf's bucket on a link of this rate: at least a TSO segment's worth, and a few
    ms of traffic. An idle link passes this many bytes at once before its rate applies
    (the cost model counts it: collectives/algorithms/costs.py)."""
    return max(TSO_BURST, int(bytes_per_second) // 250)


def emulated() -> bool:
    """Whether this rank runs on the emulated cluster, where every host is this one
    machine (its cores shared by all of them)."""
    return bool(os.environ.get("COLLECTIVES_CLUSTER_IFACE"))


def link_bytes() -> Optional[Dict[str, int]]:
    """{"sent", "received"}: bytes through this host's NIC so far (frames as the kernel
    counts them: payload plus Ethernet, IP and TCP headers). None off the cluster."""
    iface = os.environ.get("COLLECTIVES_CLUSTER_IFACE")
    if not iface:
        return None
    folder = f"/sys/class/net/{iface}/statistics"
    try:
        with open(f"{folder}/tx_bytes") as sent, open(f"{folder}/rx_bytes") as received:
            return {"sent": int(sent.read()), "received": int(received.read())}
    except OSError:
        return None


def link_rate_bytes() -> Optional[float]:
    """Bytes per second each link carries each way, when this rank runs on a shaped
    emulated cluster; None elsewhere. Where the hosts' links differ (`links_differ`),
    the slowest shaped link's."""
    bits = os.environ.get("COLLECTIVES_CLUSTER_RATE")
    return int(bits) / 8 if bits else None


def link_rates_bytes() -> Optional[List[Optional[float]]]:
    """Every host's link rate in bytes per second each way, in host order (None: that
    host's link is unshaped), when this rank runs on a shaped emulated cluster; None
    elsewhere."""
    listed = os.environ.get("COLLECTIVES_CLUSTER_LINKS")
    if not listed:
        return None
    return [int(bits) / 8 or None for bits in listed.split(",")]


def links_differ() -> bool:
    """Whether the emulated cluster's hosts have links of different rates (--link), or
    some shaped and some not: then link_rate_bytes() is only the slowest one's."""
    rates = link_rates_bytes()
    return rates is not None and len(set(rates)) > 1
