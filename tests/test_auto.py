"""`auto`'s choices, as plain function calls: no ranks, no network.

The choice is a pure function of (bytes, world size, transport name, topology), so a
topology of several hosts can be written down instead of built.
"""
import pytest

from collectives.algorithms import auto
from collectives.transport.topology import Topology

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]
TWO_HOSTS = {
    "2 hosts of 2 ranks": Topology((0, 0, 1, 1)),
    "2 hosts of 4 ranks": Topology((0, 0, 0, 0, 1, 1, 1, 1)),
    "2 hosts of 1 rank": Topology((0, 1)),
    "hosts of 1 and 3 ranks": Topology((0, 1, 1, 1)),
}


@pytest.mark.parametrize("placement", list(TWO_HOSTS))
def test_nccl_across_hosts_keeps_nccls_own_all_reduce(placement):
    """NCCL runs its own rings and trees across nodes; ours would drive a second NCCL
    communicator from a second thread (hierarchical's pipeline), which NCCL documents
    as a possible deadlock. Across hosts on nccl, auto must say native at every size."""
    topology = TWO_HOSTS[placement]
    n = len(topology.host_of)
    chosen = {size: auto.all_reduce_choice(size, n, "nccl", topology) for size in SIZES}
    assert set(chosen.values()) == {"native"}, chosen


@pytest.mark.parametrize("transport", ["gloo", "gloo+shm", "mpi", "mpi+shm"])
def test_other_backends_across_hosts_still_take_the_hierarchy(transport):
    """The measured choices off nccl stay: the tree below 64 KiB, the hierarchy above
    with several ranks on a host, the ring with one (docs/cluster.md)."""
    assert auto.all_reduce_choice(4 * KiB, 4, transport, TWO_HOSTS["2 hosts of 2 ranks"]) == "tree"
    assert auto.all_reduce_choice(16 * MiB, 4, transport,
                                  TWO_HOSTS["2 hosts of 2 ranks"]) == "hierarchical"
    assert auto.all_reduce_choice(16 * MiB, 2, transport, TWO_HOSTS["2 hosts of 1 rank"]) == "ring"
