"""What happened to every token of a run, as light plain data a front end can keep per user;
and one needle followed through a compression (:func:`trace_needle`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from kvlab.context import Context, Memo
from kvlab.figures import EVICTED
from kvlab.lab.explore import Explored, token_texts
from kvlab.metrics import percentile_levels, question_attention, scored_view
from kvlab.runtime.attention import attention_weights, group_queries
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import greedy, greedy_from_draft
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.model import LoadedModel


def level_bytes(per_layer: list[torch.Tensor]) -> list[list[bytes]]:
    """Per layer [H_kv, T] scores -> [layer][head] one level byte per token (kvlab.metrics.percentile_levels)."""
    levels = percentile_levels(torch.stack(per_layer)).cpu()  # [L, H_kv, T] bytes, for the front end
    return [[bytes(row.numpy()) for row in layer] for layer in levels]


@dataclass(frozen=True)
class QuestionLevels(Memo):
    """Where :meth:`TokenFates.of` keeps the full cache's attention levels of ``question`` (asked and
    answered as ``answer_ids``): the same for every method's run on it."""

    answer_ids: tuple[int, ...]


@dataclass
class TokenFates:
    """What happened to every context token in every layer and KV head of a run: plain, light data.

    codes[layer][head] holds one byte per context token, an index into
    ``names`` (0: evicted). levels[source][layer][head] holds one byte per
    context token for each intensity source the run has ("score": the
    method's own score, absent for a method without one; "question": the
    question's attention over the full cache): 0 for a token without a
    score, else its percentile rank within the head (1-255). This is what the
    app keeps per user between runs, instead of the run and its cache.
    """

    token_texts: list[str]
    names: list[str]
    codes: list[list[bytes]]
    levels: dict[str, list[list[bytes]]] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.codes)

    @property
    def n_kv_heads(self) -> int:
        return len(self.codes[0]) if self.codes else 0

    @classmethod
    def of(cls, ex: Explored) -> TokenFates:
        names, index = [EVICTED], {EVICTED: 0}
        n = len(ex.token_texts)
        codes = []
        for layer in range(ex.n_layers):
            row = []
            for head in range(ex.n_kv_heads):
                buf = bytearray(n)
                for i, fate in ex.run.stored.fates(layer, head).items():
                    if 0 <= i < n:
                        if fate not in index:
                            index[fate] = len(names)
                            names.append(fate)
                        buf[i] = index[fate]
                row.append(bytes(buf))
            codes.append(row)
        run, ev = ex.run, ex.run.evaluation
        # The same for every method's run on this question (the full cache's attention): made once per context.
        levels = {
            "question": run.ctx.cached(
                QuestionLevels(tuple(ev.answer.ids), question=ev.question),
                # At each layer's own scaling (Gemma 3's query_pre_attn_scalar), as the runtime attends.
                lambda: level_bytes(
                    question_attention(ev.queries, run.ctx.full.keys, [g.scaling for g in run.ctx.lm.geometry])
                ),
            )
        }
        if run.stored.importance is not None:
            levels["score"] = level_bytes(run.stored.importance)
        return cls(ex.token_texts, names, codes, levels)

    def fates(self, layer: int, head: int) -> dict[int, str]:
        """Token index -> fate, for the tokens not evicted in one layer and KV head."""
        return {i: self.names[c] for i, c in enumerate(self.codes[layer][head]) if c}


def pieces_spelling(pieces: Sequence[str], text: str, start: int = 0) -> list[int]:
    """Indices of the ``pieces`` (token texts, in order) that overlap the first occurrence of ``text``
    in their concatenation at or after character ``start``; [] when it does not occur."""
    begin = "".join(pieces).find(text, start)
    if begin < 0 or not text:
        return []
    end, out, at = begin + len(text), [], 0
    for i, piece in enumerate(pieces):
        if piece and at < end and at + len(piece) > begin:
            out.append(i)
        at += len(piece)
    return out


