"""Cartridges (kvlab.methods.cartridges): a KV prefix trained by self-study distillation, on tiny random models.

Each check against something computed apart from the training code:

- the loss: the KL divergence of the whole vocabulary written out here (float64, from the runtime's
  own inference logits), and torch's ``kl_div``;
- the gradient: transformers' eager attention over the same template + cartridge keys, at the same
  logical positions (kvlab's CPU fast path would lose the gradient through the attention mass);
- training: the loss by hand falls on the training conversations and on a held-out continuation;
  on a one-fact document the cartridge matches the full cache's answer about the fact far better
  than its initialisation (the document's first tokens, without the fact) and than no context;
- storage: the bytes of a uniform eviction at the same ratio, every tensor on the model's device (the
  CUDA stand-in, kvlab.testing.fake_cuda); the initialisation is the full cache's first keys sliced here;
- the result store: a second call and a restart read the trained cartridge, no training step runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from conftest import TINY_DOC, with_template
from kvlab import cancellation, results
from kvlab.context import Context, prepare_context
from kvlab.methods import Request, cartridges, get_method
from kvlab.methods.families import cartridge_training as ct
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import extend, open_session
from kvlab.runtime.model import LoadedModel
from kvlab.testing.device_suite import DOCUMENT, suite_model
from kvlab.testing.fake_cuda import FAKE_DEVICE, fake_cuda, is_fake, to_fake_cuda
from kvlab.testing.random_models import random_model

RATIO = 8.0  # 12 cartridge keys per KV head for the 96-token document
QUICK = {"self_study_tokens": 16, "steps": 2}  # a cheap training, where only storage and placement matter


@pytest.fixture(scope="module")
def ctx(tiny: LoadedModel):
    """The tiny Llama with a 2-token template, prefilled with the 96-token document."""
    return prepare_context(with_template(tiny), TINY_DOC)


def token_runs(n: int, length: int, seed: int) -> list[torch.Tensor]:
    """``n`` seeded sequences of ``length`` word ids (w2..w61): conversations written here."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 62, (length,), generator=gen) for _ in range(n)]


def kl_to_full(ctx: Context, stored: CompressedKV, ids: torch.Tensor) -> float:
    """Mean over the positions of ``ids`` read after each cache of KL(full cache || ``stored``), in float64."""
    full = torch.log_softmax(extend(ctx.lm, open_session(ctx.lm, ctx.full.stored), ids).double(), dim=-1)
    other = torch.log_softmax(extend(ctx.lm, open_session(ctx.lm, stored), ids).double(), dim=-1)
    return float((full.exp() * (full - other)).sum(dim=-1).mean())


def trained(ctx: Context, runs: list[torch.Tensor], steps: int, t: int) -> tuple[ct.Cartridge, list[float]]:
    """A t-key cartridge of ``ctx`` trained on ``runs`` (whole vocabulary, every run each step)."""
    cart = ct.first_tokens(ctx, t)
    targets = [ct.teacher(ctx, ids, 0) for ids in runs]
    losses = ct.train(ctx, cart, targets, ct.Schedule(steps, 0.02, 0, 0), lambda *report: None)
    return cart, losses


