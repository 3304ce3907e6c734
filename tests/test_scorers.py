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
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.families.scorers import RIDGE, gaussian_sketches
from kvlab.methods.pyramidkv import pyramid_budgets
from kvlab.prompts import question_tokens, repeat_tokens

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


# --- The scorers of 2025-26 (issue 34) against their formulas, in float64 from an eager pass -----------
# As the tests above (whose reference helpers these reuse): transformers' eager attention gives
# the attention weights, hooks on the projections the pre-RoPE queries, keys and values, RoPE is
# applied by hand; nothing goes through kvlab's query recording, cache or attention maths. The tiny
# model has no chat template: the document is the whole context (prefix 0), so the sinks of these
# methods are document tokens, kept at +inf.

EPS32 = 2.0**-23


def post_rope(x: torch.Tensor, start: int, lm) -> torch.Tensor:
    """[H, n, d] pre-RoPE vectors at positions start.. -> rotated by hand (float64)."""
    rot = rope_matrices(torch.arange(start, start + x.shape[1]), x.shape[-1], theta(lm))
    return torch.einsum("tij,htj->hti", rot, x)


def z(scores: torch.Tensor) -> torch.Tensor:
    return (scores - scores.mean()) / scores.std()


def hand_leverage(keys: torch.Tensor, sketch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """diag(Y (Y^T Y + lambda I)^{-1} Y^T) with Y = (K - mean K) Phi, by an explicit inverse per head
    (clamped at 0); and how far float32 may be from it once z-scored: a solve loses about
    cond x 2^-23 of the largest score, and the z-score divides by the scores' spread."""
    x = keys - keys.mean(dim=1, keepdim=True)
    y = x @ sketch.double()
    gram = y.transpose(1, 2) @ y + RIDGE * torch.eye(y.shape[-1], dtype=torch.float64)
    hat = torch.einsum("hti,hij,htj->ht", y, torch.linalg.inv(gram), y).clamp_min(0)
    return hat, 4 * float(torch.linalg.cond(gram).max()) * EPS32 * float(hat.max() / hat.std())


def hand_chunk_attention(q: torch.Tensor, k: torch.Tensor, chunk: int) -> torch.Tensor:
    """[H, N] attention summed over each chunk's queries, softmax over the chunk's keys only (float64)."""
    d, out = q.shape[-1], []
    for start in range(0, q.shape[1], chunk):
        logits = q[:, start : start + chunk] @ k[:, start : start + chunk].transpose(1, 2) / math.sqrt(d)
        out.append(torch.softmax(logits, dim=-1).sum(dim=1))
    return torch.cat(out, dim=1)


def hand_non_causal(eager, layer: int, lm, chunk: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Non-causal chunked attention x ||v||, pooled over 3 tokens, over tokens start..end (chunks from start)."""
    end = eager.keys[layer].shape[1] if end is None else end
    group = eager.queries[layer].shape[0] // eager.keys[layer].shape[0]
    q = post_rope(eager.queries[layer][:, start:end], start, lm)
    k = post_rope(eager.keys[layer][:, start:end], start, lm).repeat_interleave(group, dim=0)
    received = group_mean(hand_chunk_attention(q, k, chunk), eager.keys[layer].shape[0])
    return hand_pool(received * eager.values[layer][:, start:end].norm(dim=-1), 3)


# --------------------------------------------------------------------------- leverage


@pytest.mark.parametrize("k", [8, 12])
def test_leverage_is_the_sketched_hat_matrix_diagonal_z_scored(ctx, eager, k):
    """s = z(diag(Y (Y^T Y + lambda I)^{-1} Y^T)), Y = centred pre-RoPE keys x the seeded sketch;
    z over the whole layer. k < d = 16: Y has full column rank, the Gram matrix is well conditioned."""
    method = get_method("leverage", sketch_dimension=k, seed=3)
    sketches = gaussian_sketches(3, ctx.lm.n_layers, ctx.lm.n_kv_heads, ctx.lm.head_dim, k)  # the input draw
    for layer, got in enumerate(method.scores(Request(ctx, 4.0))):
        hat, tol = hand_leverage(eager.keys[layer], sketches[layer])
        torch.testing.assert_close(got.double(), z(hat), atol=tol, rtol=0)


def test_leverage_seed_draws_another_sketch(ctx):
    a = get_method("leverage", seed=0).scores(Request(ctx, 4.0))
    b = get_method("leverage", seed=1).scores(Request(ctx, 4.0))
    assert not torch.equal(a[0], b[0])


# --------------------------------------------------------------------------- non-causal attention


@pytest.mark.parametrize("chunk", [40, 96, 256])
def test_non_causal_attn_is_chunked_bidirectional_attention_times_vnorm(ctx, eager, chunk):
    """Chunks of `chunk` tokens from the first (40: 40 + 40 + a last one of 16, its own softmax);
    inside each, softmax(q k / sqrt d) over the chunk's keys, summed over its queries, group mean,
    x ||v||, 3-token mean pooling (zero padding counted), z-scored over the layer."""
    scores = get_method("non_causal_attn", attention_chunk=chunk).scores(Request(ctx, 4.0))
    for layer, got in enumerate(scores):
        want = z(hand_non_causal(eager, layer, ctx.lm, chunk))
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- Compactor


@pytest.mark.parametrize(
    ("ratio", "options", "blend"),
    [
        (4.0, {}, 0.75),  # lambda = 1 - 1/ratio
        (
            2.0,
            {"blend_by_ratio": False, "blending": 2.0, "sink_size_start": 3, "sink_size_end": 5, "attention_chunk": 32},
            2.0,
        ),
    ],
)
def test_compactor_blends_the_two_z_scores_on_the_middle_and_keeps_the_sinks(ctx, eager, ratio, options, blend):
    method = get_method("compactor", sketch_dimension=8, **options)
    opts = method.options
    start, end = opts.sink_size_start, ctx.length - opts.sink_size_end
    sketches = gaussian_sketches(opts.seed, ctx.lm.n_layers, ctx.lm.n_kv_heads, ctx.lm.head_dim, 8)
    for layer, got in enumerate(method.scores(Request(ctx, ratio))):
        hat, tol = hand_leverage(eager.keys[layer][:, start:end], sketches[layer])
        want = blend * z(hat) + z(hand_non_causal(eager, layer, ctx.lm, opts.attention_chunk, start, end))
        assert torch.isinf(got[:, :start]).all() and torch.isinf(got[:, end:]).all()
        torch.testing.assert_close(got[:, start:end].double(), want, atol=blend * tol + 1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- CapKV


@pytest.mark.parametrize("options", [{}, {"tau": 1.0, "n_sink": 2, "n_future_positions": 16, "epsilon": 0.1}])
def test_capkv_is_the_query_weighted_leverage_of_the_values(ctx, eager, options):
    """mu = R_future mean_{i >= sink} q_i (pre-RoPE queries); w_j = exp(tau cos(k_j, mu) - max);
    A = I + sum_j (w_j + eps) v_j v_j^T per query head; s_j = w_j v_j^T A^{-1} v_j; group mean;
    the first n_sink tokens +inf."""
    method = get_method("capkv", **options)
    opts = method.options
    d, n_kv, n, sink = ctx.lm.head_dim, ctx.lm.n_kv_heads, ctx.length, opts.n_sink
    future = rope_matrices(torch.arange(n, n + opts.n_future_positions), d, theta(ctx.lm)).mean(dim=0)
    for layer, got in enumerate(method.scores(Request(ctx, 4.0))):
        group = eager.queries[layer].shape[0] // n_kv
        mu = eager.queries[layer][:, sink:].mean(dim=1) @ future.T  # [H, d]
        keys = post_rope(eager.keys[layer], 0, ctx.lm).repeat_interleave(group, dim=0)[:, sink:]
        values = eager.values[layer].repeat_interleave(group, dim=0)[:, sink:]
        cos = torch.einsum("hd,htd->ht", mu / mu.norm(dim=-1, keepdim=True), keys / keys.norm(dim=-1, keepdim=True))
        w = torch.exp(opts.tau * (cos - cos.amax(dim=-1, keepdim=True)))
        capacity = torch.eye(d, dtype=torch.float64) + torch.einsum("ht,hti,htj->hij", w + opts.epsilon, values, values)
        want = group_mean(w * torch.einsum("hti,hij,htj->ht", values, torch.linalg.inv(capacity), values), n_kv)
        cond = float(torch.linalg.cond(capacity).max())
        assert torch.isinf(got[:, :sink]).all()
        torch.testing.assert_close(
            got[:, sink:].double(), want, atol=10 * cond * EPS32 * float(want.abs().max()), rtol=1e-4
        )


# --------------------------------------------------------------------------- ObservedAttention


def test_observed_attention_is_the_mean_attention_from_the_queries_that_see_a_key(ctx, eager):
    """s_j = sum_i a_ij / (N - j) from the eager prefill's attention, mean over the group."""
    scores = get_method("observed_attention").scores(Request(ctx, 4.0))
    seen_by = torch.arange(ctx.length, 0, -1, dtype=torch.float64)
    for layer, got in enumerate(scores):
        want = group_mean(eager.attentions[layer].sum(dim=1) / seen_by, ctx.lm.n_kv_heads)
        torch.testing.assert_close(got.double(), want, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------- Finch


@pytest.mark.parametrize("normalize", [True, False])
def test_finch_is_the_questions_attention_scaled_by_each_querys_position(sharp_eager, ctx, normalize):
    """The eager pass over document + question: the question's rows of the causal attention (their
    softmax over the document and the question's own earlier tokens), columns of the document;
    row i (position N + i) times N + i, mean over the rows, mean over the group."""
    question = question_tokens(ctx.lm.tokenizer, QUESTION)
    full = eager_pass(sharp_eager, torch.cat([ctx.tokens.ids.cpu(), question]))
    scores = get_method("finch", normalize_scores=normalize).scores(Request(ctx, 4.0, QUESTION))
    n = ctx.length
    for layer, got in enumerate(scores):
        rows = full.attentions[layer][:, n:, :n]  # [H, n_question, N]
        if normalize:
            rows = rows * torch.arange(n, n + rows.shape[1], dtype=torch.float64).unsqueeze(1)
        want = group_mean(rows.mean(dim=1), ctx.lm.n_kv_heads)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_finch_without_a_question_says_so(ctx):
    with pytest.raises(MethodError, match="question"):
        get_method("finch").scores(Request(ctx, 4.0))


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("leverage", {"sketch_dimension": 0}),
        ("non_causal_attn", {"attention_chunk": 0}),
        ("capkv", {"tau": -1.0}),
        ("compactor", {"blending": -0.5}),
    ],
)
def test_bad_knobs_are_refused_in_one_line(name, options):
    with pytest.raises(MethodError) as err:
        get_method(name, **options)
    assert "\n" not in str(err.value) and next(iter(options)) in str(err.value)


# --------------------------------------------------------------------------- KVzip+


def test_kvzip_plus_weights_the_reconstruction_attention_by_output_over_input_norms(sharp_eager, ctx):
    """The eager pass over document + repeat prompt + document: the reconstruction rows of its attention
    (no template: their softmax runs over every key, KVzip's set), each row divided by the norm of its
    attention input (the input norm's output, hooked), each column times ||v_j W_o^(h)||_2 with W_o^(h)
    the head's columns of o_proj; max over the rows and the group; the 4 sinks +inf."""
    assert ctx.prefix_len == 0
    repeat = repeat_tokens(ctx.lm.tokenizer, ctx.tokens.ids.cpu())
    norms: dict[int, torch.Tensor] = {}
    layers = sharp_eager.model.model.layers
    hooks = [
        layer.input_layernorm.register_forward_hook(
            lambda mod, args, out, i=i: norms.__setitem__(i, out[0].double().norm(dim=-1))
        )
        for i, layer in enumerate(layers)
    ]
    try:
        full = eager_pass(sharp_eager, torch.cat([ctx.tokens.ids.cpu(), repeat]))
    finally:
        for hook in hooks:
            hook.remove()
    scores = get_method("kvzip_plus", prune="head").scores(Request(ctx, 4.0))
    n, d, n_kv = ctx.length, ctx.lm.head_dim, ctx.lm.n_kv_heads
    for layer, got in enumerate(scores):
        rows = full.attentions[layer][:, n:, :n] / norms[layer][n:].view(1, -1, 1)  # [H, n_repeat, N]
        w_o = layers[layer].self_attn.o_proj.weight.double()  # [hidden, H * d]
        values = full.values[layer][:, :n].repeat_interleave(rows.shape[0] // n_kv, dim=0)  # [H, N, d]
        out = torch.stack([(values[h] @ w_o[:, h * d : (h + 1) * d].T).norm(dim=-1) for h in range(rows.shape[0])])
        want = (rows.amax(dim=1) * out).reshape(n_kv, -1, n).amax(dim=1)
        assert torch.isinf(got[:, :4]).all()
        torch.testing.assert_close(got[:, 4:].double(), want[:, 4:], atol=1e-8, rtol=1e-5)
