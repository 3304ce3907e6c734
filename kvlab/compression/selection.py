"""How a scoring method's scores become kept tokens: the selection wrappers' knobs
(:class:`SelectionOptions`, applied by :func:`select`), each head's top-k and the gather, and
the kept keys' re-rotation (:func:`rerotate_keys`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvlab.compression.budget_profiles import BUDGET_SOURCES, HeadBudgets, from_profile, global_ranking
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.request import Request
from kvlab.compression.wrappers.adakv import adakv_budgets, safeguard
from kvlab.compression.wrappers.chunkkv import chunk_ranks
from kvlab.compression.wrappers.criticalkv import critical_scores, projected_value_norm
from kvlab.compression.wrappers.key_rerotation import packed_positions
from kvlab.runtime.attention import output_projection
from kvlab.runtime.cache import DenseSegment, Segment, gather_tokens, template_segment
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import rotation_tables, turn_keys


@dataclass(frozen=True)
class SelectionOptions(Options):
    """The knobs every scoring method gets (:class:`EvictionMethod` whose scores mean importance):
    how its scores become kept tokens. One module each does the maths:
    kvlab.compression.wrappers (adakv, chunkkv, criticalkv, key_rerotation).

    A scoring method's Options extend this class (the method's own knobs are listed first,
    kvlab.compression.catalog.knobs); :func:`kvlab.compression.registry.register` checks it.
    """

    budgets: Literal["uniform", "adakv", "nonuniform", "global"] = knob(
        "uniform", "uniform (the method's own per-head budgets), adakv (a layer's budget shared among its heads by "
        "their scores), nonuniform (the model's head-budget profile, as Attention Matching's) or global (one "
        "ranking of the scores across every head and layer, as KVzip's); the last three stored ragged")
    alpha_safeguard: float = knob(
        0.2, "adakv: fewest tokens a head keeps, as a share of the mean per-head budget", low=0.0, high=1.0)
    granularity: Literal["token", "chunk"] = knob(
        "token", "token, or chunk (ChunkKV: keep whole chunks of consecutive tokens, the same in every head)")
    chunk_size: int = knob(10, "chunk: tokens per chunk", low=1)
    critical: bool = knob(
        False, "CriticalKV: after a first stage by the method's scores, reweight by the value's norm through o_proj")
    first_stage_ratio: float = knob(
        0.5, "critical: share of each head's budget chosen by the method's own scores", low=0.0, high=1.0)
    critical_epsilon: float = knob(1e-4, "critical: added to the scores before the reweighting", low=0.0)
    rerotate: bool = knob(
        False, "key re-rotation (kvpress's KeyRerotationPress): the kept keys moved to contiguous positions, "
        "what follows the cache right after them")

    def __post_init__(self) -> None:
        super().__post_init__()
        # ChunkKV picks chunks by one score shared by the heads: head budgets (AdaKV) and per-head
        # first-stage picks (CriticalKV) have no meaning there.
        if self.granularity == "chunk" and self.budgets != "uniform":
            raise MethodError(f"budgets={self.budgets} needs granularity=token: ChunkKV keeps the same chunks in "
                              "every head")
        if self.granularity == "chunk" and self.critical:
            raise MethodError("critical=true needs granularity=token: ChunkKV keeps the same chunks in every head")


#: Published configurations of any scoring method with one wrapper on (``kvlab bench --preset adakv``).
SELECTION_PRESETS: dict[str, dict[str, Any]] = {
    "adakv": {"budgets": "adakv"},
    "chunkkv": {"granularity": "chunk"},
    "criticalkv": {"critical": True},
    "key_rerotation": {"rerotate": True},
}

SELECTION_LEARN = (
    "**Selection wrappers** (knobs shared by every scoring method). `budgets` says where the budget goes, the "
    "total always T/r keys per head on average: `adakv` (AdaKV): a layer's budget "
    "is shared among its heads by one top-k over all their scores, each head keeping at least `alpha_safeguard` "
    "of the mean; `nonuniform`: the model's head-budget profile, the same one Attention Matching uses; "
    "`global`: one top-k over every head's scores in every layer (KVzip's pruning), each head keeping at least "
    "its best token. The heads are stored ragged, so the bytes are those of the kept tokens. "
    "`granularity=chunk` (ChunkKV): chunks of `chunk_size` tokens scored by their mean, "
    "$\\bar s_c=\\tfrac{1}{|c|}\\sum_{j\\in c}\\sum_h s^{(h)}_j$, whole chunks kept, the same in every head. "
    "`critical=true` (CriticalKV): each head keeps a `first_stage_ratio` share of its budget by $s_j$, the rest by "
    "$(s_j+\\epsilon)\\,\\lVert v_j W_o^{(h)}\\rVert_1$, what the value adds to the layer's output. "
    "`rerotate=true` (kvpress's KeyRerotationPress, the form of StreamingLLM's and Finch's caches): each kept "
    "key is turned by RoPE from its position $p_j$ to a new one, $k_j\\leftarrow R_{p'_j-p_j}\\,k_j$, so that "
    "a head's $n_h$ kept keys sit at $P-n_h,\\dots,P-1$ ($P$: the most keys any head keeps) and the question "
    "starts at $P$: the positions after the cache become contiguous. Values are untouched."
)


def select(
    req: Request, scores: list[torch.Tensor], own: HeadBudgets, opts: SelectionOptions
) -> tuple[list[torch.Tensor], HeadBudgets]:
    """The wrappers applied to a method's scores and budgets: the allocation (AdaKV's from the method's
    scores, as kvpress's CriticalAdaKVPress; the model's profile; the global ranking), then
    CriticalKV's two stages with those budgets; or ChunkKV's chunks alone.

    scores: per layer [H_kv, T_doc]; own: the method's own budgets ([n_layers, H_kv]) -> the scores
    and budgets, changed. MethodError when ``budgets`` would replace an allocation the method makes
    itself (``own.mode`` not uniform: PyramidKV's pyramid, KVzip's pruning).
    """
    ctx = req.ctx
    head = own
    if opts.budgets in ("nonuniform", "global"):
        if own.mode != "uniform":
            raise MethodError(f"budgets={opts.budgets} would replace the method's own allocation ({own.source}); "
                              "use budgets=uniform or adakv with it")
        head = from_profile(req) if opts.budgets == "nonuniform" else global_ranking(req, scores)
    elif opts.budgets == "adakv":
        n_heads = own.budgets.shape[1]
        head = HeadBudgets(torch.stack([
            adakv_budgets(s, int(b.sum()), safeguard(int(b.sum()), n_heads, opts.alpha_safeguard))
            for s, b in zip(scores, own.budgets)
        ]), "adakv", BUDGET_SOURCES["adakv"] + ("" if own.mode == "uniform" else f", from {own.source}"))
    budgets = head.budgets
    if opts.critical:
        scores = [
            critical_scores(s, projected_value_norm(ctx.full.values[i][:, ctx.prefix_len :],
                                                    output_projection(ctx.lm.model, i)),
                            budgets[i], opts.first_stage_ratio, opts.critical_epsilon)
            for i, s in enumerate(scores)
        ]
    if opts.granularity == "chunk":
        scores = [chunk_ranks(s, opts.chunk_size) for s in scores]
    return scores, head


def keep_tokens(
    req: Request, layer: int, doc_index: torch.Tensor, lengths: torch.Tensor, fate: str = "kept"
) -> list[Segment]:
    """Segments for one layer keeping the template prefix plus chosen document tokens.

    doc_index: [H_kv, L] document-relative token indices, padded past each
    head's length; lengths: [H_kv].
    """
    ctx = req.ctx
    prefix = ctx.prefix_len
    keys, values = ctx.full.keys[layer], ctx.full.values[layer]
    segments: list[Segment] = [template_segment(keys, values, prefix)] if prefix else []
    index = doc_index.clamp(min=0) + prefix
    segments.append(DenseSegment.from_padded(
        gather_tokens(keys, index), gather_tokens(values, index), lengths, index, fate=fate))
    return segments


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
        raise MethodError(f"rerotate=true needs full-attention layers only; {lm.name} has sliding-window layers "
                          f"({', '.join(map(str, windowed))}), whose windows count original positions")
    kinds = getattr(lm.model.model.rotary_emb, "rope_type", None)
    kinds = set(kinds.values()) if isinstance(kinds, dict) else {kinds}
    if kinds & set(UNEVEN_ROPE):
        raise MethodError(f"rerotate=true needs a RoPE whose angle grows evenly with the position; {lm.name}'s "
                          f"({', '.join(sorted(kinds & set(UNEVEN_ROPE)))}) picks its frequencies by the length read")


def rerotate_keys(lm: LoadedModel, layers: list[list[Segment]]) -> tuple[list[list[Segment]], int]:
    """Every layer's kept keys turned to right-aligned contiguous positions
    (kvlab.compression.wrappers.key_rerotation); values, token indices and the lists given stay as
    they are.

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
        out.append([
            dataclasses.replace(seg, keys=turn_keys(seg.keys, *rotation_tables(lm, i, pos - seg.token_index)))
            for seg, pos in zip(layer, new)
        ])
    return out, total


def top_k_per_head(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each head's ``lengths[h]`` highest-scoring positions, ascending, padded with -1.

    scores: [H, T]; lengths: [H] -> [H, max(lengths)].
    """
    width, sentinel = int(lengths.max()), scores.shape[-1]
    top = torch.topk(scores.float(), k=width, dim=-1).indices
    lengths = lengths.to(scores.device)
    valid = torch.arange(width, device=scores.device).unsqueeze(0) < lengths.unsqueeze(1)
    # Sort each head's picks into reading order; the sentinel sorts past them.
    ordered = torch.sort(torch.where(valid, top, sentinel), dim=-1).values
    return ordered.masked_fill(ordered == sentinel, -1)