def test_the_loss_is_the_kl_divergence_whole_or_over_the_top_k_and_the_rest():
    """Whole vocabulary: torch's kl_div. Top k: the KL of the distributions coarsened to the k tokens and
    the rest, never negative, 0 for the teacher itself (the top-k cross-entropy alone is not)."""
    gen = torch.Generator().manual_seed(0)
    t_logits, s_logits = torch.randn(5, 30, generator=gen) * 3, torch.randn(5, 30, generator=gen) * 3
    t_logp, s_logp = torch.log_softmax(t_logits, -1), torch.log_softmax(s_logits, -1)
    whole = ct.Teacher(torch.zeros(5), t_logp, None)
    expected = F.kl_div(s_logp, t_logp, log_target=True, reduction="sum")
    torch.testing.assert_close(ct.distillation_kl(whole, s_logits), expected)
    index = t_logp.topk(4, dim=-1).indices
    picked = t_logp.gather(-1, index)
    rest = torch.log1p(-picked.exp().sum(-1, keepdim=True))
    top = ct.Teacher(torch.zeros(5), torch.cat([picked, rest], -1), index)
    s_picked = s_logp.gather(-1, index)
    s_rest = torch.log1p(-s_picked.exp().sum(-1, keepdim=True))
    by_hand = (top.logprobs.exp() * (top.logprobs - torch.cat([s_picked, s_rest], -1))).sum()
    torch.testing.assert_close(ct.distillation_kl(top, s_logits), by_hand)
    assert 0 <= float(by_hand) <= float(expected)  # coarsening never adds divergence
    assert float(ct.distillation_kl(top, t_logits)) == pytest.approx(0.0, abs=1e-5)


def test_the_gradient_is_eager_attentions_over_the_same_keys(ctx, tiny_eager: LoadedModel):
    """The student's gradient with respect to the cartridge through kvlab's runtime equals the one through
    transformers' eager attention over the template + cartridge keys at the full cache's positions."""
    ids = token_runs(1, 20, seed=1)[0]
    target = ct.teacher(ctx, ids, 0)
    cart = ct.first_tokens(ctx, 12)
    params = cart.parameters()
    for p in params:
        p.requires_grad_(True)
    student = ct.Student(ctx.lm, ct.recordable_lean(ctx.lm))
    ours = torch.autograd.grad(
        ct.distillation_kl(target, student.logits(ct.cartridge_cache(ctx, cart, ctx.lm.dtype), [ids])[0]), params
    )
    cache, prefix = DynamicCache(), ctx.prefix_len
    for layer in range(ctx.lm.n_layers):
        keys = torch.cat([ctx.full.keys[layer][:, :prefix].clone(), cart.keys[layer]], dim=1)
        values = torch.cat([ctx.full.values[layer][:, :prefix].clone(), cart.values[layer]], dim=1)
        cache.update(keys.unsqueeze(0), values.unsqueeze(0), layer)
    positions = torch.arange(ctx.length, ctx.length + ids.numel()).unsqueeze(0)
    logits = tiny_eager.model(input_ids=ids.unsqueeze(0), position_ids=positions, cache=cache, use_cache=True).logits
    theirs = torch.autograd.grad(ct.distillation_kl(target, logits[0]), params)
    for mine, eager in zip(ours, theirs):
        assert float((mine - eager).norm() / eager.norm()) < 1e-4


def test_training_lowers_the_loss_and_moves_a_held_out_continuation_toward_the_teacher(ctx):
    runs, held_out = token_runs(4, 24, seed=0), token_runs(1, 24, seed=9)[0]
    init = ct.cartridge_cache(ctx, ct.first_tokens(ctx, 12), ctx.lm.dtype)
    cart, losses = trained(ctx, runs, steps=16, t=12)
    after = ct.cartridge_cache(ctx, cart, ctx.lm.dtype)
    before_loss = sum(kl_to_full(ctx, init, ids) for ids in runs)
    after_loss = sum(kl_to_full(ctx, after, ids) for ids in runs)
    assert after_loss < 0.5 * before_loss
    assert kl_to_full(ctx, after, held_out) < 0.8 * kl_to_full(ctx, init, held_out)
    # The training's own account agrees: its first loss is the initialisation's, measured by hand.
    assert losses[0] == pytest.approx(before_loss / len(runs), rel=1e-3) and losses[-1] < losses[0]


