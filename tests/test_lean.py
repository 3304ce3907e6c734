"""The lean forward pass (kvlab.runtime.lean) against transformers' own forward of the same weights."""

from __future__ import annotations

import pytest
import torch

import kvlab.runtime.decode as decode
from kvlab.runtime.cache import CompressedKV, DenseSegment
from kvlab.runtime.decode import extend, open_session, prefill
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.lean import lean_model, project, unsupported_reason
from kvlab.testing.random_models import random_model

LEAN_FAMILIES = ["llama", "qwen2", "mistral"]


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(seed))


def eager_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    """transformers' forward with its own eager attention over the whole sequence: [n, V]."""
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return lm.model(input_ids=ids.unsqueeze(0)).logits[0].float()
    finally:
        lm.model.set_attn_implementation("kvlab")


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_prefill_then_decode_equals_transformers_eager_forward(family):
    """Six tokens read at once, then five one at a time: every logit as in one eager pass."""
    lm = random_model(family, seed=3)
    ids = ids_of(11, seed=4)
    reference = eager_logits(lm, ids)  # before the lean view fuses the weights
    assert lean_model(lm.model) is not None
    session = open_session(lm)
    logits = [extend(lm, session, ids[:6])]
    logits += [extend(lm, session, ids[i : i + 1]) for i in range(6, 11)]
    assert torch.allclose(torch.cat(logits), reference, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_families_outside_llamas_layer_run_through_transformers(family):
    lm = random_model(family)
    assert unsupported_reason(lm.model) is not None and lean_model(lm.model) is None
    ids = ids_of(8, seed=2)
    assert torch.allclose(extend(lm, open_session(lm), ids), eager_logits(lm, ids), atol=1e-5)


def test_fused_weights_are_views_and_leave_transformers_forward_unchanged():
    lm = random_model("qwen2", seed=5)  # q/k/v biases fused too
    ids = ids_of(9, seed=6)
    before = eager_logits(lm, ids)
    params = sum(p.numel() for p in lm.model.parameters())
    lean = lean_model(lm.model)
    attn = lm.model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == lean.layers[0].qkv.data_ptr()
    assert attn.k_proj.bias.data_ptr() == lean.layers[0].qkv_bias[attn.q_proj.bias.numel() :].data_ptr()
    assert sum(p.numel() for p in lm.model.parameters()) == params
    assert torch.equal(eager_logits(lm, ids), before)
    assert lean_model(lm.model) is lean  # built once


def ragged_biased_cache(lm, full, seed: int) -> CompressedKV:
    """Each head keeps a different random subset of the tokens, each key with a random bias."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for k, v in zip(full.keys, full.values):
        n_heads, length = k.shape[:2]
        lengths = torch.randint(length // 3, length + 1, (n_heads,), generator=gen)
        index = torch.stack([torch.randperm(length, generator=gen) for _ in range(n_heads)])
        gather = index.unsqueeze(-1).expand(-1, -1, k.shape[-1])
        bias = torch.randn(n_heads, length, generator=gen)
        layers.append([DenseSegment.from_padded(k.gather(1, gather), v.gather(1, gather), lengths, index, bias)])
    return CompressedKV(layers, full.length)


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_a_ragged_biased_cache_reads_as_through_transformers(family, monkeypatch):
    """Question then decode steps over a stored cache with padding and fitted-like biases: the lean
    pass against transformers' layers with kvlab's attention function, logits and recorded queries."""
    lm = random_model(family, seed=7)
    stored = ragged_biased_cache(lm, prefill(lm, ids_of(30, seed=8)), seed=9)
    question = ids_of(7, seed=10)

    def answer() -> tuple[torch.Tensor, list[torch.Tensor]]:
        capture = QueryCapture(lm.n_layers)
        session = open_session(lm, stored)
        out = [extend(lm, session, question, capture)]
        out += [extend(lm, session, question[i : i + 1], capture) for i in range(3)]
        return torch.cat(out), capture.per_layer()

    lean_logits, lean_queries = answer()
    monkeypatch.setattr(decode, "lean_model", lambda model: None)
    ref_logits, ref_queries = answer()
    assert torch.allclose(lean_logits, ref_logits, atol=1e-5)
    for mine, theirs in zip(lean_queries, ref_queries):
        assert torch.allclose(mine, theirs, atol=1e-5)


def test_a_copy_cast_to_bf16_gets_its_own_lean_view():
    """The lean view kept on a model must not outlive its weights: a deep copy whose parameters are
    cast to bfloat16 (as tests/test_bf16.py makes its twins) reads with its own bf16 weights."""
    import copy

    lm = random_model("llama", seed=11)
    assert lean_model(lm.model) is not None
    twin = copy.deepcopy(lm.model)
    for param in twin.parameters():
        param.data = param.data.to(torch.bfloat16)
    lean = lean_model(twin)
    assert lean.layers[0].qkv.dtype == torch.bfloat16
    assert lean.layers[0].qkv.data_ptr() == twin.model.layers[0].self_attn.q_proj.weight.data_ptr()


@pytest.mark.parametrize("rows", [1, 2, 7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_project_is_linear_for_any_row_count(rows, with_bias):
    # The lean pass's products (weight @ x^T, one row doubled) against torch's own linear, float64 as
    # the reference; the bound is float32 rounding of a 96-term dot product of unit-scale terms.
    gen = torch.Generator(device="cpu").manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen, device="cpu")
    weight = torch.randn(40, 96, generator=gen, device="cpu")
    bias = torch.randn(40, generator=gen, device="cpu") if with_bias else None
    got = project(x, weight, bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, 40) and got.dtype == torch.float32 and got.is_contiguous()
    scale = (x.double().abs() @ weight.double().abs().T) + (0 if bias is None else bias.double().abs())
    assert ((got.double() - want).abs() <= 96 * torch.finfo(torch.float32).eps * scale).all()
