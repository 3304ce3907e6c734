"""Kernel 3: Attention Matching's key scores without the n-by-T attention matrix.

Scores (HighestAttnKeys, see :func:`kvlab.compression.solvers.scores.score_keys`) of
``T`` keys under ``n`` reference queries, with ``a_ij = exp(s_ij - lse_i)``:
rms = sqrt(mean_i a_ij^2), mean = mean_i a_ij, max = max_i a_ij; keys whose
bias is -inf (padding) score -inf.

Two passes, each streaming one operand through registers:

1. one program per (head, query tile) sweeps the keys and keeps each
   query's running log-sum-exp: writes lse [B, n];
2. one program per (head, key tile) sweeps the queries, recomputes the
   logits, and reduces ``a_ij`` over queries: writes scores [B, T].

The logits are computed twice, and the only memory traffic beyond q and k is
``n + T`` floats per head.

Shapes: q [B, n, d], k [B, T, d] (unit stride on d), bias float32 [B, T] or None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.runtime.triton_decode import dot_precision

BLOCK_Q = 32
BLOCK_K = 64
# Reduction selector passed as a constexpr, so each one compiles to its own kernel.
SCORINGS = {"mean": 0, "rms": 1, "max": 2}


@triton.jit
def score_logits(
    q, k_ptr, bias_ptr, cols, col_ok, d, d_ok, sk_s, scale, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """Logits [BLOCK_Q, BLOCK_K] (float32, -inf past the keys) of a query tile over key columns ``cols``."""
    k = tl.load(k_ptr + cols[:, None] * sk_s + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if HAS_BIAS:
        s += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    return tl.where(col_ok[None, :], s, float("-inf"))


@triton.jit
def _row_lse_kernel(
    q_ptr,
    k_ptr,
    bias_ptr,
    lse_ptr,
    sq_b,
    sq_n,
    sk_b,
    sk_s,
    sb_b,
    n_queries,
    n_keys,
    scale,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < n_queries
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * sq_b + rows[:, None] * sq_n + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    for n0 in range(0, n_keys, BLOCK_K):
        cols = n0 + tl.arange(0, BLOCK_K)
        s = score_logits(
            q, k_ptr + b * sk_b, bias_ptr + b * sb_b, cols, cols < n_keys, d, d_ok, sk_s, scale, HAS_BIAS, DOT_PRECISION
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
        m_i = m_new
    tl.store(lse_ptr + b * n_queries + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _key_reduce_kernel(
    q_ptr,
    k_ptr,
    bias_ptr,
    lse_ptr,
    out_ptr,
    sq_b,
    sq_n,
    sk_b,
    sk_s,
    sb_b,
    n_queries,
    n_keys,
    scale,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCORING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < n_keys
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    total = tl.zeros([BLOCK_K], tl.float32)
    for r0 in range(0, n_queries, BLOCK_Q):
        rows = r0 + tl.arange(0, BLOCK_Q)
        row_ok = rows < n_queries
        q = tl.load(
            q_ptr + b * sq_b + rows[:, None] * sq_n + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        lse = tl.load(lse_ptr + b * n_queries + rows, mask=row_ok, other=0.0)
        # A query that sees only padding (lse -inf) gives weight exp(-inf - 0) = 0 everywhere.
        shift = tl.where(lse == float("-inf"), 0.0, lse)
        s = score_logits(
            q, k_ptr + b * sk_b, bias_ptr + b * sb_b, cols, col_ok, d, d_ok, sk_s, scale, HAS_BIAS, DOT_PRECISION
        )
        a = tl.where(row_ok[:, None], tl.exp(s - shift[:, None]), 0.0)
        if SCORING == 0:
            total += tl.sum(a, 0)
        elif SCORING == 1:
            total += tl.sum(a * a, 0)
        else:
            total = tl.maximum(total, tl.max(a, 0))
    if SCORING == 0:
        score = total / n_queries
    elif SCORING == 1:
        score = tl.sqrt(total / n_queries)
    else:
        score = total
    if HAS_BIAS:
        bias = tl.load(bias_ptr + b * sb_b + cols, mask=col_ok, other=0.0)
        score = tl.where(bias == float("-inf"), float("-inf"), score)
    tl.store(out_ptr + b * n_keys + cols, score, mask=col_ok)


def key_scores(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float, scoring: str = "rms"
) -> torch.Tensor:
    """Triton key scores: q [B, n, d], k [B, T, d], bias float32 [B, T] or None -> [B, T] float32."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be 'rms', 'mean' or 'max', got {scoring!r}")
    batch, n, d = q.shape
    n_keys = k.shape[1]
    lse = torch.empty(batch, n, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, n_keys, dtype=torch.float32, device=q.device)
    has_bias = bias is not None
    bias_arg = bias if has_bias else lse  # never read when HAS_BIAS is False
    common = dict(
        HEAD_DIM=d,
        HAS_BIAS=has_bias,
        DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_Q=BLOCK_Q,
        BLOCK_K=BLOCK_K,
        BLOCK_D=triton.next_power_of_2(d),
    )
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), bias.stride(0) if has_bias else 0)
    _row_lse_kernel[(batch, triton.cdiv(n, BLOCK_Q))](q, k, bias_arg, lse, *strides, n, n_keys, scale, **common)
    _key_reduce_kernel[(batch, triton.cdiv(n_keys, BLOCK_K))](
        q, k, bias_arg, lse, out, *strides, n, n_keys, scale, SCORING=SCORINGS[scoring], **common
    )
    return out
