"""Your pick: the learner chooses which parts of the document stay (kvlab issue #43).

The knob ``keep`` names the document's spans to keep, in one of these forms:

- token spans, 0-based and inclusive at both ends: ``"0-39,120-179"`` keeps tokens 0 to 39 and
  120 to 179 (100 tokens); ``"7"`` keeps token 7 alone;
- sentence spans over the document's sentence split (kvlab.sentences, inclusive): ``"s0,s3-s5"``
  keeps sentences 0, 3, 4 and 5 (``"s3-5"`` reads the same); the two forms may be mixed;
- ``"first"`` (the default): the document's first B tokens, B the ratio's budget (T / ratio,
  rounded as every method rounds it, kvlab.compression.request.Request.doc_budget): what a reader
  who stops when the room runs out keeps;
- ``"none"``: none of the document, the floor (an empty text is refused: a blank field in the app
  or the command line means the default, so the floor has a name).

The chat template and the question are kept, as by every method; every layer and every KV head
keeps the same tokens (a sliding-window layer keeps its window, as for every method). The spans
must lie inside the document, must not overlap, and must hold at most B tokens; fewer is allowed
(a cheaper cache). Each refusal is one line (MethodError). The pick is recorded as the token
view's importance (1 kept, 0 not); the selection wrappers do not apply (they would move the pick).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Baseline
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.context import Context, Memo
from kvlab.sentences import Sentence, split_sentences

FIRST, NONE = "first", "none"
#: One span: ``a``, ``a-b``, ``sa``, ``sa-sb`` or ``sa-b`` (whitespace around the dash allowed).
_SPAN = re.compile(r"(s?)(\d+)(?:\s*-\s*(s?)(\d+))?", re.IGNORECASE)
FORMS = "token spans like '0-39,120-179', sentence spans like 's0,s3-s5', 'first' or 'none'"


@dataclass(frozen=True)
class Span:
    """One span of a pick as written: tokens (``kind="token"``) or sentences ``first`` to ``last``, inclusive."""

    kind: Literal["token", "sentence"]
    first: int
    last: int

    def __str__(self) -> str:
        mark = "s" if self.kind == "sentence" else ""
        return f"{mark}{self.first}" if self.first == self.last else f"{mark}{self.first}-{mark}{self.last}"


def parse_keep(text: str) -> tuple[Span, ...] | str:
    """``keep`` read: FIRST or NONE, else its spans in the order written.

    MethodError (one line) for an empty or malformed text, a span written backwards, or two spans of
    the same kind that overlap (a token span and a sentence span are compared once the document is known).
    """
    words = text.strip().lower()
    if not words:
        raise MethodError(
            f"keep is empty: write '{NONE}' to keep none of the document, or spans ('0-39,120-179', 's0,s3-s5')"
        )
    if words in (FIRST, NONE):
        return words
    spans = []
    for item in (part.strip() for part in words.split(",")):
        found = _SPAN.fullmatch(item)
        if found is None or (found[3] and not found[1]):
            raise MethodError(f"keep must be {FORMS}; {item!r} is none of these")
        kind: Literal["token", "sentence"] = "sentence" if found[1] else "token"
        first, last = int(found[2]), int(found[4] if found[4] is not None else found[2])
        if last < first:
            raise MethodError(f"keep: {item} runs backwards; write its first {kind}, then its last")
        spans.append(Span(kind, first, last))
    check_disjoint([(s.first, s.last + 1, str(s)) for s in spans if s.kind == "token"], "token")
    check_disjoint([(s.first, s.last + 1, str(s)) for s in spans if s.kind == "sentence"], "sentence", "s")
    return tuple(spans)


def check_disjoint(ranges: list[tuple[int, int, str]], unit: str, mark: str = "") -> None:
    """MethodError naming the first two of ``ranges`` (start, end exclusive, the span as written) that
    share a ``unit`` (a token or a sentence, numbered with ``mark`` before it)."""
    ordered = sorted(ranges)
    for (_, a1, a), (b0, b1, b) in zip(ordered, ordered[1:]):
        last = min(a1, b1) - 1
        if b0 <= last:
            shared = f"{unit} {mark}{b0}" if last == b0 else f"{unit}s {mark}{b0}-{mark}{last}"
            raise MethodError(f"keep: {a} and {b} overlap (both hold {shared}); name each part of the document once")


@dataclass(frozen=True)
class ManualOptions(Options):
    keep: str = knob(
        FIRST,
        "the document's spans to keep: tokens '0-39,120-179' (0-based, ends included), sentences "
        "'s0,s3-s5', 'first' (the opening, as far as the budget goes) or 'none' (the floor)",
    )

    def __post_init__(self) -> None:
        parse_keep(self.keep)  # the clearer line first: an empty keep says how to keep nothing
        super().__post_init__()


@dataclass(frozen=True)
class DocumentSentences(Memo):
    """Where :func:`sentences_of` keeps the document's sentence split (the same for every pick)."""


