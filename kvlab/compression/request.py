"""What a method is asked: :class:`Request`, a prepared context and a ratio.

Ratio semantics, for every method: the chat template's prefix (system prompt
and turn header, a few dozen tokens) is always kept; the document's T tokens
are reduced to about T / ratio stored keys per KV head on average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.compression.options import MethodError
from kvlab.context import Context, Progress, no_progress

MIN_RATIO, MAX_RATIO = 1.0, 1000.0


@dataclass
class Request:
    """What a method is asked: compress ``ctx`` by ``ratio``.

    question: the user's question, for the methods (and query sources) that are
    explicitly query-aware; query-agnostic methods never read it.
    record_importance: also fill ``CompressedKV.importance`` (a diagnostic for
    the app's token view; off by default: it is per-token data nobody else reads).
    """

    ctx: Context
    ratio: float
    question: str | None = None
    progress: Progress = no_progress
    record_importance: bool = False

    def __post_init__(self) -> None:
        if not (MIN_RATIO <= self.ratio <= MAX_RATIO) or math.isnan(self.ratio):
            raise MethodError(f"ratio must be between {MIN_RATIO:g} and {MAX_RATIO:g}, got {self.ratio:g}")

    @property
    def doc_budget(self) -> int:
        """Document tokens kept per KV head on average: T / ratio, at least one."""
        return max(1, round(self.ctx.doc_len / self.ratio))

    def uniform_budgets(self) -> torch.Tensor:
        """[n_layers, H_kv] uniform per-head document budgets."""
        lm = self.ctx.lm
        return torch.full((lm.n_layers, lm.n_kv_heads), self.doc_budget, dtype=torch.long, device=lm.device)
