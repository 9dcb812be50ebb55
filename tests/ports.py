"""A free TCP port for a test's rendezvous, that nothing else running can take meanwhile.

`collectives.launch.spawn.free_port()` asks the kernel for any free port and closes it;
the rank that binds it does so a moment later (seconds, for torchrun, which imports
torch first). Meanwhile every connection the machine opens takes an ephemeral port of
the kernel's range (32768-60999 by default), and with tests running on two workers the
other worker opens plenty: one could take ours. So the tests draw their ports below
that range, where the kernel hands none out, from a block of their own per pytest-xdist
worker ($PYTEST_XDIST_WORKER), and check that nothing listens there yet.
"""
import os
import random
import socket

LOWEST, HIGHEST = 20000, 32000  # below the kernel's ephemeral ports


def _block() -> range:
    """This worker's ports: the range split evenly among the workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    size = (HIGHEST - LOWEST) // max(count, 1)
    return range(LOWEST + index * size, LOWEST + (index + 1) * size)


def free_port() -> int:
    """A port of this worker's block that nothing is bound to now."""
    block = _block()
    for _ in range(200):
        port = random.choice(block)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue  # in use, or a closed connection's TIME_WAIT holds it
            return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}")
