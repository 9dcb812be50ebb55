"""An emulated cluster on one machine: hosts with their own network, hostname and link.

    python -m collectives.cluster --hosts 4 --ranks-per-host 2 --bandwidth 100mbit -- \\
        python -m trainer --epochs 1

Communication between ranks of one host is nearly free; between hosts it crosses a
link of limited bandwidth. To see what a sync algorithm or a topology-aware collective
buys, the network has to be there. As root, Linux can give each emulated host a
network namespace (its own NIC and addresses) and a UTS namespace (its own hostname),
join them through a bridge, and shape every link with tc. Ranks then find their peers
over TCP as on real machines, and shared memory joins only ranks of one host.

    network.py   ClusterSpec (what the network is) and Network (build / remove it)
    cgroups.py   hosts that compute slower (a CPU share) or stop for a while (pauses)
    options.py   the command line's options that make one host differ, checked
    job.py       starting ranks on the hosts: torchrun-style, or under mpirun
    rsh.py       the ssh stand-in mpiexec uses to reach a host
    __main__.py  the command line

Inside a rank, `link_bytes()` reads what its host's NIC has really sent and received.
This package is about launching and networks; it knows nothing of the algorithms.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from .network import (ClusterError, ClusterSpec, Network, bucket_bytes, rate_bits,
                      remove_leftovers)


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


__all__ = ["ClusterError", "bucket_bytes", "ClusterSpec", "Network", "link_bytes", "link_rate_bytes",
           "link_rates_bytes", "links_differ", "rate_bits", "remove_leftovers"]
