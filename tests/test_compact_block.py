"""Tests of Attention Matching's compaction of one block (kvlab.compression.solvers.compact,
.keys, .omp): keys chosen, biases and values fitted, as whole blocks of heads.

Small seeded random problems; each test checks a property that fails if the
maths is wrong, not merely that the code runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.compression.solvers.compact import compact_block
from kvlab.compression.solvers.keys import OMP, GivenScores, HighestAttn
from kvlab.compression.solvers.nnls import nnls, nnls_bias
from kvlab.compression.solvers.omp import omp_select
from kvlab.compression.solvers.scores import mass_features, score_keys, select_highest_attn, streamed_mass
from kvlab.runtime.attention import attend
from solver_cases import gather_cols, gen, mass_err, qkv, rel_out_err

# --------------------------------------------------------------------------
# OMP
# --------------------------------------------------------------------------


def test_omp_mass_error_decreases_with_t_and_beats_highest_attn():
    q, k, _ = qkv(B=3, n=96, T=64, d=16, q_scale=1.5, seed=9)
    phi, z = mass_features(q, k)
    errs = []
    for t in (4, 8, 16, 32):
        idx, w = omp_select(phi, z, t)
        errs.append(mass_err(gather_cols(phi, idx), w, z))
        # prefix order: the first picks are the first ones of a longer run
        if t == 16:
            first = idx[:, :4]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    idx32, _ = omp_select(phi, z, 32)
    assert torch.equal(idx32[:, :4], first)
    # highest attention + bounded NNLS at the same t
    t = 8
    idx_h = select_highest_attn(score_keys(q, k), t)
    m_h = gather_cols(phi, idx_h)
    err_h = mass_err(m_h, nnls_bias(m_h, z, iters=50).exp(), z)
    assert errs[1] <= err_h * 1.05, (errs[1], err_h)


def test_omp_beats_highest_attn_on_redundant_keys():
    # 6 distinct keys; the most attended one appears 20 times. Top-t by score
    # fills the budget with its copies; OMP sees their mass is already
    # explained and spends the budget on the others.
    g = gen(10)
    B, n, d = 2, 80, 8
    base = torch.randn(B, 6, d, generator=g)
    base[:, 0] *= 0.3
    copies = [20, 4, 4, 4, 4, 4]
    k = torch.cat([base[:, i : i + 1].expand(B, c, d) for i, c in enumerate(copies)], 1)
    q = torch.randn(B, n, d, generator=g) * 0.5 + 1.0 * base[:, :1]
    phi, z = mass_features(q, k)
    t = 6
    idx, w = omp_select(phi, z, t, keys_per_iter=1, refit_every=1)
    err_omp = mass_err(gather_cols(phi, idx), w, z)
    idx_h = select_highest_attn(score_keys(q, k), t)
    m_h = gather_cols(phi, idx_h)
    err_h = mass_err(m_h, nnls_bias(m_h, z, iters=50).exp(), z)
    assert err_omp < 1e-3 < err_h
    assert torch.allclose(w.sort(-1).values, torch.tensor([4.0] * 5 + [20.0]).expand(B, 6), rtol=1e-2)


def test_omp_drops_and_refills_consistently():
    q, k, _ = qkv(B=2, n=48, T=40, d=8, q_scale=2.0, seed=11)
    phi, z = mass_features(q, k)
    t = 10
    # an aggressive drop threshold forces many drop/ban/refill rounds
    idx, w = omp_select(phi, z, t, drop_below=0.0)
    assert torch.all(idx >= 0)
    for b in range(2):
        assert len(set(idx[b].tolist())) == t
    # the incrementally updated Gram gives the same weights as a fresh NNLS
    w_fresh = nnls(gather_cols(phi, idx), z)
    assert torch.allclose(w, w_fresh, rtol=1e-3, atol=1e-4)
    # drops really happened: the selection differs from a run without them
    idx_nodrop, _ = omp_select(phi, z, t, drop_below=None)
    assert not torch.equal(idx, idx_nodrop)
    # t = T: dropped keys are banned, the pool runs dry and the remaining
    # slots are filled from banned keys; every key still appears exactly once
    idx_all, w_all = omp_select(phi[:, :, :12], z, 12, drop_below=0.0)
    for b in range(2):
        assert sorted(idx_all[b].tolist()) == list(range(12))
    # All 12 keys of a near-singular design: the NNLS optimum's weights are not well
    # determined (they move by 1e-3 with the BLAS kernel), its objective is.
    design = gather_cols(phi[:, :, :12], idx_all)
    fresh = nnls(design, z)
    assert torch.all(w_all >= 0)
    residual = lambda w: ((design @ w.unsqueeze(-1)).squeeze(-1) - z).norm(dim=-1)  # noqa: E731
    assert torch.allclose(residual(w_all), residual(fresh), rtol=1e-4)


def test_omp_respects_padding_keys():
    q, k, _ = qkv(B=2, n=40, T=20, d=8, seed=12)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, ::2] = False  # head 0: 10 real keys
    bias = torch.zeros(2, 20).masked_fill(~valid, float("-inf"))
    phi, z = mass_features(q, k, bias)
    idx, w = omp_select(phi, z, 12, key_valid=valid)
    assert torch.all(idx[0, 10:] == -1) and torch.all(w[0, 10:] == 0)
    assert torch.all(valid[0, idx[0, :10]])
    assert torch.all(idx[1] >= 0)


# --------------------------------------------------------------------------
# compact_block
# --------------------------------------------------------------------------


@pytest.mark.parametrize("selection", [HighestAttn(), OMP()], ids=["highest_attn", "omp"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_keep_all_reproduces_attention(selection, with_bias):
    q, k, v = qkv(B=3, n=64, T=32, seed=13)
    bias = torch.empty(3, 32).uniform_(-2, 2, generator=gen(14)) if with_bias else None
    ref = attend(q, k, v, bias)
    cb = compact_block(q, k, v, 32, bias=bias, keys=selection)
    got = attend(q, cb.keys, cb.values, cb.bias)
    assert torch.allclose(got.output, ref.output, atol=1e-4)
    assert torch.allclose(got.lse, ref.lse, atol=1e-4)
    if bias is not None:  # re-compaction carries the old bias into beta
        assert torch.allclose(cb.bias, bias.gather(1, cb.index), atol=1e-3)
    assert set(cb.timings) == {"keys", "bias", "values"}


def test_budgets_pad_with_minus_inf_and_match_solo_compaction():
    q, k, v = qkv(B=3, n=64, T=32, seed=15)
    t = 8
    budgets = torch.tensor([8, 5, 0])
    cb = compact_block(q, k, v, t, budgets=budgets)
    assert cb.lengths.tolist() == [8, 5, 0]
    assert torch.all(cb.bias[1, 5:] == float("-inf")) and torch.all(cb.index[1, 5:] == -1)
    assert torch.all(cb.bias[2] == float("-inf")) and torch.all(cb.index[2] == -1)
    assert torch.all(cb.values[1, 5:] == 0) and torch.isfinite(cb.values).all()
    assert torch.isfinite(cb.bias[0]).all() and torch.all(cb.index[0] >= 0)
    # padded head 1 = head 1 compacted alone at its budget
    solo = compact_block(q[1:2], k[1:2], v[1:2], 5)
    assert torch.equal(cb.index[1, :5], solo.index[0])
    assert torch.allclose(cb.bias[1, :5], solo.bias[0], atol=1e-5)
    assert torch.allclose(cb.values[1, :5], solo.values[0], atol=1e-4)
    # and as a cache block the padding slots are absent keys
    a = attend(q[1:2], cb.keys[1:2], cb.values[1:2], cb.bias[1:2])
    b = attend(q[1:2], solo.keys, solo.values, solo.bias)
    assert torch.allclose(a.output, b.output, atol=1e-4) and torch.allclose(a.lse, b.lse, atol=1e-4)


def test_budgets_with_omp_refit_the_cut_heads():
    q, k, v = qkv(B=2, n=64, T=32, seed=16)
    cb = compact_block(q, k, v, 8, budgets=torch.tensor([8, 4]), keys=OMP())
    full = compact_block(q, k, v, 8, keys=OMP())
    assert torch.equal(cb.index[:, :4], full.index[:, :4])  # OMP order is a prefix
    assert torch.all(cb.bias[1, 4:] == float("-inf"))
    phi, z = mass_features(q[1:2], k[1:2])
    m = gather_cols(phi, cb.index[1:2, :4])
    # the cut head's weights are refitted on its own 4 keys, not OMP's 8-key ones
    assert mass_err(m, cb.bias[1:2, :4].exp(), z) <= mass_err(m, full.bias[1:2, :4].exp(), z)


def test_padding_keys_in_the_input_block_are_never_selected():
    q, k, v = qkv(B=2, n=64, T=32, seed=17)
    bias = torch.zeros(2, 32)
    bias[0, 10:] = float("-inf")  # head 0 has only 10 real keys
    for selection in (HighestAttn(), OMP()):
        cb = compact_block(q, k, v, 16, bias=bias, keys=selection)
        assert cb.lengths.tolist() == [10, 16]
        assert torch.all(cb.index[0, :10] < 10) and torch.all(cb.index[0, 10:] == -1)
        ref = attend(q, k, v, bias)
        got = attend(q, cb.keys, cb.values, cb.bias)
        # head 0 keeps all its real keys: exact
        assert torch.allclose(got.output[0], ref.output[0], atol=1e-4)
        assert torch.allclose(got.lse[0], ref.lse[0], atol=1e-4)


@pytest.mark.parametrize("selection", [HighestAttn(), OMP()], ids=["highest_attn", "omp"])
def test_compaction_beats_plain_top_t(selection):
    q, k, v = qkv(B=4, n=128, T=64, d=16, q_scale=1.5, seed=18)
    t = 16
    ref = attend(q, k, v)
    cb = compact_block(q, k, v, t, keys=selection)
    got = attend(q, cb.keys, cb.values, cb.bias)
    idx = select_highest_attn(score_keys(q, k), t)
    kk = k.gather(1, idx.unsqueeze(-1).expand(-1, -1, k.shape[-1]))
    vv = v.gather(1, idx.unsqueeze(-1).expand(-1, -1, v.shape[-1]))
    base = attend(q, kk, vv)
    err_am, err_base = rel_out_err(got.output, ref.output), rel_out_err(base.output, ref.output)
    assert err_am < 0.8 * err_base, (err_am, err_base)
    mass_am = float((torch.exp(got.lse - ref.lse) - 1).abs().mean())
    mass_base = float((torch.exp(base.lse - ref.lse) - 1).abs().mean())
    assert mass_am < 0.5 * mass_base, (mass_am, mass_base)


def test_low_precision_inputs():
    q, k, v = qkv(B=2, n=64, T=32, seed=19)
    cb = compact_block(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32)
    assert cb.keys.dtype == torch.bfloat16 and cb.values.dtype == torch.bfloat16
    assert cb.bias.dtype == torch.float32
    ref = attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    got = attend(q.bfloat16(), cb.keys, cb.values, cb.bias)
    assert torch.allclose(got.output, ref.output, atol=3e-2)
    assert torch.allclose(got.lse, ref.lse, atol=1e-3)


@pytest.mark.parametrize(
    ("selection", "beta"), [(HighestAttn(), 3.0), (OMP(), math.log(64))], ids=["highest_attn", "omp"]
)
def test_beta_is_bounded_as_published(selection, beta):
    """64 copies of one key compacted to one: its exact weight is 64, beta = log 64 ~ 4.16.
    The published HighestAttnKeys configuration bounds beta to [-3, 3], so it stops at 3;
    OMP's bound is 7 (keys below -7 dropped), so it keeps the exact log 64."""
    q, k, v = qkv(B=2, n=32, T=64, d=16, seed=20)
    k = k[:, :1].expand(-1, 64, -1).contiguous()
    cb = compact_block(q, k, v, 1, keys=selection)
    assert torch.allclose(cb.bias, torch.full((2, 1), beta), atol=1e-3)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_omp_with_fewer_slots_than_keys_per_iter(t):
    """A budget below keys_per_iter (a high ratio on a short block) fills exactly t slots
    with distinct keys, weighted by their NNLS fit."""
    q, k, _ = qkv(B=2, n=40, T=24, d=8, seed=21)
    phi, z = mass_features(q, k)
    idx, w = omp_select(phi, z, t, keys_per_iter=4)
    assert idx.shape == (2, t) and all(len(set(row.tolist())) == t for row in idx) and bool((idx >= 0).all())
    assert torch.allclose(w, nnls(gather_cols(phi, idx), z), rtol=1e-3, atol=1e-4)


