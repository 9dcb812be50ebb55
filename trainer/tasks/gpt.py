"""A small decoder-only transformer over bytes, written plainly (the GPT-2 layout).

    bytes (B, T) ─ embed + position ─┬─ block ─ ... ─ block ─ norm ─ head ─ logits (B, T, 256)
                                     │
    block:  x + attention(norm(x))   then   x + mlp(norm(x))          (pre-norm)
    attention: causal multi-head self-attention by torch's scaled_dot_product_attention
    mlp: width -> 4 width -> width with GELU

The head shares its weights with the byte embedding (tied, as GPT-2): one matrix
reads bytes in and scores them out. Its parameters are ordinary nn.Module parameters,
so every sync strategy sees them as it sees a ResNet's; the tied matrix is one
parameter, listed once.

Sizes by name (`--model`); the trainer prints the parameter count:

    gpt-nano    2 layers, width  32, 2 heads, context  32      ~ 0.03 M   (tests)
    gpt-tiny    4 layers, width 128, 4 heads, context  64      ~ 0.83 M
    gpt-small   6 layers, width 256, 8 heads, context 128      ~ 4.8 M
    gpt-medium  8 layers, width 384, 6 heads, context 256      ~ 14 M
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

VOCABULARY = 256  # bytes


class GPTConfig(NamedTuple):
    layers: int     # transformer blocks
    width: int      # the residual stream's size
    heads: int      # attention heads (width / heads each)
    context: int    # the longest input, in bytes


SIZES: Dict[str, GPTConfig] = {
    "gpt-nano": GPTConfig(layers=2, width=32, heads=2, context=32),
    "gpt-tiny": GPTConfig(layers=4, width=128, heads=4, context=64),
    "gpt-small": GPTConfig(layers=6, width=256, heads=8, context=128),
    "gpt-medium": GPTConfig(layers=8, width=384, heads=6, context=256),
}


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: each position attends to itself and those before."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)    # queries, keys and values at once
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, T, 3W) -> three (B, heads, T, W / heads)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """One pre-norm transformer block: attention, then the MLP, each added to the stream."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Bytes in, the next byte's logits out, at every position."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCABULARY, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads)
                                    for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, VOCABULARY, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.apply(self._initialise)
        for block in self.blocks:  # residual projections scaled down with depth, as GPT-2
            for projection in (block.attention.out, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / (2 * config.layers) ** 0.5)

    @staticmethod
    def _initialise(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.context:
            raise ValueError(f"{length} bytes in: longer than the context of "
                             f"{self.config.context}")
        positions = torch.arange(length, device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_gpt(name: str) -> GPT:
    """The model of size `name` (SIZES)."""
    return GPT(SIZES[name])


def hidden_matrices(model: nn.Module):
    """The 2-D weights inside the blocks: what Muon orthogonalises. The embeddings, the
    tied head, norms and biases are not hidden matrices (Muon's authors train them with
    AdamW)."""
    return [p for name, p in model.named_parameters()
            if p.ndim == 2 and name.startswith("blocks.")]
