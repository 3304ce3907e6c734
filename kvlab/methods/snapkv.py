"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Each document token is scored by the attention it gets from an observation
window of queries, averaged over the window and the query heads of its GQA
group, smoothed by 1-D average pooling; the window's own tokens are kept.
Query-agnostic when the window is the end of the document, query-aware when
it is the user's question.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import MethodError, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.queries import question_queries
from kvlab.runtime.attention import attention_weights, expand_kv_heads


@dataclass(frozen=True)
class SnapKVOptions(SelectionOptions):
    window: int = knob(64, "observation window: the last queries of the document", low=1)
    # Odd, as in SnapKV's code: padding kernel // 2 on both sides keeps one score per token.
    kernel: int = knob(5, "1-D average-pooling kernel over token scores (odd: centred on each token)", low=1, odd=True)


def pooled_window_scores(
    queries: torch.Tensor, keys: torch.Tensor, kernel: int, causal: bool, drop_last: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Mean attention from a query window, pooled along the tokens.

    queries: [H, w, d], keys: [H_kv, T, d] -> [H_kv, T - drop_last]; scale:
    the layer's own (None: 1/sqrt(d)). The
    softmax runs over all T keys; the last ``drop_last`` columns (the window's
    own tokens, kept anyway) are cut before pooling, as SnapKV does, so they
    do not leak into their neighbours' scores.
    """
    n_heads, n_kv = queries.shape[0], keys.shape[0]
    weights = attention_weights(queries, expand_kv_heads(keys, n_heads), scale=scale, causal=causal)
    per_head = weights.mean(dim=1)[:, : keys.shape[1] - drop_last]
    if per_head.shape[1] == 0:  # the window is the whole context: nothing left to pool
        return per_head.reshape(n_kv, n_heads // n_kv, 0).mean(dim=1)
    pooled = F.avg_pool1d(per_head.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    return pooled.reshape(n_kv, n_heads // n_kv, -1).mean(dim=1)


def snap_scores(req: Request, window: int, kernel: int, from_question: bool) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc] SnapKV scores; the window's own tokens score +inf."""
    ctx = req.ctx
    if from_question and not req.question:
        raise MethodError("query-aware SnapKV needs a question")
    window = min(window, ctx.doc_len)
    sources = question_queries(ctx, req.question) if from_question else ctx.queries["context"]
    out = []
    for layer, q in enumerate(sources):
        keys, scale = ctx.full.keys[layer], ctx.lm.geometry[layer].scaling
        if from_question:
            score = pooled_window_scores(q, keys, kernel, causal=False, scale=scale)[:, ctx.prefix_len :]
        else:
            cut = pooled_window_scores(q[:, -window:], keys, kernel, causal=True, drop_last=window, scale=scale)
            score = torch.cat([cut[:, ctx.prefix_len :], torch.full((keys.shape[0], window), float("inf"), device=cut.device)], dim=1)
        out.append(score)
    return out


@register
class SnapKV(EvictionMethod):
    name = "snapkv"
    summary = "query-agnostic: attention from the document's last tokens (a window), pooled, top-k per head"
    learn = (
        "The last queries of the prompt already show what the model will look for. Each token is scored by "
        "the attention of an observation window $W$ (the document's last `window` queries), averaged over the "
        "window and the query heads of its group and smoothed by 1-D average pooling over `kernel` tokens: "
        "$s_j=\\operatorname{pool}\\big(\\tfrac{1}{|W|}\\sum_{i\\in W}a_{ij}\\big)$; top B per head, the window "
        "itself is kept. Here the window is the end of the document, so it is query-agnostic."
    )
    paper = Paper(
        "Li et al.", 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arxiv="2404.14469")
    family = "selection"
    bf16_tolerance = "same_tokens"
    Options = SnapKVOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return snap_scores(req, self.options.window, self.options.kernel, from_question=False)
