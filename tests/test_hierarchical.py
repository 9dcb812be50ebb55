"""The hierarchical all-reduce's pipelined path at a realistic size, on emulated hosts.

Ranks of one machine are told they sit on two hosts (ranks 0 1 | 2 3): each rank
reports a made-up host fingerprint, the ranks exchange them as at init, and shared
memory joins only the ranks of one "host" while gloo's TCP carries the rest. That is
the route split of a real cluster (shared memory inside a host, the network between
hosts), so the traffic each route counts can be checked against the cost formula,
without the network namespaces of test_cluster.py.

A buffer of 32 MiB goes through the pipeline in 8 chunks of PIPELINE_CHUNK_BYTES, as
a real gradient bucket would: no constant is patched.
"""
import threading

import pytest
import torch

from collectives.algorithms import hierarchical
from distributed import run_world

NUMEL = 8 << 20  # float32: 32 MiB, 8 chunks of 4 MiB
PIPELINE_THREAD = "collectives-hierarchical"


def on_emulated_hosts(comm, host_of):
    """`comm` (gloo, no shared memory) with ranks placed on hosts as `host_of` says:
    shared memory inside each host, gloo between hosts."""
    from collectives.transport import shm, topology
    topology.host_fingerprint = lambda: 1000 + host_of[comm.rank]
    comm.topology = topology.Topology.exchange(comm)
    return shm.ShmTransport.connect(comm)


def counting_chunks():
    """Record how many chunks each pipelined call cut its buffer into."""
    chunks = []
    pipelined = hierarchical._pipelined

    def counted(comm, host, pieces, op):
        chunks.append(len(pieces))
        return pipelined(comm, host, pieces, op)

    hierarchical._pipelined = counted
    return chunks


def pattern(rank, numel):
    """Whole numbers: every sum is exact in float32, whatever the order of additions."""
    return torch.arange(numel, dtype=torch.float32) % 1000 + rank


def pipelined_sums_and_traffic(comm, host_of, numel):
    hosts = on_emulated_hosts(comm, host_of)
    chunks = counting_chunks()
    data = pattern(hosts.rank, numel)
    hierarchical.all_reduce(hosts, data, "sum")  # the first call also makes the duplicate
    expected = (torch.arange(numel, dtype=torch.float32) % 1000) * hosts.world_size + sum(
        range(hosts.world_size))
    first_right = torch.equal(data, expected)
    data = pattern(hosts.rank, numel)
    hosts.traffic.reset()
    hierarchical.all_reduce(hosts, data, "sum")
    traffic = hosts.traffic.snapshot()
    return {"name": hosts.name, "chunks": chunks, "right": [first_right,
                                                           torch.equal(data, expected)],
            "routes": traffic.routes, "sent": traffic.bytes_sent,
            "received": traffic.bytes_received,
            "threads_left": [t.name for t in threading.enumerate()
                             if t.name == PIPELINE_THREAD]}


