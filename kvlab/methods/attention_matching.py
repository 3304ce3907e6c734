"""Attention Matching (Zweiger, Fu, Guo, Kim, 2026, "Fast KV Compaction via Attention Matching").

Each KV head's document block is replaced by t compact keys (a subset of the
original keys, RoPE phases kept), one bias beta per key and refitted values,
chosen in closed form so that, for reference queries, the block's attention
output and attention mass are preserved (kvlab.methods.families.compaction). The
chat-template prefix stays as it is.

The published configurations are presets under the public code's names
(kvlab.methods.families.am_recipe.PRESETS, which summary_am shares).
The defaults are ``AM-HighestAttnKeys-basic`` (HighestAttnKeys, not
on-policy). On-policy fitting (``on_policy``) reads the reference text once
more, in one forward sweep that fits each layer as it reaches it
(``on_policy_sweep``; the paper's code re-reads the text once per layer, kept
as the reference the sweep is tested against), and combines with self-study
(``self_study_weight``): the paper's recipe, which is not yet the default
until the lab has measured it on real text.
"""

from __future__ import annotations

from kvlab.compression.interface import Method
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.am_recipe import PAPER, PRESETS, AMOptions, QuerySourced
from kvlab.methods.families.document_fit import compact_document
from kvlab.runtime.cache import CompressedKV


@register
class AttentionMatching(QuerySourced, Method):
    name = "attention_matching"
    summary = "compact keys + per-key bias + refitted values matching attention output and mass (closed form)"
    paper = PAPER
    family = "compaction"
    # a least-squares fit absorbs the rounding of its inputs (test_bf16's drift check sees a solver run in bf16)
    bf16_tolerance = "fit"
    Options = AMOptions
    presets = PRESETS

    def compress(self, req: Request) -> CompressedKV:
        return compact_document(req, self.options, self.name)
