"""What the merging family shares (kvlab/methods/cam.py, kvlab/methods/merging.py): the scorer's
selection, then a method's ``fold`` of the evicted values into the kept ones, stored as dense
segments (fate "merged" for a kept token that absorbed others, "kept" otherwise)."""
from __future__ import annotations

from abc import abstractmethod

import torch

from kvlab.compression.interface import EvictionMethod, Method
from kvlab.compression.registry import get_method
from kvlab.compression.request import Request
from kvlab.runtime.cache import CompressedKV, DenseSegment, PaddedView, Segment, segment_from_view, select_keys


def kept_mask(kept_index: torch.Tensor, lengths: torch.Tensor, length: int) -> torch.Tensor:
    """Which positions each head keeps.

    kept_index: [H, K] positions, padded past each head's ``lengths`` [H] -> [H, length] bool.
    """
    n_heads, width = kept_index.shape
    device = kept_index.device
    slot = torch.arange(width, device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)
    # Padding goes to a spare column, so that it cannot unset a real position.
    mask = torch.zeros(n_heads, length + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, torch.where(slot, kept_index, length), True)
    return mask[:, :length]


def merged_segments(view: PaddedView, values: torch.Tensor, absorbed: torch.Tensor) -> list[Segment]:
    """A layer's document segment stored with its merged values: fate "merged" for the kept tokens
    that absorbed others, "kept" for the rest (no bias: every real key's is 0).

    view: the kept tokens [H, K] (bias -inf on padding); values: [H, K, d] (any float dtype,
    stored in the keys' dtype); absorbed: [H, K] bool.
    """
    merged = PaddedView(view.keys, values.to(view.values.dtype), view.bias, view.token_index)
    real = torch.isfinite(view.bias)
    out: list[Segment] = []
    for fate, mask in (("merged", real & absorbed), ("kept", real & ~absorbed)):
        if bool(mask.any()):
            out.append(segment_from_view(select_keys(merged, mask), fate, keep_bias=False))
    return out


class MergingMethod(EvictionMethod):
    """Select as the method named by the ``scorer`` option does (its default options; the selection
    wrappers are this method's own knobs), then fold the evicted tokens into the kept ones."""

    # The scorer keeps its own scores per context.
    keep_scores = False

    def scorer(self) -> Method:
        return get_method(self.options.scorer)

    def uses_question(self) -> bool:
        return self.scorer().uses_question()

    def scores(self, req: Request) -> list[torch.Tensor]:
        scorer = self.scorer()
        assert isinstance(scorer, EvictionMethod)
        return scorer.kept_scores(req)

    def details(self) -> dict:
        return {"scorer": self.options.scorer}

    @abstractmethod
    def fold(self, req: Request, layer: int, kept_index: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's kept values after the merge: kept_index [H_kv, K] ascending document positions
        (padded past ``lengths`` [H_kv]) -> (values [H_kv, K, d], absorbed [H_kv, K] bool)."""

    def compress(self, req: Request) -> CompressedKV:
        stored = super().compress(req)
        ctx = req.ctx
        for layer, segments in enumerate(stored.layers):
            if ctx.full.window(layer) is not None:
                continue  # a window layer is stored as the model keeps it (keeping_windows)
            document = segments[-1]
            assert isinstance(document, DenseSegment)
            view = document.view()
            kept_index = torch.where(view.token_index >= 0, view.token_index - ctx.prefix_len, -1)
            values, absorbed = self.fold(req, layer, kept_index, document.head_lengths)
            segments[-1:] = merged_segments(view, values, absorbed)
        return stored
