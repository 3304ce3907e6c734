"""The one place where attention is computed.

Everything in kvlab that needs softmax attention (the model's forward pass,
the compression methods, the metrics) calls these functions, so that the
runtime, the solvers and the error figures can never disagree on the maths.

Shapes use: ``B`` batch of heads, ``n`` queries, ``T`` keys, ``d`` head dim.
A ``bias`` is additive on the logits, one value per key; ``-inf`` marks an
absent (padding) key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvlab.runtime import kernel_launch as launch

#: SDPA's backends on CUDA, cuDNN's left out: it builds an execution plan for each new key length, and each
#: decode step is a new length. On an H200 (torch 2.11) a Llama-3.1-8B-shaped step over 32k keys took about
#: 100 ms with cuDNN's plans still to build and 35 ms without cuDNN (docs/gpu.md, "On an H200").
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)``; on CUDA among CUDA_SDPA_BACKENDS only."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


#: Batch elements up to which a CPU product runs as a loop of 2-D products (:func:`matmul`); a larger
#: batch of small matrices (a decode step's heads, OMP's rows) is one batched call, the loop's overhead
#: then outweighing what it saves.
LOOP_BATCH = 64


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` [..., m, c] of ``a`` [..., m, k] and ``b`` [..., k, c] (``out``: where to write it).

    On a CPU, where ``a`` and ``b`` have the same leading dims (at most :data:`LOOP_BATCH` matrices),
    one 2-D product per matrix into one output: MKL's batched product ran 1.1-2.4x slower than that
    loop at every size the solvers multiply on the AMD EPYC CPU (2026-12-05), and Attention Matching's
    compression of the story at 10x got about 20 % faster for both allocations (timed as
    ``python -m benchmarks.head_budgets`` times it, which prints both). Elsewhere, and for broadcast
    or mixed operands, ``torch.matmul`` itself.
    """
    lead, count = a.shape[:-2], math.prod(a.shape[:-2])
    if (
        a.device.type != "cpu"
        or a.dim() < 3
        or b.shape[:-2] != lead
        or a.dtype != b.dtype
        or count > LOOP_BATCH
        or (out is not None and not out.is_contiguous())
    ):
        return torch.matmul(a, b, out=out)
    (m, k), c = a.shape[-2:], b.shape[-1]
    result = a.new_empty(*lead, m, c) if out is None else out
    rows = result.view(count, m, c)  # the count, not -1: an empty operand has no size to infer
    for i, (x, y) in enumerate(zip(a.reshape(count, m, k), b.reshape(count, k, c))):
        torch.mm(x, y, out=rows[i])
    return result


def attention_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product logits in float32.

    q: [..., n, d], k: [..., T, d], bias: [..., T] or None -> [..., n, T] (float32).
    float32 even for bf16 inputs: the mass targets of Attention Matching are
    sums of exponentials and lose their meaning in 8-bit mantissas. ``out``:
    a contiguous float32 [..., n, T] to write them into (a block loop reuses
    one buffer instead of allocating a large matrix per block).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # The queries scaled, not the logits: n x d multiplications instead of n x T, and one pass
    # fewer over the largest tensor here (exact for d = 64: the scale is a power of two).
    logits = matmul(q.float() * scale, k.float().transpose(-1, -2), out=out)
    if bias is not None:
        # In place: the matmul's result is this function's own (or the caller's ``out``).
        logits = logits.add_(bias.float().unsqueeze(-2))
    return logits


def softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in place: [..., T] float32 -> the same tensor, now weights.

    The same maximum-shifted maths as ``torch.softmax`` without a second
    matrix of the logits' size (a row whose keys are all -inf gives NaN, as there).
    """
    logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(dim=-1, keepdim=True))


@dataclass
class BlockAttention:
    """Attention of queries over one block of keys.

    output: [..., n, dv] softmax-weighted values; lse: [..., n] log of the
    block's attention mass ``log sum_j exp(logit_ij)``.
    """

    output: torch.Tensor
    lse: torch.Tensor


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None
) -> BlockAttention:
    """Attention output and log-mass of queries over a block (no causal mask).

    q: [..., n, d], k: [..., T, d], v: [..., T, dv], bias: [..., T] or None.
    """
    logits = attention_logits(q, k, bias, scale)
    lse = torch.logsumexp(logits, dim=-1)
    # A head that keeps no key of the block has lse = -inf: zero output and
    # zero mass, not NaN.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(logits - shift.unsqueeze(-1))
    return BlockAttention(output=matmul(weights, v.float()), lse=lse)


def future_mask(q_len: int, kv_len: int, device: torch.device | None = None, window: int | None = None) -> torch.Tensor:
    """[q_len, kv_len] True where query i may not see key j.

    The queries are the last ``q_len`` tokens of the ``kv_len`` keys
    (bottom-right alignment), so this holds whatever the physical length of the
    cached part before them. ``window`` (a sliding-window layer's, as
    transformers counts it): query i also may not see keys ``window`` or more
    tokens before it; such a layer's keys are consecutive tokens, so physical
    distance is token distance.
    """
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    now = kv_len - q_len + rows
    hidden = cols > now
    if window is not None:
        hidden |= cols <= now - window
    return hidden


def attention_weights(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """Softmax attention weights [..., n, T] (float32).

    q: [..., n, d], k: [..., T, d]; causal=True when the queries are the last
    n of the T keys' tokens.
    """
    logits = attention_logits(q, k, bias, scale)
    if causal:
        logits = logits.masked_fill(future_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.softmax(logits, dim=-1)


def expand_kv_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[H_kv, ...] -> [n_heads, ...]: each KV head repeated for its query-head group."""
    return x.repeat_interleave(n_heads // x.shape[0], dim=0)


def group_queries(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[H, n, d] queries -> [H_kv, g*n, d]: all queries that read each KV head (GQA)."""
    n_heads, n, d = q.shape
    return q.reshape(n_kv_heads, (n_heads // n_kv_heads) * n, d)


def causal_bias_mask(
    q_len: int,
    kv_len: int,
    key_bias: torch.Tensor,
    n_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask for queries that are the last ``q_len`` tokens of the keys.

    key_bias: [H_kv, L] for the first L keys (the stored cache; later keys get
    0); window as in :func:`future_mask`. Returns [1, n_heads, q_len, kv_len].
    """
    mask = torch.zeros(n_heads, q_len, kv_len, dtype=dtype, device=device)
    mask[:, :, : key_bias.shape[1]] += expand_kv_heads(key_bias.to(dtype), n_heads).unsqueeze(1)
    if q_len > 1 or window is not None:
        mask.masked_fill_(future_mask(q_len, kv_len, device, window).unsqueeze(0), float("-inf"))
    return mask.unsqueeze(0)


#: Queries per block when several are read after a cache with biases (:func:`causal_attention`).
BIAS_BLOCK = 1024


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for the model's forward pass (fast path through SDPA).

    q: [1, H, n, d], k/v: [1, H_kv, kv_len, d], key_bias: [H_kv, L] or None
    -> [1, H, n, d]. Same maths as :func:`attend` plus the causal mask;
    tests check the two agree. window: a sliding-window layer's (see
    :func:`future_mask`), None for a layer that sees every key. sinks: [H]
    learned attention-sink logits (GPT-OSS), or None: see :func:`_with_sinks`.
    """
    n_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    if window is not None and kv_len > window:
        return _sliding_window(q, k, v, key_bias, scale, window, sinks)
    if sinks is not None:
        return _with_sinks(q, k, v, key_bias, scale, sinks, window)
    gqa = n_heads != k.shape[1]
    if key_bias is None and q_len == kv_len:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q_len == 1 and (key_bias is not None or q.device.type == "cpu"):
        return _decode_step(q, k, v, key_bias, scale)
    if key_bias is None and q_len == 1:
        return sdpa(q, k, v, scale=scale, enable_gqa=gqa)
    if key_bias is None and _CPU_FLASH is not None and q.device.type == "cpu":
        return _past_then_causal(q, k, v, scale)
    if key_bias is None:
        # One boolean mask shared by all heads: a float one per head would be
        # [H, q, kv] (300 MB for a repeat-prefill of 2,000 tokens), rebuilt per layer.
        mask = ~future_mask(q_len, kv_len, q.device)[None, None]
        return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if _CPU_FLASH is not None and q.device.type == "cpu" and q_len > BIAS_BLOCK:
        # A long text read after a fitted cache on a CPU (Attention Matching's on-policy sweep): the
        # fitted keys with their biases as a plain product, the text's own keys through the causal
        # kernel; a float mask over every pair cost the sweep more than the attention itself.
        return _past_then_causal(q, k, v, scale, key_bias)
    if q_len > BIAS_BLOCK:
        # A long text read after a fitted cache (Attention Matching's on-policy sweep reads a whole
        # repeat of the document): the queries in blocks, each over the keys it may see, so the float
        # mask is [H, block, kv] at a time, never [H, q, kv].
        parts = []
        for start in range(0, q_len, BIAS_BLOCK):
            end = min(start + BIAS_BLOCK, q_len)
            seen = kv_len - q_len + end  # the cache and the text up to the block's last query
            parts.append(causal_attention(q[:, :, start:end], k[:, :, :seen], v[:, :, :seen], key_bias, scale))
        return torch.cat(parts, dim=2)
    # SDPA takes a float mask only in the queries' dtype, and in bf16 a fitted
    # bias keeps 8 bits: this call (several tokens read after a fitted cache,
    # e.g. the question) runs in float32 so the biases stay exact.
    mask = causal_bias_mask(q_len, kv_len, key_bias, n_heads, torch.float32, q.device)
    out = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.to(q.dtype)


def _sliding_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`causal_attention` of a window layer whose keys reach past the first query's window.

    Shapes as there. The keys no query sees are cut off first (a decode step
    then reads exactly the last ``window`` keys, unmasked); what remains is
    masked by the band of each query's window.
    """
    n_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    start = max(0, kv_len - q_len - window + 1)
    k, v = k[:, :, start:], v[:, :, start:]
    if key_bias is not None:
        key_bias = key_bias[..., start:] if key_bias.shape[-1] > start else None
    if sinks is not None:
        return _with_sinks(q, k, v, key_bias, scale, sinks, window)
    if q_len == 1:
        return causal_attention(q, k, v, key_bias, scale)
    gqa, kv_len = n_heads != k.shape[1], kv_len - start
    if key_bias is None:
        mask = ~future_mask(q_len, kv_len, q.device, window)[None, None]
        return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    mask = causal_bias_mask(q_len, kv_len, key_bias, n_heads, torch.float32, q.device, window)
    out = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.to(q.dtype)


def _with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`causal_attention` with a learned sink per query head: a logit that joins every query's
    softmax as one more key with no value (GPT-OSS), taking its share of the mass.

    Shapes as there, sinks [H]. The sink is a key of zeros (its logit is then
    only its bias, the head's sink logit) whose value is zeros, read in float32
    through the per-head float mask.
    """
    n_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    bias = key_bias if key_bias is not None else k.new_zeros(k.shape[1], 0)
    mask = causal_bias_mask(q_len, kv_len, bias, n_heads, torch.float32, q.device, window)
    sink = sinks.float().view(1, n_heads, 1, 1).expand(1, n_heads, q_len, 1)
    none = k.new_zeros(1, k.shape[1], 1, k.shape[-1])
    k, v = torch.cat([k, none], dim=2).float(), torch.cat([v, none], dim=2).float()
    out = sdpa(
        q.float(), k, v, attn_mask=torch.cat([mask, sink], dim=-1), scale=scale, enable_gqa=n_heads != k.shape[1]
    )
    return out.to(q.dtype)


def _decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query per head over the whole cache (nothing to mask causally): q [B, H, 1, d] -> [B, H, 1, d].

    On CUDA a biased cache goes to the split-K kernel (biases kept in float32).
    Elsewhere two grouped matmuls: each KV head's keys are read once for its
    query group, and the bias is added to the logits directly, in float32,
    rather than through a [H, 1, kv] float mask built per layer (a fitted
    bias keeps 8 bits in a bf16 mask).
    """
    if key_bias is not None and launch.backend(q) == "triton":
        return launch.launch_decode_attention(q, k, v, key_bias, scale).output
    batch, n_heads, n_kv, d = q.shape[0], q.shape[1], k.shape[1], q.shape[-1]
    grouped = q.reshape(batch, n_kv, n_heads // n_kv, d).float()
    logits = torch.matmul(grouped * scale, k.float().transpose(-1, -2))  # [B, H_kv, group, kv]
    if key_bias is not None:  # [H_kv, L] or [B, H_kv, L]
        logits[..., : key_bias.shape[-1]] += key_bias.float().unsqueeze(-2)
    out = torch.matmul(torch.softmax(logits, dim=-1), v.float())
    return out.reshape(batch, n_heads, 1, d).to(q.dtype)


# PyTorch's CPU flash kernel, which also returns the log-sum-exp; None if this
# build lacks it (then the masked kernel is used).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _past_then_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of n new queries over kv_len > n keys: [1, H, n, d].

    The earlier keys are seen by every query (no mask) and the queries' own
    block is square-causal: two fast kernels whose outputs are merged by their
    log-sum-exps, instead of a masked kernel that scores every masked-out pair
    too (about 1.5x slower for a 2,000-token repeat-prefill on CPU). One KV
    head's query group at a time: the kernel takes no GQA, and keys copied for
    every query head at once would be group-size times the layer's cache.
    key_bias: [H_kv, L] for the first L earlier keys (a fitted cache's; the
    others 0), or None: with biases the earlier keys are read by
    :func:`_biased_past`, exactly, in float32.
    """
    n_kv, q_len, kv_len = k.shape[1], q.shape[2], k.shape[2]
    group, past = q.shape[1] // n_kv, kv_len - q_len
    out = torch.empty_like(q)
    for h in range(n_kv):
        heads = slice(h * group, (h + 1) * group)
        kh, vh = k[:, h : h + 1].expand(-1, group, -1, -1), v[:, h : h + 1].expand(-1, group, -1, -1)
        if key_bias is None:
            out_past, lse_past = _CPU_FLASH(q[:, heads], kh[:, :, :past], vh[:, :, :past], 0.0, False, scale=scale)[:2]
        else:
            out_past, lse_past = _biased_past(q[:, heads], k[0, h, :past], v[0, h, :past], key_bias[h], scale)
        out_new, lse_new = _CPU_FLASH(q[:, heads], kh[:, :, past:], vh[:, :, past:], 0.0, True, scale=scale)[:2]
        top = torch.maximum(lse_past, lse_new)
        w_past = torch.exp(lse_past - top).unsqueeze(-1)
        w_new = torch.exp(lse_new - top).unsqueeze(-1)
        out[:, heads] = ((w_past * out_past.float() + w_new * out_new.float()) / (w_past + w_new)).to(q.dtype)
    return out


def _biased_past(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries [1, g, n, d] over earlier keys and values [past, d] that every query sees, the
    first L keys with ``bias`` [L] (the others 0): (outputs [1, g, n, d], log-sum-exps [1, g, n]), in float32
    and in blocks of :data:`BIAS_BLOCK` queries (the logits [g, block, past] at a time)."""
    past = k.shape[0]
    full_bias = torch.zeros(past, dtype=torch.float32, device=k.device)
    full_bias[: bias.shape[0]] = bias.float()
    keys, values = k.float().T, v.float()
    outs, lses = [], []
    for start in range(0, q.shape[2], BIAS_BLOCK):
        logits = torch.matmul(q[:, :, start : start + BIAS_BLOCK].float(), keys) * scale + full_bias
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), values))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def output_projection(model: torch.nn.Module, layer: int) -> torch.Tensor:
    """The weight [hidden, H * d] of ``layer``'s attention output projection (o_proj), where the model keeps it."""
    return model.get_decoder().layers[layer].self_attn.o_proj.weight
