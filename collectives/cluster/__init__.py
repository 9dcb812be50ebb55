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

Inside a rank, what it knows of its link (`link_bytes()`: what its host's NIC has
really sent and received; the link's rate) comes from the variables the cluster sets,
read by collectives/launch/links.py. This package is about launching and networks; it
knows nothing of the algorithms.
"""
from __future__ import annotations

from ..launch.links import (bucket_bytes, emulated, link_bytes, link_rate_bytes,
                            link_rates_bytes, links_differ)
from .network import ClusterError, ClusterSpec, Network, rate_bits, remove_leftovers

__all__ = ["ClusterError", "bucket_bytes", "ClusterSpec", "emulated", "Network", "link_bytes",
           "link_rate_bytes", "link_rates_bytes", "links_differ", "rate_bits",
           "remove_leftovers"]
