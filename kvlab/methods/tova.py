"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Token Omission Via Attention: a token's score is the attention the last
context token pays it, averaged over all the query heads of the layer, so
every KV head of a layer keeps the same tokens (kvpress's TOVAPress does the
same). The last token itself is always kept.
"""
from __future__ import annotations

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import protect
from kvlab.compression.selection import SelectionOptions
from kvlab.runtime.attention import attention_weights, expand_kv_heads


def tova_scores(req: Request) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: the last context query's attention, mean over all query heads."""
    ctx = req.ctx
    out = []
    for layer, q in enumerate(ctx.queries["context"]):
        keys = expand_kv_heads(ctx.full.keys[layer], q.shape[0])
        # The last token sees every key: no causal mask needed.
        weights = attention_weights(q[:, -1:], keys, scale=ctx.lm.geometry[layer].scaling)[:, 0]  # [H, T]
        score = weights.mean(dim=0)[ctx.prefix_len :].clone()
        protect(score, slice(ctx.doc_len - 1, None))
        out.append(score.expand(ctx.lm.n_kv_heads, -1))
    return out


@register
class TOVA(EvictionMethod):
    name = "tova"
    Options = SelectionOptions
    summary = "attention of the document's last token, averaged over all heads (same tokens in every head of a layer)"
    learn = (
        "Token Omission Via Attention: the score is the attention the document's last token pays each token, "
        "averaged over all query heads of the layer, $s_j=\\tfrac1H\\sum_h a^{(h)}_{T j}$, so every KV head of "
        "a layer keeps the same tokens."
    )
    paper = Paper(
        "Oren, Hassid, Yarden, Adi, Schwartz", 2024, "Transformers are Multi-State RNNs",
        arxiv="2401.06104", note="TOVA")
    family = "selection"
    bf16_tolerance = "near_ties"

    def scores(self, req: Request) -> list[torch.Tensor]:
        return tova_scores(req)
