"""Key re-rotation (``rerotate=true``, kvpress's KeyRerotationPress) on the tiny random Llama.

The references never use kvlab's RoPE tables, cache or attention: pre-RoPE keys, values and
queries come from forward hooks on transformers' eager model (tests/test_scorers.eager_pass),
RoPE is applied by hand in float64 from the config's theta, and the decode reference is
transformers' own eager forward over a cache built by hand. Tolerances: float32 rounding
(eps) times the sizes that accumulate it (positions turned through, channels, keys summed).
"""

from __future__ import annotations

import pytest
import torch
from test_scorers import eager_pass, rope_matrices, theta
from transformers import DynamicCache

from conftest import with_template
from kvlab.cli import build_parser, main, method_from_args
from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.metrics import head_errors
from kvlab.pipeline import run
from kvlab.prompts import question_tokens
from kvlab.runtime.decode import extend, open_session
from kvlab.runtime.rope import rope_cos_sin, rotation_tables, turn_keys
from kvlab.testing.random_models import random_model

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96))
QUESTION = "w3 w5 w8"
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def ctx(tiny):
    """The tiny model behind a 2-token chat template: 98 context tokens."""
    ctx = prepare_context(with_template(tiny), DOC)
    assert ctx.prefix_len == 2 and ctx.length == 98
    return ctx


@pytest.fixture(scope="module")
def question(ctx):
    return question_tokens(ctx.lm.tokenizer, QUESTION)


@pytest.fixture(scope="module")
def eager(ctx, question, tiny_eager):
    """Pre-RoPE queries, keys and values (float64) of the context followed by the question."""
    return eager_pass(tiny_eager, torch.cat([ctx.tokens.ids, question]))


def rope(x: torch.Tensor, positions: torch.Tensor, lm) -> torch.Tensor:
    """x [..., n, d] float64 rotated by hand at ``positions`` [n]."""
    r = rope_matrices(positions, x.shape[-1], theta(lm))
    return torch.einsum("nij,...nj->...ni", r, x)


def kept_index(stored, layer: int) -> list[torch.Tensor]:
    """Per KV head, the token positions a layer keeps, in reading order."""
    index = stored.layer_view(layer).token_index
    return [row[row >= 0] for row in index]


def by_hand_positions(stored) -> tuple[list[list[torch.Tensor]], int]:
    """Per layer and head the new positions, right-aligned at P (the most keys any head keeps), and P."""
    counts = [[len(idx) for idx in kept_index(stored, layer)] for layer in range(stored.n_layers)]
    total = max(max(row) for row in counts)
    return [[torch.arange(total - n, total) for n in row] for row in counts], total


@pytest.mark.parametrize(
    "name, options",
    [
        ("knorm", {}),
        ("knorm", {"budgets": "document"}),  # ragged heads
        ("pyramidkv", {}),  # a budget per layer
        ("knorm", {"granularity": "chunk"}),
        ("streaming_llm", {}),  # its own knob: the paper's positions within the cache
    ],
)
def test_rerotated_keys_are_the_pre_rope_keys_at_contiguous_right_aligned_positions(ctx, eager, name, options):
    stored = get_method(name, rerotate=True, **options).compress(Request(ctx, 4.0))
    new, total = by_hand_positions(stored)
    assert stored.position_shift == ctx.length - total and stored.meta["rerotate"] is True
    if options.get("budgets") == "adakv" or name == "pyramidkv":
        assert len({len(p) for row in new for p in row}) > 1  # the right alignment is exercised
    # Rounding: the model's float32 RoPE at positions up to T, the turn by up to T more, d channels.
    tol = (2 * ctx.length + ctx.lm.head_dim) * EPS
    for layer in range(stored.n_layers):
        view = stored.layer_view(layer)
        for head, idx in enumerate(kept_index(stored, layer)):
            want = rope(eager.keys[layer][head, idx], new[layer][head], ctx.lm)
            got = view.keys[head, : len(idx)].double()
            assert torch.allclose(got, want, atol=tol * float(want.abs().max())), (layer, head)
            assert torch.allclose(
                view.values[head, : len(idx)].double(),
                eager.values[layer][head, idx],
                atol=ctx.lm.head_dim * EPS * float(eager.values[layer].abs().max()),
            )
            assert idx[: ctx.prefix_len].tolist() == list(range(ctx.prefix_len))  # the template, first


def test_keep_all_with_rerotation_gives_the_full_caches_logits(ctx, question):
    stored = get_method("knorm", rerotate=True).compress(Request(ctx, 1.0))
    assert stored.position_shift == 0
    got = extend(ctx.lm, open_session(ctx.lm, stored), question)
    want = extend(ctx.lm, open_session(ctx.lm, ctx.full.stored), question)
    assert torch.allclose(got, want, atol=ctx.length * EPS * float(want.abs().max()))


def test_decoding_after_rerotation_is_the_model_over_the_kept_tokens_at_0_to_n_then_the_question_at_n(
    ctx, question, eager, tiny_eager
):
    """kvpress's form: the same budget everywhere, kept keys at 0..n-1, the question from n on; the
    reference is transformers' eager forward over a cache of hand-rotated keys."""
    stored = get_method("knorm", rerotate=True).compress(Request(ctx, 4.0))
    n = int(stored.kept_per_head().max())
    assert bool((stored.kept_per_head() == n).all()) and stored.position_shift == ctx.length - n
    cache = DynamicCache()
    for layer in range(stored.n_layers):
        idx = torch.stack(kept_index(stored, layer))  # [H_kv, n]
        keys = torch.stack([rope(eager.keys[layer][h, idx[h]], torch.arange(n), ctx.lm) for h in range(len(idx))])
        values = torch.stack([eager.values[layer][h, idx[h]] for h in range(len(idx))])
        cache.update(keys.float()[None], values.float()[None], layer)
    positions = torch.arange(n, n + question.numel())
    with torch.no_grad():
        want = (
            tiny_eager.model(input_ids=question[None], position_ids=positions[None], cache=cache, use_cache=True)
            .logits[0]
            .double()
        )
    got = extend(ctx.lm, open_session(ctx.lm, stored), question).double()
    assert torch.allclose(got, want, atol=ctx.length * ctx.lm.head_dim * EPS * float(want.abs().max()))


