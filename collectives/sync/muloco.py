"""`muloco`: DiLoCo whose pseudo-gradient travels compressed, with an error-feedback
buffer on each rank; MuLoCo when the inner optimizer is Muon.

Communicates: every H optimizer steps (`period`), one all-gather of each rank's
compressed pseudo-gradient (the top-k of every chunk, or every entry in 2, 4 or 8
bits); nothing in between. Each rank trains its replica with the trainer's own
optimizer (the inner one) for H steps, then, on rank r:

    delta_r  = synced - local_r                      the pseudo-gradient (DiLoCo's)
    e_r     <- beta e_r + delta_r                    error feedback (`error_decay` beta)
    sent_r   = C(e_r)                                compressed (`compression`): exactly
                                                     what every rank will decode
    e_r     <- e_r - sent_r                          what was not sent (the rest of a
                                                     chunk, the rounding of a code) waits
                                                     for the next synchronization
    average  = (1/n) sum over ranks of sent_r        all-gathered, decoded by every rank:
                                                     the same dense tensor everywhere
    synced  <- outer_sgd_step(synced, average)       DiLoCo's outer step: SGD with
                                                     Nesterov momentum (lr 0.7, momentum
                                                     0.9), its momentum the outer state
    local_r <- synced                                every replica starts the next H
                                                     steps from the same weights

         rank 0: e_0 ─ C ─┐                   ┌─ decode, average ─ Nesterov ─ synced
         rank 1: e_1 ─ C ─┼─ all-gather ──────┼─ decode, average ─ Nesterov ─ synced
         rank 2: e_2 ─ C ─┘   (ring)          └─ decode, average ─ Nesterov ─ synced

The inner optimizer is the trainer's, not the strategy's. MuLoCo is this strategy run
with `--optimizer muon` (torch's Muon on the hidden matrices, AdamW on the rest):

    mpirun -np 4 python -m trainer --sync muloco --model gpt-tiny --optimizer muon

With `--optimizer adamw` the same strategy is DiLoCo with a compressed pseudo-gradient
and error feedback, the baseline the paper compares MuLoCo with.

Compression (`compression`), each parameter on its own:

    topk      sparseloco's chunks: the parameter, flattened, cut into runs of
              L = min(`chunk`, N) entries (the last padded with zeros), the
              k = max(1, round(density L)) of largest |e| kept in each; their positions
              inside the chunk (int16; int32 when chunk > 32768) and values (float32)
    quantize  every entry, in `bits` bits (2, 4 or 8), by sparseloco's quantizer: centred
              on the parameter's mean (the shift), 2^bits bins of width 6 std / 2^bits,
              each decoded as the mean of the values that fell in it (the codebook);
              codes packed 8/bits to a byte, the shift and codebook as float32
    none      nothing compressed: DiLoCo's all-reduce of the pseudo-gradient (the error
              buffer would stay 0, so none is kept)

Sent per synchronization, for a parameter of N elements (C = ceil(N / L) chunks):

    topk      C k x (2 + 4) bytes (x (4 + 4) with int32 positions)
    quantize  ceil(N bits / 8) + (1 + 2^bits) x 4 bytes
and P, their sum over the parameters, travels in one ring all-gather: each rank sends
(n-1) P bytes per synchronization, (n-1) P / H per optimizer step (`cost`). With none,
the ring all-reduce's 2 (n-1)/n x 4 N per synchronization, on average over the ranks.
At the defaults (2 bits, H = 30) a parameter of N entries puts N/4 + 20 bytes in the
payload, a sixteenth of its float32 pseudo-gradient. An all-gather's bytes grow with
the ranks, though: each sends (n-1) N/4 where float32 DiLoCo's ring all-reduce sends
2 (n-1)/n 4N, n/32 of it (1/8 on 4 ranks), and n/960 of what allreduce sends in the
same 30 steps.

One rank's bytes, as the all-gather carries them: topk, every value (float32) of every
parameter, then every position; quantize, every parameter's shift and codebook
(float32), then every parameter's packed codes; parameter after parameter in each,
largest element first so that each section starts aligned.

A synchronization whose decoded average is not finite (an inf or NaN on any rank: it
is among the largest entries of its chunk, or it makes its parameter's codebook NaN,
so it always travels) is dropped on every rank alike, as diloco drops one: the synced
weights, the outer momentum and the error buffers stay as they were, and every replica
goes back to the synced weights. The average is the same on every rank, so every rank
decides alike without asking.

DiLoCo's synchronous warm-up (`warmup_steps` W) comes with it: W steps of averaged
gradients, then the first synchronization after step W + H. Buffers (BatchNorm
statistics) are not synchronized: the run's model is the replicas' average
(`replicas_differ`), as with diloco.

Literature: Therien, Huang, Rish, Belilovsky, "MuLoCo: Muon is a practical inner
optimizer for DiLoCo" (arXiv 2505.23725, 2025): with Muon as DiLoCo's inner optimizer
and an error-feedback accumulator, the pseudo-gradient compresses to 2 bits with next
to no loss, and MuLoCo beats AdamW-DiLoCo while sending 8x less (K = 8 workers,
H = 30). The rule above is the one of the authors' code (facebookresearch/MuLoCo,
torchtitan/components/quantized_outer_sgd.py, QuantizedOuterSGD): error buffer
e <- beta e + delta, C(e) gathered and averaged, e <- e - C(e), then torch's SGD with
Nesterov momentum on the average; their configurations use beta = 0.9, 4 bins (2 bits)
spanning 6 standard deviations, and top-k ratios of 0.02 to 0.1. Differences from that
code: it adds outer_lr x delta to the buffer and then steps with lr outer_lr again
(the rate counts twice), ours adds delta, so outer_lr means what it means in diloco;
its top-k is over the whole tensor with int64 positions, ours per chunk (bytes that
depend on the size alone, and pieces of one size for a plain all-gather); its
quantized runs quantize the average again (a compressed reduce-scatter and all-gather,
simulated) and send the norms' weights uncompressed, ours averages exactly what was
gathered and compresses every parameter. Outer lr 0.7 and momentum 0.9 are DiLoCo's
(the authors' MuLoCo configurations use 0.9 and 0.8 uncompressed, 0.8 and 0.9
compressed).

Options: period H (30), compression ("quantize"), bits (2), density (0.02), chunk L
(4096), error_decay beta (0.9), outer_lr (0.7), outer_momentum (0.9; 0: plain SGD),
warmup_steps W (0), algorithm (the all-gather's: "auto", "ring" or "native"; a name of
an all-reduce algorithm alone, as the trainer's --algorithm may give, gathers with the
ring; with none, the all-reduce's).

Checkpoint: diloco's (the synced weights, the outer momentum, the steps done) and this
rank's error buffers (they differ by rank), so a resumed run continues bit for bit.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch

from .. import api
from .base import Shape, StepCost, element_count, finite, register, state_dtype
from .diloco import DiLoCo
from .options import need
from .sparseloco import SparseLoCo, chunking, dequantize, pack, packet_bytes, quantize, unpack

COMPRESSIONS = ("topk", "quantize", "none")
QUANTIZED_BITS = (2, 4, 8)


class Quantized(NamedTuple):
    """What quantize sends for one parameter."""
    codes: torch.Tensor   # uint8: every entry's code, 8/bits to a byte
    scales: torch.Tensor  # float32: [shift, codebook (2^bits)]


def quantized_bytes(numel: int, bits: int) -> Tuple[int, int]:
    """(code, scale) bytes of one parameter's Quantized."""
    return -(-numel * bits // 8), (1 + 2 ** bits) * 4


@register("muloco")
class MuLoCo(DiLoCo):
    def __init__(self, period: int = 30, compression: str = "quantize", bits: int = 2,
                 density: float = 0.02, chunk: int = 4096, error_decay: float = 0.9,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, warmup_steps: int = 0,
                 algorithm: str = "auto"):
        need(period >= 1, self.name, "period", period, "at least 1")
        need(compression in COMPRESSIONS, self.name, "compression", compression,
             f"one of {', '.join(COMPRESSIONS)}")
        need(bits in QUANTIZED_BITS, self.name, "bits", bits,
             f"one of {', '.join(map(str, QUANTIZED_BITS))}")
        need(0 < density <= 1, self.name, "density", density, "in (0, 1]")
        need(chunk >= 1, self.name, "chunk", chunk, "at least 1")
        need(0 <= error_decay <= 1, self.name, "error_decay", error_decay, "in [0, 1]")
        # DiLoCo with one fragment and no delay: its outer step, warm-up and checkpoint
        super().__init__(period=period, outer_lr=outer_lr, outer_momentum=outer_momentum,
                         nesterov=outer_momentum > 0, warmup_steps=warmup_steps,
                         algorithm=algorithm)
        self.compression, self.bits, self.density = compression, bits, density
        self.chunk, self.error_decay = chunk, error_decay
        # sparseloco's coder for the top-k pieces (bits 32: float32 values): its chunks,
        # packets, byte layout, and the all-gather algorithm it picks
        self.sparse = SparseLoCo(density=density, chunk=chunk, bits=32, algorithm=algorithm)

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.params = self.fragments[0]  # every parameter, in the model's order
        self.coded = [i for i, p in enumerate(self.params) if p.numel()]  # those that send
        self.sparse.parts = [chunking(self.params[i].numel(), self.chunk, self.density)
                             for i in self.coded]
        # what this rank has not sent yet (none: always nothing)
        self.errors = ([] if self.compression == "none" else
                       [torch.zeros_like(p, dtype=state_dtype(p)) for p in self.params])
        self.candidates = self.sent = None  # a synchronization's new buffers, until merged

    def replicas_equal_after(self, step: int) -> bool:
        return step <= self.warmup_steps or (step - self.warmup_steps) % self.period == 0

    def cost(self, shapes: Sequence[Shape], world_size: int) -> StepCost:
        numels = [element_count(shape) for shape in shapes]
        if self.compression == "none":
            share = 2 * (world_size - 1) / world_size  # the ring's, on average over ranks
            return StepCost(share * 4 * sum(numels) / self.period, 1 / self.period)
        payload = sum(self.payload_bytes(numel) for numel in numels if numel)
        return StepCost((world_size - 1) * payload / self.period, 1 / self.period)

    def payload_bytes(self, numel: int) -> int:
        """What one parameter of `numel` elements adds to a rank's payload."""
        if self.compression == "topk":
            index_bytes = torch.tensor([], dtype=self.sparse.index_dtype).element_size()
            return sum(packet_bytes(chunking(numel, self.chunk, self.density), 32,
                                    index_bytes))
        return sum(quantized_bytes(numel, self.bits))

    # --- one synchronization: DiLoCo's _send (what is averaged) and _merge (the outer
    # --- step), the first compressed and the second keeping the error buffers

    @torch.no_grad()
    def _send(self, index: int) -> None:
        if self.compression == "none":
            super()._send(index)  # DiLoCo's all-reduce of the pseudo-gradient
            return
        n = self.comm.world_size
        self.candidates = [error * self.error_decay + (synced.to(error.dtype)
                                                       - p.detach().to(error.dtype))
                           for error, synced, p in zip(self.errors, self.synced[index],
                                                       self.params)]
        self.sent = [torch.zeros_like(error) for error in self.errors]
        pieces = []
        for at, i in enumerate(self.coded):
            piece, self.sent[i] = self.compress(self.candidates[i], at)
            pieces.append(piece)
        payload = self.encode(pieces)
        gathered = payload.new_empty(n * payload.numel())
        api.all_gather(gathered, payload, algorithm=self.sparse.gather_algorithm,
                       comm=self.comm, check=False)
        totals = [error.new_zeros(error.numel()) for error in self.errors]  # flat, as diloco's
        for rank_bytes in gathered.view(n, -1):
            for i, decoded in zip(self.coded, self.decode(rank_bytes)):
                totals[i].add_(decoded.to(totals[i]))
        # in the parameters' dtype, as diloco's outer step takes it
        average = torch.cat([(total / n).to(p.dtype) for total, p in zip(totals, self.params)])
        self.in_flight = (index, average, None)  # merged at once: no delay

    @torch.no_grad()
    def _merge(self) -> None:
        """DiLoCo's merge (the outer step, or nothing where the average is not finite),
        and the error buffers of a synchronization that was taken: e <- e - C(e)."""
        taken = self.compression != "none" and finite([self.in_flight[1]])
        super()._merge()
        if taken:
            for error, candidate, sent in zip(self.errors, self.candidates, self.sent):
                torch.sub(candidate, sent, out=error)
        self.candidates = self.sent = None

    def compress(self, error: torch.Tensor, at: int) -> Tuple[Any, torch.Tensor]:
        """The piece that parameter `at` (counting those that send) puts on the wire, and
        the dense tensor (the parameter's shape) every rank will decode from it."""
        if self.compression == "topk":
            return self.sparse.compress(error, self.sparse.parts[at])
        codes, scales = quantize(error.reshape(-1).float(), self.bits)
        decoded = dequantize(codes, scales).to(error.dtype).view_as(error)
        return Quantized(pack(codes, self.bits), scales), decoded

    def encode(self, pieces: List[Any]) -> torch.Tensor:
        """The pieces as one byte buffer, as the docstring lays it out."""
        if self.compression == "topk":
            return self.sparse.encode(pieces)
        scales = torch.cat([piece.scales for piece in pieces]).view(torch.uint8)
        return torch.cat([scales] + [piece.codes for piece in pieces])

    def decode(self, payload: torch.Tensor) -> List[torch.Tensor]:
        """What one rank sent, per parameter that sends: flat float32, as decoded."""
        if self.compression == "topk":
            decoded = []
            for packet, part in zip(self.sparse.decode(payload), self.sparse.parts):
                values = self.sparse.decoded_values(packet, part)
                dense = values.new_zeros(part.chunks, part.length).scatter_(
                    1, packet.indices.long(), values)
                decoded.append(dense.view(-1)[:part.numel])
            return decoded
        sizes = [quantized_bytes(self.params[i].numel(), self.bits) for i in self.coded]
        scale_end = sum(scale for _, scale in sizes)
        scales = payload[:scale_end].clone().view(torch.float32).split(
            [scale // 4 for _, scale in sizes])
        codes = payload[scale_end:].split([code for code, _ in sizes])
        return [dequantize(unpack(packed, self.bits, self.params[i].numel()), shift_codebook)
                for i, packed, shift_codebook in zip(self.coded, codes, scales)]

    def state_dict(self) -> Dict[str, Any]:
        """diloco's, and this rank's error buffers, by parameter position."""
        state = super().state_dict()
        state["errors"] = [error.clone() for error in self.errors]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        shapes = [tuple(t.shape) for t in state["errors"]]
        mine = [tuple(t.shape) for t in self.errors]
        if shapes != mine:
            raise ValueError(f"muloco: the checkpoint's error buffers have shapes {shapes}, "
                             f"this strategy's {mine} (compression {self.compression!r})")
        super().load_state_dict(state)
        for error, saved in zip(self.errors, state["errors"]):
            error.copy_(saved)  # onto this model's device (a checkpoint loads on the CPU)
