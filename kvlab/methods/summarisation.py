"""Summarisation: the model writes a summary of the document, and the summary's cache
replaces the document's.

The model reads the full document, is asked for a summary of about T / ratio
tokens (greedy, capped at ``max_tokens``), and the template prefix followed by
the summary is prefilled afresh: that cache is what is stored, and the
question is then asked after the summary. Its logical length is the summary
context's (prefix + summary): positions continue from there, not from the
document's length. The summary's tokens are not document tokens (their
token index is -1), so every document token shows as evicted.

By default the end of turn is suppressed until the summary fills its budget,
so that it costs what the other methods' caches cost at the same ratio;
``fill_budget=false`` lets the model stop when it wants (a smaller cache).
At ratio 1 there is nothing to save: the full cache is returned as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import Method
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Baseline
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.summary import SUMMARY_PROMPT, write_summary
from kvlab.prompts import question_tokens
from kvlab.runtime.cache import CompressedKV, DenseSegment, FullKV, template_segment
from kvlab.runtime.decode import prefill


@dataclass(frozen=True)
class SummaryOptions(Options):
    max_tokens: int = knob(256, "cap on the summary's tokens (generation is slow on a CPU)", low=1)
    fill_budget: bool = knob(
        True,
        "suppress the end of turn until the summary has T/ratio tokens (equal memory); "
        "false: the model stops when it wants",
    )
    prompt: str = knob(SUMMARY_PROMPT, "the request read after the document; {words} is the target length")

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.prompt.format(words=1)
        except (KeyError, IndexError, ValueError) as exc:
            raise MethodError(f"prompt must be a text whose only {{field}} is {{words}}, got {self.prompt!r}") from exc


def summary_cache(full: FullKV, prefix_len: int, fate: str = "summary") -> list[list[DenseSegment]]:
    """Segments of a prefilled (prefix + summary) context: the prefix as template, the rest synthetic."""
    layers = []
    for keys, values in zip(full.keys, full.values):
        n_heads, length = keys.shape[:2]
        rest = torch.full((n_heads, length - prefix_len), -1, device=keys.device)
        lengths = torch.full((n_heads,), length - prefix_len, device=keys.device)
        layers.append(
            [
                template_segment(keys, values, prefix_len),
                DenseSegment.from_padded(keys[:, prefix_len:], values[:, prefix_len:], lengths, rest, fate=fate),
            ]
        )
    return layers


@register
class Summarisation(Method):
    name = "summarisation"
    summary = "the model summarises the document in about T/ratio tokens; the summary's cache replaces the document's"
    paper = Baseline("prompt compression by the model's own summary")
    family = "baselines"
    bf16_tolerance = "same_tokens"  # the summary is pinned in tests/test_bf16.py: a prefill of the same tokens
    Options = SummaryOptions

    def long_compression(self) -> bool:
        """It writes a summary (up to T/ratio tokens, decoded one by one) and reads it."""
        return True

    def compress(self, req: Request) -> CompressedKV:
        ctx, lm, opts = req.ctx, req.ctx.lm, self.options
        if req.ratio == 1:
            return CompressedKV(ctx.full.stored.layers, ctx.length, meta={"method": self.name, "summary": None})
        budget = max(1, min(req.doc_budget, opts.max_tokens))
        prompt = opts.prompt.format(words=max(1, round(budget * 0.75)))
        req.progress(0.3, f"writing a summary of up to {budget} tokens")
        ids = write_summary(lm, ctx.full.stored, question_tokens(lm.tokenizer, prompt), budget, opts.fill_budget)
        summary_ids = torch.tensor(ids, dtype=torch.long, device="cpu")  # token ids, as the context's
        context = torch.cat([ctx.tokens.ids[: ctx.prefix_len], summary_ids])
        req.progress(0.5, "reading the summary")
        full = prefill(lm, context)
        return CompressedKV(
            summary_cache(full, ctx.prefix_len),
            context.numel(),
            meta={
                "method": self.name,
                "summary": lm.tokenizer.decode(ids, skip_special_tokens=True).strip(),
                "summary_tokens": len(ids),
                "summary_prompt": prompt,
            },
        )
