"""The rank program of the cluster tests: run on emulated hosts by test_cluster.py.

    python checks_cluster.py BACKEND algorithms OUTDIR   every algorithm against numpy,
                                                          plus NIC bytes per algorithm
    python checks_cluster.py BACKEND paired OUTDIR       the same, each dtype and op once
                                                          (PAIRS), not every combination
    python checks_cluster.py BACKEND loop OUTDIR         all-reduce until a peer fails
    python checks_cluster.py BACKEND ddp OUTDIR          our DDP equals torch's DDP
    python checks_cluster.py BACKEND slurm OUTDIR        under srun: every algorithm (float32,
                                                          every op), where Slurm placed us,
                                                          what auto picks, the rendezvous port

Each rank writes what it saw to OUTDIR/rank<R>.json; the test compares the ranks.
"""
import json
import os
import socket
import sys
import time

import torch

import collectives
from collectives import cluster
from checks_algorithms import check_all_reduce, check_ring_segments

NIC_PROBE_BYTES = 4 << 20  # big enough that barriers and handshakes are noise beside it

# Every dtype and every op, each in one pair rather than in every combination: 6
# all-reduces per algorithm and size instead of 24. What hosts change is the route
# between ranks, not the arithmetic of a dtype or an op: every combination, and the
# ring's tiny segments, are checked on one host at world sizes 1-6 and over TCP
# (test_algorithms.py), and across hosts on one cluster of test_cluster.py.
PAIRS = [(torch.float32, "sum"), (torch.float64, "avg"), (torch.float16, "max"),
         (torch.bfloat16, "min"), (torch.int32, "avg"), (torch.int64, "min")]


def check_pairs(comm, algorithm_names=None, pairs=PAIRS):
    """check_all_reduce for each (dtype, op) of `pairs`: every algorithm and size."""
    digests = {}
    for dtype, op in pairs:
        digests.update(check_all_reduce(comm, algorithm_names, dtypes=[dtype], ops=[op]))
    return digests


