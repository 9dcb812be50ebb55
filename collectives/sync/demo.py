"""`demo`: DeMo, decoupled momentum. Each rank keeps its own momentum and sends only its
fastest-moving components: the top-k DCT coefficients of every chunk.

Communicates: every optimizer step, one all-gather of k coefficients (value and
position) per chunk of every parameter, from every rank; the momentum itself never
travels. After each backward, on rank r, for every parameter:

    m_r   <- beta m_r + grad_r                   local momentum (`momentum` beta)
    q_r    = top_k(DCT(m_r))                     per chunk: its k largest |coefficients|
    m_r   <- m_r - IDCT(q_r)                     what was sent leaves the momentum; the
                                                 rest keeps accumulating (error feedback
                                                 by momentum subtraction)
    Q      = (1/n) sum over ranks of q_r         all-gathered, the same on every rank
    grad  <- sign(IDCT(Q))                       the paper's signum step: the trainer's
                                                 optimizer then steps on this gradient

         grad_r ─ m_r ─ DCT per chunk ─ top-k ─┐                  ┌─ average ─ IDCT ─ sign
                  ^                            ├─ all-gather ─────┤       (every rank)
                  └──── m_r - IDCT(q_r) ───────┘    (ring)        └─▶ .grad

Chunks, as the paper's code cuts them. A matrix (a tensor of two or more dimensions,
seen as rows x the rest) is cut into tiles of h x w, h the largest divisor of its rows
and w of its columns not above `chunk` (64: tiles of 64 x 64 = 4096 entries); a vector
into runs of the largest divisor of its length not above `chunk`. Each tile goes
through the orthonormal DCT-II along both of its sides (D_h T D_w^T, D the DCT matrix:
no FFT, no new dependency) and keeps its k = min(`topk`, h w) coefficients of largest
magnitude; k = 32 of a 64 x 64 tile keeps 0.8 % of it. A dimension with no divisor
near `chunk` (a prime) gets thin tiles, whose k may be all of them, as in the paper's
code.

Sent per step: for a parameter cut into T tiles, T k values (float32) and T k
positions inside their tile (int16 when no tile has more than 32768 entries, else
int32 for the whole model); P, the sum over the parameters, travels in one ring
all-gather: each rank sends (n-1) P bytes per step (`cost`), 6 bytes per kept
coefficient with int16 positions. A 64 x 64 tile: 32 x 6 = 192 bytes for 4096 x 4 of
float32 gradient, 1/85.

The optimizer. The paper steps x <- x - lr sign(IDCT(Q)) (signum; decoupled weight
decay beside it). Here the rank's optimizer receives sign(IDCT(Q)) as the gradient and
steps on it, so the natural pairing is plain SGD: `--optimizer sgd --momentum 0`
(the momentum is DeMo's own), with --clip-grad 0 (a sign gradient's norm is the square
root of the parameter count, so a clip to 1 would shrink every step). Another optimizer
(AdamW, SGD with momentum) takes it as it takes any gradient. Every rank decodes the
same Q and steps alike: the replicas stay equal, as with allreduce.

A step whose decoded average is not finite (an inf or NaN on any rank: one always
ranks among the largest coefficients, so it is sent) leaves every momentum as it was,
and the gradients are the non-finite average, so the loop (--skip-nonfinite, or
GradScaler) skips the step on every rank. With fp16 AMP the momentum is kept
unscaled (each gradient divided by its step's loss scale), and the sign is handed over
multiplied by the scale, for the loop to unscale: a plain loop with GradScaler must
therefore set `model.sync.grad_scaler = scaler` (the trainer does), or every step would
be divided by a scale the sign never carried.

Literature: Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization" (arXiv
2411.19870, 2024; its second version with Chen, Su and Liu, ICLR 2026): the algorithm
above, with signum, and up to 85x fewer bytes per step than AdamW with DDP at matching
loss. Reference code github.com/bloc97/DeMo (demo.py), whose defaults are ours: chunks
of 64 (x 64), top-k 32, momentum decay beta 0.999. Where ours differs from that code:
its momentum accumulates lr x grad, ours the gradient (the learning rate is the
optimizer's; the sign of the decoded average is the same unless the rate changes
between steps); it averages each coefficient over the ranks that sent it, ours over
all ranks, as the algorithm's Q (the sign of the decoded average can differ only in a
tile that holds coefficients some ranks did not send); and its positions travel as
int64, ours as int16.

Options: momentum beta (0.999), chunk (64), topk k (32), algorithm (the all-gather's:
"auto", "ring" or "native"; an all-reduce algorithm's name alone, as the trainer's
--algorithm gives, gathers with the ring; the bytes are the same for all).

Checkpoint: each rank's momentum (they differ by rank).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple, Union

import torch

from .. import algorithms, api
from .base import Shape, StepCost, SyncStrategy, element_count, finite, register, state_dtype
from .options import check_algorithm, need

INT16_TILE = 32768  # the largest tile whose positions (0 .. h w - 1) fit int16


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is not above `at_most`."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


class Tiling(NamedTuple):
    """How one parameter, seen as rows x cols, is cut into h x w tiles."""
    rows: int
    cols: int
    h: int
    w: int
    k: int  # coefficients kept per tile

    @property
    def tiles(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)


def tiling(shape: Union[int, Sequence[int]], chunk: int, topk: int) -> Tiling:
    """A parameter of `shape` (a number: a vector of that length) cut as the paper's
    code cuts it: matrices into tiles, vectors into runs."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = math.prod(shape)
    rows, cols = (shape[0], numel // shape[0]) if len(shape) >= 2 else (1, numel)
    h, w = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
    return Tiling(rows, cols, h, w, min(topk, h * w))


def index_dtype(tilings: Sequence[Tiling]) -> torch.dtype:
    return torch.int16 if all(t.h * t.w <= INT16_TILE for t in tilings) else torch.int32


def dct_matrix(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II: row f holds cos(pi (j + 1/2) f / size) over j, scaled by
    sqrt(1/size) (f = 0) or sqrt(2/size); its transpose is its inverse (the DCT-III)."""
    j = torch.arange(size, dtype=torch.float64)
    basis = torch.cos(math.pi * (j[None, :] + 0.5) * j[:, None] / size) * math.sqrt(2 / size)
    basis[0] = math.sqrt(1 / size)
    return basis.to(dtype=dtype, device=device)


class Packet(NamedTuple):
    """What one rank sends for one parameter at a step."""
    indices: torch.Tensor  # (T, k) int16/int32: positions inside each tile, ascending
    values: torch.Tensor   # (T, k) float32: the coefficients there


@register("demo")
class DeMo(SyncStrategy):
    uses_buckets = False

    def __init__(self, momentum: float = 0.999, chunk: int = 64, topk: int = 32,
                 algorithm: str = "auto"):
        need(0 <= momentum < 1, self.name, "momentum", momentum, "in [0, 1)")
        need(chunk >= 1, self.name, "chunk", chunk, "at least 1")
        need(topk >= 1, self.name, "topk", topk, "at least 1")
        check_algorithm(self.name, algorithm)
        self.beta, self.chunk, self.topk, self.algorithm = momentum, chunk, topk, algorithm
        # an all-reduce algorithm's name (the trainer's --algorithm) gathers with the ring
        self.gather_algorithm = (algorithm if algorithm in algorithms.names("all_gather")
                                 else "ring")

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.params = [p for p in model.parameters() if p.requires_grad and p.numel()]
        self.tilings = [tiling(p.shape, self.chunk, self.topk) for p in self.params]
        self.index_dtype = index_dtype(self.tilings)
        self.momenta = [torch.zeros_like(p, dtype=state_dtype(p)) for p in self.params]
        self.bases: Dict[Tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def cost(self, shapes: Sequence[Shape], world_size: int) -> StepCost:
        """`shapes`: each parameter's (a matrix's tiles depend on it; an int: a vector)."""
        tilings = [tiling(shape, self.chunk, self.topk) for shape in shapes
                   if element_count(shape)]
        per_value = 4 + torch.tensor([], dtype=index_dtype(tilings)).element_size()
        payload = sum(t.tiles * t.k for t in tilings) * per_value
        return StepCost((world_size - 1) * payload, 1)

    def basis(self, size: int, like: torch.Tensor) -> torch.Tensor:
        key = (size, like.dtype, like.device)
        if key not in self.bases:
            self.bases[key] = dct_matrix(size, like.dtype, like.device)
        return self.bases[key]

    def to_coefficients(self, x: torch.Tensor, t: Tiling) -> torch.Tensor:
        """(T, h w): the 2-D DCT of every tile of `x` (any shape of rows x cols)."""
        tiles = x.reshape(t.rows // t.h, t.h, t.cols // t.w, t.w).transpose(1, 2)
        coefficients = self.basis(t.h, x) @ tiles @ self.basis(t.w, x).T
        return coefficients.reshape(t.tiles, t.h * t.w)

    def from_coefficients(self, coefficients: torch.Tensor, t: Tiling) -> torch.Tensor:
        """to_coefficients' inverse, as a (rows, cols) tensor."""
        tiles = coefficients.reshape(t.rows // t.h, t.cols // t.w, t.h, t.w)
        x = self.basis(t.h, coefficients).T @ tiles @ self.basis(t.w, coefficients)
        return x.transpose(1, 2).reshape(t.rows, t.cols)

    def compress(self, momentum: torch.Tensor, t: Tiling) -> Tuple[Packet, torch.Tensor]:
        """The packet of the k largest coefficients of each tile, and what they stand
        for in the parameter's own shape (what leaves the momentum)."""
        coefficients = self.to_coefficients(momentum, t)
        indices = coefficients.abs().topk(t.k, dim=1, sorted=False).indices.sort(dim=1).values
        values = coefficients.gather(1, indices).float()  # as it travels
        kept = torch.zeros_like(coefficients).scatter_(1, indices, values.to(coefficients))
        return (Packet(indices.to(self.index_dtype), values),
                self.from_coefficients(kept, t).view_as(momentum))

    def encode(self, packets: List[Packet]) -> torch.Tensor:
        """The packets as one byte buffer: every value (float32), then every position."""
        values = torch.cat([p.values.reshape(-1) for p in packets])
        indices = torch.cat([p.indices.reshape(-1) for p in packets])
        return torch.cat([values.view(torch.uint8), indices.view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> List[Packet]:
        """encode's inverse, for one rank's bytes."""
        counts = [t.tiles * t.k for t in self.tilings]
        split = 4 * sum(counts)
        values = payload[:split].clone().view(torch.float32).split(counts)
        indices = payload[split:].clone().view(self.index_dtype).split(counts)
        return [Packet(i.view(t.tiles, t.k), v.view(t.tiles, t.k))
                for i, v, t in zip(indices, values, self.tilings)]

    @torch.no_grad()
    def after_backward(self, model: torch.nn.Module) -> None:
        n, scale = self.comm.world_size, self.gradient_scale()
        momenta, packets = [], []
        for p, m, t in zip(self.params, self.momenta, self.tilings):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            # kept unscaled: the next step's loss scale may differ (fp16 AMP)
            momentum = m * self.beta + grad / scale
            packet, sent = self.compress(momentum, t)
            momenta.append(momentum.sub_(sent))
            packets.append(packet)
        payload = self.encode(packets)
        gathered = payload.new_empty(n * payload.numel())
        api.all_gather(gathered, payload, algorithm=self.gather_algorithm, comm=self.comm,
                       check=False)
        totals = [torch.zeros(t.tiles, t.h * t.w, dtype=m.dtype, device=m.device)
                  for m, t in zip(self.momenta, self.tilings)]
        for rank_bytes in gathered.view(n, -1):
            for total, packet in zip(totals, self.decode(rank_bytes)):
                total.scatter_add_(1, packet.indices.long().to(total.device),
                                   packet.values.to(total))
        decoded = [self.from_coefficients(total / n, t).view_as(p)
                   for total, t, p in zip(totals, self.tilings, self.params)]
        # Every rank holds the same average: all take the step, or all pass it on
        # non-finite for the loop to skip, their momenta untouched.
        step_is_finite = finite(decoded)
        for p, m, momentum, average in zip(self.params, self.momenta, momenta, decoded):
            if step_is_finite:
                m.copy_(momentum)
                average = average.sign_()
            average.mul_(scale)
            if p.grad is None:
                p.grad = average.to(p.dtype)
            else:
                p.grad.copy_(average)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's momentum of each parameter, by position."""
        return {"momenta": [m.clone() for m in self.momenta]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        shapes = [tuple(m.shape) for m in state["momenta"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(f"demo: the checkpoint's momenta have shapes {shapes}, this "
                             f"model's parameters {[tuple(p.shape) for p in self.params]}")
        for m, saved in zip(self.momenta, state["momenta"]):
            m.copy_(saved)  # onto this model's device (a checkpoint loads on the CPU)
