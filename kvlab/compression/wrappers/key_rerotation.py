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
this is kvpress's 0 .. n_kept - 1 with P = n_kept. With ragged heads (``budgets=document``) or
per-layer budgets (pyramidkv) each head's latest kept key stays right before the question, as
it was in the full cache: kvpress has one budget for all and never meets the case.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.compression.options import MethodError, knob
from kvlab.compression.stage import Stage
from kvlab.runtime.cache import DenseSegment, Segment
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import rotation_tables, turn_keys


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


#: RoPE kinds (transformers' rope_type) whose frequencies follow the longest position passed: a turn by a
#: position difference is not the difference of two positions' turns there (and asking for its tables
#: at small positions would reset the model's own frequencies).
UNEVEN_ROPE = ("dynamic", "longrope")


def check_rerotation(lm: LoadedModel) -> None:
    """MethodError unless ``rerotate=true`` can hold for ``lm``: a sliding-window layer keeps its
    window at the original positions and masks by them, which moved keys would break; and
    :data:`UNEVEN_ROPE` cannot turn a key by a difference of positions."""
    windowed = [i for i, g in enumerate(lm.geometry) if g.window is not None]
    if windowed:
        raise MethodError(
            f"rerotate=true needs full-attention layers only; {lm.name} has sliding-window layers "
            f"({', '.join(map(str, windowed))}), whose windows count original positions"
        )
    kinds = getattr(lm.model.model.rotary_emb, "rope_type", None)
    kinds = set(kinds.values()) if isinstance(kinds, dict) else {kinds}
    if kinds & set(UNEVEN_ROPE):
        raise MethodError(
            f"rerotate=true needs a RoPE whose angle grows evenly with the position; {lm.name}'s "
            f"({', '.join(sorted(kinds & set(UNEVEN_ROPE)))}) picks its frequencies by the length read"
        )


def rerotate_keys(lm: LoadedModel, layers: list[list[Segment]]) -> tuple[list[list[Segment]], int]:
    """Every layer's kept keys turned to right-aligned contiguous positions (:func:`packed_positions`);
    values, token indices and the lists given stay as they are.

    layers: per layer, segments of plain kept keys in reading order (the
    template first), each key's token index its position -> (the new layers,
    P: the position of the first token after the cache).
    """
    total = int(torch.stack([sum(seg.lengths() for seg in layer) for layer in layers]).max())
    out = []
    for i, layer in enumerate(layers):
        if not all(isinstance(seg, DenseSegment) and bool((seg.token_index >= 0).all()) for seg in layer):
            raise MethodError("rerotate=true needs segments of kept tokens, each key at its own token's position")
        new = packed_positions([seg.lengths() for seg in layer], total)
        out.append(
            [
                dataclasses.replace(seg, keys=turn_keys(seg.keys, *rotation_tables(lm, i, pos - seg.token_index)))
                for seg, pos in zip(layer, new)
            ]
        )
    return out, total


@dataclass(frozen=True)
class RerotationKnobs:
    """Key re-rotation's knob (:func:`rerotate_keys`); on with ``rerotate=true``."""

    rerotate: bool = knob(
        False,
        "key re-rotation (kvpress's KeyRerotationPress): the kept keys moved to contiguous positions, "
        "what follows the cache right after them",
    )


STAGE = Stage(
    name="key_rerotation",
    order=40,
    knobs=RerotationKnobs,
    preset={"rerotate": True},
    check=check_rerotation,
    kept=rerotate_keys,
)
