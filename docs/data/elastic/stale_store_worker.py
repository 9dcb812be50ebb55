"""A worker for stale_store.sh: gloo through torch alone, no collectives. On its first
start rank 1 fails after one all-reduce; started again, it comes 3 s late, as a worker
on a busy host does. Prints the store torchrun gave it and whether it got through."""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

rank, attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT")
print(f"rank {rank} restart {attempt}: store {os.environ['MASTER_ADDR']}:"
      f"{os.environ['MASTER_PORT']}", flush=True)
if rank == "1" and attempt != "0":
    time.sleep(3.0)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
dist.all_reduce(torch.ones(1))
if rank == "1" and attempt == "0":
    sys.exit(1)
time.sleep(2.0)
print(f"rank {rank} restart {attempt}: done", flush=True)