def test_a_cartridge_recovers_a_fact_its_initialisation_lacks():
    """A random model with sharp attention (kvlab.testing.random_models' perturbed weights) reads a document
    whose one fact, "w50 w51 w52", ends it, past the cartridge's first tokens. Trained on conversations that
    mention the fact among other words, the cartridge's next-token distribution after "w50 w51" read right
    after the cache is far closer to the full cache's than its initialisation's and no context's are."""
    lm = with_template(random_model("llama", seed=0))
    filler = " ".join(f"w{(i * 7) % 40 + 2}" for i in range(45))
    fact_ctx = prepare_context(lm, filler + " w50 w51 w52")
    fact = torch.tensor(lm.tokenizer("w50 w51 w52", add_special_tokens=False).input_ids)
    runs = [torch.cat([a, fact, b]) for a, b in zip(token_runs(4, 6, seed=0), token_runs(4, 6, seed=1))]
    t = round(fact_ctx.doc_len / RATIO)
    assert t < fact_ctx.doc_len - fact.numel()  # the initialisation does not hold the fact
    init = ct.cartridge_cache(fact_ctx, ct.first_tokens(fact_ctx, t), lm.dtype)
    nothing = get_method("no_context").compress(Request(fact_ctx, RATIO))
    cart, _ = trained(fact_ctx, runs, steps=32, t=t)
    after = ct.cartridge_cache(fact_ctx, cart, lm.dtype)

    def next_token_kl(stored: CompressedKV) -> float:
        full = torch.log_softmax(extend(lm, open_session(lm, fact_ctx.full.stored), fact[:2])[-1].double(), -1)
        other = torch.log_softmax(extend(lm, open_session(lm, stored), fact[:2])[-1].double(), -1)
        return float((full.exp() * (full - other)).sum())

    assert next_token_kl(after) < 0.4 * min(next_token_kl(init), next_token_kl(nothing))


def test_with_no_steps_the_cartridge_is_the_documents_first_keys_and_values(ctx, monkeypatch):
    monkeypatch.setattr(cartridges, "train", lambda *a, **k: pytest.fail("nothing to train"))
    stored = get_method("cartridges", steps=0).compress(Request(ctx, RATIO))
    t, prefix = round(ctx.doc_len / RATIO), ctx.prefix_len
    for layer in range(ctx.lm.n_layers):
        view = stored.layer_view(layer)
        for head in range(ctx.lm.n_kv_heads):
            keys, values = ctx.full.keys[layer][head], ctx.full.values[layer][head]
            assert torch.equal(view.keys[head], torch.cat([keys[:prefix], keys[prefix : prefix + t]]))
            assert torch.equal(view.values[head], torch.cat([values[:prefix], values[prefix : prefix + t]]))
    assert stored.logical_len == ctx.length  # a token read after it gets the full cache's position


def test_without_a_template_the_sequences_first_token_stays_frozen(tiny):
    """The attention sink the paper freezes is the sequence's first token: with a chat template it is the
    template's, kept as it is (every cartridge key trains); without one it is the cartridge's first key."""
    plain = prepare_context(tiny, TINY_DOC)
    assert plain.prefix_len == 0
    stored = get_method("cartridges", **QUICK).compress(Request(plain, RATIO))
    for layer in range(tiny.n_layers):
        view = stored.layer_view(layer)
        assert torch.equal(view.keys[:, 0], plain.full.keys[layer][:, 0])
        assert torch.equal(view.values[:, 0], plain.full.values[layer][:, 0])
        assert not torch.equal(view.keys[:, 1:], plain.full.keys[layer][:, 1 : view.keys.shape[1]])


def test_the_cartridge_stays_on_the_models_device_and_costs_a_uniform_evictions_bytes():
    lm = suite_model(name="fake-cuda-llama")
    to_fake_cuda(lm.model)
    lm = LoadedModel(lm.name, lm.model, lm.tokenizer, FAKE_DEVICE, lm.dtype)
    with fake_cuda():
        doc = prepare_context(lm, DOCUMENT)
        stored = get_method("cartridges", **QUICK).compress(Request(doc, 4.0))
        evicted = get_method("snapkv").compress(Request(doc, 4.0))
        for layer in stored.layers:
            for seg in layer:
                assert all(is_fake(x) for x in (seg.keys, seg.values, seg.head_lengths, seg.token_index))
                assert seg.keys.dtype == seg.values.dtype == lm.dtype and seg.bias is None
    assert stored.meta["trained"] == "now"
    assert stored.nbytes == evicted.nbytes and stored.breakdown() == evicted.breakdown()
    assert torch.equal(stored.kept_per_head().cpu(), evicted.kept_per_head().cpu())