def span_attention(
    queries: list[torch.Tensor], stored: CompressedKV, positions: torch.Tensor, scales: list[float], lm: LoadedModel
) -> list[torch.Tensor]:
    """Per layer [H_kv, P]: the share of the queries' attention over ``stored`` that lands on the key
    standing for each of the context positions [P] (0 where the head keeps none).

    queries: per layer [H, n, d]; each query's softmax runs over the stored
    keys with their biases (what the compressed cache answers from) at the
    layer's own scaling, averaged over the queries and the KV head's group of
    query heads, as :func:`kvlab.metrics.question_attention` does for the full cache. A re-rotated
    cache is met as generation meets it (:func:`kvlab.metrics.scored_view`, with ``lm``'s RoPE).
    """
    out = []
    for layer, q in enumerate(queries):
        view = scored_view(stored, layer, lm)
        weights = attention_weights(
            group_queries(q, view.keys.shape[0]), view.keys, view.bias, scale=scales[layer]
        ).mean(dim=1)  # [H_kv, L]
        hit = (view.token_index.unsqueeze(-1) == positions.to(view.token_index.device)).float()  # [H_kv, L, P]
        out.append(torch.einsum("hl,hlp->hp", weights, hit).cpu())
    return out


@dataclass
class NeedleTrace:
    """One needle followed through one compression: plain data (the figure and ``--json`` are drawn from it).

    span_texts / positions: [P] the traced tokens (the needle sentence) and their
    context positions; span_value: [P] whether the token spells the needle's value.
    fates[layer][head][p]: that token's fate in the compressed cache ("kept",
    "compacted", ..., "evicted" when no key stands for it).
    attention_full / attention_compressed[layer][head][p]: the share of the
    held-out queries' attention (the question turn's and the full cache's
    answer's) that lands on the token's key, in each cache (:func:`span_attention`).
    answer_texts: [m] the tokens of the full cache's answer; answer_value: [m]
    whether each spells the value; logprob_full / logprob_compressed: [m] their
    log-probabilities teacher-forced under each cache.
    """

    label: str
    ratio: float
    value: str
    span_texts: list[str]
    positions: list[int]
    span_value: list[bool]
    fates: list[list[list[str]]]
    attention_full: list[list[list[float]]]
    attention_compressed: list[list[list[float]]]
    answer_texts: list[str]
    answer_value: list[bool]
    logprob_full: list[float]
    logprob_compressed: list[float]
    answer_full: str
    answer_compressed: str

    def to_dict(self) -> dict:
        return asdict(self)


def trace_needle(
    ctx: Context,
    stored: CompressedKV,
    prompt_ids: torch.Tensor,
    span: str,
    value: str,
    max_new_tokens: int,
    label: str,
    ratio: float,
) -> NeedleTrace:
    """Follow the tokens of ``span`` (a text of the context, e.g. the needle sentence, holding ``value``)
    through ``stored``, the context's cache compressed by ``label`` at ``ratio``.

    prompt_ids: [n] the question turn (and answer prefix) answered after the
    cache. The full cache answers greedily (its queries are the held-out
    ones; an answer without the value has no token flagged in
    ``answer_value``); ValueError when the span is not in the context or the
    value not in the span.
    """
    lm = ctx.lm
    pieces = token_texts(lm.tokenizer, ctx.tokens.ids.tolist())
    joined = "".join(pieces)
    begin = joined.find(span)
    if begin < 0 or not span:
        raise ValueError(f"the span {span!r} is not in the context")
    if value not in span:
        raise ValueError(f"the value {value!r} is not in the span {span!r}")
    index = pieces_spelling(pieces, span)
    in_value = set(pieces_spelling(pieces, value, begin))
    capture = QueryCapture(lm.n_layers)
    full = greedy(lm, ctx.full.stored, prompt_ids, max_new_tokens, capture)
    answer_pieces = token_texts(lm.tokenizer, full.ids)
    answer_value = set(pieces_spelling(answer_pieces, value))
    drafted = greedy_from_draft(lm, stored, prompt_ids, full.ids, max_new_tokens)
    queries, scales = capture.per_layer(), [g.scaling for g in lm.geometry]
    positions = torch.tensor(index, device=lm.device)
    shares_full = span_attention(queries, ctx.full.stored, positions, scales, lm)
    shares = span_attention(queries, stored, positions, scales, lm)
    fates = []
    for layer in range(stored.n_layers):
        fates.append(
            [
                [kept.get(i, EVICTED) for i in index]
                for kept in (stored.fates(layer, h) for h in range(shares[layer].shape[0]))
            ]
        )
    return NeedleTrace(
        label,
        ratio,
        value,
        [pieces[i] for i in index],
        index,
        [i in in_value for i in index],
        fates,
        [s.tolist() for s in shares_full],
        [s.tolist() for s in shares],
        answer_pieces,
        [i in answer_value for i in range(len(full.ids))],
        list(full.logprobs),
        drafted.draft_logprobs.tolist(),
        full.text,
        drafted.generation.text,
    )
