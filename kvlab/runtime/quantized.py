"""A segment of KIVI-quantised tokens: packed low-bit codes, dequantised only for attention.

Storage (what :attr:`QuantSegment.nbytes` counts, nothing else): for every KV
head, that head's stored tokens, in reading order, form one ``[1, n_h, d]``
block quantised KIVI-style by :mod:`kvlab.methods.quant`:

* keys per channel: each channel's ``group_size`` consecutive stored tokens
  (of that head) share one float16 scale and zero;
* values per token: each token's ``group_size`` consecutive channels share one
  float16 scale and zero (one group when ``d <= group_size``);
* codes packed ``8 // bits`` per byte.

Heads may store different tokens and different numbers of them (ragged
sets): each head is quantised on its own, so no padding is ever quantised or
stored, and a key group never mixes heads. Padding appears only in the
transient :meth:`QuantSegment.view` (bias -inf, i.e. an absent key), exactly as
for :class:`~kvlab.runtime.cache.DenseSegment`. The token index is bookkeeping
for the figures (attention never reads it) and is not counted as stored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlab.runtime.cache import NEG_INF, PaddedView, pack_heads, unpack_heads

if TYPE_CHECKING:
    from kvlab.methods.quant import PackedTensor

# kvlab.methods.quant is imported where it is used: importing it here would run
# kvlab.methods' registry (whose methods import this module) half-way through
# importing this module.


def quant_nbytes(n_tokens: int, head_dim: int, bits: int, group_size: int) -> int:
    """Bytes :class:`QuantSegment` stores for one head holding ``n_tokens`` tokens.

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
class QuantSegment:
    """Tokens of every KV head stored as KIVI packed codes (see the module docstring).

    keys/values: per head, the packed block of that head's ``head_lengths[h]``
    tokens (None for a head that stores none here); token_index: [N] original
    positions, head-major (N = head_lengths.sum()); dtype: what :meth:`view`
    dequantises to (the model's cache dtype).
    """

    keys: list[PackedTensor | None]
    values: list[PackedTensor | None]
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
        from kvlab.methods.quant import SUPPORTED_BITS, quantize_keys, quantize_values

        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
        lengths = lengths.long().cpu()
        packed_k: list[PackedTensor | None] = []
        packed_v: list[PackedTensor | None] = []
        for h, n in enumerate(lengths.tolist()):
            if n == 0:
                packed_k.append(None)
                packed_v.append(None)
                continue
            packed_k.append(quantize_keys(keys[h : h + 1, :n].float().cpu(), bits, group_size))
            packed_v.append(quantize_values(values[h : h + 1, :n].float().cpu(), bits, group_size))
        return cls(
            keys=packed_k,
            values=packed_v,
            head_lengths=lengths,
            token_index=pack_heads(token_index.cpu(), lengths),
            bits=bits,
            group_size=group_size,
            head_dim=keys.shape[-1],
            dtype=keys.dtype,
            fate=fate,
        )

    def _packed(self) -> list[PackedTensor]:
        return [p for p in (*self.keys, *self.values) if p is not None]

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        packed = self._packed()
        return {
            f"{self.bits}-bit codes": sum(p.codes.numel() * p.codes.element_size() for p in packed),
            "scales+zeros": sum(
                p.scale.numel() * p.scale.element_size() + p.zero.numel() * p.zero.element_size()
                for p in packed
            ),
        }

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def _dequantized(self, blocks: list[PackedTensor | None]) -> torch.Tensor:
        """[N, d] dequantised tokens, head-major (the packed layout of DenseSegment)."""
        parts = [p.dequantize(self.dtype)[0] for p in blocks if p is not None]
        if not parts:
            return torch.zeros(0, self.head_dim, dtype=self.dtype)
        return torch.cat(parts, dim=0)

    def view(self) -> PaddedView:
        """Dequantised keys/values for attention (transient: never stored)."""
        keys = self._dequantized(self.keys)
        values = self._dequantized(self.values)
        bias = keys.new_zeros(keys.shape[0])
        return PaddedView(
            keys=unpack_heads(keys, self.head_lengths, 0.0),
            values=unpack_heads(values, self.head_lengths, 0.0),
            bias=unpack_heads(bias, self.head_lengths, NEG_INF),
            token_index=unpack_heads(self.token_index, self.head_lengths, -1),
        )
