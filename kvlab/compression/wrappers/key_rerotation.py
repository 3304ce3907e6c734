"""Key re-rotation (kvpress's KeyRerotationPress; the cache of StreamingLLM, Xiao et al., 2023,
arXiv 2309.17453, as transformers' SinkCache keeps it, and of Finch, Corallo & Papotti, 2024):
after eviction, the kept keys are moved to contiguous positions.

A wrapper over any scoring method (``rerotate=true``). A post-RoPE key carries its position in
its rotation. Once a scoring method has chosen each head's kept keys, they sit at scattered
positions p_j. Each one is turned by the angle of ``new_j - p_j`` (a pure rotation: RoPE's
attention scaling, if any, is divided out), so it reads as if the kept tokens had been read one
after the other. Values are untouched. The tokens after the cache then continue right after the
kept keys, not at the context's length: the model sees a short context with no gaps.

New positions are right-aligned. Let P be the largest number of keys any head stores (the
template prefix included). A head that keeps n_h keys has them, in reading order, at
P - n_h .. P - 1, and the question starts at P. With the same budget in every head and layer
this is kvpress's 0 .. n_kept - 1 with P = n_kept. With ragged heads (``budgets=adakv``) or
per-layer budgets (pyramidkv) each head's latest kept key stays right before the question, as
it was in the full cache: kvpress has one budget for all and never meets the case.
"""
from __future__ import annotations

import torch


def packed_positions(lengths: list[torch.Tensor], total: int) -> list[torch.Tensor]:
    """New positions of one layer's keys, stored as segments packed per head (head-major).

    lengths: per segment [H] keys of each head, the segments in reading order;
    total: P, at least every head's sum -> per segment [sum(lengths)] long:
    a head's n_h keys over all the segments get P - n_h .. P - 1 in order.
    """
    counts = torch.stack(lengths).sum(dim=0)  # [H] keys per head, all segments
    before = torch.zeros_like(counts)  # [H] the head's keys in the segments already placed
    out = []
    for seg_lengths in lengths:
        heads = torch.arange(seg_lengths.numel(), device=seg_lengths.device).repeat_interleave(seg_lengths)
        starts = torch.cumsum(seg_lengths, 0) - seg_lengths  # [H] where each head's rows begin
        within = torch.arange(heads.numel(), device=seg_lengths.device) - starts[heads]
        out.append(total - counts[heads] + before[heads] + within)
        before = before + seg_lengths
    return out
