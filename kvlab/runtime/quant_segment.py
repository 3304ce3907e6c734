"""A segment of KIVI-quantised tokens: packed low-bit codes, dequantised only for attention.

Storage (what :attr:`QuantSegment.nbytes` counts, nothing else): each KV
head's stored tokens, in reading order, are quantised KIVI-style by
:mod:`kvlab.runtime.low_bit`:

* keys per channel: each channel's ``group_size`` consecutive stored tokens
  (of that head) share one float16 scale and zero;
* values per token: each token's ``group_size`` consecutive channels share one
  float16 scale and zero (one group when ``d <= group_size``);
* codes packed ``8 // bits`` per byte.

Heads may store different tokens and different numbers of them (ragged
sets). Heads that store the same *number* of tokens are packed together as
one ``[h, n, d]`` block (with uniform budgets: one block per layer), which
changes nothing in the quantisation (key groups run along one head's tokens,
value groups along one token's channels, never across heads) and only saves
calls; heads with other counts get blocks of their own. No padding is ever
quantised or stored: padding appears only in the transient
:meth:`QuantSegment.view` (bias -inf, i.e. an absent key), exactly as for
:class:`~kvlab.runtime.cache.DenseSegment`. The token index is bookkeeping
for the figures (attention never reads it) and is not counted as stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.runtime.cache import NEG_INF, PaddedView, pack_heads, unpack_heads
from kvlab.runtime.low_bit import SUPPORTED_BITS, PackedTensor, quantize_keys, quantize_values


def quant_nbytes(n_tokens: int, head_dim: int, bits: int, group_size: int) -> int:
    """Bytes :class:`QuantSegment` stores for one head holding ``n_tokens`` tokens.

    Exact when ``n_tokens * head_dim * bits`` is a multiple of 8 (always for even
    head dims); otherwise heads packed in one block may share a byte, and the
    segment stores up to one byte per head less than this.

    keys: codes + float16 scale and zero per (channel, group of tokens);
    values: codes + float16 scale and zero per (token, group of channels).
    """
    if n_tokens <= 0:
        return 0
    codes = math.ceil(n_tokens * head_dim * bits / 8)
    key_meta = 2 * 2 * head_dim * math.ceil(n_tokens / group_size)
    value_meta = 2 * 2 * n_tokens * math.ceil(head_dim / group_size)
    return 2 * codes + key_meta + value_meta


@dataclass
class QuantBlock:
    """KV heads ``heads`` that store the same number of tokens, packed together.

    keys: PackedTensor [len(heads), n, d] (per channel); values: PackedTensor
    [len(heads), n, d] (per token).
    """

    heads: list[int]
    keys: "PackedTensor"
    values: "PackedTensor"


@dataclass
class QuantSegment:
    """Tokens of every KV head stored as KIVI packed codes (see the module docstring).

    blocks: the packed heads, grouped by token count (heads storing no token
    here are in no block); head_lengths: [H]; token_index: [N] original
    positions, head-major (N = head_lengths.sum()); dtype: what :meth:`view`
    dequantises to (the model's cache dtype).
    """

    blocks: list[QuantBlock]
    head_lengths: torch.Tensor
    token_index: torch.Tensor
    bits: int
    group_size: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    fate: str = ""

    def __post_init__(self) -> None:
        if not self.fate:
            self.fate = f"{self.bits}-bit"

    @classmethod
    def quantize(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        token_index: torch.Tensor,
        bits: int,
        group_size: int = 32,
        fate: str = "",
    ) -> "QuantSegment":
        """Quantise each head's first ``lengths[h]`` tokens.

        keys/values: [H, L, d] (padded per head past its length), lengths: [H],
        token_index: [H, L] original positions (reading order within each head).
        """
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
        lengths = lengths.to(keys.device, torch.long)
        counts = lengths.tolist()
        blocks = []
        for n in sorted(set(counts) - {0}):
            heads = [h for h, m in enumerate(counts) if m == n]
            sel = torch.tensor(heads, device=keys.device)
            # Quantised where the cache lives, like the dense segments beside it.
            k = quantize_keys(keys[sel, :n].float(), bits, group_size)
            v = quantize_values(values[sel, :n].float(), bits, group_size)
            blocks.append(QuantBlock(heads, k, v))
        return cls(
            blocks=blocks,
            head_lengths=lengths,
            token_index=pack_heads(token_index.to(keys.device), lengths),
            bits=bits,
            group_size=group_size,
            head_dim=keys.shape[-1],
            dtype=keys.dtype,
            fate=fate,
        )

    def _packed(self) -> list["PackedTensor"]:
        return [p for b in self.blocks for p in (b.keys, b.values)]

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        packed = self._packed()
        return {
            f"{self.bits}-bit codes": sum(p.codes.numel() * p.codes.element_size() for p in packed),
            "scales+zeros": sum(
                p.scale.numel() * p.scale.element_size() + p.zero.numel() * p.zero.element_size() for p in packed
            ),
        }

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def view(self) -> PaddedView:
        """Dequantised keys/values for attention (transient: never stored)."""
        n_heads = self.head_lengths.numel()
        width = int(self.head_lengths.max()) if n_heads else 0
        device = self.head_lengths.device
        keys = torch.zeros(n_heads, width, self.head_dim, dtype=self.dtype, device=device)
        values = torch.zeros_like(keys)
        bias = torch.full((n_heads, width), NEG_INF, dtype=self.dtype, device=device)
        for block in self.blocks:
            n = block.keys.shape[1]
            heads = torch.tensor(block.heads, device=device)
            keys[heads, :n] = block.keys.dequantize(self.dtype)
            values[heads, :n] = block.values.dequantize(self.dtype)
            bias[heads, :n] = 0.0
        return PaddedView(keys, values, bias, unpack_heads(self.token_index, self.head_lengths, -1))
