"""KVSculpt's learned keys (kvlab.compression.solvers.learned_keys, kvlab/methods/kvsculpt.py), each
against a computation of its own:

- the closed-form values for fixed keys are the weighted least squares solved by hand
  (torch.linalg.lstsq on the rows times the roots of their weights), and with no iteration the
  head keeps its start's keys with those values;
- the objective's gradient in the keys, for fixed values, is its central finite differences (float64);
- from the same start, the learned keys fit a random block no worse than select-then-fit
  (HighestAttnKeys and least squares), and far better a block whose keys come in pairs symmetric
  about centres the subset cannot reach;
- with no iteration the method's cache is Attention Matching's, key for key and value for value;
- the pilot's budgets keep the total and give more to the head the pilot fits worse;
- on the tiny model a keep-all ratio reproduces the full logits, and the stored bytes are
  Attention Matching's at the same ratio.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.compression.budget_profiles import allocate
from kvlab.compression.solvers.compact import compact_block
from kvlab.compression.solvers.keys import HighestAttn
from kvlab.compression.solvers.learned_keys import (
    HeadProblem,
    Targets,
    block_targets,
    head_values,
    objective,
    output_mse,
    sculpt_head,
)
from kvlab.methods import Request, get_method
from kvlab.methods.kvsculpt import pilot_shares
from kvlab.runtime.decode import extend, open_session

QUESTION = "w3 w5 w8"


@pytest.fixture(scope="module")
def ctx(templated):
    return templated


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype=torch.float64) -> Targets:
    """A block's output and log-mass, written out in float64 (returned in ``dtype``)."""
    logits = q.double() @ k.double().T * scale
    return Targets((torch.softmax(logits, -1) @ v.double()).to(dtype), torch.logsumexp(logits, -1).to(dtype))


def problem(q, targets, beta, weights=None, mass_weight=0.0, ridge=1e-6, scale=0.5) -> HeadProblem:
    """One head's problem, at the solvers' default ridge."""
    root_w = None if weights is None else weights.sqrt()
    return HeadProblem(q, beta, targets, root_w, scale, ridge, mass_weight)


def random_head(n=40, T=24, d=6, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=gen, dtype=dtype)
    k = torch.randn(T, d, generator=gen, dtype=dtype)
    v = torch.randn(T, 5, generator=gen, dtype=dtype)
    return q, k, v


def output_error(p: HeadProblem, keys: torch.Tensor, values: torch.Tensor) -> float:
    """sum_i ||x_i V - y_i||^2 / sum_i ||y_i||^2, the softmax written out (float64)."""
    x = torch.softmax(p.q.double() @ keys.double().T * p.scale + p.beta.double(), -1)
    y = p.targets.output.double()
    return float((x @ values.double() - y).square().sum() / y.square().sum())


def test_closed_form_values_are_the_weighted_least_squares_solved_by_hand():
    q, k, v = random_head(dtype=torch.float32)
    weights = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(3)) + 0.5
    beta = torch.randn(4, generator=torch.Generator().manual_seed(4))
    # At scale 1 the attention over these 4 keys is well conditioned (cond ~5): float32 normal equations
    # then agree with float64's least squares to ~1e-5.
    p = problem(q, by_hand(q, k, v, 1.0, torch.float32), beta, weights, scale=1.0)
    keys = k[:4]
    x = torch.softmax(q.double() @ keys.double().T + beta.double(), -1)
    root = weights.double().sqrt().unsqueeze(-1)
    want = torch.linalg.lstsq(x * root, p.targets.output.double() * root).solution
    torch.testing.assert_close(head_values(keys, p).double(), want, rtol=1e-4, atol=1e-5)


