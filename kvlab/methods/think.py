"""ThinK (Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning").

Key channels, not tokens: in every KV head, the channels of the key cache that
the observation window's queries use least are pruned, and only the kept
channels are stored (:class:`~kvlab.runtime.channel_segment.ChannelSegment`).

The score of channel ``j`` of a head, in the paper (Section 3.2),
``||Q[-S_obs:, j] K[:, j]^T||_F``, the Frobenius norm of the outer product of
the window's queries and the keys in that channel, which is
``||Q[:, j]|| * ||K[:, j]||``. kvpress (``kvpress/presses/think_press.py``,
``ThinKPress.compress``) and the authors' code
(SalesforceAIResearch/ThinK, ``ThinK_flash/src/kv_pruning_utils.py``,
``key_pruner_query_driven``) compute ``mean_i q_ij^2 * mean_t k_tj^2``: the
square of the paper's score over a constant, so the same ranking in every
head. kvlab computes that form. With grouped-query attention the squared query
norms are averaged over the query heads of the KV head's group, as kvpress
does (the paper's score with the group's queries stacked, squared). The
``floor(d * key_channel_compression_ratio)`` lowest-scoring channels of each
head are pruned (the same count in every head, different channels).

Which keys are pruned: the authors' code scores and prunes the keys left
after a token eviction method (SnapKV or H2O) and keeps the last
``recent_size`` tokens' keys whole (its "unpruned" part, which the new tokens
join while decoding); kvpress's press prunes every key (``recent_size=0``
here). kvlab does the former: the scores use every stored key of the layer
(template and recent tokens included), the template's keys are pruned like
the document's, the context's last ``recent_size`` tokens stay whole, and
the keys of the question and the answer, appended while decoding, are whole.
kvpress's press zeroes the pruned channels and stores them all the same (no
memory gained, its docstring says); kvlab stores only the kept channels and
their indices, and counts those bytes.

Ratio semantics: the ratio is kvlab's token ratio (kvlab.compression.request):
the scoring method ``evict_with`` keeps T / ratio document tokens per KV head,
as ThinK in the paper runs on top of H2O or SnapKV at their token budget
("KV size"), and the channels are pruned on top, so the memory falls further
than the ratio: about (1 - lambda / 2) of what the evictor stores (keys are
half of a token's bytes), reported as ``meta["memory_ratio"]``. Ratio 1 is the
full cache, as for every method; channels alone are pruned when T / ratio
rounds to T (every token kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod, Method
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import get_method, register
from kvlab.compression.request import Request
from kvlab.methods.families.engine_format import scoring_methods
from kvlab.runtime.attention import group_queries
from kvlab.runtime.cache import CompressedKV, Segment, concat_views, segment_from_view, select_keys
from kvlab.runtime.channel_segment import ChannelSegment


@dataclass(frozen=True)
class ThinKOptions(Options):
    key_channel_compression_ratio: float = knob(
        0.4, "share of each head's key channels pruned (the paper's lambda; below 1)", low=0.0, high=1.0
    )
    window_size: int = knob(32, "observation window: the context's last queries that score the channels", low=1)
    recent_size: int = knob(
        32, "the context's last tokens whose keys stay whole (0: prune every key, as kvpress)", low=0
    )
    evict_with: str = knob("snapkv", "the scoring method that keeps T / ratio tokens before the channels are pruned")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.key_channel_compression_ratio >= 1.0:
            raise MethodError("key_channel_compression_ratio must be below 1: a head keeps at least one channel")
        if self.evict_with not in scoring_methods():
            raise MethodError(
                f"evict_with must be a scoring method ({', '.join(scoring_methods())}), got {self.evict_with!r}"
            )


def channel_scores(queries: torch.Tensor, keys: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """ThinK's score of every key channel, as kvpress computes it (module docstring).

    queries: [H, w, d] the observation window; keys: [H_kv, L, d]; real: [H_kv, L]
    which keys are stored (not padding) -> [H_kv, d] float32:
    mean over the group's queries of q_j^2, times mean over the real keys of k_j^2.
    """
    q_energy = group_queries(queries.float(), keys.shape[0]).pow(2).mean(dim=1)  # [H_kv, d]
    mask = real.unsqueeze(-1).float()
    k_energy = (keys.float().pow(2) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return q_energy * k_energy


def kept_channels(scores: torch.Tensor, n_pruned: int) -> torch.Tensor:
    """scores [H, d] -> [H, d - n_pruned]: every channel but each head's ``n_pruned`` lowest, ascending."""
    pruned = torch.topk(scores, n_pruned, dim=-1, largest=False).indices
    keep = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, pruned, False)
    every = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    return every[keep].view(scores.shape[0], -1)


