"""Each KV head's role for a question: does it read the whole document, or only its ends?

DuoAttention (Xiao et al., 2024, arXiv 2410.10819) splits a model's heads in two: *retrieval* heads need
the full context, *streaming* heads do as well with StreamingLLM's attention sinks and a recent window.
Here the split is read off the full cache for one question: the question turn's queries attend over the
cache and the question's own tokens, and a head's **beyond-window share** is the part of that attention
that lands on document tokens that are neither sinks (the context's first ``n_sink`` tokens) nor in the
recent window (the context's last ``window`` tokens; the question's own tokens, which every streaming head
keeps, count as recent). The chat template's tokens, which every method keeps, are never beyond.

A head is ``retrieval`` when its share reaches ``threshold``: most of what it reads would be lost to a
sinks-and-window cache. DuoAttention learns a gate per head instead and sets its threshold for a chosen
fraction of retrieval heads; here a fixed mass threshold (one half by default) labels the heads from one
question. On the embedded SmolLM2-135M it makes 25 to 30 of the 90 KV heads retrieval heads on the bundled
examples, most of them in the first ten layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.context import Context, Memo
from kvlab.lab.inputs import InputError
from kvlab.methods.families.scorers import N_SINK, SnapKVOptions
from kvlab.prompts import question_tokens
from kvlab.runtime.attention import attention_logits, future_mask, group_queries, softmax_
from kvlab.runtime.decode import open_session, read_chunked
from kvlab.runtime.hooks import QueryCapture

#: The recent window by default: SnapKV's observation window, the lab's recent-window default.
ROLE_WINDOW: int = SnapKVOptions.window
#: A head is a retrieval head when at least this share of the question's attention lies beyond the window.
RETRIEVAL_THRESHOLD = 0.5
RETRIEVAL, STREAMING = "retrieval", "streaming"


def span_share(
    queries: torch.Tensor, keys: torch.Tensor, start: int, stop: int, scale: float | None, sliding: int | None = None
) -> torch.Tensor:
    """Per KV head, the share of the queries' attention that falls on keys ``start..stop-1``.

    queries: [H, n, d], the last n of the T tokens whose keys are ``keys`` [H_kv, T, d] (each query sees
    the keys up to its own, causal; a sliding-window layer's ``sliding`` hides older ones too, as
    kvlab.runtime.attention.future_mask counts it). scale: the layer's factor on q.k (None: 1/sqrt(d)).
    -> [H_kv] float32: each query's softmax over the keys it sees, the mass on the span, averaged over
    the queries and the query heads of the KV head's group (GQA). Builds [H_kv, g * n, T], never [T, T].
    """
    n_kv, n, length = keys.shape[0], queries.shape[1], keys.shape[1]
    logits = attention_logits(group_queries(queries, n_kv), keys, scale=scale)  # [H_kv, g * n, T] float32
    # Grouped rows run over (query head of the group, position): the causal mask repeats per query head.
    hidden = future_mask(n, length, keys.device, sliding)  # [n, T]
    logits.view(n_kv, -1, n, length).masked_fill_(hidden, float("-inf"))
    weights = softmax_(logits)
    return weights[..., start:stop].sum(dim=-1).mean(dim=-1)


def beyond_span(context_len: int, prefix_len: int, n_sink: int, window: int) -> tuple[int, int]:
    """The context positions (start, stop) of the document tokens beyond the sinks and the window.

    Sinks are the context's first ``n_sink`` tokens (StreamingLLM counts them from the start, template
    included); the template prefix is never beyond; the window is the context's last ``window`` tokens.
    An empty span (stop <= start) when the document fits in the sinks and the window.
    """
    start = max(n_sink, prefix_len)
    return start, max(start, context_len - window)


@dataclass
class HeadRoles:
    """Each KV head's role for one question, as plain data (CPU floats and strings, for figures and pages).

    shares[layer][head]: the head's beyond-window share (:func:`span_share`), in [0, 1];
    labels[layer][head]: "retrieval" when the share is at least ``threshold``, else "streaming";
    descriptions[layer][head]: one line, e.g. "layer 14, head 2: retrieval, 81% of the question's
    attention beyond the window". n_sink, window, threshold: the split's settings; beyond_tokens:
    how many document tokens lie beyond the sinks and the window (0: every head streams).
    """

    shares: list[list[float]]
    labels: list[list[str]]
    descriptions: list[list[str]]
    n_sink: int
    window: int
    threshold: float
    beyond_tokens: int

    @classmethod
    def of(cls, shares: list[list[float]], n_sink: int, window: int, threshold: float, beyond: int) -> HeadRoles:
        """Roles and descriptions of ``shares`` [layer][head] at ``threshold``."""
        labels = [[RETRIEVAL if s >= threshold else STREAMING for s in row] for row in shares]
        descriptions = [
            [
                f"layer {layer}, head {head}: {role}, {share:.0%} of the question's attention beyond the window"
                for head, (share, role) in enumerate(zip(row, roles))
            ]
            for layer, (row, roles) in enumerate(zip(shares, labels))
        ]
        return cls(shares, labels, descriptions, n_sink, window, threshold, beyond)

    @property
    def settings(self) -> str:
        """The split's settings in words, for titles and notes."""
        return f"{self.n_sink} sinks, a {self.window}-token window; retrieval at >= {self.threshold:.0%} beyond it" + (
            "" if self.beyond_tokens else " (the document fits in the sinks and the window: every head streams)"
        )


