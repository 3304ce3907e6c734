"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction").

Query-agnostic: after the document, the model is asked to repeat it
("Repeat the previous context exactly.", the paper's and kvpress's prompt)
and is teacher-forced through the document again. A key's score is the
largest attention it receives from any of those reconstruction queries and
any query head of its GQA group: a token the model needs to rebuild the
context is a token worth keeping. As in the paper's code and kvpress, each
reconstruction query's softmax runs over the first ``n_sink`` context tokens,
the document and the reconstruction's own tokens (causal).

The scores are then pruned globally across all layers and heads by default
(kvpress's ``layerwise=False``): heads keep different numbers of tokens
(ragged), the total stays what the ratio allows. ``prune=layer`` shares each
layer's total among its heads (kvpress's ``layerwise=True``); ``prune=head``
gives every head the uniform budget.

Deliberate differences from kvpress's KVzipPress: kvlab keeps the template
prefix (kvpress scores it 0 beyond the sinks, so it is evicted first), and
reconstructs the whole document in one pass (kvpress and the paper's code
replay contexts longer than ``chunk_size`` = 2048 tokens chunk by chunk, with
a "Repeat the part of the previous context exactly, starting with ..." prompt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.budget_profiles import pooled_budgets
from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import per_context, pool_group, protect, received_attention
from kvlab.compression.selection import SelectionOptions
from kvlab.compression.wrappers.adakv import adakv_budgets
from kvlab.context import Context
from kvlab.prompts import REPEAT_INSTRUCTION
from kvlab.queries import repeat_pass


@dataclass(frozen=True)
class KVzipOptions(SelectionOptions):
    prune: Literal["global", "layer", "head"] = knob(
        "global", "global (across all layers and heads, ragged), layer (across the heads of each layer), head (uniform)")
    n_sink: int = knob(4, "first context tokens in every reconstruction softmax (never evicted)", low=0)
    instruction: str = knob(REPEAT_INSTRUCTION, "the reconstruction prompt read after the document")


def kvzip_scores(req: Request, opts: KVzipOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: max attention from the reconstruction queries and the group's heads."""
    ctx = req.ctx
    sink = min(opts.n_sink, ctx.prefix_len)

    def make() -> list[torch.Tensor]:
        recon = repeat_pass(ctx, opts.instruction)
        out = []
        for layer, (q, k_own) in enumerate(zip(recon.queries, recon.keys)):
            keys = ctx.full.keys[layer]
            if ctx.full.window(layer) is not None:
                # A sliding-window layer keeps its window whatever its scores (and its working
                # cache held only the window, not the repeat's own keys in order): none needed.
                out.append(torch.zeros(keys.shape[0], ctx.doc_len, device=keys.device))
                continue
            # Sinks, document, reconstruction: the queries are the last n of these keys.
            keys = torch.cat([keys[:, :sink], keys[:, ctx.prefix_len :], k_own], dim=1)
            received = received_attention(q, keys, reduce="max", causal=True, scale=ctx.lm.geometry[layer].scaling)
            # Without a template prefix the sinks are the document's first tokens: never evicted.
            doc_sinks = max(0, opts.n_sink - ctx.prefix_len)
            scored = pool_group(received, ctx.lm.n_kv_heads, "max")[:, sink : sink + ctx.doc_len]
            out.append(protect(scored, slice(0, doc_sinks)))
        return out

    return per_context(ctx, ("kvzip", opts.n_sink, opts.instruction), make)


@register
class KVzip(EvictionMethod):
    name = "kvzip"
    summary = "query-agnostic: max attention while the model repeats the document; pruned across heads (ragged)"
    learn = (
        "Query-agnostic by construction: the model is asked to \"Repeat the previous context exactly\" and is "
        "teacher-forced through the document again; a token needed to rebuild the context is worth keeping. "
        "Score: the largest attention it receives from any reconstruction query and any query head of its "
        "group, $s_j=\\max_{i\\in\\text{repeat}}\\max_{g}a^{(g)}_{ij}$. With `prune` the scores are pruned "
        "globally across all layers and heads, or across the heads of each layer, so heads keep different "
        "numbers of tokens; or per head, with the uniform budget."
    )
    paper = Paper(
        "Kim et al.", 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
        arxiv="2505.23416")
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = KVzipOptions
    # The pooled top-k decides how many tokens each head keeps, and the total stays
    # exact: a head may keep no document token at all.
    min_head_budget = 0

    # Its scores are the reconstruction memo itself (Attention Matching's key selection reads it too).
    keep_scores = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        return kvzip_scores(req, self.options)

    def prepare(self, ctx: Context) -> None:
        """Record the reconstruction pass and score every key from it: both depend on the document
        alone, and together they are most of a compression (the ratio only selects)."""
        self.kept_scores(Request(ctx, 1.0))

    def head_budgets(self, req: Request) -> torch.Tensor:
        budgets = req.uniform_budgets()
        layers = req.ctx.lm.compressed_layers  # a sliding-window layer keeps its window: not in the pool
        if self.options.prune == "head" or not layers:
            return budgets
        scores = [self.kept_scores(req)[i] for i in layers]
        per_head = min(req.doc_budget, req.ctx.doc_len)
        # No floor: the pooled top-k alone decides (kvpress's), a head may keep no document token.
        if self.options.prune == "global":
            budgets[layers] = pooled_budgets(scores, per_head, floor=0).to(budgets.device)
        else:
            n_heads = budgets.shape[1]
            budgets[layers] = torch.stack([adakv_budgets(s, n_heads * per_head, 0) for s in scores]).to(budgets.device)
        return budgets

    def allocation(self) -> tuple[str, str] | None:
        if self.options.prune == "head":
            return None
        across = "every head and layer" if self.options.prune == "global" else "the heads of each layer"
        return self.options.prune, f"KVzip's pruning: one ranking of its scores across {across} (prune={self.options.prune})"

    def details(self) -> dict:
        return {"prune": self.options.prune}
