"""Each eviction scorer against its paper's formula, computed here from scratch on the tiny model.

The references never go through kvlab's query recording, cache, RoPE tables or attention maths:
transformers' eager attention gives the attention weights (``output_attentions``), forward hooks
on the projections give the pre-RoPE queries, keys and values, and RoPE is applied here by hand
from the config's theta. The tiny model has no chat template: the document is the whole context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from conftest import tiny_llama
from kvlab.context import prepare_context
from kvlab.methods import Request, get_method
from kvlab.methods.pyramidkv import pyramid_budgets
from kvlab.prompts import question_tokens

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96))
QUESTION = "w3 w5 w8"


@dataclass
class Eager:
    """One eager forward pass: per layer, attention weights [H, T, T] and the projections
    before RoPE: queries [H, T, d], keys and values [H_kv, T, d] (float64)."""

    attentions: list[torch.Tensor]
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def eager_pass(lm, ids: torch.Tensor) -> Eager:
    """Run transformers' eager attention over ``ids`` [T] and keep what the formulas need."""
    taken: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(lm.model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            hook = lambda mod, args, out, key=(i, name): taken.__setitem__(key, out[0].double())  # noqa: E731
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = lm.model(ids[None], output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    d = lm.model.config.head_dim
    heads = lambda x: x.view(x.shape[0], -1, d).transpose(0, 1)  # noqa: E731  [T, n*d] -> [n, T, d]
    n = len(lm.model.model.layers)
    return Eager(
        attentions=[a[0].double() for a in out.attentions],
        queries=[heads(taken[i, "q_proj"]) for i in range(n)],
        keys=[heads(taken[i, "k_proj"]) for i in range(n)],
        values=[heads(taken[i, "v_proj"]) for i in range(n)],
    )


def rope_matrices(positions: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    """[n, d, d] float64 RoPE rotations (Llama's rotate-half pairing: channel i with i + d/2)."""
    half = d // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    angle = positions.double().unsqueeze(1) * freq  # [n, half]
    cos, sin = angle.cos(), angle.sin()
    r = torch.zeros(positions.numel(), d, d, dtype=torch.float64)
    i = torch.arange(half)
    r[:, i, i], r[:, i, i + half] = cos, -sin
    r[:, i + half, i + half], r[:, i + half, i] = cos, sin
    return r


def theta(lm) -> float:
    return lm.model.config.rope_parameters["rope_theta"]


def hand_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """[H, T] -> [H, T]: the mean over the ``kernel`` tokens centred on each one, zero padding counted."""
    r = kernel // 2
    cols = [scores[:, max(0, j - r) : j + r + 1].sum(dim=1) / kernel for j in range(scores.shape[1])]
    return torch.stack(cols, dim=1)


def group_mean(scores: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[H, T] per query head -> [H_kv, T]: the mean over each KV head's group."""
    return scores.reshape(n_kv, scores.shape[0] // n_kv, -1).mean(dim=1)


SHARPEN = 6.0


def sharp_llama(attn: str | None = None):
    """The tiny Llama with its query and key projections scaled up: on the random weights attention
    is nearly uniform and the formulas' terms nearly vanish; scaled, its rows peak as a trained
    model's do (the largest weight of a row is typically several times the uniform 1/T)."""
    lm = tiny_llama(seed=3) if attn is None else tiny_llama(seed=3, attn=attn)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    return lm


@pytest.fixture(scope="module")
def sharp():
    return sharp_llama()


@pytest.fixture(scope="module")
def sharp_eager():
    """The same weights under transformers' own eager attention: the reference."""
    return sharp_llama("eager")


@pytest.fixture(scope="module")
def ctx(sharp):
    return prepare_context(sharp, DOC)


@pytest.fixture(scope="module")
def eager(sharp_eager, ctx) -> Eager:
    return eager_pass(sharp_eager, ctx.tokens.ids.cpu())


def kept_document_tokens(stored, layer: int, head: int, prefix: int) -> set[int]:
    return {i - prefix for i in stored.fates(layer, head) if i >= prefix}


# --------------------------------------------------------------------------- SnapKV


@pytest.mark.parametrize("kernel", [1, 5])
def test_snapkv_scores_are_the_observation_windows_pooled_attention(ctx, eager, kernel):
    """s_j = pool(mean over the last `window` queries of a_ij), averaged over the group's query
    heads, for the tokens before the window; the window scores +inf (always kept)."""
    window, n_kv = 8, ctx.lm.n_kv_heads
    cut = ctx.length - window
    scores = get_method("snapkv", window=window, kernel=kernel).scores(Request(ctx, 4.0))
    for layer, got in enumerate(scores):
        mean_attention = eager.attentions[layer][:, -window:, :cut].mean(dim=1)  # [H, cut]
        want = group_mean(hand_pool(mean_attention, kernel), n_kv)
        assert got.shape == (n_kv, ctx.doc_len) and torch.isinf(got[:, cut:]).all()
        torch.testing.assert_close(got[:, :cut].double(), want, atol=1e-7, rtol=1e-5)


def test_snapkv_question_scores_are_the_questions_pooled_attention_on_the_context(sharp_eager, ctx):
    """The window is the question read after the document; its attention is normalised over the
    context's keys (the question's own keys are not candidates), then pooled and group-averaged."""
    question = question_tokens(ctx.lm.tokenizer, QUESTION)
    full = eager_pass(sharp_eager, torch.cat([ctx.tokens.ids.cpu(), question]))
    scores = get_method("snapkv_question", kernel=3).scores(Request(ctx, 4.0, QUESTION))
    for layer, got in enumerate(scores):
        rows = full.attentions[layer][:, ctx.length :, : ctx.length]  # [H, n_question, T]
        on_context = rows / rows.sum(dim=-1, keepdim=True)
        want = group_mean(hand_pool(on_context.mean(dim=1), 3), ctx.lm.n_kv_heads)
        torch.testing.assert_close(got.double(), want, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------- PyramidKV


@pytest.mark.parametrize(
    ("n_layers", "budget", "length", "beta", "expected"),
    [
        # B = 10, beta = 3: the top layer keeps B/beta = 3.33, the bottom 2B - B/beta = 16.67, evenly
        # spaced: 16.67, 12.22, 7.78, 3.33 -> floors 16, 12, 7, 3 (38); the 2 left go to the largest
        # remainders (.78, .67).
        (4, 10, 100, 3.0, [17, 12, 8, 3]),
        # B = 60, beta = 20: the bottom would be 117 > T = 100, so it keeps T and the top 2B - T = 20.
        (3, 60, 100, 20.0, [100, 60, 20]),
        # The tiny model's 2 layers at 2x of 96 tokens: 93.6 and 2.4 -> 93 + 2, the 1 left to layer 0.
        (2, 48, 96, 20.0, [94, 2]),
        (4, 10, 100, 1.0, [10, 10, 10, 10]),  # beta = 1: uniform, SnapKV's budgets
    ],
)
def test_pyramid_budgets_by_hand(n_layers, budget, length, beta, expected):
    got = pyramid_budgets(n_layers, budget, length, beta)
    assert got.tolist() == expected and int(got.sum()) == n_layers * budget


def test_pyramidkv_keeps_its_layers_budget_of_the_snapkv_ranking(ctx, eager):
    """Layer budgets 94 and 2 at 2x (above); each keeps the window's newest tokens first (here the
    whole 8-token window in layer 0, the newest 2 in layer 1) and fills the rest with the tokens of
    the highest SnapKV scores, computed from the eager attention."""
    window, kernel, n_kv = 8, 5, ctx.lm.n_kv_heads
    cut = ctx.length - window
    stored = get_method("pyramidkv", window=window, kernel=kernel, beta=20.0).compress(Request(ctx, 2.0))
    for layer, budget in enumerate([94, 2]):
        snap = group_mean(hand_pool(eager.attentions[layer][:, -window:, :cut].mean(dim=1), kernel), n_kv)
        for head in range(n_kv):
            newest = list(range(ctx.doc_len - min(budget, window), ctx.doc_len))
            rest = torch.topk(snap[head], max(0, budget - window)).indices.tolist()
            assert kept_document_tokens(stored, layer, head, ctx.prefix_len) == set(newest + rest)


# --------------------------------------------------------------------------- Expected Attention


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_covariance": False},
        {"use_vnorm": False, "n_future_positions": 16},
        {"stats_window": 30, "n_sink": 2, "epsilon": 0.01},
    ],
)
def test_expected_attention_is_the_gaussian_expectation_of_future_attention(ctx, eager, options):
    """Future queries q ~ N(mu, Sigma), the pre-RoPE context queries' mean and (population)
    covariance, rotated by the RoPE matrix averaged over the next n positions, R:
    E[exp(q.k / sqrt d)] = exp(k.R mu / sqrt d + k^T R Sigma R^T k / (2d)); softmax over the
    non-sink keys, mean over the group's query heads, then (s + epsilon) ||v||. Sinks: +inf."""
    method = get_method("expected_attention", **options)
    opts = method.options
    scores = method.scores(Request(ctx, 4.0))
    d, n_kv, length = ctx.lm.head_dim, ctx.lm.n_kv_heads, ctx.length
    sink = opts.n_sink
    future = rope_matrices(torch.arange(length, length + opts.n_future_positions), d, theta(ctx.lm)).mean(dim=0)
    rotations = rope_matrices(torch.arange(length), d, theta(ctx.lm))  # each key at its own position
    start = max(sink, length - opts.stats_window) if opts.stats_window else sink
    for layer, got in enumerate(scores):
        q = eager.queries[layer][:, start:]  # [H, N, d] the statistics' queries, before RoPE
        group = q.shape[0] // n_kv
        keys = torch.einsum("tij,htj->hti", rotations, eager.keys[layer]).repeat_interleave(group, dim=0)[:, sink:]
        logits = keys @ (future @ q.mean(dim=1).T).T.unsqueeze(-1) / math.sqrt(d)  # [H, T', 1]
        logits = logits.squeeze(-1)
        if opts.use_covariance:
            cov = torch.stack([torch.cov(h.T, correction=0) for h in q])  # [H, d, d]
            spread = future @ cov @ future.T
            logits = logits + torch.einsum("hti,hij,htj->ht", keys, spread, keys) / (2 * d)
        want = group_mean(torch.softmax(logits, dim=-1), n_kv)
        if opts.use_vnorm:
            want = (want + opts.epsilon) * eager.values[layer][:, sink:].norm(dim=-1)
        assert got.shape == (n_kv, ctx.doc_len) and torch.isinf(got[:, :sink]).all()
        torch.testing.assert_close(got[:, sink:].double(), want, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------- random


def test_random_keeps_each_heads_top_budget_of_a_seeded_uniform_draw(ctx):
    """A CPU generator seeded with `seed` draws U[0, 1) scores [H_kv, T_doc] layer after layer;
    each head keeps exactly its budget, the highest draws; the same seed gives the same subset."""
    n_kv, budget = ctx.lm.n_kv_heads, round(ctx.doc_len / 4)
    kept_by_seed = {}
    for seed in (0, 7):
        gen = torch.Generator().manual_seed(seed)
        draws = [torch.rand(n_kv, ctx.doc_len, generator=gen) for _ in range(ctx.lm.n_layers)]
        stored = get_method("random", seed=seed).compress(Request(ctx, 4.0))
        again = get_method("random", seed=seed).compress(Request(ctx, 4.0))
        kept = []
        for layer, draw in enumerate(draws):
            for head in range(n_kv):
                got = kept_document_tokens(stored, layer, head, ctx.prefix_len)
                assert len(got) == budget and got == set(torch.topk(draw[head], budget).indices.tolist())
                assert got == kept_document_tokens(again, layer, head, ctx.prefix_len)
                kept.append(got)
        kept_by_seed[seed] = kept
    assert kept_by_seed[0] != kept_by_seed[7]
