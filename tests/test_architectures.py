"""The architectures researchers use, as tiny random models: every family through kvlab's invariants.

Each family of :data:`kvlab.synthetic.FAMILIES` (Llama with Llama 3.1's RoPE
scaling, Qwen2, Qwen3, Mistral, Gemma 3) runs its own transformers modelling
code; kvlab replaces only the attention function. The reference is always
transformers' own eager attention on a twin with the same weights, never
kvlab's own output. What kvlab does not handle (real Gemma 3's sliding
windows and per-layer RoPE, Mistral v0.1's window, attention scalings other
than 1/sqrt(head_dim), logit softcapping) is refused in one line at load time.
"""
from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedModel

from kvlab.bounded.generate import run_policy
from kvlab.bounded.policies import BOUNDED, make_policy
from kvlab.context import prepare_context
from kvlab.methods import REGISTRY, Request, get_method
from kvlab.models import ATTENTION_NAME, LoadedModel, ModelLoadError, load_model, register_attention
from kvlab.runtime.decode import extend, open_session, prefill
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.rope import rope_cos_sin, rotate, unrotate
from kvlab.synthetic import FAMILIES, SPECIAL_IDS, TINY, random_model, word_tokenizer
from test_methods import assert_meets_budget
from test_runtime import cache_from, logits_after

T = 40
# Longer than SnapKV's default 64-query observation window (a shorter document fails there).
DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(72))
QUESTION = "w3 w5 w8"


def ids_of(n: int, seed: int) -> torch.Tensor:
    """[n] seeded random token ids of the word vocabulary (w0..w61)."""
    return torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(seed))


def eager_twin(lm: LoadedModel) -> PreTrainedModel:
    """The same weights under transformers' own eager attention (its own config: the attention
    implementation lives on the config, and sharing it would switch ``lm`` to eager too)."""
    twin = type(lm.model)(copy.deepcopy(lm.model.config)).eval()
    twin.load_state_dict(lm.model.state_dict())
    twin.set_attn_implementation("eager")
    return twin


