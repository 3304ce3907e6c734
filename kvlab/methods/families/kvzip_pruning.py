"""What KVzip and KVzip+ share (kvlab/methods/kvzip.py, kvlab/methods/kvzip_plus.py): their scores'
pruning across heads (``prune``) and the document-only preparation; each method brings its scores."""

from __future__ import annotations

import torch

from kvlab.compression.budget_profiles import pooled_budgets
from kvlab.compression.interface import EvictionMethod
from kvlab.compression.request import Request
from kvlab.compression.wrappers.adakv import adakv_budgets
from kvlab.context import Context


class KVzipPruning(EvictionMethod):
    """Scores pruned globally across all layers and heads, across the heads of each layer, or per head
    (``prune``, kvpress's ``layerwise``; Options: :class:`~kvlab.methods.families.scorers.KVzipOptions`);
    the subclass's :meth:`scores` say what is pruned."""

    # The pooled top-k decides how many tokens each head keeps, and the total stays
    # exact: a head may keep no document token at all.
    min_head_budget = 0

    # The scores are a per-context memo already (KVzip's reconstruction scores, which Attention
    # Matching's key selection reads too; KVzip+'s weighted ones): not kept twice.
    keep_scores = False

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
        return (
            self.options.prune,
            f"KVzip's pruning: one ranking of its scores across {across} (prune={self.options.prune})",
        )

    def details(self) -> dict:
        return {"prune": self.options.prune}
