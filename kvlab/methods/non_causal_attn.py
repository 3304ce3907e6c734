"""Non-causal chunked attention (Chari & Van Durme, 2025, Compactor, arXiv 2507.08143; kvpress's
NonCausalAttnPress).

A query-agnostic attention score that is not biased towards early tokens: the context is cut
into chunks of ``attention_chunk`` consecutive tokens (kvpress: ``chunk_size``; counted from the first token) and
inside each chunk every query attends to every key of the chunk, earlier and later alike
(non-causal). A key's score is the attention it receives from its chunk's queries, summed,
averaged over the query heads of its GQA group, multiplied by ||v_j|| (what the key would add),
smoothed by a 3-token average pooling (zero padding counted) and z-scored over the layer.

Deliberate differences from kvpress 0.5.5: the logits carry the layer's own attention scale
(1/sqrt(d), the model's attention; kvpress's press multiplies q.k unscaled), and a last chunk
shorter than ``attention_chunk`` is its own softmax over its real keys (kvpress pads it with zero
queries and keys whose padded rows and columns still take part in the softmax and the sums).
The per-layer maths is shared with compactor (kvlab.methods.families.scorers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.scorers import non_causal_layer, z_score


@dataclass(frozen=True)
class NonCausalAttnOptions(SelectionOptions):
    attention_chunk: int = knob(
        256, "non-causal attention: consecutive tokens per chunk; queries attend to every key of their chunk", low=1
    )


def non_causal_scores(req: Request, chunk_size: int) -> list[torch.Tensor]:
    """Per layer [H_kv, N]: z-scored non-causal chunked attention x ||v|| over the whole context."""
    ctx = req.ctx
    return [
        z_score(non_causal_layer(q, ctx.full.keys[i], ctx.full.values[i], chunk_size, ctx.lm.geometry[i].scaling))
        for i, q in enumerate(ctx.queries["context"])
    ]


@register
class NonCausalAttn(EvictionMethod):
    name = "non_causal_attn"
    summary = "attention received inside chunks where every query sees every key (non-causal), x ||v||, z-scored"
    paper = Paper(
        "Chari, Van Durme",
        2025,
        "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores",
        arxiv="2507.08143",
        note="its attention half",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = NonCausalAttnOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return [s[:, req.ctx.prefix_len :] for s in non_causal_scores(req, self.options.attention_chunk)]
