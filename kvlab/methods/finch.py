"""Finch (Corallo & Papotti, 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large
Language Models", TACL; kvpress's FinchPress).

Query-aware: the prompt (here the user's question, read after the document) is the
observation window. As SnapKV from the question, but without pooling and with Finch's
normalisation: query i of the window sits at position p_i = N + i after the N context tokens
and its softmax runs over the p_i + 1 keys it sees (the context, then the question's own
keys, causal), so its weights are multiplied by p_i before they are averaged over the window
(a row spread over more keys is not counted weaker), then over the query heads of each KV
head's group: s_j = mean_g mean_i p_i a_ij, for the context keys j.

kvpress's ``rerotate_keys`` (the kept keys moved to consecutive positions) is the selection
wrappers' ``rerotate=true`` here (preset ``key_rerotation``). Not here: kvpress's ``chunk_length``
(the document compressed chunk by chunk, each keeping its share). kvlab never stores the
question, so there is no window to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import MethodError, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import pool_group
from kvlab.compression.selection import SelectionOptions
from kvlab.context import Context, Memo
from kvlab.prompts import question_tokens
from kvlab.queries import RepeatPass
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.decode import open_session, read_chunked
from kvlab.runtime.hooks import QueryCapture


@dataclass(frozen=True)
class FinchOptions(SelectionOptions):
    normalize_scores: bool = knob(True, "multiply each window query's weights by the number of keys before it")


@dataclass(frozen=True)
class FinchPass(Memo):
    """Where :func:`question_pass` keeps the pass that read ``question`` after the full cache."""

    store = "queries"


def question_pass(ctx: Context, question: str) -> RepeatPass:
    """The question read after the full cache: its queries and its own keys per layer, kept on ``ctx``."""

    def make() -> RepeatPass:
        capture = QueryCapture(ctx.lm.n_layers)
        session = open_session(ctx.lm, ctx.full.stored)
        read_chunked(ctx.lm, session, question_tokens(ctx.lm.tokenizer, question), capture)
        keys = [layer.keys[0, :, ctx.length :].clone() for layer in session.cache.layers]
        return RepeatPass(capture.per_layer(), keys)

    return ctx.cached(FinchPass(question=question), make)


def finch_scores(req: Request, normalize: bool) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: the question window's attention on the document, Finch-normalised."""
    ctx = req.ctx
    if not req.question:
        raise MethodError("finch needs a question")
    window = question_pass(ctx, req.question)
    out = []
    for layer, (q, own) in enumerate(zip(window.queries, window.keys)):
        keys = expand_kv_heads(torch.cat([ctx.full.keys[layer], own], dim=1), q.shape[0])
        weights = attention_weights(q, keys, scale=ctx.lm.geometry[layer].scaling, causal=True)[..., : ctx.length]
        if normalize:  # query i sits at position N + i: it sees N + i earlier keys
            weights = weights * torch.arange(ctx.length, ctx.length + q.shape[1], device=q.device).unsqueeze(1)
        out.append(pool_group(weights.mean(dim=1), ctx.lm.n_kv_heads, "mean")[:, ctx.prefix_len :])
    return out


@register
class Finch(EvictionMethod):
    name = "finch"
    summary = "query-aware: the question's attention on the document, each query's row scaled by its position"
    paper = Paper(
        "Corallo, Papotti",
        2024,
        "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models",
        url="https://direct.mit.edu/tacl/article/doi/10.1162/tacl_a_00716/125280",
        note="TACL",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    query_aware = True
    Options = FinchOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return finch_scores(req, self.options.normalize_scores)