def sentences_of(ctx: Context) -> list[Sentence]:
    """The sentences of ``ctx``'s document (kvlab.sentences.split_sentences), split once per context."""
    doc_ids = ctx.tokens.ids[ctx.prefix_len :].tolist()
    return ctx.cached(DocumentSentences(), lambda: split_sentences(ctx.lm.tokenizer, doc_ids))


def token_ranges(spans: tuple[Span, ...], doc_len: int, sentences: list[Sentence]) -> list[tuple[int, int]]:
    """The spans as document token ranges (start, end exclusive), sorted; MethodError for a span
    past the document's end or two spans (of either kind) that share a token."""
    ranges = []
    for span in spans:
        if span.kind == "token":
            if span.last >= doc_len:
                raise MethodError(
                    f"keep: {span} runs past the document's last token (it has {doc_len} tokens: 0-{doc_len - 1})"
                )
            ranges.append((span.first, span.last + 1, str(span)))
        else:
            if span.last >= len(sentences):
                count = (
                    "1 sentence: s0" if len(sentences) == 1 else f"{len(sentences)} sentences: s0-s{len(sentences) - 1}"
                )
                raise MethodError(f"keep: {span} runs past the document's last sentence (it has {count})")
            ranges.append((sentences[span.first].start, sentences[span.last].end, str(span)))
    check_disjoint(ranges, "token")
    return sorted((a, b) for a, b, _ in ranges)


def pick_ranges(keep: str, ctx: Context, ratio: float) -> list[tuple[int, int]]:
    """The document token ranges (start, end exclusive) ``keep`` names on ``ctx``, sorted and disjoint.

    MethodError (one line, the method's name first) for a span past the document's end, two spans
    sharing a token, or a pick over the ratio's budget (the document tokens a head keeps,
    kvlab.compression.request.Request.doc_budget).
    """
    budget = Request(ctx, ratio).doc_budget
    try:
        return _checked_ranges(keep, ctx, ratio, budget)
    except MethodError as exc:
        raise MethodError(f"{Manual.name}: {exc}") from None


def _checked_ranges(keep: str, ctx: Context, ratio: float, budget: int) -> list[tuple[int, int]]:
    parsed = parse_keep(keep)
    if parsed == NONE:
        return []
    if parsed == FIRST:
        return [(0, min(budget, ctx.doc_len))]
    ranges = token_ranges(parsed, ctx.doc_len, sentences_of(ctx) if any(s.kind == "sentence" for s in parsed) else [])
    size = sum(b - a for a, b in ranges)
    if size > budget:
        raise MethodError(
            f"keep: the pick holds {size} document tokens, over the budget of {budget} at {ratio:g}x "
            f"(the document's {ctx.doc_len} tokens / {ratio:g}); drop {size - budget}"
        )
    return ranges


def pick_mask(ranges: list[tuple[int, int]], doc_len: int, device: torch.device) -> torch.Tensor:
    """[doc_len] float32 on ``device``: 1 on the picked tokens, 0 elsewhere."""
    mask = torch.zeros(doc_len, dtype=torch.float32, device=device)
    for a, b in ranges:
        mask[a:b] = 1.0
    return mask


@register
class Manual(EvictionMethod):
    name = "manual"
    summary = "your pick: the document spans you choose (tokens or sentences), within the ratio's budget"
    paper = Baseline("the learner's own pick of the document's spans")
    family = "baselines"
    bf16_tolerance = "same_tokens"  # the pick is the same tokens in both dtypes
    Options = ManualOptions
    #: A pick of nothing keeps no document token (``none``; the floor).
    min_head_budget = 0
    #: ``first`` follows the ratio; the spans are cheap to read again.
    keep_scores = False

    @classmethod
    def selects(cls) -> bool:
        """The pick is importance (the token view shows it), but no wrapper may move it."""
        return False

    def ranges(self, req: Request) -> list[tuple[int, int]]:
        """The picked document token ranges at ``req``'s ratio (checked: see :func:`pick_ranges`)."""
        return pick_ranges(self.options.keep, req.ctx, req.ratio)

    def scores(self, req: Request) -> list[torch.Tensor]:
        """Per layer [H_kv, T_doc]: 1 on the picked tokens, 0 elsewhere, the same in every layer and head."""
        lm = req.ctx.lm
        mask = pick_mask(self.ranges(req), req.ctx.doc_len, lm.device)
        return [mask.expand(lm.n_kv_heads, -1) for _ in range(lm.n_layers)]

    def head_budgets(self, req: Request) -> torch.Tensor:
        """[n_layers, H_kv]: the pick's size in every head (no more: top-k then keeps the pick exactly)."""
        lm, size = req.ctx.lm, sum(b - a for a, b in self.ranges(req))
        return torch.full((lm.n_layers, lm.n_kv_heads), size, dtype=torch.long, device=lm.device)

    def details(self) -> dict:
        return {"keep": self.options.keep}
