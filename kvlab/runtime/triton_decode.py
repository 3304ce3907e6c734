"""Kernel 1: decode attention over a compacted cache, split along the keys (flash-decoding).

A few new query tokens (``n``, 1 to about 8) attend over one KV head's cache:
the compacted keys, each with one additive float32 bias (Attention
Matching's beta; ``-inf`` marks padding of a ragged head), followed by the
uncompressed recent keys (bias 0), the last ``n`` of which are the queries'
own tokens (causal). All ``g * n`` queries that read a KV head (GQA group of
``g`` query heads) are one tile, so each key tile is loaded once per group.

The key axis is cut into ``splits`` chunks, one program each, so that a long
cache fills the GPU even at batch 1 with 8 KV heads; each program writes its
partial output and log-sum-exp, and :func:`merge_splits` combines them
exactly: ``out = sum_s exp(lse_s - lse) out_s`` with ``lse = logsumexp_s lse_s``.
The partial buffers are shared with kernel 2 (mixed precision), which writes
its own splits next to these ones before the same merge.

Layout conventions (any strides except a unit stride on the head dim):
q [B, H, n, d], k/v [B, H_kv, S, d], bias [B or 1, H_kv, L] float32 with
L <= S; partial out float32 [B*H_kv, splits, g*n, d], partial lse float32
[B*H_kv, splits, g*n].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Key tile width: 64 keys of head dim 128 in bf16 is 16 KiB per tile, which
# leaves room for double-buffered K and V in an SM's shared memory.
BLOCK_N = 64
# tl.dot needs at least 16 rows on tensor cores; a decode group is often smaller.
MIN_BLOCK_M = 16


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One tile of the streaming softmax: logits s [M, N] (-inf = unseen), values v [N, D].

    Returns the updated running max, mass and unnormalised output. A row that
    has seen only -inf keeps m = -inf, l = 0, acc = 0 (shifting by 0 instead of
    -inf avoids NaN from -inf - -inf).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_partial(part_out, part_lse, slot, rows, d, row_ok, d_ok, m_i, l_i, acc, ROWS, HEAD_DIM: tl.constexpr):
    """Write one program's normalised partial output and its lse (-inf for no visible key)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        part_out + (slot * ROWS + rows[:, None]) * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :]
    )
    tl.store(part_lse + slot * ROWS + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    part_out,
    part_lse,
    sq_b,
    sq_h,
    sq_n,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    sb_b,
    sb_h,
    n_kv_heads,
    seq_len,
    bias_len,
    n_queries,
    chunk,
    split_offset,
    total_splits,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # b * n_kv_heads + kv head
    split = tl.program_id(1)
    b = pid // n_kv_heads
    hk = pid % n_kv_heads
    rows = tl.arange(0, BLOCK_M)  # row r = query head hk*GROUP + r // n, token r % n
    n_rows = GROUP * n_queries
    row_ok = rows < n_rows
    tok = rows % n_queries
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * sq_b + (hk * GROUP + rows // n_queries)[:, None] * sq_h + tok[:, None] * sq_n + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    # Query token i is key seq_len - n + i: it sees every key up to itself.
    if CAUSAL:
        last_visible = seq_len - n_queries + tok
    else:
        last_visible = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        tile_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sk_s + d[None, :], mask=tile_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_BIAS:
            # float32 from memory to the logits: a bf16 beta would move the mass by up to 0.4%.
            s += tl.load(bias_ptr + b * sb_b + hk * sb_h + cols, mask=cols < bias_len, other=0.0)[None, :]
        s = tl.where(col_ok[None, :] & (cols[None, :] <= last_visible[:, None]), s, float("-inf"))
        v = tl.load(v_base + cols[:, None] * sv_s + d[None, :], mask=tile_ok, other=0.0)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)
    slot = pid * total_splits + split_offset + split
    store_partial(part_out, part_lse, slot, rows, d, row_ok, d_ok, m_i, l_i, acc, n_rows, HEAD_DIM)


@triton.jit
def _merge_kernel(
    part_out,
    part_lse,
    out_ptr,
    lse_ptr,
    so_b,
    so_h,
    so_n,
    n_kv_heads,
    n_queries,
    total_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // n_kv_heads
    hk = pid % n_kv_heads
    rows = tl.arange(0, BLOCK_M)
    n_rows = GROUP * n_queries
    row_ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, total_splits):
        lse = tl.load(part_lse + (pid * total_splits + s) * n_rows + rows, mask=row_ok, other=float("-inf"))
        top = tl.maximum(top, lse)
    shift = tl.where(top == float("-inf"), 0.0, top)
    mass = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, total_splits):
        slot = pid * total_splits + s
        w = tl.exp(tl.load(part_lse + slot * n_rows + rows, mask=row_ok, other=float("-inf")) - shift)
        part = tl.load(
            part_out + (slot * n_rows + rows[:, None]) * HEAD_DIM + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc += w[:, None] * part
        mass += w
    out = acc / tl.where(mass > 0, mass, 1.0)[:, None]
    head = hk * GROUP + rows // n_queries
    tok = rows % n_queries
    tl.store(
        out_ptr + b * so_b + head[:, None] * so_h + tok[:, None] * so_n + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    # lse laid out [B, H, n] contiguous, i.e. [B * H_kv, GROUP * n] by rows.
    tl.store(lse_ptr + pid * n_rows + rows, shift + tl.log(mass), mask=row_ok)


def block_m(rows: int) -> int:
    """Tile height for ``rows`` = g * n query rows of one KV head."""
    return max(MIN_BLOCK_M, triton.next_power_of_2(rows))


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be multiplied in TF32 (10-bit mantissa) on GPUs.
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_splits(seq_len: int, programs: int, device: torch.device) -> int:
    """How many key chunks: about two programs per SM, at most one chunk per key tile."""
    if seq_len <= 0:
        return 1
    tiles = triton.cdiv(seq_len, BLOCK_N)
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # the interpreter: enough chunks to exercise the merge, few to keep it fast
    return max(1, min(tiles, triton.cdiv(target, max(programs, 1))))


def new_partials(
    programs: int, splits: int, rows: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty partial buffers: out [programs, splits, rows, d], lse [programs, splits, rows] (float32)."""
    out = torch.empty(programs, splits, rows, head_dim, dtype=torch.float32, device=device)
    return out, torch.empty(programs, splits, rows, dtype=torch.float32, device=device)


def launch_splits(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    split_offset: int,
    splits: int,
) -> None:
    """Fill partial slots ``[split_offset, split_offset + splits)`` with attention over k/v.

    q [B, H, n, d], k/v [B, H_kv, S, d] (unit stride on d), bias float32
    [B or 1, H_kv, L] or None.
    """
    batch, n_heads, n, d = q.shape
    n_kv, seq_len = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    chunk = triton.cdiv(triton.cdiv(max(seq_len, 1), splits), BLOCK_N) * BLOCK_N
    has_bias = bias is not None
    bias_arg = bias if has_bias else part_lse  # never read when HAS_BIAS is False
    sb_b = (bias.stride(0) if bias.shape[0] > 1 else 0) if has_bias else 0
    _decode_split_kernel[(batch * n_kv, splits)](
        q,
        k,
        v,
        bias_arg,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        sb_b,
        bias.stride(1) if has_bias else 0,
        n_kv,
        seq_len,
        bias.shape[-1] if has_bias else 0,
        n,
        chunk,
        split_offset,
        part_lse.shape[1],
        scale,
        GROUP=group,
        HEAD_DIM=d,
        CAUSAL=causal,
        HAS_BIAS=has_bias,
        DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=block_m(group * n),
        BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(d),
    )


def merge_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, batch: int, n_heads: int, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of all partial slots -> (out [B, H, n, d] ``dtype``, lse [B, H, n] float32)."""
    programs, splits, rows, d = part_out.shape
    n_kv = programs // batch
    out = torch.empty(batch, n_heads, n, d, dtype=dtype, device=part_out.device)
    lse = torch.empty(batch, n_heads, n, dtype=torch.float32, device=part_out.device)
    _merge_kernel[(programs,)](
        part_out,
        part_lse,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n_kv,
        n,
        splits,
        GROUP=n_heads // n_kv,
        HEAD_DIM=d,
        BLOCK_M=block_m(rows),
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out, lse


def triton_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool = True,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton decode attention: -> (out [B, H, n, d] q.dtype, lse [B, H, n] float32).

    Inputs as in :func:`launch_splits`; ``splits`` overrides the chunk count.
    """
    batch, n_heads, n, d = q.shape
    programs = batch * k.shape[1]
    splits = splits or choose_splits(k.shape[2], programs, q.device)
    part_out, part_lse = new_partials(programs, splits, (n_heads // k.shape[1]) * n, d, q.device)
    launch_splits(q, k, v, bias, scale, causal, part_out, part_lse, 0, splits)
    return merge_splits(part_out, part_lse, batch, n_heads, n, q.dtype)
