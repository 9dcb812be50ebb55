"""Wall time and CPU of one all-reduce call, algorithm by algorithm, in turns.

    python -m collectives.cluster --hosts 4 --bandwidth 1gbit -- \
        python docs/data/cpu/cpu_per_call.py 25,1 ring,native 6

Arguments: sizes in MiB, algorithms, calls per turn. Four turns, each starting one
algorithm later; rank 0 prints medians over them: wall ms a call, the process's CPU ms
a call, and of it the calling thread's and the other threads' (gloo's own).
"""
import statistics
import sys
import time

import torch

import collectives


def main():
    torch.set_num_threads(1)
    comm = collectives.init()
    sizes = [int(float(s) * (1 << 20)) for s in (sys.argv[1] if len(sys.argv) > 1 else "25,1").split(",")]
    algorithms = (sys.argv[2] if len(sys.argv) > 2 else "ring,native").split(",")
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    for nbytes in sizes:
        tensor = torch.randn(nbytes // 4)
        times = {algorithm: [] for algorithm in algorithms}
        for algorithm in algorithms:  # warm-up: connections, scratch
            for _ in range(2):
                collectives.all_reduce(tensor, algorithm=algorithm, check=False)
        for turn in range(4):
            for algorithm in algorithms[turn % len(algorithms):] + algorithms[:turn % len(algorithms)]:
                comm.barrier()
                wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
                for _ in range(calls):
                    collectives.all_reduce(tensor, algorithm=algorithm, check=False)
                own = time.thread_time() - own
                cpu = time.process_time() - cpu
                wall = time.perf_counter() - wall
                times[algorithm].append((wall / calls * 1e3, cpu / calls * 1e3, own / calls * 1e3))
        if comm.rank == 0:
            for algorithm, rows in times.items():
                median = [statistics.median(row[i] for row in rows) for i in range(3)]
                others = statistics.median(row[1] - row[2] for row in rows)
                print(f"{nbytes / 2**20:5.1f} MiB {algorithm:8s} wall {median[0]:7.1f} ms  "
                      f"cpu {median[1]:6.2f}  caller {median[2]:6.2f}  others {others:6.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