def test_a_trained_cartridge_is_read_back_from_the_result_store_after_a_restart(ctx, tiny, monkeypatch):
    steps: list[int] = []
    real = cartridges.train

    def counted(
        ctx: Context, cart: ct.Cartridge, targets: list[ct.Teacher], schedule: ct.Schedule, report: ct.Report
    ) -> list[float]:
        return real(ctx, cart, targets, schedule, lambda step, *rest: (steps.append(step), report(step, *rest)))

    monkeypatch.setattr(cartridges, "train", counted)
    first = get_method("cartridges", **QUICK).compress(Request(ctx, RATIO))
    assert steps == [1, 2] and first.meta["trained"] == "now"
    again = get_method("cartridges", **QUICK).compress(Request(ctx, RATIO))
    monkeypatch.setattr(results, "_store", None)  # a restart: the store opened again from its folder
    restarted = get_method("cartridges", **QUICK).compress(
        Request(prepare_context(with_template(tiny), TINY_DOC), RATIO)
    )
    assert steps == [1, 2] and again.meta["trained"] == restarted.meta["trained"] == "stored"
    for other in (again, restarted):
        for layer in range(ctx.lm.n_layers):
            assert torch.equal(other.layer_view(layer).keys, first.layer_view(layer).keys)
    get_method("cartridges", **{**QUICK, "lr": 0.01}).compress(Request(ctx, RATIO))  # another knob: trained anew
    assert steps == [1, 2, 1, 2]


def test_training_reports_the_time_left_and_stops_when_cancelled(ctx):
    """Each step reports its progress with the seconds left; a request stopped during the training raises
    Cancelled at the next step and keeps nothing (the same request trains again)."""
    seen: list[tuple[float, str]] = []
    get_method("cartridges", **QUICK).compress(Request(ctx, RATIO, progress=lambda f, d: seen.append((f, d))))
    steps = [(f, d) for f, d in seen if d.startswith("training the cartridge")]
    assert [d.split(",")[0] for _, d in steps] == [
        "training the cartridge: step 1/2",
        "training the cartridge: step 2/2",
    ]
    assert all(d.endswith("s left") for _, d in steps) and steps[-1][0] == pytest.approx(0.6)
    opts = {**QUICK, "steps": 3}
    stopped = lambda: cancellation.STOPPED if any("step 1/" in d for _, d in later) else None  # noqa: E731
    later: list[tuple[float, str]] = []
    with cancellation.scope(stopped=stopped), pytest.raises(cancellation.Cancelled):
        get_method("cartridges", **opts).compress(Request(ctx, RATIO, progress=lambda f, d: later.append((f, d))))
    assert get_method("cartridges", **opts).compress(Request(ctx, RATIO)).meta["trained"] == "now"


def test_batches_read_every_conversation_once_per_epoch_in_a_seeded_order():
    drawn = ct.batches(6, ct.Schedule(steps=6, lr=0.02, batch=2, seed=3))
    assert all(len(b) == 2 for b in drawn)
    for epoch in (drawn[:3], drawn[3:]):
        assert sorted(k for b in epoch for k in b) == [0, 1, 2, 3, 4, 5]
    assert drawn == ct.batches(6, ct.Schedule(steps=6, lr=0.02, batch=2, seed=3))
    assert drawn != ct.batches(6, ct.Schedule(steps=6, lr=0.02, batch=2, seed=4))
    assert ct.batches(3, ct.Schedule(steps=2, lr=0.02, batch=0, seed=0)) == [[0, 1, 2], [0, 1, 2]]