def test_with_no_iteration_a_head_keeps_its_start_and_its_least_squares_values():
    q, k, v = random_head(dtype=torch.float32)
    p = problem(q, by_hand(q, k, v, 0.5, torch.float32), torch.zeros(6))
    head = sculpt_head(k[:6], p, iterations=0, every=5)
    x = torch.softmax(q.double() @ k[:6].double().T * 0.5, -1)
    want = torch.linalg.lstsq(x, p.targets.output.double()).solution
    assert torch.equal(head.keys, k[:6])
    torch.testing.assert_close(head.values.double(), want, rtol=1e-3, atol=1e-4)


def test_the_gradient_in_the_keys_is_the_objectives_finite_differences():
    q, k, v = random_head(seed=1)
    weights = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5
    p = problem(q, by_hand(q, k, v, 0.5), 0.3 * torch.randn(5, dtype=torch.float64), weights, mass_weight=1.0)
    keys = (k[:5] + 0.1 * torch.randn(5, 6, dtype=torch.float64)).requires_grad_(True)
    values = torch.randn(5, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad(objective(keys, values, p), keys)
    h = 1e-6
    for i, j in [(0, 0), (1, 3), (2, 5), (3, 1), (4, 4), (4, 2)]:
        step = torch.zeros_like(keys)
        step[i, j] = h
        with torch.no_grad():
            slope = (objective(keys + step, values, p) - objective(keys - step, values, p)) / (2 * h)
        assert float(grad[i, j]) == pytest.approx(float(slope), rel=1e-6, abs=1e-9)


def highest_attn_start(q, k, v, t, scale):
    """Attention Matching's HighestAttnKeys selection of one head (the start both fits share)."""
    fit = compact_block(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), t, scale=scale, keys=HighestAttn())
    return fit.keys[0]


def test_learned_keys_fit_a_random_block_no_worse_than_select_then_fit():
    gen = torch.Generator().manual_seed(5)
    q = 0.5 * torch.randn(64, 8, generator=gen)
    k, v = torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen)
    p = problem(q, by_hand(q, k, v, 0.5, torch.float32), torch.zeros(6))
    start = highest_attn_start(q, k, v, 6, 0.5)
    fitted = sculpt_head(start, p, iterations=0, every=5)  # select-then-fit: the start, least-squares values
    learned = sculpt_head(start, p, iterations=20, every=5)
    assert output_error(p, learned.keys, learned.values) <= output_error(p, fitted.keys, fitted.values) * (1 + 1e-5)


def test_learned_keys_find_the_centres_of_symmetric_pairs_the_subset_cannot_reach():
    """T keys in pairs c_j +- delta u_j with one value per pair: the pair's weight is
    2 cosh(delta q.u_j) e^{q.c_j}, which the centre c_j reproduces up to delta^2 while either
    key of the pair is off by e^{+-delta q.u_j}. The learned keys beat the subset by far."""
    gen = torch.Generator().manual_seed(6)
    t, d = 6, 8
    centres, u = 1.5 * torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    keys = torch.stack([centres + 0.8 * u, centres - 0.8 * u], 1).reshape(2 * t, d)
    values = torch.randn(t, 4, generator=gen).repeat_interleave(2, 0)
    q = 0.5 * torch.randn(96, d, generator=gen)
    p = problem(q, by_hand(q, keys, values, 0.5, torch.float32), torch.zeros(t))
    start = highest_attn_start(q, keys, values, t, 0.5)
    subset = sculpt_head(start, p, iterations=0, every=5)
    centred = sculpt_head(centres, p, iterations=0, every=5)
    learned = sculpt_head(start, p, iterations=50, every=5)
    e_subset, e_centred = output_error(p, subset.keys, subset.values), output_error(p, centred.keys, centred.values)
    assert e_centred < 0.2 * e_subset  # the construction: the centres are the better keys
    assert output_error(p, learned.keys, learned.values) < 0.5 * e_subset


