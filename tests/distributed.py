"""Run a function on N spawned ranks, like fairscale's tests, but with a hard deadline.

    def check_x(comm, size):          # module level, so spawned ranks can import it
        ...
        return something_picklable

    results = run_world(check_x, world_size=4, args=(10,))   # [rank0's, rank1's, ...]

Each rank is a fresh process forked from multiprocessing's forkserver, which has imported
torch once: a rank starts in a fraction of a second instead of the seconds torch's import
takes, most of a short test (the server holds no state of any test: it only imported).
Each rank gets torchrun-style variables and calls collectives.init(backend). The first
rank that raises fails the test with its traceback; a rank that hangs past `timeout`
gets every rank killed and the test fails with TimeoutError. Nothing can hang CI.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback


def _rank_main(payload, rank, world_size, port, backend, init_timeout, results, shm,
               environ):
    # The forkserver's environment is the one it started with: take the caller's now (a
    # test may set COLLECTIVES_DEBUG, say, for one run), before anything imports
    # collectives; so the function and its arguments come pickled, to be loaded after.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "SLURM_PROCID", "SLURM_NTASKS", "PMIX_RANK"):
        os.environ.pop(name, None)
    try:
        import torch
        torch.set_num_threads(1)
        import collectives
        function, args = pickle.loads(payload)
        comm = (None if backend is None else  # None: the function joins by itself
                collectives.init(backend=backend, timeout=init_timeout, shm=shm))
        value = function(comm, *args)
        # By value: a tensor put on the queue as it is goes as a file descriptor that
        # this process must still hold when the caller reads it, and it may have exited.
        results.put((rank, "ok", pickle.dumps(value)))
        collectives.destroy()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _rank_context():
    """multiprocessing's forkserver, with torch (and torchvision, for the models) imported
    in the server before it forks any rank."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchvision"])
    return context


def run_world(function, world_size, args=(), backend="gloo", timeout=120.0,
              init_timeout=60.0, may_die=(), shm=None):
    """Run function(comm, *args) on `world_size` ranks; return the per-rank results.

    shm: passed to collectives.init ("on", "off"; None: the default, shared memory
    when possible). backend None: no init, the function gets None and joins itself.

    Ranks listed in `may_die` are not waited for: they may die, hang or report (their
    slot is None unless they reported before the others finished).
    """
    from ports import free_port

    context = _rank_context()
    results = context.Queue()
    port = free_port()
    payload = pickle.dumps((function, args))
    ranks = [context.Process(target=_rank_main, daemon=True,
                             args=(payload, rank, world_size, port, backend,
                                   init_timeout, results, shm, dict(os.environ)))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    values = {}
    try:
        while any(rank not in values for rank in range(world_size) if rank not in may_die):
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(values))} "
                                       f"did not finish within {timeout} s")
                dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)
                        and r not in values and r not in may_die]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code "
                                       f"{ranks[dead[0]].exitcode}")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for process in ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [values.get(rank) for rank in range(world_size)]


def run_world_collecting_errors(function, world_size, args=(), timeout=60.0, **kwargs):
    """Like run_world, but each rank's exception comes back as a string result instead."""
    return run_world(_catching, world_size, (function, args), timeout=timeout, **kwargs)


def _catching(comm, function, args):
    try:
        return ("ok", function(comm, *args))
    except Exception as error:  # the exception is the result under test
        return ("raised", f"{type(error).__name__}: {error}")