def test_given_key_scores_pick_the_keys_and_the_fit_stays_highest_attn():
    """key_scores equal to an eager RMS score reproduce the default compaction; other
    scores pick their own top-t, and the values are still the least-squares optimum."""
    q, k, v = qkv(B=2, n=64, T=32, seed=22)
    t = 8
    a = torch.softmax(q @ k.transpose(1, 2) / k.shape[-1] ** 0.5, dim=-1)  # [B, n, T]
    default = compact_block(q, k, v, t)
    given = compact_block(q, k, v, t, keys=GivenScores(a.square().mean(dim=1).sqrt()))
    assert torch.equal(given.index, default.index)
    assert torch.allclose(given.bias, default.bias, atol=1e-6) and torch.allclose(
        given.values, default.values, atol=1e-5
    )

    scores = torch.rand(2, 32, generator=gen(23))
    cb = compact_block(q, k, v, t, keys=GivenScores(scores))
    for b in range(2):
        assert set(cb.index[b].tolist()) == set(scores[b].argsort(descending=True)[:t].tolist())
    assert cb.bias.min() >= -3.0 - 1e-6 and cb.bias.max() <= 3.0 + 1e-6  # the HighestAttnKeys bounds
    x = torch.softmax(q @ cb.keys.transpose(1, 2) / k.shape[-1] ** 0.5 + cb.bias.unsqueeze(1), dim=-1)
    y = a @ v
    best = torch.linalg.lstsq(x.double(), y.double()).solution.float()
    assert torch.allclose(cb.values, best, atol=1e-3)
    with pytest.raises(ValueError, match="key_scores"):
        compact_block(q, k, v, t, keys=GivenScores(scores[:, :t]))


