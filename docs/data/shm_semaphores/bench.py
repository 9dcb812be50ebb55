"""Our ctypes semaphores against posix_ipc's: the costs the shared-memory transport pays.

The shared-memory transport (collectives/transport/shm/) counts each channel's free and
filled slots with POSIX semaphores, and every rank sleeps on one (its bell) when nothing
can move. Ours are unnamed sem_t's inside the mapped segment, called through ctypes
(semaphores.py); posix_ipc is a C extension whose semaphores are named (sem_open). Both
call the same C library underneath: what differs is the cost of getting there from
Python, and the design (a name per semaphore, see below). Three measurements, each for
both, each the median of --trials runs:

    ping-pong      two processes, one post and one wait each way: the round trip a
                   message of one piece costs in synchronisation alone (us per round trip)
    post+trywait   one process, a post then a successful trywait: what moving one piece
                   costs each side when nothing has to sleep (ns per pair)
    failed trywait one process, a trywait on a semaphore at zero: what the progress
                   engine pays polling a channel with nothing ready (ns per call);
                   posix_ipc reports it by raising BusyError

A wait is what the transport's wait does: try without blocking, then sleep in
sem_timedwait (up to 0.1 s) when nothing is there. `#wrong` counts runs that ended with
a count left on a semaphore (a post lost or doubled): it must be 0.

    python docs/data/shm_semaphores/bench.py                  # both, 7 trials
    python docs/data/shm_semaphores/bench.py --trials 3 --round-trips 2000 --calls 20000

What adopting posix_ipc would change besides the numbers: each semaphore gets a name in
/dev/shm (sem.<name>) and its own small mapping, so a host of L ranks holds
L + 2 L (L-1) of them (each bell, each channel's free and filled) instead of none beyond
the L segments; they must be created, opened by the peers by name and unlinked like the
segments are, and a rank killed before it unlinks leaves its names behind.
"""
import argparse
import mmap
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

NAP_SECONDS = 0.1  # as the transport's wait
SEMAPHORES = 4096  # room for this many in the ctypes mapping


class CtypesSemaphores:
    """Ours: unnamed sem_t's on cache lines of an anonymous shared mapping (fork shares it)."""
    name = "ctypes"

    def __init__(self):
        from collectives.transport.shm import semaphores
        self.sem = semaphores
        self.map = mmap.mmap(-1, 64 * SEMAPHORES)  # shared and anonymous: a forked child sees it
        import ctypes
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.base = ctypes.addressof(self._anchor)
        self.made = 0

    def make(self, value: int):
        if self.made == SEMAPHORES:
            raise RuntimeError(f"more than {SEMAPHORES} semaphores: use fewer --trials")
        address = self.base + 64 * self.made  # one to a cache line, as in a segment
        self.made += 1
        self.sem.init(address, value)
        return address

    def post(self, handle) -> None:
        self.sem.post(handle)

    def trywait(self, handle) -> bool:
        return self.sem.trywait(handle)

    def nap(self, handle, seconds: float) -> bool:
        return self.sem.nap(handle, seconds)

    def close(self) -> None:
        pass  # the mapping goes with the process


class PosixIpcSemaphores:
    """posix_ipc's: named semaphores (sem_open), unlinked at close."""
    name = "posix_ipc"

    def __init__(self):
        import posix_ipc
        self.ipc = posix_ipc
        self.made = []

    def make(self, value: int):
        name = f"/collectives-bench-{os.getpid()}-{len(self.made)}"
        semaphore = self.ipc.Semaphore(name, self.ipc.O_CREX, initial_value=value)
        self.made.append(semaphore)
        return semaphore

    def post(self, handle) -> None:
        handle.release()

    def trywait(self, handle) -> bool:
        try:
            handle.acquire(0)
        except self.ipc.BusyError:
            return False
        return True

    def nap(self, handle, seconds: float) -> bool:
        try:
            handle.acquire(seconds)
        except self.ipc.BusyError:
            return False
        return True

    def close(self) -> None:
        for semaphore in self.made:
            semaphore.unlink()
            semaphore.close()


def wait(impl, handle) -> None:
    """The transport's way of waiting: try, then sleep on it a while, until a count comes."""
    while not impl.trywait(handle):
        if impl.nap(handle, NAP_SECONDS):
            return


def leftover(impl, *handles) -> int:
    """Counts left on the semaphores (taken, so they end at zero)."""
    count = 0
    for handle in handles:
        while impl.trywait(handle):
            count += 1
    return count


def ping_pong(impl, round_trips: int):
    """Microseconds per round trip between two processes, and the counts left over."""
    ping, pong = impl.make(0), impl.make(0)
    child = os.fork()
    if child == 0:
        try:
            for _ in range(round_trips + 1):
                wait(impl, ping)
                impl.post(pong)
        finally:
            os._exit(0)
    impl.post(ping)  # one round trip unmeasured: both processes awake and running
    wait(impl, pong)
    started = time.perf_counter()
    for _ in range(round_trips):
        impl.post(ping)
        wait(impl, pong)
    seconds = time.perf_counter() - started
    os.waitpid(child, 0)
    return seconds / round_trips * 1e6, leftover(impl, ping, pong)


def post_trywait(impl, calls: int):
    """Nanoseconds per post + successful trywait in one process, and counts left."""
    semaphore = impl.make(0)
    post, trywait = impl.post, impl.trywait
    missed = 0
    started = time.perf_counter()
    for _ in range(calls):
        post(semaphore)
        missed += not trywait(semaphore)
    seconds = time.perf_counter() - started
    return seconds / calls * 1e9, missed + leftover(impl, semaphore)


def failed_trywait(impl, calls: int):
    """Nanoseconds per trywait on a semaphore at zero, and the counts it wrongly took."""
    semaphore = impl.make(0)
    trywait = impl.trywait
    taken = 0
    started = time.perf_counter()
    for _ in range(calls):
        taken += trywait(semaphore)
    seconds = time.perf_counter() - started
    return seconds / calls * 1e9, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["ctypes", "posix_ipc", "both"], default="both")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--round-trips", type=int, default=20000, help="per ping-pong trial")
    parser.add_argument("--calls", type=int, default=200000, help="per single-process trial")
    args = parser.parse_args()
    kinds = {"ctypes": [CtypesSemaphores], "posix_ipc": [PosixIpcSemaphores],
             "both": [CtypesSemaphores, PosixIpcSemaphores]}[args.impl]
    tests = [("ping-pong", "us/round trip", ping_pong, args.round_trips),
             ("post+trywait", "ns/pair", post_trywait, args.calls),
             ("failed trywait", "ns/call", failed_trywait, args.calls)]
    print(f"# {args.trials} trials each, {args.round_trips} round trips or {args.calls} calls "
          f"a trial; {os.cpu_count()} cores; python {sys.version.split()[0]}")
    print(f"{'implementation':>14} {'measurement':>15} {'median':>10} {'min':>10} "
          f"{'max':>10} {'unit':>14} {'#wrong':>6}")
    for kind in kinds:
        impl = kind()
        try:
            for test, unit, run, count in tests:
                run(impl, max(1, count // 10))  # warm up, not counted
                results = [run(impl, count) for _ in range(args.trials)]
                times = [time for time, _ in results]
                wrong = sum(1 for _, left in results if left)
                print(f"{impl.name:>14} {test:>15} {statistics.median(times):10.2f} "
                      f"{min(times):10.2f} {max(times):10.2f} {unit:>14} {wrong:6d}", flush=True)
        finally:
            impl.close()


if __name__ == "__main__":
    main()
