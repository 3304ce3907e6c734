"""Summarise, then compact: Attention Matching applied to the cache of the model's own summary.

The paper reports that compacting a summary's cache reaches about 200x with
the accuracy of the summary alone. Here the model writes a summary of up to
``summary_tokens`` tokens, the summary is read as a new context, and
Attention Matching compacts it so that the stored keys per head are what the
requested ratio allows for the original document (T / ratio).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlab.compression.interface import Method
from kvlab.compression.options import knob
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.context import prepare_context
from kvlab.methods.families.am_recipe import PAPER, PRESETS, AMOptions, QuerySourced
from kvlab.methods.families.document_fit import compact_document
from kvlab.methods.families.summary import SUMMARY_PROMPT, write_summary
from kvlab.prompts import question_tokens
from kvlab.runtime.cache import CompressedKV, keep_windows, template_segment


@dataclass(frozen=True)
class SummaryAMOptions(AMOptions):
    summary_tokens: int = knob(256, "length cap of the summary the model writes first", low=1)


@register
class SummaryThenAM(QuerySourced, Method):
    name = "summary_am"
    summary = "the model summarises the document, then Attention Matching compacts the summary's cache to T/ratio keys"
    paper = dataclasses.replace(PAPER, note="summarise, then compact: Attention Matching on the summarisation baseline")
    family = "compaction"
    bf16_tolerance = "code_flips"  # the summary pinned, Attention Matching's fit of it then moves like a selection
    Options = SummaryAMOptions
    presets = PRESETS

    def long_compression(self) -> bool:
        """It writes a summary, reads it, then fits Attention Matching to it."""
        return True

    def compress(self, req: Request) -> CompressedKV:
        ctx, lm, opts = req.ctx, req.ctx.lm, self.options
        if req.ratio == 1:
            return CompressedKV(ctx.full.stored.layers, ctx.length, meta={"method": self.name, "summary": None})
        req.progress(0.3, f"writing a summary of up to {opts.summary_tokens} tokens")
        prompt = SUMMARY_PROMPT.format(words=round(opts.summary_tokens * 0.75))
        ids = write_summary(lm, ctx.full.stored, question_tokens(lm.tokenizer, prompt), opts.summary_tokens, fill=False)
        summary = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
        if not summary:
            # Nothing but special tokens or spaces (a random model's ids past its tokenizer's vocabulary, say):
            # no summary to read, so the cache holds what no context holds, the template's prefix.
            layers = [[template_segment(k, v, ctx.prefix_len)] for k, v in zip(ctx.full.keys, ctx.full.values)]
            return CompressedKV(layers, ctx.prefix_len, meta={"method": self.name, "summary": "", "summary_tokens": 0})
        summary_ctx = prepare_context(lm, summary)
        target = max(1, round(ctx.doc_len / req.ratio))
        inner = max(1.0, summary_ctx.doc_len / target)
        req.progress(0.5, f"compacting the {summary_ctx.doc_len}-token summary {inner:.1f}x")
        am_fields = {f: getattr(opts, f) for f in AMOptions.__dataclass_fields__}
        stored = compact_document(Request(summary_ctx, inner, req.question), AMOptions(**am_fields), self.name)
        # The summary's sliding-window layers as the model keeps them, as a registered method's cache of
        # its own document is (kvlab.compression.interface.keeping_windows).
        stored = keep_windows(stored, summary_ctx.full)
        for layer in stored.layers:
            for seg in layer:
                if seg.fate != "template":
                    # These keys stand for summary tokens, not for tokens of the document.
                    seg.token_index = seg.token_index.new_full(seg.token_index.shape, -1)
                    seg.fate = "summary"
        stored.meta.update(summary=summary, summary_tokens=summary_ctx.doc_len, inner_ratio=inner)
        return stored