def test_with_no_iteration_the_cache_is_attention_matchings(ctx):
    req = Request(ctx, 4.0, QUESTION)
    ours = get_method("kvsculpt", lbfgs_iters=0, budgets="uniform").compress(req)
    theirs = get_method("attention_matching", budgets="uniform").compress(req)
    for mine, am in zip(ours.layers, theirs.layers):
        assert [s.fate for s in mine] == [s.fate for s in am]
        for a, b in zip(mine, am):
            va, vb = a.view(), b.view()
            assert torch.equal(va.keys, vb.keys) and torch.equal(va.values, vb.values)
            assert torch.equal(va.bias, vb.bias) and torch.equal(va.token_index, vb.token_index)


def test_pilot_budgets_keep_the_total_and_favour_the_head_fitted_worse():
    """Two heads of one block: head 0's values are all one vector (any fit reproduces its output),
    head 1's are random. Attention Matching's fit at the uniform budget measures them; the budgets
    that follow keep the total and give head 1 more."""
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 64, 8, generator=gen), torch.randn(2, 40, 8, generator=gen)
    v = torch.randn(2, 40, 4, generator=gen)
    v[0] = v[0, :1]
    fit = compact_block(q, k, v, 8, scale=0.5)
    errors = output_mse(q, fit.keys, fit.bias, fit.values, block_targets(q, k, v, None, 0.5), 0.5)
    assert float(errors[0]) < 1e-6 < float(errors[1])
    budgets = allocate(pilot_shares(errors.double()), 8, 40)
    assert int(budgets.sum()) == 16
    assert int(budgets[1]) > int(budgets[0])


def test_the_methods_pilot_budgets_follow_its_pilot_errors(ctx):
    stored = get_method("kvsculpt", lbfgs_iters=0).compress(Request(ctx, 4.0, QUESTION))
    errors = torch.tensor(stored.meta["pilot_output_mse"])
    kept = stored.kept_per_head() - ctx.prefix_len  # [n_layers, H_kv] document keys per head
    assert int(kept.sum()) == round(ctx.doc_len / 4.0) * kept.numel()
    for layer in range(kept.shape[0]):
        order = errors[layer].argsort()
        assert bool((kept[layer][order].diff() >= 0).all()), (errors[layer], kept[layer])


def test_keep_all_reproduces_the_full_logits(ctx):
    stored = get_method("kvsculpt").compress(Request(ctx, 1.0, QUESTION))
    ids = torch.tensor([5, 9, 11])
    got = extend(ctx.lm, open_session(ctx.lm, stored), ids)
    torch.testing.assert_close(got, extend(ctx.lm, open_session(ctx.lm, ctx.full.stored), ids), atol=1e-4, rtol=0)


def test_learned_keys_are_new_vectors_stored_in_attention_matchings_bytes(ctx):
    req = Request(ctx, 4.0, QUESTION)
    ours = get_method("kvsculpt").compress(req)
    theirs = get_method("attention_matching").compress(req)
    assert ours.nbytes == theirs.nbytes
    assert ours.logical_len == ctx.length
    full_keys = ctx.full.keys[0][:, ctx.prefix_len :]
    compacted = next(s for s in ours.layers[0] if s.fate == "compacted").view()
    real = compacted.keys[torch.isfinite(compacted.bias)]
    # Not a subset: most learned keys are no original key of the block.
    distance = torch.cdist(real.float(), full_keys.flatten(0, 1).float()).min(-1).values
    assert float((distance > 1e-3).float().mean()) > 0.5
    assert real.dtype == full_keys.dtype


def test_the_keys_are_learned_under_a_callers_inference_mode_as_outside_it(ctx):
    """The lab compresses inside torch.inference_mode, whose tensors autograd refuses to save: the
    learning must leave it for its own steps and land where it lands outside."""
    req = Request(ctx, 4.0, QUESTION)
    outside = get_method("kvsculpt").compress(req)
    with torch.inference_mode():
        inside = get_method("kvsculpt").compress(req)
    for a, b in zip(outside.layers, inside.layers):
        for x, y in zip(a, b):
            assert torch.equal(x.view().keys, y.view().keys) and torch.equal(x.view().values, y.view().values)
