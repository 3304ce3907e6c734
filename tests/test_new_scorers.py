"""The scorers of 2025-26 (issue 34) against their formulas, computed here in float64 from an eager pass.

As tests/test_scorers.py (whose reference helpers these reuse): transformers' eager attention gives
the attention weights, hooks on the projections the pre-RoPE queries, keys and values, RoPE is
applied by hand; nothing goes through kvlab's query recording, cache or attention maths. The tiny
model has no chat template: the document is the whole context (prefix 0), so the sinks of these
methods are document tokens, kept at +inf.
"""

from __future__ import annotations

import math

import pytest
import torch

# The sharpened tiny Llama, its context and its eager pass: test_scorers' own fixtures (module-scoped here too).
from test_scorers import (  # noqa: F401 - fixtures
    QUESTION,
    ctx,
    eager,
    eager_pass,
    group_mean,
    hand_pool,
    rope_matrices,
    sharp,
    sharp_eager,
    theta,
)

from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.families.scorers import RIDGE, gaussian_sketches
from kvlab.prompts import question_tokens, repeat_tokens

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
