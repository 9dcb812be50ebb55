"""torch's PowerSGD hook across a change of DDP's bucket layout (what a resume meets).

torch's powerSGD_hook keeps its state per bucket, as flat tensors in the order of the
bucket's gradients: `error_dict[i]` (the error feedback, every gradient of bucket i one
after another) and `q_memory_dict[i]` (the warm-started Q's of the matrices it
compresses, grouped by shape). torch's DDP lays its buckets out twice: at wrapping, in
the order of model.parameters(), and again after the first step, in the order the
gradients became ready ("rebuilt buckets"):

    wrapping:     bucket 0 = [conv1.w, bn1.w, bn1.b, conv2.w, ..., fc.w, fc.b]
    after step 1: bucket 0 = [fc.b, fc.w, ..., conv2.w, bn1.w, bn1.b, conv1.w]

An uninterrupted run compresses only after the rebuild (torch's start_powerSGD_iter > 1
is there for this), so its state is always in the rebuilt layout. A resumed run starts
a new DDP: its first step runs in the wrapping layout with state saved in the rebuilt
one, and its second in the rebuilt layout with state written in the wrapping one. Each
bucket's flat tensors would then be read against the wrong gradients.

`LayoutKeeper` wraps the hook and remembers the layout each bucket's state was written
in (the indices in model.parameters() of its gradients, in order). When a bucket comes
with another layout, every bucket's state is first cut into one piece per parameter
(`pool`), and each bucket then takes its pieces, in its new order, when it comes: the
hook sees state in its own layout. PowerSGD's arithmetic is per matrix and its
all-reduces elementwise, so the order of the pieces changes no number in the state. (A
ring still sums an element of a bucket in an order that depends on where the element
sits, so on 3 or more ranks the first step's reduced values may differ in the last
bits; on 2 ranks a + b = b + a, and the resumed run goes on bit for bit.) P's memory is only allocated (the hook overwrites it with M Q
before reading it), so P needs no moving.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

Layout = Tuple[int, ...]  # a bucket's gradients, as indices in model.parameters()


class LayoutKeeper:
    """powerSGD_hook, with its state moved into each bucket's layout when it changes."""

    def __init__(self, model: torch.nn.Module, state: powerSGD_hook.PowerSGDState):
        self.params = list(model.parameters())
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.state = state
        self.layouts: Dict[int, Layout] = {}  # bucket index -> the layout of its state
        # parameter index -> (its error, its Q or None), during a step whose layout changed
        self.pool: Optional[Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
        self.called = set()  # the buckets this step has reduced so far

    def hook(self, state: powerSGD_hook.PowerSGDState, bucket):
        """The comm hook DDP calls for each bucket: torch's, on state in this layout."""
        layout = tuple(self.index[id(p)] for p in bucket.parameters())
        index = bucket.index()
        if self.layouts.get(index, layout) != layout and self.pool is None:
            self.pool = self._cut_into_pieces(done=self.called)
        if self.pool is not None:
            self._assemble(index, layout)
        self.layouts[index] = layout
        self.called.add(index)
        if bucket.is_last():  # DDP's last bucket of the step: every bucket has moved
            self.called, self.pool = set(), None
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def _q_slices(self, layout: Layout) -> List[Tuple[int, int, int, int]]:
        """(parameter index, start and length of its Q, length of its P) for each matrix
        the hook compresses in a bucket of this layout, in the order the hook lays the
        Q's out: grouped by matrix shape, shapes in order of first appearance. A
        parameter is an n x m matrix (n its first dimension), compressed at rank
        r = min(n, m, rank) where _should_compress says it gains enough."""
        by_shape: Dict[tuple, List[Tuple[int, int]]] = defaultdict(list)
        for i in layout:
            n = self.params[i].shape[0]
            m = self.params[i].numel() // n
            rank = min(n, m, self.state.matrix_approximation_rank)
            if powerSGD_hook._should_compress(n, m, rank, self.state.min_compression_rate)[0]:
                by_shape[(n, m)].append((i, rank))
        slices, start = [], 0
        for (n, m), members in by_shape.items():
            for i, rank in members:
                slices.append((i, start, m * rank, n * rank))
                start += m * rank
        return slices

    def _cut_into_pieces(self, done: set) -> Dict[int, Tuple[torch.Tensor,
                                                             Optional[torch.Tensor]]]:
        """The error and Q of every bucket not `done` this step (whose state is still
        the last step's, in its old layout), one piece per parameter, taken out of the
        hook's state."""
        state, pool = self.state, {}
        for index, layout in self.layouts.items():
            if index in done:
                continue
            error = state.error_dict.pop(index, None)
            q_memory = state.q_memory_dict.pop(index, None)
            state.p_memory_dict.pop(index, None)
            if error is None:
                continue
            qs = {}
            if q_memory is not None:
                qs = {i: q_memory[start:start + length]
                      for i, start, length, _ in self._q_slices(layout)}
            offset = 0
            for i in layout:
                numel = self.params[i].numel()
                pool[i] = (error[offset:offset + numel], qs.get(i))
                offset += numel
        return pool

    def _assemble(self, index: int, layout: Layout) -> None:
        """Bucket `index`'s error and Q in `layout`, from the pool's pieces (when the pool
        holds them all; else the hook starts this bucket afresh, as at its first step).
        P's memory is allocated only: the hook writes M Q into it before reading it."""
        state, pool = self.state, self.pool
        if all(i in pool for i in layout):
            state.error_dict[index] = torch.cat([pool[i][0] for i in layout])
            slices = self._q_slices(layout)
            if slices and all(pool[i][1] is not None for i, *_ in slices):
                q_memory = torch.cat([pool[i][1] for i, *_ in slices])
                state.q_memory_dict[index] = q_memory
                state.p_memory_dict[index] = q_memory.new_empty(
                    sum(p_length for *_, p_length in slices))
        for i in layout:
            pool.pop(i, None)
