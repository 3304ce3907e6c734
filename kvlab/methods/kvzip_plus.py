"""KVzip+ (Jégou & Jeblick, 2026, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv
2601.07891; kvpress's KVzipPress with
``kvzip_plus_normalization=True``): KVzip's reconstruction attention weighted by what a key
adds to the layer's output, relative to the size of the query's own input.

KVzip scores key j by the largest attention a_ij any reconstruction query i pays it. KVzip+
multiplies each weight by ||v_j W_o^(h)||_2 / ||h_i||: the norm of what the key's value adds
to the attention output through the head's slice of the output projection, over the norm of
the query's own attention input h_i (the hidden state after the layer's input norm), so that
a weight counts by how much it changes the query's residual stream. As kvpress computes it:
s_j = max_i max_(h in group) a^(h)_ij ||v_j W_o^(h)||_2 / ||h_i||, each softmax over the first
``n_sink`` context tokens, the document and the reconstruction's own tokens (causal), then
pruned as KVzip's (``prune``).

The queries and their softmax are KVzip's (kvlab.methods.families.scorers, the recorded repeat pass);
the attention inputs' norms need one more pass over the same tokens, through transformers'
modules (``output_hidden_states``), kept per context beside it. The differences from kvpress
are KVzip's (the template prefix kept, the document replayed in one chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import BLOCK_ELEMENTS, pool_group, protect
from kvlab.context import Context, Memo
from kvlab.methods.families.kvzip_pruning import KVzipPruning
from kvlab.methods.families.scorers import KVzipOptions
from kvlab.prompts import repeat_tokens
from kvlab.queries import repeat_pass
from kvlab.runtime.attention import attention_logits, future_mask, group_queries, output_projection, softmax_
from kvlab.runtime.decode import open_session
from kvlab.runtime.hooks import ForwardContext


@torch.inference_mode()
def attention_input_norms(ctx: Context, instruction: str, chunk_size: int = 2048) -> list[torch.Tensor]:
    """Per layer [n] float32: ||h_i||, the norm of each reconstruction token's attention input (the
    residual stream after the layer's input norm), from a pass after the full cache."""
    lm = ctx.lm
    ids = repeat_tokens(lm.tokenizer, ctx.tokens.ids[ctx.prefix_len :], instruction).to(lm.device)
    session = open_session(lm, ctx.full.stored)
    norms: list[list[torch.Tensor]] = [[] for _ in range(lm.n_layers)]
    layers = lm.model.get_decoder().layers
    for start in range(0, ids.numel(), chunk_size):
        chunk = ids[start : start + chunk_size]
        positions = torch.arange(session.position, session.position + chunk.numel(), device=lm.device).unsqueeze(0)
        out = lm.model(
            input_ids=chunk.unsqueeze(0),
            position_ids=positions,
            cache=session.cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=True,
            kvlab=ForwardContext(key_bias=session.key_bias),
        )
        session.position += chunk.numel()
        for i, layer in enumerate(layers):  # hidden_states[i]: the residual stream entering layer i
            norms[i].append(layer.input_layernorm(out.hidden_states[i][0]).float().norm(dim=-1))
    return [torch.cat(n) for n in norms]


def output_norms(values: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
    """||v_j W_o^(h)||_2 per query head: values [H_kv, T, d], o_proj weight [hidden, H * d] -> [H, T] float32."""
    n_kv, length, d = values.shape
    n_heads = o_weight.shape[1] // d
    w = o_weight.detach().float().view(-1, n_heads, d).transpose(0, 1)  # [H, hidden, d]
    gram = w.transpose(1, 2) @ w  # [H, d, d]: ||v W||^2 = v (W^T W) v^T, with no [T, hidden] product held
    v = values.float()
    group = n_heads // n_kv
    return torch.stack(
        [((v[h // group] @ gram[h]) * v[h // group]).sum(dim=-1).clamp_min(0.0).sqrt() for h in range(n_heads)]
    )


def weighted_max(
    queries: torch.Tensor, keys: torch.Tensor, row: torch.Tensor, scale: float, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """max_i a_ij / row_i per query head; causal, the queries the last n of the keys' tokens.

    queries [H, n, d], keys [H_kv, T, d], row [n] -> [H, T] float32, in blocks of query rows.
    """
    n_heads, n, total = queries.shape[0], queries.shape[1], keys.shape[1]
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    keys = keys.float()  # not copied per query head: each KV head's group is stacked against its keys
    out = torch.zeros(n_heads, total, device=keys.device)
    rows = max(1, block_elements // max(1, n_heads * total))
    for start in range(0, n, rows):
        end = min(start + rows, n)
        visible = total - n + end  # query i of the block sits at key position total - n + i
        block = group_queries(queries[:, start:end].float(), n_kv)  # [H_kv, group * rows, d]
        logits = attention_logits(block, keys[:, :visible], scale=scale).view(n_kv, group, end - start, visible)
        own = logits[..., visible - (end - start) :]  # only the block's own keys can lie in a query's future
        own.masked_fill_(future_mask(end - start, end - start, keys.device), float("-inf"))
        weights = softmax_(logits).view(n_heads, end - start, visible)
        weighted = weights / row[start:end].view(1, -1, 1)
        out[:, :visible] = torch.maximum(out[:, :visible], weighted.amax(dim=1))
    return out


@dataclass(frozen=True)
class KVzipPlusScores(Memo):
    """Where :func:`kvzip_plus_scores` keeps its scores: the knobs they depend on."""

    n_sink: int
    instruction: str


def kvzip_plus_scores(req: Request, opts: KVzipOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: max over the reconstruction queries and the group of a_ij ||v_j W_o|| / ||h_i||."""
    ctx = req.ctx
    sink = min(opts.n_sink, ctx.prefix_len)

    def make() -> list[torch.Tensor]:
        recon = repeat_pass(ctx, opts.instruction)
        norms = attention_input_norms(ctx, opts.instruction)
        out = []
        for layer, (q, k_own) in enumerate(zip(recon.queries, recon.keys)):
            keys = ctx.full.keys[layer]
            if ctx.full.window(layer) is not None:  # as KVzip: a sliding-window layer keeps its window
                out.append(torch.zeros(keys.shape[0], ctx.doc_len, device=keys.device))
                continue
            keys = torch.cat([keys[:, :sink], keys[:, ctx.prefix_len :], k_own], dim=1)
            weights = weighted_max(q, keys, norms[layer], ctx.lm.geometry[layer].scaling)[:, sink : sink + ctx.doc_len]
            values = ctx.full.values[layer][:, ctx.prefix_len :]
            scored = weights * output_norms(values, output_projection(ctx.lm.model, layer))
            out.append(pool_group(scored, ctx.lm.n_kv_heads, "max"))
        return out

    scores = ctx.cached(KVzipPlusScores(opts.n_sink, opts.instruction), make)
    doc_sinks = max(0, opts.n_sink - ctx.prefix_len)
    return [protect(s.clone(), slice(0, doc_sinks)) for s in scores]


@register
class KVzipPlus(KVzipPruning):
    name = "kvzip_plus"
    summary = "KVzip's reconstruction attention x ||v W_o|| / ||h||: weighted by what a key adds to the output"
    paper = Paper(
        "Jégou, Jeblick",
        2026,
        "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning",
        arxiv="2601.07891",
        note="KVzip+, the scores KVzap's surrogates are trained to predict",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = KVzipOptions  # KVzip's own knobs, its pruning too (kvlab.methods.families.kvzip_pruning)

    def scores(self, req: Request) -> list[torch.Tensor]:
        return kvzip_plus_scores(req, self.options)
