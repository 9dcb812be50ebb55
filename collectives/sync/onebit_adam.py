"""`onebit-adam`: 1-bit Adam. Adam's full-precision warm-up, then the variance frozen and
only the momentum averaged, each element as one bit, with the compression error fed back
on both sides.

Communicates: every optimizer step, after backward. The first `freeze_step` steps (the
warm-up) all-reduce the gradients in full precision and run Adam on their average. Then
v stays as the warm-up left it and each step is one compressed all-reduce of the
momentum: an all-to-all of signs, an all-gather of signs. On rank r of n, for every
parameter, at a step after the warm-up:

    m_r  <- b1 m + (1 - b1) g_r                   local momentum, from this rank's own
                                                  gradient (m: last step's, the same on
                                                  every rank)
    c     = m_r + e_w                             worker: add its error, cut c into n
    s_w   = ||c|| / sqrt(len c)                   chunks (chunk p is server p's); one
    e_w  <- c - s_w sign(c)                       scale, signs 8 to a byte
         -- all-to-all: to rank p, s_w and the signs of chunk p --
    a     = (1/n) sum_q s_w,q sign(c_q)[chunk r]  server r: the average of what the
    z     = a + e_s                               ranks sent for its chunk, plus its
    s_s   = ||z|| / sqrt(len z)                   error; compressed again
    e_s  <- z - s_s sign(z)
         -- all-gather: every server's s_s and signs --
    m     = [s_s,0 sign(z_0), ..., s_s,n-1 sign(z_n-1)]   the same on every rank
    grad <- m / (sqrt(v) + eps)                   the direction: the trainer's optimizer
                                                  steps on it as the gradient

    rank r, as a worker: g_r ─▶ m_r ─▶ + e_w ─▶ sign, s_w ─▶ all-to-all ─────────┐
                                                           (chunk p to rank p)  │
    as server r:  ┌─ sign, s_s ◀─ + e_s ◀─ average ◀─ chunk r from every rank ◀──┘
                  └─▶ all-gather (ring) ─▶ m, the same everywhere ─▶ .grad = m / (sqrt(v) + eps)

sign(x) is +1 for x >= 0 (zero included: one bit has no zero) and -1 below, as
DeepSpeed's. The worker's scale covers its whole (padded) parameter, one per
parameter, as DeepSpeed's compressed_allreduce takes one scale for the buffer it is
given; the server's covers its chunk. A parameter of N elements is padded with zeros
to P, the next multiple of 8 n, so that each of its n chunks is L = P / n elements,
L / 8 whole bytes: the padding is compressed (and counted) with the rest and cut off
when decoding. Every scale travels as float32, and the errors are taken against the
scale as it travels, so that they are exactly what the receivers lost.

The warm-up, steps 1 .. freeze_step: the gradients of all parameters in one buffer,
one all-reduce (average, `algorithm`) after backward (not overlapped with backward as
`allreduce`'s buckets are), then Adam on every rank alike:

    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2,   grad <- m / (sqrt(v) + eps)

No bias correction, as the paper's algorithm and DeepSpeed's OnebitAdam (its
`bias_correction` flag is accepted and never read); `bias_correction=true` divides m
by 1 - b1^t and v by 1 - b2^t (t: the step; after the warm-up v's stays at its
freeze_step's), as torch's Adam does, which makes the warm-up torch's Adam exactly.
Without it a warm-up short beside 1 / (1 - b2) steps freezes v far below its size:
after 200 steps at b2 = 0.999, 18 % of it, and every later step is 2.3x as long.
DeepSpeed's warm-ups (thousands of steps) do not see this; a short run should set
bias_correction=true.

How long a warm-up. One bit per element decodes every element of a chunk to the same
magnitude, s_s, so an element whose frozen v is small steps by s_s / sqrt(v): error
feedback makes the steps right on average over steps, not each one. DeepSpeed's
tutorial advises a warm-up of 15-25 % of the run, until v has settled; a warm-up of a
few steps, while the gradients still change fast, can diverge.

The optimizer: the strategy is the Adam, so the trainer's optimizer must only step
x <- x - lr grad: `--optimizer sgd --momentum 0 --clip-grad 0`, with `--lr` Adam's
rate (lr is the optimizer's, never an option here: its schedule applies). Weight
decay stays the optimizer's: SGD's weight_decay wd steps x <- x - lr (grad + wd x),
which is DeepSpeed's `update += weight_decay * p` (AdamW's decoupled decay).

Zeros. One bit has no zero: where the frozen v is exactly 0 (an element that had no
gradient in all of the warm-up) the decoded momentum is still +-s_s, and m / eps would
throw that element far away. DeepSpeed asks its user for a mask (exp_avg_mask) that
zeroes such momentum after each compressed all-reduce; here the mask is v != 0, taken
from v itself, the same on every rank.

Sent per step after the warm-up, by each rank, for parameters of N_i elements:

    L_i = ceil(N_i / (8 n)) 8                   elements in each chunk of parameter i
    B   = sum over parameters of (4 + L_i / 8)  one piece: the float32 scale and the
                                                signs of one chunk of every parameter
    all-to-all: (n - 1) B     all-gather (ring): (n - 1) B
    bytes per step = 2 (n - 1) B ;  collectives per step = 2                     (`cost`)

about 2 (n - 1) / n x N / 8 bytes: 1/32 of a float32 ring all-reduce's
2 (n - 1) / n x 4 N. Each warm-up step all-reduces every gradient, 4 N bytes in
float32 (a ring: 2 (n - 1) / n x 4 N sent per rank), one collective. One rank (n = 1)
sends nothing and compresses nothing, as DeepSpeed's.

Every rank decodes the same m and holds the same v, so all hand over the same
direction and the replicas stay equal. A step whose average (warm-up) or decoded m is
not finite (an inf or NaN on any rank: in the warm-up it survives the sum; after, it
makes that rank's scale inf or NaN, and every server's chunk with it) leaves m, v,
both errors and the step count as they were, and the non-finite values are handed on
for the loop to skip (--skip-nonfinite, or GradScaler) on every rank. With fp16 AMP
the state is kept unscaled (each gradient divided by its step's loss scale) and the
direction is handed over multiplied by the scale, for the loop to unscale: a plain
loop with GradScaler must set `model.sync.grad_scaler = scaler` (the trainer does).

Literature: Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence Speed" (ICML 2021,
arXiv 2102.02888): the rule above; up to 5x less communication volume than Adam and
the same convergence speed, up to 3.3x the throughput for BERT-Large pre-training on
up to 256 GPUs. Reference code: DeepSpeed's OnebitAdam
(deepspeed/runtime/fp16/onebit/adam.py) and compressed_allreduce
(deepspeed/runtime/comm/nccl.py, compressed.py), whose defaults b1, b2, eps these
are. freeze_step: DeepSpeed's tutorial advises 15-25 % of the run (its examples: 23000
steps for BERT-Large, 400 to fine-tune on SQuAD); the default, 200, is 20 % of the
trainer's 1000 steps for a GPT. Where ours differs from DeepSpeed's code: its first
step only fills m and v and leaves the parameters (its buffers' initialization),
ours steps; it pads each parameter to a multiple of n lcm(n, 8), ours to 8 n (whole
bytes per chunk either way; a worker scale divides by the padded length, so the two
differ by that); it sends each parameter's signs and scales in four collectives,
ours every parameter's in two; its exp_avg_mask is given, ours is v != 0; and it
resets the errors when it loads a checkpoint, ours saves and restores them.

Options: beta1 b1 (0.9), beta2 b2 (0.999), eps (1e-8), freeze_step (200),
bias_correction (false), algorithm (the warm-up's all-reduce, and the all-gather's:
an all-gather algorithm of that name, else the ring).

State: m and v, every parameter's end to end, in float32 (float64 where every
parameter is); the worker error on an n x S grid (row p: chunk p of every parameter,
side by side, S the sum of the L_i), the server error one row of S. A checkpoint keeps
them all (m and v alike on every rank, the errors this rank's) and the step count.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch

from .. import algorithms, api
from .base import Shape, StepCost, SyncStrategy, element_count, finite, register
from .options import check_algorithm, need

STATE = ("m", "v", "worker_error", "server_error")  # the tensors a checkpoint keeps


def chunk_length(numel: int, world_size: int) -> int:
    """L: the elements of each of a parameter's n chunks, once padded to a multiple of
    8 n (so that each chunk's signs fill whole bytes)."""
    return -(-numel // (8 * world_size)) * 8


def piece_bytes(numels: Sequence[int], world_size: int) -> int:
    """B: one piece of either collective, a float32 scale and one chunk's signs for
    every parameter."""
    return sum(4 + chunk_length(numel, world_size) // 8 for numel in numels)


def signs(values: torch.Tensor) -> torch.Tensor:
    """+1 where a value is >= 0 (zero included: one bit has no zero), -1 below."""
    return torch.where(values >= 0, 1.0, -1.0).to(values.dtype)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per value, 1 for >= 0 and 0 below, 8 to a byte, the first value in the
    lowest bit; the values' last dimension must divide by 8 (each row packs alone)."""
    bits = (values >= 0).to(torch.uint8).view(*values.shape[:-1], -1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=values.device)
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pack_signs' inverse: +1 or -1 for each bit, as `dtype`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(*packed.shape[:-1], -1).to(dtype) * 2 - 1


@register("onebit-adam")
class OnebitAdam(SyncStrategy):
    uses_buckets = False
    hands_over_the_update = True  # Adam's direction: for plain SGD (see above)

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 freeze_step: int = 200, bias_correction: bool = False,
                 algorithm: str = "auto"):
        need(0 <= beta1 < 1, self.name, "beta1", beta1, "in [0, 1)")
        need(0 <= beta2 < 1, self.name, "beta2", beta2, "in [0, 1)")
        need(eps > 0, self.name, "eps", eps, "above 0")
        need(freeze_step >= 1, self.name, "freeze_step", freeze_step, "at least 1")
        check_algorithm(self.name, algorithm)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.freeze_step, self.bias_correction = freeze_step, bias_correction
        self.algorithm = algorithm
        self.gather_algorithm = (algorithm if algorithm in algorithms.names("all_gather")
                                 else "ring")
        self.warmup_steps = freeze_step  # benchmarks time the compressed steps after it
        self.step = 0  # steps taken (a non-finite one is not)

    def setup(self, model: torch.nn.Module, comm) -> None:
        """The state, flat: m and v hold every parameter's elements end to end (N in
        all). The compressed all-reduce works on an n x S grid, S = sum of the L_i: row
        p holds chunk p of every parameter, side by side (parameter i in columns
        starts[i] .. starts[i] + L_i), which is what rank p is sent; the worker error
        has that shape, the server error one row."""
        super().setup(model, comm)
        n = comm.world_size
        self.params = [p for p in model.parameters() if p.requires_grad and p.numel()]
        numels = [p.numel() for p in self.params]
        self.chunks = [chunk_length(numel, n) for numel in numels]
        self.starts = [sum(self.chunks[:i]) for i in range(len(self.chunks))]
        width = sum(self.chunks)
        device = self.params[0].device
        # float64 where every parameter is; else float32 (bf16 parameters keep it too)
        self.dtype = (torch.float64 if all(p.dtype == torch.float64 for p in self.params)
                      else torch.float32)
        to_grid, from_grid, first = [], [], 0
        for numel, chunk, start in zip(numels, self.chunks, self.starts):
            source = torch.arange(first, first + n * chunk)
            source[numel:] = sum(numels)  # padding: a zero placed after the N elements
            to_grid.append(source.view(n, chunk))
            element = torch.arange(numel)
            from_grid.append(element // chunk * width + start + element % chunk)
            first += numel
        self.to_grid = torch.cat(to_grid, dim=1).to(device)    # (n, S): index into m
        self.from_grid = torch.cat(from_grid).to(device)       # (N,): index into the grid
        self.owner = torch.repeat_interleave(                  # (S,): each column's param
            torch.arange(len(numels)), torch.tensor(self.chunks)).to(device)
        self.m = torch.zeros(sum(numels), dtype=self.dtype, device=device)
        self.v = torch.zeros_like(self.m)
        self.worker_error = torch.zeros(n, width, dtype=self.dtype, device=device)
        self.server_error = torch.zeros(width, dtype=self.dtype, device=device)

    def cost(self, shapes: Sequence[Shape], world_size: int) -> StepCost:
        """Bytes per step after the warm-up (the module's docstring has the warm-up's)."""
        if world_size == 1:
            return StepCost(0, 0)
        numels = [element_count(shape) for shape in shapes if element_count(shape)]
        return StepCost(2 * (world_size - 1) * piece_bytes(numels, world_size), 2)

    @property
    def compressing(self) -> bool:
        """Past the warm-up: v is frozen and the momentum travels in one bit."""
        return self.step >= self.freeze_step

    @torch.no_grad()
    def after_backward(self, model: torch.nn.Module) -> None:
        scale = self.gradient_scale()
        # kept unscaled: the next step's loss scale may differ (fp16 AMP)
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params]).to(self.dtype).div_(scale)
        if self.compressing:
            handed = self.compressed_step(grad)
        else:
            handed = self.warmup_step(grad)
        if handed is None:
            self.step += 1
            handed = self.direction()
        # else: not finite on any rank, so on every rank alike: handed on for the loop
        # to skip, the state as it was
        handed.mul_(scale)
        for p, part in zip(self.params, handed.split([p.numel() for p in self.params])):
            if p.grad is None:
                p.grad = part.view_as(p).to(p.dtype, copy=True)
            else:
                p.grad.copy_(part.view_as(p))

    def warmup_step(self, grad: torch.Tensor):
        """Adam on the average gradient; None, or the average where it is not finite."""
        api.all_reduce(grad, op="avg", algorithm=self.algorithm, comm=self.comm, check=False)
        if not finite([grad]):
            return grad
        self.m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        return None

    def compressed_step(self, grad: torch.Tensor):
        """The compressed all-reduce of each rank's momentum, into m; None, or the
        decoded momentum where it is not finite."""
        local = self.m * self.beta1 + grad * (1 - self.beta1)
        if self.comm.world_size == 1:  # nothing to send, nothing to compress
            decoded, errors = local, (self.worker_error, self.server_error)
        else:
            decoded, errors = self.compressed_allreduce(local)
        if not finite([decoded]):
            return decoded
        torch.where(self.v != 0, decoded, torch.zeros_like(decoded), out=self.m)  # the mask
        self.worker_error, self.server_error = errors
        return None

    def norms(self, grid: torch.Tensor) -> torch.Tensor:
        """||.|| of each parameter's columns of `grid` (all its rows)."""
        return torch.stack([grid[..., start:start + chunk].norm()
                            for start, chunk in zip(self.starts, self.chunks)])

    def compressed_allreduce(self, local: torch.Tensor):
        """(decoded m, (new worker error, new server error)) for `local`, this rank's
        momentum: the worker's compression, the all-to-all, the server's, the
        all-gather. Every scale is rounded to float32 before its error is taken."""
        n = self.comm.world_size
        chunks = torch.tensor(self.chunks, dtype=self.dtype, device=local.device)
        # worker: c = m_r + e_w on the grid, one scale per parameter over its n L_i
        grid = torch.cat([local, local.new_zeros(1)])[self.to_grid] + self.worker_error
        worker_scales = (self.norms(grid) / (n * chunks).sqrt()).float()
        worker_error = grid - signs(grid) * worker_scales.to(self.dtype)[self.owner]
        pieces = self.encode(worker_scales, pack_signs(grid))
        received = torch.empty_like(pieces)
        api.all_to_all(list(received), list(pieces), comm=self.comm, check=False)

        # server: the average of every rank's chunk, plus e_s, one scale per parameter
        scales_from, signs_from = self.decode(received)
        average = (signs_from * scales_from[:, self.owner]).sum(0) / n
        compensated = average + self.server_error
        server_scales = (self.norms(compensated) / chunks.sqrt()).float()
        server_error = compensated - signs(compensated) * server_scales.to(self.dtype)[self.owner]
        mine = self.encode(server_scales, pack_signs(compensated).view(1, -1))[0]
        gathered = mine.new_empty(n, mine.numel())
        api.all_gather(gathered.view(-1), mine, algorithm=self.gather_algorithm,
                       comm=self.comm, check=False)

        # every rank: server r's chunks are row r of the grid
        scales_at, signs_at = self.decode(gathered)
        decoded = (signs_at * scales_at[:, self.owner]).view(-1)[self.from_grid]
        return decoded, (worker_error, server_error)

    @staticmethod
    def encode(scales: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """(rows, B) uint8: each row a piece, every parameter's float32 scale, then the
        packed signs of a grid row (its chunk of every parameter, in parameter order)."""
        scale_bytes = scales.float().contiguous().view(torch.uint8)
        return torch.cat([scale_bytes.expand(packed.shape[0], -1), packed], dim=1)

    def decode(self, pieces: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """encode's inverse for n pieces: (n, k) scales and the (n, S) signs (+-1),
        both in the state's dtype."""
        k = len(self.params)
        scales = pieces[:, :4 * k].clone().view(torch.float32).to(self.dtype)
        return scales, unpack_signs(pieces[:, 4 * k:], self.dtype)

    def direction(self) -> torch.Tensor:
        """m / (sqrt(v) + eps), bias-corrected where asked (v's correction stops with v)."""
        if not self.bias_correction:
            return self.m / (self.v.sqrt() + self.eps)
        m_factor = 1 - self.beta1 ** self.step
        v_factor = 1 - self.beta2 ** min(self.step, self.freeze_step)
        return (self.m / m_factor) / ((self.v / v_factor).sqrt() + self.eps)

    def state_dict(self) -> Dict[str, Any]:
        """m and v (each rank's alike, flat), this rank's worker and server errors (on
        the grid) and the steps taken."""
        return {"step": self.step, **{key: getattr(self, key).clone() for key in STATE}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in STATE:
            mine, saved = getattr(self, key), state[key]
            if saved.shape != mine.shape:
                raise ValueError(f"onebit-adam: the checkpoint's {key} has shape "
                                 f"{tuple(saved.shape)}, this model on {self.comm.world_size} "
                                 f"ranks wants {tuple(mine.shape)}")
            mine.copy_(saved)  # onto this model's device (a checkpoint loads on the CPU)
        self.step = int(state["step"])