def bytes_sent(comm, algorithm: str) -> dict:
    """What one all-reduce of NIC_PROBE_BYTES sent: through this host's NIC, and by
    route as the transport counted it ("shm", "network"; one route: all "network")."""
    tensor = torch.zeros(NIC_PROBE_BYTES // 4)
    collectives.all_reduce(tensor, algorithm=algorithm, comm=comm, check=False)  # warm up
    comm.barrier()
    time.sleep(0.2)  # what the kernel still holds of the warm-up leaves
    # read before the barrier: no rank can start the measured call before every rank
    # has read its counters
    before, counted = cluster.link_bytes()["sent"], comm.traffic.snapshot()
    comm.barrier()
    collectives.all_reduce(tensor, algorithm=algorithm, comm=comm, check=False)
    after = comm.traffic.snapshot()
    comm.barrier()
    time.sleep(0.2)  # the last bytes and ACKs leave
    routes = {route: after.routes.get(route, [0, 0])[0] - counted.routes.get(route, [0, 0])[0]
              for route in ("shm", "network")}
    if not after.routes:  # a transport with one route: everything went over the backend
        routes["network"] = after.bytes_sent - counted.bytes_sent
    return {"nic": cluster.link_bytes()["sent"] - before, **routes}


def pipelined_hierarchy(comm, paired):
    """The hierarchical all-reduce with its phases pipelined over chunks (made tiny
    here so that small tensors take that path too)."""
    from collectives.algorithms import hierarchical
    saved = hierarchical.PIPELINE_CHUNK_BYTES
    hierarchical.PIPELINE_CHUNK_BYTES = 64
    try:
        if paired:
            return check_pairs(comm, ["hierarchical"], [
                (torch.float32, "sum"), (torch.float16, "avg"), (torch.int64, "max"),
                (torch.float32, "min")])
        return check_all_reduce(comm, ["hierarchical"],
                                dtypes=[torch.float32, torch.float16, torch.int64])
    finally:
        hierarchical.PIPELINE_CHUNK_BYTES = saved


def algorithms_case(comm, paired=False):
    """Every algorithm and awkward size against numpy: every op and dtype in every
    combination (or `paired`: each once, PAIRS), the pipelined hierarchy, the ring's
    tiny segments (not `paired`); then what each algorithm sends."""
    # every algorithm, op, dtype and awkward size
    digests = check_pairs(comm) if paired else check_all_reduce(comm)
    digests.update({("pipelined",) + key: value
                    for key, value in pipelined_hierarchy(comm, paired).items()})
    segments = {} if paired else check_ring_segments(comm)
    sent = {name: bytes_sent(comm, name) for name in ("ring", "naive", "hierarchical")}
    return {"digest": str(sorted(digests.items())) + str(sorted(segments.items())),
            "checks": len(digests) + len(segments), "sent": sent}


def loop_case(comm, outdir):
    """All-reduce 1 MiB again and again; the test cuts a link or kills a rank meanwhile."""
    tensor = torch.ones(1 << 18)
    started = time.monotonic()
    calls = 0
    try:
        while time.monotonic() - started < 120:
            collectives.all_reduce(tensor, comm=comm)  # auto: the cost model's pick
            tensor.fill_(1)
            calls += 1
            if calls == 3:  # tell the test this rank is in its loop
                open(os.path.join(outdir, f"looping-{comm.rank}"), "w").close()
        return {"raised": None, "calls": calls}
    except collectives.PeerError as error:
        failed_at = time.monotonic()
        return {"raised": f"PeerError: {error}", "calls": calls, "failed_at": failed_at}


def ddp_case(comm):
    """ResNet-18 (BatchNorm) and the MLP with unused branches train as with torch DDP."""
    from checks_ddp import compare_with_torch_ddp
    digests = [compare_with_torch_ddp(comm, "resnet18", algorithm="hierarchical"),
               compare_with_torch_ddp(comm, "mlp", "by-rank")]  # auto's pick too
    return {"digest": str(digests)}


def slurm_case(comm):
    """What a rank started by Slurm saw: its place, the algorithms' answers, auto's pick
    for a large all-reduce, and the port its job step met on."""
    import torch
    from collectives.algorithms.auto import all_reduce_choice
    from collectives.launch import detect_launch
    from collectives.launch.rendezvous import slurm_rendezvous
    digests = check_all_reduce(comm, dtypes=[torch.float32])
    return {"digest": str(sorted(digests.items())), "checks": len(digests),
            "job": os.environ["SLURM_JOB_ID"], "node_id": int(os.environ["SLURM_NODEID"]),
            "ranks_on_host": len(comm.topology.local_ranks(comm.rank)),  # as the ranks found
            "launch": detect_launch().__dict__,  # as Slurm said
            "auto_16M": all_reduce_choice(16 << 20, comm.world_size, comm.name, comm.topology),
            "transport": comm.name,
            "port": slurm_rendezvous(os.environ)[1],
            "netmod": os.environ.get("MPIR_CVAR_CH4_NETMOD")}  # MPICH's, where it was set


def meet_other_jobs(folder: str, jobs: int, seconds: float = 120) -> None:
    """Wait until ranks of `jobs` different Slurm jobs have arrived in `folder`, so that
    the jobs meet at their rendezvous at the same time, on the same nodes."""
    job = os.environ["SLURM_JOB_ID"]
    open(os.path.join(folder, f"job{job}-task{os.environ['SLURM_PROCID']}"), "w").close()
    deadline = time.monotonic() + seconds
    while len({name.split("-")[0] for name in os.listdir(folder)}) < jobs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other jobs did not start within {seconds} s")
        time.sleep(0.1)


def main(backend: str, case: str, outdir: str) -> None:
    if os.environ.get("CHECK_MEET_JOBS"):
        meet_other_jobs(os.environ["CHECK_MEET_DIR"], int(os.environ["CHECK_MEET_JOBS"]))
    comm = collectives.init(backend=backend, timeout=float(os.environ.get("CHECK_TIMEOUT", 30)))
    result = {"rank": comm.rank, "hostname": socket.gethostname(), "transport": comm.name,
              "local_rank": comm.local_rank}
    cases = {"algorithms": algorithms_case,
             "paired": lambda comm: algorithms_case(comm, paired=True), "ddp": ddp_case,
             "loop": lambda comm: loop_case(comm, outdir), "slurm": slurm_case}
    result.update(cases[case](comm))
    result["finished_at"] = time.monotonic()
    with open(os.path.join(outdir, f"rank{comm.rank}.json"), "w") as out:
        json.dump(result, out)
    if result.get("raised"):
        print(f"rank {comm.rank}: {result['raised']}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