def attention_modules(lm: LoadedModel) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in lm.model.model.layers]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared 2-core machine the thread pools of
    parallel processes spin against each other (a 2-layer forward pass went from 1 to 75 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def lm(family) -> LoadedModel:
    return random_model(family)


@pytest.fixture(scope="module")
def ref(lm) -> PreTrainedModel:
    return eager_twin(lm)


@pytest.fixture(scope="module")
def ctx(lm):
    return prepare_context(lm, DOC)


# --- the family is what it says ------------------------------------------------------------------


def test_each_tiny_model_has_its_familys_features(family, lm):
    attn = attention_modules(lm)
    assert type(lm.model).__name__ == FAMILIES[family].model_class.__name__
    assert all(a.q_proj.bias is None for a in attn) == (family != "qwen2")
    if family == "qwen2":  # random biases, not transformers' zeros
        assert all(a.q_proj.bias.abs().min() > 0 and a.k_proj.bias is not None for a in attn)
    assert all(hasattr(a, "q_norm") and hasattr(a, "k_norm") for a in attn) == (family in ("qwen3", "gemma3"))
    if family == "llama":
        rotary = lm.model.model.rotary_emb
        d = lm.head_dim
        plain = 500000.0 ** -(torch.arange(0, d, 2, dtype=torch.float32, device=lm.device) / d)
        scaled = ~torch.isclose(rotary.inv_freq, plain)
        assert rotary.rope_type == "llama3" and scaled.any() and not scaled.all()  # some bands scaled
    if family == "gemma3":
        assert [a.sliding_window for a in attn] == [512, 512, None]  # interleaved local and global
        assert all(a.scaling == lm.head_dim ** -0.5 for a in attn)


# --- runtime invariants, against eager -----------------------------------------------------------


def test_keep_all_equals_eager_attention_over_8_greedy_steps(lm, ref):
    ids = ids_of(T, seed=1)
    with torch.inference_mode():
        read = extend(lm, open_session(lm), ids)  # the prefill's own logits, all T positions
        cache = DynamicCache(config=ref.config)
        out = ref(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True)
    assert (read - out.logits[0]).abs().max() < 1e-4
    session = open_session(lm, prefill(lm, ids).stored)
    token = out.logits[0, -1].argmax().view(1)
    for _ in range(8):
        ours = extend(lm, session, token)[-1]
        with torch.inference_mode():
            theirs = ref(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1]
        assert (ours - theirs).abs().max() < 1e-4
        token = theirs.argmax().view(1)


def test_a_key_with_bias_minus_inf_is_that_key_absent(lm):
    full = prefill(lm, ids_of(T, seed=1))
    drop, every = 17, torch.arange(T)
    kept = every[every != drop]
    heads = lambda x: [[x] * lm.n_kv_heads for _ in range(lm.n_layers)]  # noqa: E731
    bias = torch.zeros(T)
    bias[drop] = float("-inf")
    question = ids_of(6, seed=3)
    removed = logits_after(lm, cache_from(full, heads(kept)), question)
    masked = logits_after(lm, cache_from(full, heads(every), heads(bias)), question)
    assert torch.allclose(removed, masked, atol=1e-5)  # two SDPA paths (plain, float mask): rounding only
    # The check can see one key: keeping it changes the logits by far more than the tolerance.
    assert (logits_after(lm, full.stored, question) - removed).abs().max() > 1e-3


def test_a_compressed_cache_reads_on_at_logical_positions_like_eager_with_those_keys_masked(lm, ref):
    """Evict a third of the context's keys in every layer and head: the question read after the
    compressed cache (positions from its logical length T) must match eager attention over the
    whole sequence at positions 0.. with those keys masked for the question's tokens only."""
    ids, question = ids_of(T, seed=1), ids_of(6, seed=3)
    dropped = torch.arange(5, T - 4, 3)
    kept = torch.tensor([i for i in range(T) if i not in set(dropped.tolist())])
    stored = cache_from(prefill(lm, ids), [[kept] * lm.n_kv_heads for _ in range(lm.n_layers)])
    session = open_session(lm, stored)
    assert session.position == T  # logical, not the physical len(kept)
    ours = extend(lm, session, question)
    n = T + question.numel()
    mask = torch.full((n, n), float("-inf")).triu(1)
    mask[T:, dropped] = float("-inf")
    with torch.inference_mode():
        out = ref(input_ids=torch.cat([ids, question]).unsqueeze(0), attention_mask=mask[None, None])
    assert (ours - out.logits[0, T:]).abs().max() < 1e-4


# --- every method, two ratios --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_every_method_meets_its_budget_with_finite_logits(ctx, name, ratio):
    stored = get_method(name).compress(Request(ctx, ratio, QUESTION))
    budget = ctx.prefix_len + round(ctx.doc_len / ratio)
    if stored.meta.get("summary_tokens", budget + 1) <= budget:
        # The random model ended its summary (an end-of-sequence token) below the budget: all of it stays.
        assert stored.kept_per_head().max() <= budget
    elif not getattr(REGISTRY[name], "fixed_budget", False):
        assert_meets_budget(ctx, name, ratio, stored)
    question = torch.tensor(ctx.lm.tokenizer(QUESTION)["input_ids"])
    logits = extend(ctx.lm, open_session(ctx.lm, stored), question)
    assert logits.shape == (question.numel(), 64) and torch.isfinite(logits).all()


# --- BeaconKV's pre-RoPE round trip --------------------------------------------------------------


def test_unrotated_recorded_queries_are_the_pre_rope_projections_in_every_layer(lm):
    """The queries kvlab records are post-RoPE; unrotated with kvlab.runtime.rope's tables they must be
    the model's own pre-RoPE queries: q_proj's output, or q_norm's where the family has one, seen in a
    pass of transformers' own forward (kvlab's prefill may run the lean pass, kvlab.runtime.lean)."""
    n = 20
    ids = ids_of(n, seed=5)
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for layer, attn in enumerate(attention_modules(lm)):
        source = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
        hook = lambda m, i, out, layer=layer: seen.__setitem__(layer, out.detach())  # noqa: E731
        handles.append(source.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            lm.model(input_ids=ids.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    capture = QueryCapture(lm.n_layers)
    prefill(lm, ids, capture)
    cos, sin = rope_cos_sin(lm, torch.arange(n))
    apply_rope = sys.modules[type(attention_modules(lm)[0]).__module__].apply_rotary_pos_emb
    for layer in range(lm.n_layers):
        out = seen[layer][0]  # [n, H*d] (q_proj), [n, H, d] (Qwen3's q_norm) or [H, n, d] (Gemma 3's)
        pre = out.view(n, lm.n_heads, lm.head_dim).transpose(0, 1) if out.shape[0] == n else out
        recorded = capture.layer(layer)
        assert torch.allclose(unrotate(recorded, cos, sin), pre, atol=1e-5)
        assert torch.allclose(rotate(pre, cos, sin), recorded, atol=1e-5)
        # kvlab's rotate is the family's own apply_rotary_pos_emb with the same tables.
        theirs, _ = apply_rope(pre.unsqueeze(0), pre.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
        assert torch.allclose(rotate(pre, cos, sin), theirs[0], atol=1e-6)


# --- bounded generation --------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", BOUNDED)
def test_bounded_generation_stays_within_its_budget(lm, policy_name):
    budget, prompt = 40, ids_of(T, seed=2)  # BeaconKV needs 37: 4 protected + a 16-token window + 16 evicted at once
    policy = make_policy(policy_name, lm, budget, protected=4)
    run = run_policy(policy, prompt, 24, chunk=8, stop=False)
    assert len(run.ids) == 24 and all(math.isfinite(x) for x in run.logprobs)
    assert run.max_size <= budget and max(run.sizes) <= budget
    assert run.events, "64 tokens in a budget of 40 must shrink the cache"


# --- what kvlab refuses, in one line, before any work ----------------------------------------------

EVERY_KEY = "kvlab's attention and compression methods let every layer see every cached key"
ONE_ROPE = "BeaconKV, Expected Attention and bounded BeaconKV re-rotate queries with one RoPE for every layer"


@pytest.mark.parametrize("family, overrides, message", [
    (  # Gemma 3 as released: local layers with a short window and their own RoPE (theta 10,000 vs 1,000,000)
        "gemma3", {"sliding_window": 16, "rope_parameters": None},
        "tiny-gemma3: sliding-window attention (2 of 3 layers see only the last 16 tokens, within a 512-token "
        "context) and a different rotary embedding per layer type (full_attention default theta 1,000,000, "
        f"sliding_attention default theta 10,000) are not supported by kvlab ({EVERY_KEY}; {ONE_ROPE})",
    ),
    (  # Gemma 3 27B: query_pre_attn_scalar 168 with head_dim 128
        "gemma3", {"query_pre_attn_scalar": 64},
        "tiny-gemma3: attention scaling 0.125 instead of 1/sqrt(head_dim 16) = 0.25 is not supported by kvlab "
        "(its compression methods and metrics score keys at 1/sqrt(head_dim))",
    ),
    (
        "gemma3", {"attn_logit_softcapping": 50.0},
        "tiny-gemma3: attention logit softcapping (50) is not supported by kvlab (kvlab's attention applies no tanh cap)",
    ),
    (  # Mistral 7B v0.1: a 4096-token window at every layer
        "mistral", {"sliding_window": 16},
        "tiny-mistral: sliding-window attention (2 of 2 layers see only the last 16 tokens, within a 512-token "
        f"context) is not supported by kvlab ({EVERY_KEY})",
    ),
    (  # Qwen2 with its (rarely used) sliding window above max_window_layers
        "qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        "tiny-qwen2: sliding-window attention (1 of 2 layers see only the last 16 tokens, within a 512-token "
        f"context) is not supported by kvlab ({EVERY_KEY})",
    ),
], ids=["gemma3-as-released", "gemma3-scaling", "gemma3-softcap", "mistral-v0.1-window", "qwen2-window"])
def test_unsupported_attention_is_refused_in_one_line(family, overrides, message):
    with pytest.raises(ModelLoadError) as refused:
        random_model(family, overrides)
    assert str(refused.value) == message


def _gemma3_unchecked(**overrides) -> LoadedModel:
    """A tiny Gemma 3 built by transformers alone: no kvlab.models.check_supported on the way."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(**{**TINY, **copy.deepcopy(FAMILIES["gemma3"].tiny), **SPECIAL_IDS, **overrides})
    model = Gemma3ForCausalLM(config).eval()
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    return LoadedModel("unchecked-gemma3", model, word_tokenizer(64), torch.device("cpu"), torch.float32)


def test_load_model_refuses_a_saved_real_gemma3_layout(tmp_path, monkeypatch):
    model = _gemma3_unchecked(sliding_window=16).model
    model.save_pretrained(tmp_path)
    word_tokenizer(64).save_pretrained(tmp_path)
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    with pytest.raises(ModelLoadError, match=r"^[^\n]*: sliding-window attention \(2 of 3 layers see only the last 16 "
                                             r"tokens, within a 512-token context\) is not supported by kvlab [^\n]*$"):
        load_model(str(tmp_path))


def test_rope_tables_refuse_a_model_whose_layer_types_rotate_differently():
    """Past the load-time check (a LoadedModel built by hand), the RoPE helper still refuses
    rather than give the global layers the sliding layers' tables."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    lm = _gemma3_unchecked(rope_parameters=rope)
    with pytest.raises(ModelLoadError, match="^unchecked-gemma3: a different rotary embedding per layer type"):
        rope_cos_sin(lm, torch.arange(4))


def test_the_forward_pass_honours_gemmas_query_pre_attn_scalar():
    """The refusal of other scalings is about the methods and metrics: kvlab's attention function
    itself uses the ``scaling`` the model passes (checked against eager, and against 1/sqrt(d))."""
    lm = _gemma3_unchecked(query_pre_attn_scalar=64)
    ids = ids_of(T, seed=1)
    with torch.inference_mode():
        ours = extend(lm, open_session(lm), ids)
        theirs = eager_twin(lm)(input_ids=ids.unsqueeze(0)).logits[0]
        plain = eager_twin(_gemma3_unchecked())  # query_pre_attn_scalar = head_dim, same weights
        plain.load_state_dict(lm.model.state_dict())
        unscaled = plain(input_ids=ids.unsqueeze(0)).logits[0]
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - unscaled).abs().max() > 1e-3
