"""How far a compressed cache is from the full one.

Per layer and KV head, on held-out queries: the attention-output relative
error ||y_c - y|| / ||y|| and the attention-mass relative error
|exp(LSE_c - LSE) - 1| of the cached block, both averaged over queries; each
head's share of its layer's attention output (:func:`output_shares`), which
weighs the output errors by what each head contributes; and
downstream, the log-perplexity of the full cache's own answer. Also, for the
app's token view, how much attention those queries pay each cached token,
and per-token scores as percentile ranks within a head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.runtime.attention import BlockAttention, attend, attention_weights, group_queries, output_projection
from kvlab.runtime.cache import CompressedKV, PaddedView, select_keys
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import rotation_tables, turn_keys


@dataclass
class HeadErrors:
    """output, mass: [n_layers, H_kv] mean relative errors per KV head;
    mass_ratio: [n_layers, H_kv] mean of exp(LSE_c - LSE), the compressed
    block's attention mass as a share of the full one's (1: as much)."""

    output: torch.Tensor
    mass: torch.Tensor
    mass_ratio: torch.Tensor

    @property
    def mean_output(self) -> float:
        return float(self.output.mean())

    @property
    def mean_mass(self) -> float:
        return float(self.mass.mean())


def block_attention(q: torch.Tensor, view: PaddedView, scale: float | None = None) -> BlockAttention:
    """Attention of grouped queries q [H_kv, n, d] over one block (keys, values, bias per head),
    at the layer's own ``scale`` (None: 1/sqrt(d))."""
    return attend(q, view.keys, view.values, bias=view.bias, scale=scale)