# the streamed and the dense path
@pytest.mark.parametrize("key_selection", [HighestAttn(), OMP()], ids=["highest_attn", "omp"])
def test_a_head_that_sees_only_padding_fits_to_zeros_not_nans(key_selection):
    """z = 0 for every query of a head whose keys are all padding: its outputs are 0, never 0/0;
    the other heads are fitted as if it were not there (compared with each fitted alone)."""
    q, k, v = qkv(B=2, n=24, T=16, seed=21)
    bias = torch.zeros(2, 16)
    bias[1] = float("-inf")
    shift, z, y, _ = streamed_mass(q, k, v, bias)
    assert torch.isfinite(y).all() and bool((y[1] == 0).all()) and bool((z[1] == 0).all())
    eager = torch.softmax(q[0] @ k[0].T / 4.0, dim=-1) @ v[0]  # head dim 16: scale 1/4
    assert torch.allclose(y[0], eager, atol=1e-5)
    both = compact_block(q, k, v, 6, bias=bias, keys=key_selection)
    alone = compact_block(q[:1], k[:1], v[:1], 6, bias=bias[:1], keys=key_selection)
    assert torch.isfinite(both.values).all() and torch.isfinite(both.keys).all()
    assert torch.allclose(both.values[0], alone.values[0], atol=1e-5)


