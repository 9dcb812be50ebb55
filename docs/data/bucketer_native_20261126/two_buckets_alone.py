"""Two buckets (25 and 19 MiB) all-reduced one after the other ("serial"), or at once
on two threads over two communicators ("two threads"), per algorithm, in turns. Rank 0
prints the median wall time of each and every turn's:

    python -m collectives.cluster --hosts 4 --bandwidth 100mbit -- \
        python docs/data/bucketer_native_20261126/two_buckets_alone.py ring,native 3
"""
import statistics
import sys
import threading
import time

import torch

import collectives


def main():
    torch.set_num_threads(1)
    comm = collectives.init()
    twin = comm.duplicate()  # the second thread's communicator
    first, second = torch.randn(25 * 2**18), torch.randn(19 * 2**18)
    algorithms = (sys.argv[1] if len(sys.argv) > 1 else "ring,native").split(",")
    turns = int(sys.argv[2]) if len(sys.argv) > 2 else 3

    def serial(algorithm):
        collectives.all_reduce(first, algorithm=algorithm, comm=comm, check=False)
        collectives.all_reduce(second, algorithm=algorithm, comm=comm, check=False)

    def two_threads(algorithm):
        other = threading.Thread(target=lambda: collectives.all_reduce(
            second, algorithm=algorithm, comm=twin, check=False))
        other.start()
        collectives.all_reduce(first, algorithm=algorithm, comm=comm, check=False)
        other.join()

    ways = [("serial", serial), ("two threads", two_threads)]
    for algorithm in algorithms:  # warm-up: connections, scratch
        for _, run in ways:
            run(algorithm)
    times = {}
    for turn in range(turns):
        for algorithm in algorithms:
            for name, run in ways[::1 if turn % 2 == 0 else -1]:
                comm.barrier()
                started = time.perf_counter()
                run(algorithm)
                times.setdefault((algorithm, name), []).append(
                    (time.perf_counter() - started) * 1e3)
    if comm.rank == 0:
        for (algorithm, name), wall in times.items():
            print(f"{algorithm:8s} {name:12s} median {statistics.median(wall):8.1f} ms  "
                  f"all {[round(ms) for ms in wall]}", flush=True)


if __name__ == "__main__":
    main()
