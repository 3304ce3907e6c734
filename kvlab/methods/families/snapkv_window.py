"""What SnapKV and its query-aware reading share (kvlab/methods/snapkv.py, snapkv_question.py): the
paper, the knobs and the scores from an observation window (pyramidkv reads the same scores,
kvlab.methods.families.scorers.snap_scores, with budgets of its own)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.request import Request
from kvlab.methods.families.scorers import SnapKVOptions, snap_scores


class SnapKVWindow(EvictionMethod):
    """SnapKV's scores (:func:`~kvlab.methods.families.scorers.snap_scores`): the observation window
    is the document's last queries, or the question's when ``from_question``."""

    paper = Paper("Li et al.", 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arxiv="2404.14469")
    Options = SnapKVOptions
    from_question: ClassVar[bool] = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        return snap_scores(req, self.options.window, self.options.kernel, from_question=self.from_question)
