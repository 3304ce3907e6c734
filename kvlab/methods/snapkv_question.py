"""SnapKV whose observation window is the user's question (Li et al., 2024): the paper's own setting,
where the question ends the prompt. The scores are :func:`kvlab.methods.families.scorers.snap_scores`'s."""

from __future__ import annotations

from kvlab.compression.registry import register
from kvlab.methods.families.snapkv_window import SnapKVWindow


@register
class SnapKVQuestion(SnapKVWindow):
    name = "snapkv_question"
    summary = "query-aware SnapKV: the window is the user's question (the compression depends on it)"
    family = "selection"
    bf16_tolerance = "near_ties"  # scored by the question's few tokens alone
    query_aware = True
    from_question = True
