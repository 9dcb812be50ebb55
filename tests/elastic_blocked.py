"""Two members of an elastic world, for tests/test_elastic.py: `waiter` blocks receiving
from the other, which drops its communicator instead of sending (as a survivor does
when it moves on to the next generation). `dropper` lets go of it; `holder` drops it
as after a failure while still holding a reference (as a thread stuck in one of its
calls, or a traceback, would), and stays alive until its standard input closes (the
test closes it once the waiter is done), so that only the drop can end the wait.
Prints how long the waiter waited for its PeerError; its timeout is 60 s.

    python elastic_blocked.py PORT waiter|dropper|holder
"""
import sys
import time

import torch

import collectives
from collectives.elastic.generations import ElasticWorld


def main():
    port, role = int(sys.argv[1]), sys.argv[2]
    world = ElasticWorld("127.0.0.1", port, timeout=60, member_id=role, dead_after=2.0)
    comm = world.join(expected=2)
    collectives.broadcast(torch.zeros(1), src=0, comm=comm)  # both are connected
    other = 1 - comm.rank
    if role in ("dropper", "holder"):
        time.sleep(1.0)  # the waiter is blocked by now
        held = comm.pg if role == "holder" else None  # noqa: F841 (its gloo group, kept)
        world.drop(failed=role == "holder")
        sys.stdin.read()  # alive, beating, and no longer in that communicator
    else:
        started = time.monotonic()
        try:
            comm.recv(torch.zeros(1), other)
            print("received", flush=True)
        except collectives.PeerError as error:
            print(f"waited {time.monotonic() - started:.2f} s: {error}", flush=True)
    world.leave()


if __name__ == "__main__":
    main()