@dataclass(frozen=True)
class HeadRolesKey(Memo):
    """Where :func:`head_roles` keeps a question's head roles at these settings."""

    n_sink: int
    window: int
    threshold: float


def check_role_settings(n_sink: object, window: object, threshold: object) -> tuple[int, int, float]:
    """The split's settings checked: whole numbers >= 0 and a threshold in [0, 1]; InputError in one line."""
    for name, value in (("n_sink", n_sink), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name} must be a whole number >= 0, got {value!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InputError(f"threshold must be a number from 0 to 1, got {threshold!r}")
    return n_sink, window, float(threshold)


def question_turn(ctx: Context, question: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The question turn read after the full cache: per layer its queries [H, n, d] and keys [H_kv, n, d].

    The full cache's answer (kvlab.pipeline.evaluation) records the same queries but not the turn's keys,
    which each query's softmax includes: one read of the turn gives both. The session keeps every key
    (``every_key``), so each layer's last n are the turn's, on a sliding-window layer too.
    """
    ids = question_tokens(ctx.lm.tokenizer, question)
    capture = QueryCapture(ctx.lm.n_layers)
    session = open_session(ctx.lm, ctx.full.stored, every_key=True)
    read_chunked(ctx.lm, session, ids, capture)
    n = ids.numel()
    return capture.per_layer(), [layer.keys[0, :, -n:] for layer in session.cache.layers]


def head_roles(
    ctx: Context, question: str, n_sink: int = N_SINK, window: int = ROLE_WINDOW, threshold: float = RETRIEVAL_THRESHOLD
) -> HeadRoles:
    """Each KV head's role for ``question`` over ``ctx``'s full cache, computed once per settings and kept
    on the context (forgotten with the question).

    Every layer at its own scaling and, on a sliding-window layer, with its window, as the model attends.
    """
    n_sink, window, threshold = check_role_settings(n_sink, window, threshold)
    if not question.strip():
        raise InputError("head roles need a question")

    def make() -> HeadRoles:
        start, stop = beyond_span(ctx.length, ctx.prefix_len, n_sink, window)
        queries, turn_keys = question_turn(ctx, question)
        shares = []
        for layer, (q, k) in enumerate(zip(queries, turn_keys)):
            keys = torch.cat([ctx.full.keys[layer], k], dim=1)
            geometry = ctx.lm.geometry[layer]
            shares.append(span_share(q, keys, start, stop, geometry.scaling, geometry.window))
        per_head = torch.stack(shares).cpu().tolist()  # [L, H_kv]: plain floats, for figures and pages
        return HeadRoles.of(per_head, n_sink, window, threshold, stop - start)

    return ctx.cached(HeadRolesKey(n_sink, window, threshold, question=question), make)
