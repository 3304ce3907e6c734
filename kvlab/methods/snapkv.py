"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Each document token is scored by the attention it gets from an observation
window of queries, averaged over the window and the query heads of its GQA
group, smoothed by 1-D average pooling; the window's own tokens are kept.
Query-agnostic when the window is the end of the document, query-aware when
it is the user's question (snapkv_question). The scores and the knobs are shared:
kvlab.methods.families.scorers, kvlab.methods.families.snapkv_window.
"""

from __future__ import annotations

from kvlab.compression.registry import register
from kvlab.methods.families.snapkv_window import SnapKVWindow


@register
class SnapKV(SnapKVWindow):
    name = "snapkv"
    summary = "query-agnostic: attention from the document's last tokens (a window), pooled, top-k per head"
    family = "selection"
    bf16_tolerance = "same_tokens"
