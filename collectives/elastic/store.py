"""The membership store: a torch TCPStore in a process of its own, outliving every rank.

    python -m collectives.elastic.store --port 29400     # prints where it listens, serves

An elastic job keeps its membership (membership.py) here, not in a rank: a rank may be
the one that dies. Start it where no rank's failure takes it down: the launching
host, or a service node.

Its own failure mode is plain: it is one process. If it dies, the job's membership can
no longer change (the next change raises MembershipError naming it); the ranks of
the generation that runs train on.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

import torch.distributed as dist


def serve(port: int = 0) -> dist.TCPStore:
    """A store listening on every address of this host, on `port` (0: a free one; the
    store's `.port` says which). It serves while the returned object lives."""
    return dist.TCPStore("0.0.0.0", port, is_master=True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives.elastic.store",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=29400,
                        help="TCP port to listen on (default 29400; 0: any free one)")
    args = parser.parse_args(argv)
    try:
        store = serve(args.port)
    except RuntimeError as error:
        parser.error(f"cannot listen on port {args.port}: {error}")
    print(f"membership store listening on port {store.port}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
