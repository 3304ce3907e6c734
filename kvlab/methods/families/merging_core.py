"""What the merging family shares (kvlab/methods/cam.py, kvlab/methods/merging.py): the scorer's
selection (the ``scorer`` knob: :data:`SCORERS`), then a method's ``fold`` of the evicted values into
the kept ones, stored as dense segments (fate "merged" for a kept token that absorbed others, "kept"
otherwise)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.request import Request
from kvlab.context import Memo
from kvlab.methods.families.scorers import (
    H2O_RECENT_SHARE,
    N_SINK,
    ExpectedAttentionOptions,
    SnapKVOptions,
    expected_attention_scores,
    h2o_recent_scores,
    knorm_scores,
    recency_scores,
    snap_scores,
    tova_scores,
)
from kvlab.runtime.cache import CompressedKV, DenseSegment, PaddedView, Segment, segment_from_view, select_keys


@dataclass(frozen=True)
class Scorer:
    """A scoring method's scores at its default knobs, as the ``scorer`` knob names it (kvpress's
    wrapped press): ``scores(req)`` -> per layer [H_kv, T_doc]."""

    scores: Callable[[Request], list[torch.Tensor]]
    #: The same at every ratio, so kept per context (not H2O's: its recent window is a share of the budget).
    ratio_free: bool = True


#: The scorers the merging methods' ``scorer`` knobs name (each method's Literal lists its own).
SCORERS: dict[str, Scorer] = {
    "h2o": Scorer(lambda req: h2o_recent_scores(req, H2O_RECENT_SHARE), ratio_free=False),
    "streaming_llm": Scorer(lambda req: recency_scores(req, N_SINK)),
    "knorm": Scorer(knorm_scores),
    "snapkv": Scorer(lambda req: snap_scores(req, SnapKVOptions().window, SnapKVOptions().kernel, from_question=False)),
    "tova": Scorer(tova_scores),
    "expected_attention": Scorer(lambda req: expected_attention_scores(req, ExpectedAttentionOptions())),
}


@dataclass(frozen=True)
class ScorerScores(Memo):
    """Where :meth:`MergingMethod.scores` keeps a ratio-free scorer's scores (its default knobs: the name says all)."""

    scorer: str


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
    wrappers are this method's own knobs), then fold the evicted tokens into the kept ones. No
    scorer reads the question."""

    # The scorer's scores are kept per context below (once for every merging knob), when ratio-free.
    keep_scores = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        name = self.options.scorer
        scorer = SCORERS[name]
        if not scorer.ratio_free:
            return scorer.scores(req)
        return req.ctx.cached(ScorerScores(name), lambda: scorer.scores(req))

    def details(self) -> dict:
        return {"scorer": self.options.scorer}

    @abstractmethod
    def fold(
        self, req: Request, layer: int, kept_index: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
