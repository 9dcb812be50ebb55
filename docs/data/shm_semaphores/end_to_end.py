"""End to end: all-reduce through shared memory on our ctypes semaphores, then on posix_ipc's.

bench.py times the semaphore calls alone; this times what a user sees. Each run starts
4 ranks (gloo + shared memory, as `collectives.init(shm="on")` makes them) and times
all_reduce with the ring, the tree and naive at a few sizes (the slowest rank's mean
per call, without the argument check). Runs alternate between the two kinds of
semaphore, --trials of each, and the table gives each one's median.

posix_ipc has named semaphores only (sem_open), where ours are unnamed sem_t's inside
each rank's segment. For this comparison every semaphore of a segment gets a name made
of the segment's file name and its offset in it, so that every rank opens the same one:
the transport's code is unchanged and calls `semaphores.init/post/trywait/nap` by
address as always; only those four functions are replaced (use_posix_ipc). The names
are unlinked when the run ends.

    pip install posix-ipc
    python docs/data/shm_semaphores/end_to_end.py --trials 5
"""
import argparse
import atexit
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import torch  # noqa: E402

KINDS = ("ctypes", "posix_ipc")
ALGORITHMS = ("ring", "tree", "naive")
# size in bytes: timed calls per measurement (about 0.3 s each on 2 cores)
SIZES = {1 << 10: 150, 16 << 10: 150, 256 << 10: 60, 4 << 20: 10}


def use_posix_ipc() -> None:
    """Make semaphores.init/post/trywait/nap work on named posix_ipc semaphores."""
    import posix_ipc
    from collectives.transport.shm import segment, semaphores

    regions = []   # (base address, size, the segment's file name) of every mapped segment
    opened = {}    # address -> posix_ipc.Semaphore
    pending = []   # inits asked for while the segment was being made (before it is known)
    created = []   # names this process made, unlinked at exit

    def name_of(address: int):
        for base, size, tag in regions:
            if base <= address < base + size:
                return f"/{tag}.{address - base}"
        return None

    def init(address: int, value: int) -> None:
        name = name_of(address)
        if name is None:
            pending.append((address, value))
            return
        opened[address] = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=value)
        created.append(name)

    def get(address: int):
        semaphore = opened.get(address)
        if semaphore is None:
            semaphore = opened[address] = posix_ipc.Semaphore(name_of(address))
        return semaphore

    def post(address: int) -> None:
        get(address).release()

    def trywait(address: int) -> bool:
        try:
            get(address).acquire(0)
            return True
        except posix_ipc.BusyError:
            return False

    def nap(address: int, seconds: float) -> bool:
        try:
            get(address).acquire(seconds)
            return True
        except posix_ipc.BusyError:
            return False

    make_segment = segment.Segment.__init__

    def segment_init(self, path, *args, **kwargs):
        make_segment(self, path, *args, **kwargs)
        regions.append((self.address, len(self.map), os.path.basename(path)))
        while pending:
            init(*pending.pop(0))

    def unlink_created() -> None:
        for name in created:
            try:
                posix_ipc.unlink_semaphore(name)
            except posix_ipc.ExistentialError:
                pass

    segment.Segment.__init__ = segment_init
    semaphores.init, semaphores.post = init, post
    semaphores.trywait, semaphores.nap = trywait, nap
    atexit.register(unlink_created)


def rank_main(kind: str, out_path: str) -> None:
    if kind == "posix_ipc":
        use_posix_ipc()
    import collectives
    comm = collectives.init(backend="gloo", shm="on")
    assert comm.name.endswith("+shm"), comm.name
    rows = {}
    for size, calls in SIZES.items():
        tensor = torch.ones(size // 4)
        for algorithm in ALGORITHMS:
            for _ in range(5):  # warm-up
                collectives.all_reduce(tensor, algorithm=algorithm, check=False)
            comm.barrier()
            started = time.perf_counter()
            for _ in range(calls):
                collectives.all_reduce(tensor, algorithm=algorithm, check=False)
            mean = torch.tensor([(time.perf_counter() - started) / calls])
            collectives.all_reduce(mean, op="max", algorithm="naive")
            rows[f"{algorithm} {size}"] = float(mean) * 1e6
    if comm.rank == 0:
        with open(out_path, "w") as out:
            json.dump(rows, out)
    collectives.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="runs of each kind")
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    from collectives.launch.spawn import spawn
    runs = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as folder:
        for trial in range(args.trials):
            for kind in KINDS:
                path = os.path.join(folder, f"{kind}{trial}.json")
                spawn(rank_main, args.nproc, kind, path)
                with open(path) as source:
                    runs[kind].append(json.load(source))
    print(f"# {args.nproc} ranks, gloo+shm, all_reduce float32, the slowest rank's mean per "
          f"call, median of {args.trials} runs each (min-max)")
    print(f"{'algorithm':>10} {'size(B)':>9} {'ctypes us':>24} {'posix_ipc us':>24} "
          f"{'posix_ipc/ctypes':>17}")
    for key in runs["ctypes"][0]:
        algorithm, size = key.split()
        cells, medians = [], []
        for kind in KINDS:
            values = [run[key] for run in runs[kind]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:9.1f} ({min(values):.0f}-{max(values):.0f})")
        print(f"{algorithm:>10} {size:>9} {cells[0]:>24} {cells[1]:>24} "
              f"{medians[1] / medians[0]:17.2f}")


if __name__ == "__main__":
    main()
