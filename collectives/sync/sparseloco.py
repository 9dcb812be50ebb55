"""`sparseloco`: DiLoCo whose outer momentum is an error-feedback buffer on each rank,
and whose pseudo-gradient travels as the top-k of every chunk, in 2 bits.

Communicates: every H optimizer steps (`period`), one all-gather of a few per cent of
the pseudo-gradient's entries (positions and 2-bit codes, one small codebook per
parameter); nothing in between. Each rank trains its replica with the trainer's own
optimizer (the inner one) for H steps, then, on rank r:

    delta_r  = synced - local_r                       the pseudo-gradient (DiLoCo's)
    e_r     <- beta e_r + delta_r                     error feedback in place of DiLoCo's
                                                      outer momentum (`error_decay` beta)
    sent_r   = Q(top_k(e_r))                          per chunk of L elements of each
                                                      parameter: its k = round(density L)
                                                      largest |e| kept, quantized to
                                                      `bits` bits
    e_r     <- e_r - sent_r                           what is not sent (the rest of the
                                                      chunk, the quantization error) waits
                                                      for the next synchronization
    average  = (1/n) sum over ranks of sent_r         all-gathered, decoded by every rank:
                                                      the same dense tensor everywhere
    synced  <- synced - outer_lr average
    local_r <- synced                                 every replica starts the next H
                                                      steps from the same weights

         rank 0: e_0 ─ top-k per chunk ─ Q ─┐                 ┌─ decode, average ─ synced
         rank 1: e_1 ─ top-k per chunk ─ Q ─┼─ all-gather ────┼─ decode, average ─ synced
         rank 2: e_2 ─ top-k per chunk ─ Q ─┘   (ring)        └─ decode, average ─ synced

There is no outer optimizer state: e_r decays like a momentum and, since what was sent
is taken out of it, the entries that wait longest grow until they are sent.

Chunks. Each parameter, flattened, is cut into runs of L = min(`chunk`, numel)
elements; the last run is padded with zeros to L (padding is never decoded into the
parameter). k = max(1, round(density x L)) entries are kept per chunk, so every rank
sends pieces of one fixed size and a plain all-gather moves them. An index is its
position inside its chunk: int16 when `chunk` <= 32768, else int32.

Quantization (`bits` 2, 4 or 8; 32: none, float32 values). The kept values of one
parameter are coded as the authors' code codes them: centred on their mean (the
"shift"), cut into 2^bits bins of width 6 standard deviations / 2^bits around it
(values beyond the outer bins fall in them), and each bin decoded as the mean of the
values that fell in it (the "codebook"). The codes are packed 8/bits to a byte; the shift and the
2^bits codebook entries travel as float32 beside them. A rank subtracts from e_r
exactly what the others will decode, so the quantization error is fed back too.

Sent per synchronization, for a parameter of N elements (C = ceil(N / L) chunks):

    indices   C k x 2 bytes (int16; x 4 with int32)
    values    bits < 32: ceil(C k bits / 8) bytes of codes + (1 + 2^bits) x 4 (shift,
              codebook);  bits = 32: C k x 4
and P, the sum over the parameters, travels in one ring all-gather: each rank sends
(n-1) P bytes per synchronization, (n-1) P / H per optimizer step (`cost`). At the
defaults (L = 4096, k = 82, 2 bits) a large parameter costs 82 x 2.25 = 184.5 bytes per
4096 entries: 1/89 of float32, against all of it every step for allreduce.

A synchronization whose decoded average is not finite (an inf or NaN on any rank: a
non-finite value is always among the largest, so it is sent, and it makes its
parameter's codebook NaN) is dropped on every rank alike: the synced weights and the
error buffers stay as they were, and every replica goes back to the synced weights.
The average is the same on every rank, so every rank decides alike without asking.

Buffers (BatchNorm statistics) are not synchronized: each replica keeps its own, and
the run's model is the average of the replicas (`replicas_differ`), as with diloco.

Literature: Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM
Pre-training with SparseLoCo" (arXiv 2508.15706, 2025): top-k sparsification to 1-3 %
of the entries with 2-bit quantization and a local error-feedback buffer, in place of
DiLoCo's global Nesterov momentum, with a plain outer step, outperforms full-precision
DiLoCo. The update, as written there: e <- beta e + delta, delta_hat = Q(TopK(e)),
e <- e - delta_hat, theta <- theta - alpha mean over ranks of delta_hat. Defaults:
H = 30, beta = 0.95, alpha = 1 (the plain outer step), chunks of 4096 entries, 2 bits,
density 0.02 (k = 82 of 4096, inside the 1-3 % it reports). Two differences from the
authors' code: it cuts a matrix into 64 x 64 tiles, ours every parameter into runs of
4096 consecutive entries (any shape, and bytes that depend on the size alone); and it
averages each entry over the ranks that sent it, ours over all ranks, as the update
above writes it.

Options: period H (30), error_decay beta (0.95), density (0.02), chunk L (4096),
bits (2), outer_lr (1.0), algorithm (the all-gather's: "auto", "ring" or "native"; a
name of an all-reduce algorithm alone, as the trainer's --algorithm may give, gathers
with the ring; the bytes are the same for all).

Checkpoint: the synced weights and each rank's error buffers (they differ by rank), so
a resumed run continues bit for bit; the steps done are the trainer's.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch

from .. import algorithms, api
from .base import Shape, StepCost, SyncStrategy, element_count, finite, register, state_dtype
from .options import check_algorithm, need

BIT_WIDTHS = (2, 4, 8, 32)  # 32: float32 values, no quantization (1 bit: two bins
# around the mean would code nearly every kept value to the same bin)
CODED_SIGMAS = 6.0  # the bins span this many standard deviations of the kept values
INT16_CHUNK = 32768  # the longest chunk whose positions (0 .. L-1) fit int16


class Chunking(NamedTuple):
    """How one parameter is cut and what it sends."""
    numel: int    # N, the parameter's elements
    length: int   # L, elements per chunk
    chunks: int   # C = ceil(N / L); the last one padded with zeros
    k: int        # entries kept per chunk


def chunking(numel: int, chunk: int, density: float) -> Chunking:
    length = min(chunk, numel)
    return Chunking(numel, length, -(-numel // length),
                    min(length, max(1, round(density * length))))


class Packet(NamedTuple):
    """What one rank sends for one parameter at a synchronization."""
    indices: torch.Tensor  # (C, k) int16/int32: positions inside each chunk, ascending
    values: torch.Tensor   # bits < 32: uint8, the codes packed 8/bits a byte;
                           # bits = 32: (C, k) float32
    scales: torch.Tensor   # bits < 32: float32 [shift, codebook (2^bits)]; else empty


def packet_bytes(part: Chunking, bits: int, index_bytes: int) -> Tuple[int, int, int]:
    """(index, value, scale) bytes of one parameter's Packet."""
    sent = part.chunks * part.k
    if bits == 32:
        return sent * index_bytes, sent * 4, 0
    return sent * index_bytes, -(-sent * bits // 8), (1 + 2 ** bits) * 4


def quantize(values: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of float32 `values` (1-D): codes in 0 .. 2^bits - 1 (uint8), and
    scales = [shift, codebook]; dequantize(codes, scales) is what they stand for.

    Bins of width CODED_SIGMAS x std / 2^bits, centred on the mean; each decoded as the
    mean of its members (an empty bin as 0). A non-finite value makes every entry
    decode as NaN, so that no rank mistakes it for a number."""
    bins = 2 ** bits
    if not finite([values]):
        return (values.new_zeros(values.numel(), dtype=torch.uint8),
                values.new_full((1 + bins,), float("nan")))
    shift = values.mean()
    centred = values - shift
    spread = (centred.norm() / math.sqrt(values.numel() - 1) if values.numel() > 1
              else centred.new_zeros(()))
    width = CODED_SIGMAS * spread / bins
    if not width > 0:  # all values alike (or one): any width codes them exactly
        width = torch.ones_like(width)
    codes = (centred / width + bins // 2).round().clamp_(0, bins - 1).long()
    sums = values.new_zeros(bins).index_add_(0, codes, centred)
    counts = values.new_zeros(bins).index_add_(0, codes, torch.ones_like(centred))
    codebook = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
    return codes.to(torch.uint8), torch.cat([shift.view(1), codebook])


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return scales[1:][codes.long()] + scales[0]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits each, 8/bits to a byte (the first in the low bits);
    zeros pad the last byte."""
    per_byte = 8 // bits
    padded = codes.new_zeros(-(-codes.numel() // per_byte) * per_byte)
    padded[:codes.numel()] = codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, per_byte) << shifts).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & (2 ** bits - 1)).view(-1)[:count]


@register("sparseloco")
class SparseLoCo(SyncStrategy):
    uses_buckets = False
    forward_buffer_sync = False  # no collective before every forward
    replicas_differ = True       # between synchronizations the replicas drift

    def __init__(self, period: int = 30, error_decay: float = 0.95, density: float = 0.02,
                 chunk: int = 4096, bits: int = 2, outer_lr: float = 1.0,
                 algorithm: str = "auto"):
        need(period >= 1, self.name, "period", period, "at least 1")
        need(0 <= error_decay <= 1, self.name, "error_decay", error_decay, "in [0, 1]")
        need(0 < density <= 1, self.name, "density", density, "in (0, 1]")
        need(chunk >= 1, self.name, "chunk", chunk, "at least 1")
        need(bits in BIT_WIDTHS, self.name, "bits", bits,
             f"one of {', '.join(map(str, BIT_WIDTHS))}")
        need(outer_lr > 0, self.name, "outer_lr", outer_lr, "positive")
        check_algorithm(self.name, algorithm)
        self.period, self.error_decay, self.density = period, error_decay, density
        self.chunk, self.bits, self.outer_lr, self.algorithm = chunk, bits, outer_lr, algorithm
        # an all-reduce algorithm's name (the trainer's --algorithm) gathers with the ring
        self.gather_algorithm = (algorithm if algorithm in algorithms.names("all_gather")
                                 else "ring")
        self.index_dtype = torch.int16 if chunk <= INT16_CHUNK else torch.int32

    def setup(self, model: torch.nn.Module, comm) -> None:
        super().setup(model, comm)
        self.params = [p for p in model.parameters() if p.requires_grad and p.numel()]
        self.parts = [chunking(p.numel(), self.chunk, self.density) for p in self.params]
        # the weights every rank held after the last synchronization, and what this
        # rank has not sent yet
        self.synced = [p.detach().clone() for p in self.params]
        self.errors = [torch.zeros_like(p, dtype=state_dtype(p)) for p in self.params]

    def replicas_equal_after(self, step: int) -> bool:
        return step % self.period == 0

    def cost(self, shapes: Sequence[Shape], world_size: int) -> StepCost:
        index_bytes = torch.tensor([], dtype=self.index_dtype).element_size()
        numels = [element_count(shape) for shape in shapes]
        payload = sum(sum(packet_bytes(chunking(numel, self.chunk, self.density),
                                       self.bits, index_bytes))
                      for numel in numels if numel)
        return StepCost((world_size - 1) * payload / self.period, 1 / self.period)

    def after_step(self, model: torch.nn.Module, step: int) -> None:
        if step % self.period == 0:
            self._synchronize()

    def compress(self, error: torch.Tensor, part: Chunking) -> Tuple[Packet, torch.Tensor]:
        """One parameter's Packet, and the dense tensor (the parameter's shape) that
        every rank will decode from it."""
        padded = error.new_zeros(part.chunks * part.length)
        padded[:part.numel] = error.reshape(-1)
        chunks = padded.view(part.chunks, part.length)
        indices = chunks.abs().topk(part.k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = chunks.gather(1, indices).float()
        if self.bits == 32:
            packet = Packet(indices.to(self.index_dtype), kept, kept.new_empty(0))
            decoded = kept
        else:
            codes, scales = quantize(kept.view(-1), self.bits)
            packet = Packet(indices.to(self.index_dtype), pack(codes, self.bits), scales)
            decoded = dequantize(codes, scales).view_as(kept)
        dense = torch.zeros_like(chunks).scatter_(1, indices, decoded.to(chunks.dtype))
        return packet, dense.view(-1)[:part.numel].view_as(error)

    def encode(self, packets: List[Packet]) -> torch.Tensor:
        """The packets as one byte buffer: every float32 (values or scales), then every
        index, then every packed code, parameter after parameter in each; by element
        size, largest first, so that each section starts aligned."""
        floats = [p.scales if self.bits < 32 else p.values for p in packets]
        codes = [p.values for p in packets] if self.bits < 32 else []
        pieces = ([torch.cat([f.reshape(-1) for f in floats]),
                   torch.cat([p.indices.reshape(-1) for p in packets])]
                  + ([torch.cat(codes)] if codes else []))
        return torch.cat([piece.view(torch.uint8) for piece in pieces])

    def decode(self, payload: torch.Tensor) -> List[Packet]:
        """encode's inverse, for one rank's bytes."""
        index_bytes = torch.tensor([], dtype=self.index_dtype).element_size()
        sizes = [packet_bytes(part, self.bits, index_bytes) for part in self.parts]
        floats = sum(v + s if self.bits == 32 else s for _, v, s in sizes)
        indices_end = floats + sum(i for i, _, _ in sizes)
        float_section = payload[:floats].clone().view(torch.float32)
        index_section = payload[floats:indices_end].clone().view(self.index_dtype)
        code_section = payload[indices_end:]
        packets, f, i, c = [], 0, 0, 0  # where each section's next piece starts
        for part, (_, value_size, scale_size) in zip(self.parts, sizes):
            sent = part.chunks * part.k
            indices = index_section[i:i + sent].view(part.chunks, part.k)
            i += sent
            if self.bits == 32:
                values = float_section[f:f + sent].view(part.chunks, part.k)
                scales = float_section.new_empty(0)
                f += sent
            else:
                values = code_section[c:c + value_size]
                scales = float_section[f:f + scale_size // 4]
                c += value_size
                f += scale_size // 4
            packets.append(Packet(indices, values, scales))
        return packets

    def decoded_values(self, packet: Packet, part: Chunking) -> torch.Tensor:
        """The (C, k) float32 values a packet stands for."""
        if self.bits == 32:
            return packet.values
        codes = unpack(packet.values, self.bits, part.chunks * part.k)
        return dequantize(codes, packet.scales).view(part.chunks, part.k)

    @torch.no_grad()
    def _synchronize(self) -> None:
        n = self.comm.world_size
        candidates, packets, sent = [], [], []  # the new error buffers: kept if finite
        for synced, p, error, part in zip(self.synced, self.params, self.errors, self.parts):
            error = error * self.error_decay + (synced - p.detach())
            packet, own = self.compress(error, part)
            candidates.append(error)
            packets.append(packet)
            sent.append(own)
        payload = self.encode(packets)
        gathered = payload.new_empty(n * payload.numel())
        api.all_gather(gathered, payload, algorithm=self.gather_algorithm, comm=self.comm,
                       check=False)
        totals = [torch.zeros(part.chunks, part.length, dtype=error.dtype, device=p.device)
                  for p, error, part in zip(self.params, self.errors, self.parts)]
        for rank_bytes in gathered.view(n, -1):
            for total, packet, part in zip(totals, self.decode(rank_bytes), self.parts):
                total.scatter_add_(1, packet.indices.long().to(total.device),
                                   self.decoded_values(packet, part).to(total))
        averages = [total.view(-1)[:part.numel].view_as(p) / n
                    for total, part, p in zip(totals, self.parts, self.params)]
        # Every rank holds the same averages: all keep this round, or all drop it.
        if finite(averages):
            for synced, average, error, candidate, own in zip(self.synced, averages,
                                                              self.errors, candidates, sent):
                synced.add_(average, alpha=-self.outer_lr)
                error.copy_(candidate - own)
        else:
            self.drop_sync("the decoded average of an outer synchronization")
        for p, synced in zip(self.params, self.synced):
            p.copy_(synced)

    def state_dict(self) -> Dict[str, Any]:
        """The synced weights and this rank's error buffers, by parameter position."""
        return {"synced": [t.clone() for t in self.synced],
                "errors": [t.clone() for t in self.errors]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in ("synced", "errors"):
            shapes = [tuple(t.shape) for t in state[key]]
            if shapes != [tuple(p.shape) for p in self.params]:
                raise ValueError(f"sparseloco: the checkpoint's {key} have shapes {shapes}, "
                                 f"this model's parameters {[tuple(p.shape) for p in self.params]}")
            for tensor, saved in zip(getattr(self, key), state[key]):
                tensor.copy_(saved)  # onto this model's device (a checkpoint loads on the CPU)