def block_errors(
    q: torch.Tensor, full: BlockAttention, approx: PaddedView, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Errors of one layer's block, per KV head.

    q: [H_kv, n, d] grouped queries; full: their attention over the reference
    block (:func:`block_attention`, at the same ``scale``); approx: the block compared with it (keys,
    values, bias per head) -> (output error [H_kv], mass error [H_kv], mass ratio
    [H_kv]), each averaged over the queries.
    """
    comp = block_attention(q, approx, scale)
    out_err = (comp.output - full.output).norm(dim=-1) / full.output.norm(dim=-1).clamp_min(1e-12)
    ratio = torch.exp(comp.lse - full.lse)
    return out_err.mean(dim=-1), (ratio - 1).abs().mean(dim=-1), ratio.mean(dim=-1)


def _block(view: PaddedView, block_start: int) -> PaddedView:
    """The keys of ``view`` that stand for tokens from ``block_start`` on (all of them for 0)."""
    return select_keys(view, view.token_index >= block_start) if block_start else view


def scored_view(stored: CompressedKV, layer: int, lm: LoadedModel | None = None) -> PaddedView:
    """``stored``'s layer as queries recorded at their original positions meet it in generation.

    A re-rotated cache (``position_shift`` s > 0) is read by queries at t - s,
    not at the t they were recorded at. RoPE scores depend on the distance
    only, q(t - s) . k = q(t) . R_s k, so the keys are turned by +s once
    instead. Any other cache's view is returned as it is. lm: the model whose
    RoPE turns them, needed only when s > 0.
    """
    view = stored.layer_view(layer)
    if not stored.position_shift:
        return view
    if lm is None:
        raise ValueError("a re-rotated cache (position_shift > 0) is scored with the model's RoPE: pass lm")
    shift = torch.full((1,), stored.position_shift, device=view.keys.device)
    return dataclasses.replace(view, keys=turn_keys(view.keys, *rotation_tables(lm, layer, shift)))


def reference_attention(
    reference: CompressedKV, queries: list[torch.Tensor], block_start: int = 0
) -> list[BlockAttention]:
    """Per layer, the attention of queries [H, n, d] (grouped per KV head) over ``reference``'s block
    from ``block_start`` on: what :func:`head_errors` compares a compressed cache with. The same for
    every compressed cache, so a caller comparing many with one reference may compute it once.
    Each layer at its own scaling (``reference.scales``)."""
    out = []
    scales = reference.scales or [None] * reference.n_layers
    for layer, q in enumerate(queries):
        ref = _block(reference.layer_view(layer), block_start)
        out.append(block_attention(group_queries(q, ref.keys.shape[0]), ref, scales[layer]))
    return out


def head_errors(
    reference: CompressedKV,
    stored: CompressedKV,
    queries: list[torch.Tensor],
    block_start: int = 0,
    full: list[BlockAttention] | None = None,
    lm: LoadedModel | None = None,
) -> HeadErrors:
    """Per-head errors of ``stored`` against ``reference`` for queries [H, n, d] per layer.

    Computed on the caches' device; the [n_layers, H_kv] results come back to
    the CPU (they go to figures and JSON). ``full``: the reference's attention
    for these queries and this block, :func:`reference_attention` (computed here when None).

    block_start > 0 compares only the keys that stand for tokens from that
    position on (e.g. the document without the template prefix that every
    method keeps): the error of the compacted block itself, as the Attention
    Matching paper reports it.

    The queries stand where they were recorded; a re-rotated ``stored`` is
    met as generation meets it (:func:`scored_view`, with ``lm``'s RoPE).
    """
    full = reference_attention(reference, queries, block_start) if full is None else full
    scales = reference.scales or [None] * reference.n_layers
    outs, masses, ratios = [], [], []
    for layer, q in enumerate(queries):
        comp = _block(scored_view(stored, layer, lm), block_start)
        out, mass, ratio = block_errors(group_queries(q, comp.keys.shape[0]), full[layer], comp, scales[layer])
        outs.append(out)
        masses.append(mass)
        ratios.append(ratio)
    return HeadErrors(torch.stack(outs).cpu(), torch.stack(masses).cpu(), torch.stack(ratios).cpu())


def output_shares(lm: LoadedModel, full: list[BlockAttention]) -> torch.Tensor:
    """[n_layers, H_kv] each KV head's share of its layer's attention output, on the CPU.

    full: per layer the full cache's attention of the held-out queries
    (:func:`reference_attention`, output [H_kv, g*n, dv]: the g query heads of
    each KV head's group in turn). A query head's contribution is what it adds
    to the residual stream, ``||y_h W_o^(h)||`` (o_proj's columns of that head),
    averaged over the queries; a KV head's is its group's sum, and its share is
    that over the layer's total (each layer's shares sum to 1). A head whose
    output the layer hardly uses gets a small share however large its own error.
    """
    rows = []
    for layer, att in enumerate(full):
        h_kv, gn, dv = att.output.shape
        weight = output_projection(lm.model, layer).detach()
        n_heads = weight.shape[1] // dv
        n = gn // (n_heads // h_kv)
        y = att.output.float().reshape(n_heads, n, dv)  # query head h = k * g + j reads KV head k
        w = weight.float().view(-1, n_heads, dv).permute(1, 2, 0)  # [H, dv, hidden]
        norms = torch.bmm(y, w.to(y.device)).norm(dim=-1).mean(dim=-1)  # [H]
        per_kv = norms.view(h_kv, -1).sum(dim=-1)
        rows.append(per_kv / per_kv.sum().clamp_min(torch.finfo(per_kv.dtype).tiny))
    return torch.stack(rows).cpu()


def weighted_output_error(errors: HeadErrors, shares: torch.Tensor) -> float:
    """The output error weighted by each head's share of its layer's output: per layer
    ``sum_h share_h err_h``, averaged over the layers (as :attr:`HeadErrors.mean_output` averages
    over layers x heads). shares: [n_layers, H_kv], each row summing to 1."""
    return float((errors.output * shares).sum(dim=-1).mean()) if shares.numel() else 0.0


def log_perplexity(logprobs: torch.Tensor) -> float:
    """Mean negative log-likelihood per token (nats); 0 for an empty answer."""
    return float(-logprobs.mean()) if logprobs.numel() else 0.0


def question_attention(
    queries: list[torch.Tensor], keys: list[torch.Tensor], scales: list[float] | None = None
) -> list[torch.Tensor]:
    """Mean attention weight each cached token gets from held-out queries, per KV head.

    queries: per layer [H, n, d] (the question turn's and the answer's, as
    in :class:`kvlab.pipeline.Evaluation`); keys: per layer [H_kv, T, d], the
    full cache's. -> per layer [H_kv, T] float32: each query's softmax over
    the T cached tokens, averaged over the queries and over the query heads
    of the KV head's group. The softmax runs over the cache only (the tokens
    after it, which these queries also see, are left out): each query's row
    sums to 1 over the cache, and the relative weights of cached tokens are
    the model's own. scales: per layer, the model's factor on q.k (``FullKV.scales``; None: 1/sqrt(d)).
    Computed where the keys are; returned on the CPU (for the token view).
    """
    scales = scales or [None] * len(keys)
    return [
        attention_weights(group_queries(q, k.shape[0]), k, scale=s).mean(dim=1).cpu()
        for q, k, s in zip(queries, keys, scales)
    ]


def percentile_levels(scores: torch.Tensor) -> torch.Tensor:
    """Each token's percentile rank of score within its head, as a byte.

    scores: [..., H, T] (NaN: no score) -> [..., H, T] uint8: 0 where NaN, else
    1 + floor(255 p) clipped to 255, with p = (mid-rank + 1/2) / m the token's
    percentile among the head's m scored tokens (ties share one level).
    Ranks, not values: attention scores are heavy-tailed (a few tokens take
    most of it), so scaled values would leave almost every token at 0.
    All heads at once, from one sort: in sorted order a token's count of smaller scores is where
    its run of equal scores starts, and its count of scores up to its own is where that run ends
    (running max / min of the runs' bounds), scattered back to the tokens.
    """
    rows = scores.float().reshape(-1, scores.shape[-1])
    scored = ~torch.isnan(rows)
    # Unscored tokens sort last as +inf (NaNs compare unequal to themselves); a real +inf score
    # then counts them as ties, which the clamp to the head's m scored tokens takes back.
    filled = torch.where(scored, rows, torch.full_like(rows, float("inf")))
    ordered, order = torch.sort(filled, dim=-1)
    n = rows.shape[-1]
    position = torch.arange(n, device=rows.device).expand_as(order)
    starts = torch.ones_like(scored)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    ends = torch.ones_like(scored)
    ends[:, :-1] = starts[:, 1:]
    below_sorted = torch.where(starts, position, torch.zeros_like(position)).cummax(dim=-1).values
    upto_sorted = torch.where(ends, position + 1, torch.full_like(position, n)).flip(-1).cummin(dim=-1).values.flip(-1)
    m = scored.sum(dim=-1, keepdim=True)
    below = torch.empty_like(order).scatter_(-1, order, below_sorted)
    upto = torch.minimum(torch.empty_like(order).scatter_(-1, order, upto_sorted), m)
    p = (below + upto).float() / (2 * m.clamp(min=1))
    levels = (1 + (p * 255).floor()).clamp(max=255)
    return torch.where(scored, levels, torch.zeros_like(levels)).to(torch.uint8).view(scores.shape)