def test_a_factorisation_that_never_succeeds_is_counted_for_its_head():
    """ridge_factor: a head whose Gram cannot be factorised at any ridge (here +inf on its
    diagonal) solves to 0 and is counted against that head only, while a fit is running."""
    from kvlab.compression.solvers.linalg import FALLBACKS, ridge_factor

    g = torch.randn(3, 6, 4, generator=gen(30))
    gram = g.transpose(-1, -2) @ g
    gram[1, 2, 2] = float("inf")
    counts = torch.zeros(3, dtype=torch.long)
    token = FALLBACKS.set(counts)
    try:
        _, ok = ridge_factor(gram, torch.ones(3, 4), 1e-6)
    finally:
        FALLBACKS.reset(token)
    assert ok.tolist() == [True, False, True]
    assert counts.tolist() == [0, 1, 0]


def test_non_finite_results_are_replaced_and_counted_per_head():
    """A NaN key in head 1 poisons that head's fit only: its values are replaced (and counted),
    the other heads' fits are those of the same batch fitted without the NaN.

    The reference is the same batch shape without the NaN (not the heads fitted alone): a batch
    of another size takes another BLAS path, whose float32 rounding differs by CPU. The tolerance
    is the forward-error bound of the value fit, a least squares through its normal equations:
    n * eps * cond(X)^2 relative to the values, X = the compact attention weights of the head.
    """
    q, k, v = qkv(B=3, n=24, T=16, seed=5)
    clean = compact_block(q, k, v, 6)
    k[1, 3] = float("nan")
    block = compact_block(q, k, v, 6)
    assert block.nonfinite[1] > 0 and block.nonfinite[[0, 2]].tolist() == [0, 0]
    assert block.fallbacks.tolist() == [0, 0, 0]
    assert torch.isfinite(block.values).all()
    for b in (0, 2):
        assert torch.equal(block.index[b], clean.index[b])
        x = torch.softmax(q[b].double() @ clean.keys[b].double().T / math.sqrt(16) + clean.bias[b].double(), -1)
        scale = float(clean.values[b].abs().max())
        tol = q.shape[1] * torch.finfo(torch.float32).eps * float(torch.linalg.cond(x)) ** 2 * scale
        assert float((block.values[b] - clean.values[b]).abs().max()) <= tol


