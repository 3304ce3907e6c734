"""Tokens whose keys keep only some channels (ThinK's thinner key cache), as a stored segment.

Shapes: ``N`` stored tokens of all KV heads, head-major (as
:class:`~kvlab.runtime.cache.DenseSegment` packs them), ``d`` the head dim,
``c`` the channels each head keeps (the same count in every head of a layer,
different channels per head).

What is stored, and counted (``nbytes``): each token's ``c`` kept key
channels, its whole value (``d`` channels), and per head the ``c`` indices of
the kept channels (int16, ThinK's per-head channel mask in index form). The
pruned channels are not stored. Attention reads the keys back as ``[H, L, d]``
with the pruned channels zero, so that ``q . k`` over the view is exactly
``q . k`` over the kept channels only, the product ThinK computes with its
pruned query. The token index is bookkeeping for the figures, as for every
segment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.runtime.cache import PaddedView, pack_heads
from kvlab.runtime.engine_formats import padded_view

#: Storage of a channel index: head dims of today's models fit in 16 bits with room to spare.
CHANNEL_INDEX_DTYPE = torch.int16


def gather_channels(keys: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Each head's kept channels of its keys: keys [H, L, d], channels [H, c] -> [H, L, c]."""
    index = channels.to(keys.device, torch.long).unsqueeze(1).expand(-1, keys.shape[1], -1)
    return keys.gather(2, index)


def scatter_channels(kept: torch.Tensor, channels: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse, zero on the pruned channels: kept [H, L, c], channels [H, c] -> [H, L, d]."""
    index = channels.to(kept.device, torch.long).unsqueeze(1).expand(-1, kept.shape[1], -1)
    out = kept.new_zeros((*kept.shape[:2], head_dim))
    return out.scatter_(2, index, kept)


@dataclass
class ChannelSegment:
    """Tokens of every KV head of one layer with pruned key channels (see the module docstring).

    keys: [N, c] the kept channels, head-major; values: [N, d]; channels: [H, c]
    int16, each head's kept channels in ascending order; head_lengths: [H];
    token_index: [N]; head_dim: d.
    """

    keys: torch.Tensor
    values: torch.Tensor
    channels: torch.Tensor
    head_lengths: torch.Tensor
    token_index: torch.Tensor
    head_dim: int
    fate: str = "kept"

    @classmethod
    def from_padded(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        token_index: torch.Tensor,
        channels: torch.Tensor,
        fate: str = "kept",
    ) -> "ChannelSegment":
        """keys/values [H, L, d] padded per head past ``lengths`` [H]; token_index [H, L];
        channels [H, c] the channels each head keeps."""
        lengths = lengths.to(keys.device, torch.long)
        channels = channels.to(keys.device).sort(dim=-1).values  # stored in ascending order, as the docstring says
        return cls(
            keys=pack_heads(gather_channels(keys, channels), lengths).contiguous(),
            values=pack_heads(values, lengths).contiguous(),
            channels=channels.to(CHANNEL_INDEX_DTYPE),
            head_lengths=lengths,
            token_index=pack_heads(token_index.to(keys.device), lengths),
            head_dim=keys.shape[-1],
            fate=fate,
        )

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        return {
            "key channels kept": self.keys.nbytes,
            "full-precision values": self.values.nbytes,
            "channel indices": self.channels.nbytes,
        }

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def view(self) -> PaddedView:
        """Keys [H, L, d] with the pruned channels zero, values, bias -inf on padding (transient)."""
        view = padded_view(self.keys, self.values, self.head_lengths, self.token_index)
        return dataclasses.replace(view, keys=scatter_channels(view.keys, self.channels, self.head_dim))
