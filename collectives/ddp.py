"""`collectives.DistributedDataParallel`: torch's DDP, built from the pieces here.

A script written for torch's DDP works by changing one import:

    from collectives import DistributedDataParallel as DDP
    model = DDP(model)                    # broadcasts rank 0's parameters and buffers
    loss_fn(model(x), y).backward()       # buckets are averaged during backward
    optimizer.step()

What happens underneath, in order:
1. Wrapping: the ranks check that their models have the same parameter names, shapes
   and dtypes (a clear error if not), then rank 0's parameters and buffers are
   broadcast so every replica starts identical.
2. Each forward: buffers (BatchNorm statistics) are broadcast from rank 0 first, as
   DDP's broadcast_buffers=True.
3. Each backward: the bucketer (bucketer.py) hands each complete bucket to the sync
   strategy (by default `allreduce`, see sync/allreduce.py) on a comm thread; when
   backward returns, every .grad holds the average over ranks.
4. `no_sync()`: gradients accumulate locally; the next backward outside it reduces
   the accumulated sum, as torch's.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Optional

from torch import nn

from .api import broadcast_coalesced, gather_rows
from .bootstrap import get_comm
from .bucketer import Bucketer
from .sync import SyncStrategy, create
from .transport import Transport


def check_same_model(module: nn.Module, comm: Transport) -> None:
    """Raise on every rank if the ranks' models differ in names, shapes or dtypes."""
    described = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in
                 list(module.named_parameters()) + list(module.named_buffers())]
    numel = sum(p.numel() for p in module.parameters())
    row = [len(described), numel, zlib.crc32(";".join(described).encode())]
    rows = gather_rows(comm, row)
    for peer, other in enumerate(rows):
        if other != rows[0]:
            raise RuntimeError(
                f"the model differs across ranks: rank 0 has {rows[0][0]} parameters and "
                f"buffers with {rows[0][1]} parameter elements, rank {peer} has {other[0]} "
                f"with {other[1]}" + ("" if other[:2] != rows[0][:2] else
                                      " (same sizes, different names, shapes or dtypes)"))


def check_same_buckets(bucketer: Bucketer, comm: Transport) -> None:
    """Raise on every rank if the ranks cut their gradients into different buckets."""
    sizes = [bucket.buffer.numel() for bucket in bucketer.buckets]
    rows = gather_rows(comm, [len(sizes), zlib.crc32(repr(sizes).encode())])
    for peer, other in enumerate(rows):
        if other != rows[0]:
            raise RuntimeError(
                f"the gradient buckets differ across ranks: rank 0 has {rows[0][0]} buckets, "
                f"rank {peer} has {other[0]}" + ("" if other[0] != rows[0][0] else
                                                  " of other sizes")
                + ": is bucket_cap_mb the same on every rank?")


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper with torch DDP's constructor arguments and behaviour.

    algorithm: the collective for each bucket ("ring", "halving-doubling", "tree",
               "native", "auto"); ignored when `sync` is given.
    sync:      a SyncStrategy instance or registered name (default "allreduce").
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None,
                 broadcast_buffers: bool = True, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 algorithm: str = "ring", sync=None, comm: Optional[Transport] = None,
                 first_bucket_mb: float = 1.0):
        super().__init__()
        self.module = module
        self.comm = comm or get_comm()
        self.broadcast_buffers = broadcast_buffers
        check_same_model(module, self.comm)
        broadcast_coalesced([p.data for p in module.parameters()] +
                            [b for b in module.buffers()], src=0, comm=self.comm)
        if sync is None:
            sync = create("allreduce", algorithm=algorithm)
        elif isinstance(sync, str):
            sync = create(sync)
        self.sync: SyncStrategy = sync
        self.sync.setup(module, self.comm)
        names = {id(p): name for name, p in module.named_parameters()}
        self.bucketer = None
        if self.sync.uses_buckets:
            self.bucketer = Bucketer(module.parameters(), self.sync.reduce_bucket, self.comm,
                                     bucket_cap_mb=bucket_cap_mb,
                                     first_bucket_mb=first_bucket_mb,
                                     gradient_as_bucket_view=gradient_as_bucket_view,
                                     find_unused_parameters=find_unused_parameters,
                                     names=names)
            check_same_buckets(self.bucketer, self.comm)

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and self.sync.forward_buffer_sync:
            buffers = list(self.module.buffers())
            if buffers:  # rank 0's BatchNorm statistics are everyone's
                broadcast_coalesced(buffers, src=0, comm=self.comm)
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block syncs them."""
        if self.bucketer is None:
            yield
            return
        previous = self.bucketer.enabled
        self.bucketer.enabled = False
        try:
            yield
        finally:
            self.bucketer.enabled = previous