def test_a_degenerate_head_duplicate_keys_and_zero_queries_fits_its_output():
    """All-zero queries over one key repeated: attention is uniform, the output is the mean value;
    the compact block must give that output (computed here by hand), with nothing to report."""
    q, k, v = qkv(B=1, n=12, T=16, seed=6)
    q.zero_()
    k[0] = k[0, :1].expand(16, -1).clone()
    block = compact_block(q, k, v, 4)
    assert block.fallbacks.tolist() == [0] and block.nonfinite.tolist() == [0]
    weights = torch.softmax(q[0] @ block.keys[0].T / 4.0 + block.bias[0], dim=-1)
    assert torch.allclose(weights @ block.values[0], v[0].mean(0).expand(12, -1), atol=1e-4)


def test_the_run_names_the_heads_whose_fit_fell_back():
    from types import SimpleNamespace

    from kvlab.pipeline import RunResult

    details = {"solver_fallbacks": [[0, 0], [0, 2]], "nonfinite_replaced": [[5, 0], [0, 0]]}
    line = RunResult.numerics_warning.fget(SimpleNamespace(details=details))
    assert line == (
        "Warning: a solve fell back to zeros in 1 head(s): layer 1 head 1; "
        "non-finite values were replaced in 1 head(s): layer 0 head 0."
    )
    assert RunResult.numerics_warning.fget(SimpleNamespace(details={"solver_fallbacks": [[0]]})) is None


def test_blocked_gram_and_its_lower_triangle_solve_as_the_plain_product():
    """Past 2 x GRAM_BLOCK columns the Gram is formed by blocks (lower triangle, mirrored unless only the
    factorisation reads it): equal to ``D^T D``, and the ridge solve equals float64 least squares
    within float32's normal-equations error (n eps cond(D)^2 of the solution)."""
    from kvlab.compression.solvers.linalg import GRAM_BLOCK, gram_matrix, ridge_lstsq

    g = gen(11)
    m = 2 * GRAM_BLOCK + 37
    d = torch.randn(2, 3 * m, m, generator=g)
    y = torch.randn(2, 3 * m, 5, generator=g)
    plain = d.double().mT @ d.double()
    # A float32 dot product of n terms is within n eps sum |a_i b_i| of the exact one.
    bound = d.shape[1] * torch.finfo(torch.float32).eps * float((d.abs().double().mT @ d.abs().double()).max())
    torch.testing.assert_close(gram_matrix(d).double(), plain, rtol=0, atol=bound)
    lower = gram_matrix(d, lower_only=True)
    assert torch.equal(lower.tril(), gram_matrix(d).tril())
    assert not bool(lower[:, :GRAM_BLOCK, 2 * GRAM_BLOCK :].any())  # above the diagonal blocks: never filled
    x = ridge_lstsq(d, y, torch.ones(2, m), 1e-12)
    ref = torch.linalg.lstsq(d.double(), y.double()).solution
    cond = float(torch.linalg.cond(d.double()).max())
    assert float((x.double() - ref).abs().max()) <= 3 * m * torch.finfo(torch.float32).eps * cond**2 * float(
        ref.abs().max()
    )
