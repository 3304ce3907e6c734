"""kvpress's MergingPress (kvpress/presses/merging_press.py, after Token Merging, Bolya et al., 2023,
arXiv 2210.09461, and D2O, Wan et al., 2024, arXiv 2406.13035): each evicted token's value is folded
into the kept token whose key is most like its own.

kvpress names no paper of its own for this rule, and neither ToMe's nor D2O's weights are these;
the method keeps kvpress's name (``merging``, as ``observed_attention`` keeps ObservedAttentionPress's)
and its knobs. Tokens are chosen as by the ``scorer`` (kvpress's wrapped ``press``), per head. Then, in
each head, for an evicted token e:

    c(e) = argmax_{kept c} cos(k_e, k_c),      s_e = cos(k_e, k_c(e)),
    merged when s_e >= similarity_threshold and s_e is in the top merge_fraction of the head's evicted,
    w_e = max(s_e, 0) * ||v_e|| / (||v_e|| + ||v_c(e)|| + eps),
    v_c <- (v_c + sum_{e : c(e) = c} w_e v_e) / (1 + sum_{e : c(e) = c} w_e)   where that sum is > 0,

eps = 1e-6 (kvpress's, also the floor of the norms in the cosine). Keys are kept as they are.
``merge_fraction`` < 1 keeps the evicted tokens whose similarity is at least the head's
(1 - merge_fraction) quantile of the evicted tokens' similarities; kvpress takes that quantile with
the tokens under the threshold set to -inf, which orders them the same but turns the quantile into
NaN (no merge in the head) where it falls next to one of them: kvlab takes it of their similarities.
The merge targets are the kept document tokens (kvpress's are every kept token of its context; the
chat template's are kept here whatever their scores, and stay as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.options import MethodError, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import BLOCK_ELEMENTS
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.merging_core import MergingMethod, kept_mask

#: kvpress's epsilon: the floor of a key's norm in the cosine and the guard of the weights' denominator.
EPS = 1e-6


def nearest_kept(
    keys: torch.Tensor, kept_index: torch.Tensor, lengths: torch.Tensor, block_elements: int = BLOCK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's most cosine-similar kept key.

    keys: [H, T, d]; kept_index: [H, K] positions, padded past ``lengths`` [H] -> (similarity
    [H, T] float32, target [H, T] long: the kept slot 0..K-1). Computed in blocks of tokens of at
    most ``block_elements`` similarities.
    """
    n_heads, length, dim = keys.shape
    width = kept_index.shape[1]
    unit = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp(min=EPS)
    kept_unit = unit.gather(1, kept_index.clamp(min=0).unsqueeze(-1).expand(-1, -1, dim))  # [H, K, d]
    padding = torch.arange(width, device=keys.device).unsqueeze(0) >= lengths.to(keys.device).unsqueeze(1)
    similarity = torch.empty(n_heads, length, device=keys.device)
    target = torch.empty(n_heads, length, dtype=torch.long, device=keys.device)
    rows = max(1, block_elements // max(1, n_heads * width))
    for start in range(0, length, rows):
        block = unit[:, start : start + rows] @ kept_unit.transpose(1, 2)  # [H, rows, K]
        block.masked_fill_(padding.unsqueeze(1), float("-inf"))
        similarity[:, start : start + rows], target[:, start : start + rows] = block.max(dim=-1)
    return similarity, target


def merge_weights(
    similarity: torch.Tensor,
    evicted: torch.Tensor,
    norms: torch.Tensor,
    target_norms: torch.Tensor,
    threshold: float,
    fraction: float,
) -> torch.Tensor:
    """w_e = max(s_e, 0) * |v_e| / (|v_e| + |v_c(e)| + eps) for the evicted tokens that pass both gates, else 0.

    similarity, norms, target_norms: [H, T] (s_e, |v_e|, |v_c(e)|); evicted: [H, T] bool -> [H, T] float32.
    """
    passing = evicted & (similarity >= threshold)
    if fraction < 1.0:
        cut = torch.where(evicted, similarity, float("nan")).nanquantile(1.0 - fraction, dim=-1, keepdim=True)
        passing &= similarity >= cut
    return torch.where(passing, similarity.clamp(min=0.0) * norms / (norms + target_norms + EPS), 0.0)


def fold_into_targets(
    kept_values: torch.Tensor, values: torch.Tensor, target: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_c + sum_e w_e v_e) / (1 + sum_e w_e) for each kept c with a positive weight sum.

    kept_values: [H, K, d]; values: [H, T, d]; target: [H, T] kept slots; weights: [H, T] (0: no
    merge) -> (values [H, K, d] float32, absorbed [H, K] bool).
    """
    dim = values.shape[-1]
    kept_values = kept_values.float()
    added = torch.zeros_like(kept_values).scatter_add_(
        1, target.unsqueeze(-1).expand(-1, -1, dim), weights.unsqueeze(-1) * values.float()
    )
    total = torch.zeros(kept_values.shape[:2], device=values.device).scatter_add_(1, target, weights)
    absorbed = total > 0
    merged = (kept_values + added) / (1.0 + total).unsqueeze(-1)
    return torch.where(absorbed.unsqueeze(-1), merged, kept_values), absorbed


@dataclass(frozen=True)
class MergingPressOptions(SelectionOptions):
    scorer: Literal["knorm", "snapkv", "expected_attention", "h2o", "tova"] = knob(
        "knorm", "the scoring method that decides which tokens stay (kvpress's wrapped press)"
    )
    similarity_threshold: float = knob(
        0.0, "fewest key cosine similarity for an evicted token to merge", low=0.0, high=1.0
    )
    merge_fraction: float = knob(
        1.0, "share of a head's evicted tokens, the most similar to their target, that merge", low=0.0, high=1.0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.merge_fraction <= 0.0:
            raise MethodError(
                f"merge_fraction must be above 0 (a share of the evicted tokens), got {self.merge_fraction:g}"
            )


@register
class Merging(MergingMethod):
    name = "merging"
    summary = "each evicted value folded into the kept token with the most similar key, weighted by similarity and norm"
    paper = Paper(
        "NVIDIA kvpress",
        2026,
        "MergingPress (after Token Merging and D2O)",
        url="https://github.com/NVIDIA/kvpress/blob/main/kvpress/presses/merging_press.py",
        note="kvpress's own rule, inspired by Bolya et al. 2023 (arXiv 2210.09461) and Wan et al. 2024 "
        "(arXiv 2406.13035)",
    )
    family = "merging"
    # The target is an argmax of cosines and the fraction gate a quantile: a cosine within a few bf16
    # roundings of another moves a value to another target, as near ties swap a kept token.
    bf16_tolerance = "near_ties"
    Options = MergingPressOptions
    # kvpress's evaluate_registry.py configurations (its merging_* entries; merging_kvzap_mlp needs
    # trained weights; merging_expected_attention's epsilon=1e-2 is not passed: the scorer runs with its defaults).
    presets = {
        "merging_knorm": {"scorer": "knorm"},
        "merging_snapkv": {"scorer": "snapkv"},
        "merging_expected_attention": {"scorer": "expected_attention"},
    }

    def fold(
        self, req: Request, layer: int, kept_index: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = req.ctx
        keys = ctx.full.keys[layer][:, ctx.prefix_len :]
        values = ctx.full.values[layer][:, ctx.prefix_len :]
        similarity, target = nearest_kept(keys, kept_index, lengths)
        kept_values = values.gather(1, kept_index.clamp(min=0).unsqueeze(-1).expand(-1, -1, values.shape[-1]))
        norms = values.float().norm(dim=-1)
        target_norms = kept_values.float().norm(dim=-1).gather(1, target)
        evicted = ~kept_mask(kept_index, lengths, ctx.doc_len)
        weights = merge_weights(
            similarity, evicted, norms, target_norms, self.options.similarity_threshold, self.options.merge_fraction
        )
        return fold_into_targets(kept_values, values, target, weights)
