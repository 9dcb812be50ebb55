"""gloo and a peer that dies in the middle of a message (docs/elastic.md).

Two processes on this host, plain torch.distributed gloo: rank 0 receives 1 GiB from
rank 1, which is SIGKILLed either before it sends (`before`) or 30 ms into sending
(`during`). Prints how long rank 0's receive took to fail.

    python docs/data/elastic/gloo_mid_message.py        # about 25 s

Measured (torch 2.14.1): `before` fails at once ("Connection reset by peer");
`during` waits out its whole timeout (twice in two runs), though the pair is closed:
the receive had begun (its header had arrived), and gloo fails the receives still
waiting for a header when a pair closes, not the one under way (gloo's
tcp/pair.cc). Nothing on this side can end that wait sooner: a gloo receive's
is_completed() stays False until wait() is called, and a wait with a shorter timeout
closes the pair when it expires.
"""
import multiprocessing
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

MESSAGE = 256 * 2**20  # float32: 1 GiB, long enough to be cut in the middle
TIMEOUT = 10.0


def rank_1(port: int, when: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=TIMEOUT))
    message = torch.ones(MESSAGE)
    store.wait(["posted"])  # rank 0 waits for the message
    if when == "during":
        group.send([message], 0, 0)
        time.sleep(0.03)
    os.kill(os.getpid(), signal.SIGKILL)


def rank_0(port: int, when: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=TIMEOUT))
    message = torch.empty(MESSAGE)
    receive = group.recv([message], 1, 0)
    started = time.perf_counter()
    store.set("posted", "1")
    try:
        receive.wait()
        outcome = "completed"
    except RuntimeError as error:
        outcome = f"failed ({str(error).splitlines()[0].split('] ')[-1][:60]})"
    print(f"{when:6s}: the receive {outcome}, {time.perf_counter() - started:.1f} s after "
          f"it was posted (timeout {TIMEOUT:g} s)", flush=True)


if __name__ == "__main__":
    for port, when in ((29881, "before"), (29882, "during")):
        processes = [multiprocessing.Process(target=target, args=(port, when))
                     for target in (rank_0, rank_1)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(TIMEOUT + 30)