@pytest.mark.timeout(200)
def test_pipelined_hierarchy_sums_right_and_each_route_carries_what_the_formula_says():
    """2 hosts of 2 ranks, K = 32 MiB. Each rank sends 2(L-1)/L K = K through shared
    memory (phases 1 and 3) and 2(H-1)/H K/L = K/2 over the network (phase 2), and
    receives as much: the buffer divides evenly, so the counts are exact."""
    results = run_world(pipelined_sums_and_traffic, 4, args=((0, 0, 1, 1), NUMEL),
                        timeout=180, shm="off")
    size = NUMEL * 4
    for rank, result in enumerate(results):
        assert result["name"] == "gloo+shm"
        assert result["chunks"] == [8, 8], (rank, result["chunks"])  # pipelined, both calls
        assert result["right"] == [True, True], rank
        assert result["routes"] == {"shm": [size, size], "network": [size // 2, size // 2]}, (
            rank, result["routes"])
        assert result["sent"] == result["received"] == size + size // 2, rank
        assert result["threads_left"] == [], rank


@pytest.mark.timeout(200)
def test_pipelined_hierarchy_on_hosts_of_1_and_3_ranks_and_an_uneven_buffer():
    """Uneven hosts (the lone rank holds every slice) and chunks of unequal length.
    Host A's only rank sends nothing through shared memory and the whole of phase 2
    over the network: 2(H-1)/H K = K."""
    numel = NUMEL + 5
    results = run_world(pipelined_sums_and_traffic, 4, args=((0, 1, 1, 1), numel),
                        timeout=180, shm="off")
    for rank, result in enumerate(results):
        assert result["chunks"] == [8, 8] and result["right"] == [True, True], rank
    assert results[0]["routes"].get("shm", [0, 0]) == [0, 0]
    assert results[0]["routes"]["network"] == [numel * 4, numel * 4]
    # everything rank 0 sends, host B's ranks receive over the network
    assert sum(r["routes"]["network"][1] for r in results[1:]) == numel * 4


class InjectedFault(RuntimeError):
    """The fault a test plants in one rank's pipeline."""


def fail_mid_pipeline(comm, victim, how):
    """Rank `victim` fails as it starts phase 1 of the pipeline's third chunk, while
    the network threads carry the first two: it raises (`how` "raises") or its process
    dies ("dies"). Nothing of its share of that chunk has left it, and every element
    of the sum needs it, so no other rank can finish: each must raise. Every rank then
    reports what it raised, which of the pipeline's threads were still running, and
    what a second call raised."""
    import os
    hosts = on_emulated_hosts(comm, (0, 0, 1, 1))
    data = pattern(hosts.rank, NUMEL)
    hierarchical.all_reduce(hosts, data, "sum")  # the duplicate exists: all is ready
    if hosts.rank == victim:
        inside = hierarchical._inside_host
        started = []

        def failing_inside(host, flat, op):
            started.append(flat)
            if len(started) == 3:
                if how == "dies":
                    os._exit(1)
                raise InjectedFault("phase 1 of chunk 2 failed on purpose")
            return inside(host, flat, op)

        hierarchical._inside_host = failing_inside
    report = {}
    try:
        hierarchical.all_reduce(hosts, data, "sum")
        expected = (torch.arange(NUMEL, dtype=torch.float32) % 1000) * 4 + 6
        report["first"] = f"returned, {'right' if torch.equal(data, expected) else 'wrong'}"
    except Exception as error:
        report["first"] = f"{type(error).__name__}: {error}"
    # Right after the raise: no thread of the failed call may still use the channel.
    report["threads_left"] = [t.name for t in threading.enumerate()
                              if t.name == PIPELINE_THREAD]
    try:
        hierarchical.all_reduce(hosts, pattern(hosts.rank, NUMEL), "sum")
        report["again"] = "returned"
    except Exception as error:
        report["again"] = f"{type(error).__name__}: {error}"
    report["threads_after_again"] = [t.name for t in threading.enumerate()
                                     if t.name == PIPELINE_THREAD]
    return report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_failure_mid_pipeline_is_a_peer_error_everywhere_and_leaves_no_thread(how):
    victim = 3
    results = run_world(fail_mid_pipeline, 4, args=(victim, how), timeout=180,
                        init_timeout=15, shm="off", may_die=(victim,) if how == "dies" else ())
    for rank, report in enumerate(results):
        if rank == victim:
            if how == "raises":
                assert report["first"].startswith("InjectedFault"), report
            else:
                assert report is None  # it died before reporting
                continue
        else:
            assert report["first"].startswith("PeerError"), (rank, report)
        assert report["threads_left"] == [], (rank, report)
        # The duplicate is retired: the next call refuses at once, naming the failure,
        # and starts no thread on a channel that may hold the failed call's messages.
        assert report["again"].startswith("PeerError") and "failed earlier" in report["again"], (
            rank, report)
        assert report["threads_after_again"] == [], (rank, report)