def thin_layer(segments: list[Segment], queries: torch.Tensor, n_pruned: int, recent_from: int) -> list[Segment]:
    """One layer's evicted cache (segments without biases) with its key channels pruned.

    queries: [H, w, d] the observation window. Every stored key is scored;
    the tokens at context positions >= ``recent_from`` stay whole (a dense
    segment), the others keep each head's kept channels. Fates are kept.
    """
    view = concat_views([seg.view() for seg in segments])
    channels = kept_channels(channel_scores(queries, view.keys, torch.isfinite(view.bias)), n_pruned)
    out: list[Segment] = []
    for seg in segments:
        own = seg.view()
        real = torch.isfinite(own.bias)
        recent = real & (own.token_index >= recent_from)
        older = real & ~recent
        if bool(older.any()):
            part = select_keys(own, older)
            out.append(
                ChannelSegment.from_padded(
                    part.keys, part.values, older.sum(dim=1), part.token_index, channels, fate=seg.fate
                )
            )
        if bool(recent.any()):
            out.append(segment_from_view(select_keys(own, recent), seg.fate, keep_bias=False))
    return out


@register
class ThinK(Method):
    name = "think"
    summary = (
        "a scoring method keeps T/ratio tokens, then each head's least-used key channels "
        "(window queries' energy x keys' energy) are pruned and not stored"
    )
    paper = Paper("Xu et al.", 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", arxiv="2407.21018")
    family = "channel"
    # SnapKV's tokens (same_tokens) plus channel scores of a random model, some within a bf16 rounding.
    bf16_tolerance = "near_ties"
    Options = ThinKOptions
    query_aware_when = "evict_with=snapkv_question"
    #: The paper's pruning ratios (LongBench with H2O and SnapKV).
    presets = {"ThinK-0.4": {"key_channel_compression_ratio": 0.4}, "ThinK-0.5": {"key_channel_compression_ratio": 0.5}}

    def evictor(self) -> EvictionMethod:
        """The scoring method that chooses the tokens."""
        return get_method(self.options.evict_with)  # type: ignore[return-value]

    def uses_question(self) -> bool:
        return self.evictor().uses_question()

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        full = ctx.full
        if req.ratio == 1.0:
            return CompressedKV(
                [list(layer) for layer in full.stored.layers],
                ctx.length,
                meta={"method": self.name, "memory_ratio": 1.0},
            )
        evicted = self.evictor().compress(req)
        layers = []
        for i, segments in enumerate(evicted.layers):
            n_pruned = int(full.keys[i].shape[-1] * opts.key_channel_compression_ratio)
            if full.window(i) is not None or n_pruned == 0:  # a window layer keeps what the model keeps
                layers.append(list(segments))
                continue
            queries = ctx.queries["context"][i][:, -opts.window_size :]
            layers.append(thin_layer(segments, queries, n_pruned, ctx.length - opts.recent_size))
        stored = CompressedKV(layers, evicted.logical_len, meta={}, importance=evicted.importance)
        stored.meta = {
            "method": self.name,
            "evict_with": opts.evict_with,
            "key_channel_compression_ratio": opts.key_channel_compression_ratio,
            "pruned_channels_per_head": int(ctx.lm.head_dim * opts.key_channel_compression_ratio),
            "memory_ratio": full.nbytes / max(1, stored.nbytes),
        }
        return stored
