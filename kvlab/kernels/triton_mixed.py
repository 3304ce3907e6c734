"""Kernel 2: attention over KIVI-packed codes plus full-precision tokens (BeaconKV, KIVI).

The quantised tokens are read straight from the project's
:class:`~kvlab.runtime.low_bit.PackedTensor` buffers and dequantised in
registers, tile by tile; no dequantised key or value is ever written to
memory. Code layout (see :mod:`kvlab.runtime.low_bit`): codes packed
``8 // bits`` per byte, first code in the low bits, in the row-major order
of the grouped layout:

* keys (per channel): grouped layout [H_kv, d, T], element (h, t, c) is code
  number ``(h * d + c) * T + t``; scale/zero [H_kv, d, ceil(T / G)] at
  ``(h * d + c) * ceil(T / G) + t // G``;
* values (per token): layout [H_kv, T, d], element (h, t, c) is code
  ``(h * T + t) * d + c``; scale/zero [H_kv, T, ceil(d / G)] at
  ``(h * T + t) * ceil(d / G) + c // G``;

and element = zero + code * scale, computed in float32 then rounded to the
queries' dtype (as :meth:`PackedTensor.dequantize` does). These are computed
offsets, not loaded ones, so the interpreter runs them too.

The quantised part is split along its tokens like kernel 1; the
full-precision tokens that follow (beacons, the recent window, the queries'
own tokens) go through kernel 1's split kernel into the same partial
buffers, and one log-sum-exp merge combines both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.runtime.low_bit import PackedTensor
from kvlab.runtime.triton_decode import (
    BLOCK_N,
    block_m,
    choose_splits,
    dot_precision,
    launch_splits,
    merge_splits,
    new_partials,
    online_softmax_step,
    store_partial,
)


@triton.jit
def dequant_tile(codes, scale, zero, code_idx, meta_idx, ok, BITS: tl.constexpr):
    """Codes ``code_idx`` (any tile shape) -> float32 values zero + code * scale."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(codes + code_idx // PER, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((code_idx % PER) * BITS)) & ((1 << BITS) - 1)
    s = tl.load(scale + meta_idx, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(zero + meta_idx, mask=ok, other=0.0).to(tl.float32)
    return z + code.to(tl.float32) * s


@triton.jit
def _quant_split_kernel(
    q_ptr,
    kc,
    ks,
    kz,
    vc,
    vs,
    vz,
    part_out,
    part_lse,
    sq_h,
    sq_n,
    n_tokens,
    n_queries,
    chunk,
    total_splits,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    hk = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    n_rows = GROUP * n_queries
    row_ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (hk * GROUP + rows // n_queries)[:, None] * sq_h + (rows % n_queries)[:, None] * sq_n + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    key_groups = tl.cdiv(n_tokens, GROUP_SIZE)
    value_groups: tl.constexpr = (HEAD_DIM + GROUP_SIZE - 1) // GROUP_SIZE
    start = split * chunk
    end = tl.minimum(start + chunk, n_tokens)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        tile_ok = t_ok[:, None] & d_ok[None, :]
        channel = hk * HEAD_DIM + d[None, :]
        k = dequant_tile(
            kc, ks, kz, channel * n_tokens + t[:, None], channel * key_groups + t[:, None] // GROUP_SIZE, tile_ok, BITS
        ).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        token = hk * n_tokens + t[:, None]
        v = dequant_tile(
            vc, vs, vz, token * HEAD_DIM + d[None, :], token * value_groups + d[None, :] // GROUP_SIZE, tile_ok, BITS
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    store_partial(part_out, part_lse, hk * total_splits + split, rows, d, row_ok, d_ok, m_i, l_i, acc, n_rows, HEAD_DIM)


def mixed_attention(
    q: torch.Tensor,
    keys: PackedTensor,
    values: PackedTensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    bias_full: torch.Tensor | None,
    scale: float,
    causal: bool = True,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton mixed-precision attention: -> (out [H, n, d] q.dtype, lse [H, n] float32).

    q [H, n, d]; keys/values packed [H_kv, T, d]; k_full/v_full [H_kv, S, d]
    (S may be 0), bias_full float32 [H_kv, L <= S] or None; see
    :func:`kvlab.kernels.reference.mixed_attention` for the maths.
    """
    n_heads, n, d = q.shape
    n_kv, n_tokens = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    q_splits = splits or choose_splits(n_tokens, n_kv, q.device)
    f_splits = choose_splits(k_full.shape[1], n_kv, q.device)
    part_out, part_lse = new_partials(n_kv, q_splits + f_splits, group * n, d, q.device)
    chunk = triton.cdiv(triton.cdiv(max(n_tokens, 1), q_splits), BLOCK_N) * BLOCK_N
    _quant_split_kernel[(n_kv, q_splits)](
        q,
        keys.codes,
        keys.scale,
        keys.zero,
        values.codes,
        values.scale,
        values.zero,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        n_tokens,
        n,
        chunk,
        q_splits + f_splits,
        scale,
        GROUP=group,
        HEAD_DIM=d,
        BITS=keys.bits,
        GROUP_SIZE=keys.group_size,
        DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=block_m(group * n),
        BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(d),
    )
    launch_splits(
        q[None],
        k_full[None],
        v_full[None],
        None if bias_full is None else bias_full[None],
        scale,
        causal,
        part_out,
        part_lse,
        q_splits,
        f_splits,
    )
    out, lse = merge_splits(part_out, part_lse, 1, n_heads, n, q.dtype)
    return out[0], lse[0]