def attention_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [m, d], k/v [n, d] float64 -> (outputs [m, d], log-sum-exp [m]) at 1/sqrt(d)."""
    logits = q @ k.T / q.shape[-1] ** 0.5
    return torch.softmax(logits, dim=-1) @ v, torch.logsumexp(logits, dim=-1)


def test_head_errors_of_a_rerotated_cache_put_the_queries_where_generation_asks_them(ctx, question, eager):
    """Recorded queries stand at their original positions t; generation asks them at t - shift."""
    stored = get_method("knorm", rerotate=True, budgets="document").compress(Request(ctx, 4.0))
    shift, length, m = stored.position_shift, ctx.length, question.numel()
    new, _ = by_hand_positions(stored)
    asked = torch.arange(length, length + m)
    recorded = [rope(q[:, length:], asked, ctx.lm).float() for q in eager.queries]  # post-RoPE at t
    got = head_errors(ctx.full.stored, stored, recorded, lm=ctx.lm)
    n_kv = ctx.lm.n_kv_heads
    group = ctx.lm.n_heads // n_kv
    out_err = torch.zeros(stored.n_layers, n_kv, dtype=torch.float64)
    mass_err = torch.zeros_like(out_err)
    for layer in range(stored.n_layers):
        keys = rope(eager.keys[layer][:, :length], torch.arange(length), ctx.lm)
        values = eager.values[layer][:, :length]
        for head, idx in enumerate(kept_index(stored, layer)):
            kept_keys = rope(eager.keys[layer][head, idx], new[layer][head], ctx.lm)
            for qh in range(head * group, (head + 1) * group):
                q0 = eager.queries[layer][qh, length:]
                y, lse = attention_by_hand(rope(q0, asked, ctx.lm), keys[head], values[head])
                yc, lse_c = attention_by_hand(rope(q0, asked - shift, ctx.lm), kept_keys, values[head, idx])
                out_err[layer, head] += ((yc - y).norm(dim=-1) / y.norm(dim=-1)).mean() / group
                mass_err[layer, head] += (torch.exp(lse_c - lse) - 1).abs().mean() / group
    # Rounding: float32 queries and keys at positions up to T + m, T keys summed per query.
    tol = (length + m) * ctx.lm.head_dim * EPS
    assert torch.allclose(got.output.double(), out_err, atol=tol)
    assert torch.allclose(got.mass.double(), mass_err, atol=tol)
    with pytest.raises(ValueError, match="pass lm"):
        head_errors(ctx.full.stored, stored, recorded)


def test_a_model_with_sliding_window_layers_refuses_in_one_line():
    lm = random_model("mistral", {"sliding_window": 8})
    assert all(g.window == 8 for g in lm.geometry)
    window_ctx = prepare_context(lm, DOC)
    with pytest.raises(MethodError, match="sliding-window") as refused:
        get_method("knorm", rerotate=True).compress(Request(window_ctx, 4.0))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "factor": 2.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_a_rope_whose_frequencies_follow_the_length_refuses_in_one_line(rope):
    """Dynamic NTK and LongRoPE pick their frequencies by the longest position they are given: a turn by a
    position difference is not what the model does there."""
    lm = random_model("llama", {"rope_parameters": rope})
    with pytest.raises(MethodError, match=rope["rope_type"]) as refused:
        get_method("knorm", rerotate=True).compress(Request(prepare_context(lm, DOC), 4.0))
    assert "\n" not in str(refused.value)


def test_the_key_rerotation_preset_runs_through_the_cli_flags_and_the_pipeline(ctx, capsys):
    args = build_parser().parse_args(
        ["run", "--doc", "d", "--method", "snapkv", "--ratio", "5", "--question", "q", "--preset", "key_rerotation"]
    )
    assert method_from_args("snapkv", args).options.rerotate is True
    assert main(["methods", "--long"]) == 0
    out = capsys.readouterr().out
    assert "| `rerotate` | `False` |" in out and "`key_rerotation`" in out
    result = run(ctx, get_method("snapkv", preset="key_rerotation"), 4.0, QUESTION, max_new_tokens=4)
    assert result.stored.meta["rerotate"] is True and result.stored.position_shift > 0


def test_a_turn_is_a_pure_rotation_under_yarns_attention_scaling():
    """YaRN's tables carry a factor s != 1 (cos^2 + sin^2 = s^2). Layer 0's pre-RoPE key depends on
    the token alone, so the model's own key of a token at position 0, turned by +2, must be its
    own key of the same token at position 2: rotated, not scaled by s once more."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    lm = random_model("llama", {"rope_parameters": yarn})
    cos, sin = rope_cos_sin(lm, torch.tensor([5]), 0)
    assert float((cos * cos + sin * sin).sqrt().min()) > 1.1  # the scaling is there to divide out
    cache = DynamicCache()
    with torch.no_grad():
        lm.model(input_ids=torch.tensor([[7, 9, 7]]), cache=cache, use_cache=True)
    keys = cache.layers[0].keys[0]  # [H_kv, 3, d], post-RoPE
    turned = turn_keys(keys[:, :1], *rotation_tables(lm, 0, torch.tensor([2])))
    assert torch.allclose(turned, keys[:, 2:], atol=8 * lm.head_dim * EPS * float(keys.abs().max()))
