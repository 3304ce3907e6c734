"""The Triton kernels under TRITON_INTERPRET=1 (set by conftest) against their torch references.

The references are themselves checked against independent computations: a
float64 brute-force softmax for decode attention, and the solvers'
unchunked :func:`score_keys` for the key scores. Shapes are small because
the interpreter runs every program in numpy; they still cover ragged heads
with -inf padding, a head with no compacted key at all, GQA ratios 1, 4 and
8, several key splits merged by log-sum-exp, head dims 64 and 80 (not a
power of two), key counts that are not a multiple of the tile, and 2- and
4-bit codes with partial quantisation groups.

Tolerances (the kernel and the reference see the same inputs and both
compute logits, softmax and sums in float32; they differ only in the order
of summation and in what the kernel rounds on the way):

* float32 outputs: ``atol = rtol = 2e-5``. Summation-order rounding over at
  most a few hundred keys is a few hundred float32 ulps of the largest term
  at worst (|v| <= ~4.5 for these draws: 4.5 * 300 * 6e-8 = 8e-5 as the
  worst-case bound, ~sqrt(300) times less in practice, observed <= 1e-6).
* float16 outputs: ``atol = 4e-3, rtol = 2e-3``. As in flash attention, the
  kernel rounds the softmax weights to float16 before the weights-times-
  values product (relative 2^-11 per weight, so up to 2^-11 * max|v| ~ 2.2e-3
  on the output), and both sides round the output to float16 (half an ulp,
  2^-11 relative).
* log-sum-exps (float32 on both sides whatever the input dtype): ``atol =
  rtol = 1e-5``; they are ~log(S) + max logit ~ 10, and float32 carries 7 digits.
* key scores (float32, weights in [0, 1]): ``atol = 2e-6, rtol = 1e-5``: a
  weight is exp(s - lse), and an error of a few ulps of s (|s| <= ~10, ulp
  ~1e-6) moves it by that much relatively.

bfloat16, the dtype models run in on CUDA, is tested on the torch references
(decode, mixed precision, key scores) against float64 brute force, with the
one rounding of the output to bfloat16 (half an ulp, 2^-8 relative) as the
tolerance. The kernels themselves cannot run it here: Triton's interpreter
(3.9) holds bfloat16 as its uint16 bit pattern and its ``tl.dot`` multiplies
those integers (only 8-bit floats are converted first), so a bfloat16 kernel
returns garbage under ``TRITON_INTERPRET=1``. ``python -m benchmarks.gpu_check``
measures the kernels' bfloat16 errors on a real GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.compression.solvers.scores import score_keys
from kvlab.kernels import dispatch as kernels
from kvlab.kernels import reference
from kvlab.runtime import kernel_launch as launch
from kvlab.runtime import triton_decode
from kvlab.runtime.attention import causal_attention
from kvlab.runtime.quant_segment import QuantSegment

# An empty key split has mass 0, and its log-sum-exp log(0) = -inf is the
# intended value; numpy (the interpreter) warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=2e-3)}
LSE_TOL = dict(atol=1e-5, rtol=1e-5)
SCORE_TOL = dict(atol=2e-6, rtol=1e-5)


@pytest.fixture
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_KERNELS", "triton")


def ragged_bias(n_kv: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [H_kv, L]: random betas, head h keeps a different prefix, head 0 keeps nothing."""
    bias = torch.randn(n_kv, length, generator=gen) * 2
    for h in range(n_kv):
        bias[h, (length * h) // n_kv :] = float("-inf")
    return bias


def brute_force_decode(q, k, v, bias, scale):
    """float64 softmax over expanded heads with an explicit causal mask: out [B, H, n, d], lse [B, H, n]."""
    batch, n_heads, n, _ = q.shape
    seq_len = k.shape[2]
    group = n_heads // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("bhnd,bhsd->bhns", q.double(), kk) * scale
    full = torch.zeros(k.shape[1], seq_len, dtype=torch.float64)
    full[:, : bias.shape[1]] = bias.double()
    logits = logits + full.repeat_interleave(group, dim=0)[None, :, None, :]
    for i in range(n):
        logits[:, :, i, seq_len - n + i + 1 :] = -math.inf
    lse = torch.logsumexp(logits, dim=-1)
    return torch.einsum("bhns,bhsd->bhnd", torch.softmax(logits, dim=-1), vv), lse


# The references against float64 brute force, in each dtype a model runs in (bfloat16 is the CUDA
# dtype): the inputs as given, float32 maths, the output rounded once to the input's dtype.
REF_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=2**-10),  # twice the rounding's half an ulp (2^-11 relative)
    torch.bfloat16: dict(atol=1e-5, rtol=2**-7),  # twice the rounding's half an ulp (2^-8 relative)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_reference_matches_brute_force(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 3, 16, generator=gen).to(dtype)
    k, v = torch.randn(2, 2, 2, 40, 16, generator=gen).to(dtype)
    bias = ragged_bias(2, 30, gen)
    bias[0, :5] = 0.5  # head 0 keeps a few keys, so every query head sees some compacted key
    out, lse = reference.eager_decode_attention(q, k, v, bias[None], 0.25)
    want_out, want_lse = brute_force_decode(q, k, v, bias, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, **REF_TOL[dtype])
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_reference_matches_brute_force(dtype) -> None:
    """Dequantised codes (rounded to the queries' dtype, as the model's view does), then the
    full-precision tokens with their betas: float64 brute force over the same keys and values."""
    gen = torch.Generator().manual_seed(2)
    n_kv, n_quant, head_dim = 2, 40, 16
    keys = torch.randn(n_kv, n_quant, head_dim, generator=gen) * 2 + 1
    values = torch.randn(n_kv, n_quant, head_dim, generator=gen)
    seg = QuantSegment.quantize(
        keys, values, torch.full((n_kv,), n_quant), torch.arange(n_quant).expand(n_kv, -1), 4, group_size=16
    )
    (block,) = seg.blocks
    q = torch.randn(8, 2, head_dim, generator=gen).to(dtype)
    k_full, v_full = torch.randn(2, n_kv, 9, head_dim, generator=gen).to(dtype)
    bias = ragged_bias(n_kv, 6, gen)
    bias[0, :3] = -0.5
    out, lse = reference.mixed_attention(q, block.keys, block.values, k_full, v_full, bias, 0.25)
    k = torch.cat([block.keys.dequantize(dtype), k_full], dim=1)
    v = torch.cat([block.values.dequantize(dtype), v_full], dim=1)
    want_out, want_lse = brute_force_decode(
        q[None], k[None], v[None], torch.cat([torch.zeros(n_kv, n_quant), bias], 1), 0.25
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want_out[0], **REF_TOL[dtype])
    torch.testing.assert_close(lse.double(), want_lse[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "n", "seq_len", "head_dim"),
    [(2, 2, 1, 150, 64), (8, 2, 3, 97, 80), (8, 1, 2, 130, 64)],
    ids=["gqa1", "gqa4", "gqa8"],
)
def test_decode_kernel(force_triton, dtype, n_heads, n_kv, n, seq_len, head_dim) -> None:
    gen = torch.Generator().manual_seed(n_heads * 7 + n_kv)
    q = torch.randn(2, n_heads, n, head_dim, generator=gen).to(dtype)
    k, v = torch.randn(2, 2, n_kv, seq_len, head_dim, generator=gen).to(dtype)
    bias = ragged_bias(n_kv, seq_len - 20, gen)  # the last 20 keys are the recent window (bias 0)
    got = kernels.decode_attention(q, k, v, bias)
    out, lse = reference.eager_decode_attention(q, k, v, bias[None], head_dim**-0.5)
    assert got.output.dtype == dtype
    torch.testing.assert_close(got.output, out, **TOL[dtype])
    torch.testing.assert_close(got.lse, lse, **LSE_TOL)


def test_decode_kernel_split_counts_agree(force_triton) -> None:
    """1, 3 and 5 key chunks (some of them empty) merge to the same result."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    k, v = torch.randn(2, 1, 2, 200, 64, generator=gen)
    bias = ragged_bias(2, 180, gen)
    out, lse = reference.eager_decode_attention(q, k, v, bias[None], 0.125)
    for splits in (1, 3, 5):
        got_out, got_lse = triton_decode.triton_decode_attention(q, k, v, bias[None].contiguous(), 0.125, splits=splits)
        torch.testing.assert_close(got_out, out, **TOL[torch.float32])
        torch.testing.assert_close(got_lse, lse, **LSE_TOL)


def test_decode_kernel_without_bias_or_causality(force_triton) -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 2, 64, generator=gen)
    k, v = torch.randn(2, 1, 2, 70, 64, generator=gen)
    got = kernels.decode_attention(q, k, v, None, causal=False)
    out, lse = reference.eager_decode_attention(q, k, v, None, 0.125, causal=False)
    torch.testing.assert_close(got.output, out, **TOL[torch.float32])
    torch.testing.assert_close(got.lse, lse, **LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("bits", "head_dim", "n_quant"), [(2, 64, 75), (4, 80, 100)])
def test_mixed_kernel(force_triton, dtype, bits, head_dim, n_quant) -> None:
    """Packed codes straight from the project's QuantSegment, then full-precision tokens with betas."""
    gen = torch.Generator().manual_seed(bits)
    n_kv, n_heads, n = 2, 8, 2
    keys = torch.randn(n_kv, n_quant, head_dim, generator=gen) * 2 + 1  # off-centre: non-zero zero points
    values = torch.randn(n_kv, n_quant, head_dim, generator=gen)
    lengths = torch.full((n_kv,), n_quant)
    seg = QuantSegment.quantize(keys, values, lengths, torch.arange(n_quant).expand(n_kv, -1), bits, group_size=32)
    (block,) = seg.blocks
    q = torch.randn(n_heads, n, head_dim, generator=gen).to(dtype)
    k_full, v_full = torch.randn(2, n_kv, 21, head_dim, generator=gen).to(dtype)
    bias = ragged_bias(n_kv, 12, gen)
    got = kernels.mixed_attention(q, block.keys, block.values, k_full, v_full, bias)
    out, lse = reference.mixed_attention(q, block.keys, block.values, k_full, v_full, bias, head_dim**-0.5)
    torch.testing.assert_close(got.output, out, **TOL[dtype])
    torch.testing.assert_close(got.lse, lse, **LSE_TOL)


def test_mixed_kernel_codes_only(force_triton) -> None:
    """No full-precision token at all (an empty recent window): the quantised part alone."""
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 1, 40, 64, generator=gen)
    seg = QuantSegment.quantize(keys, values, torch.tensor([40]), torch.arange(40)[None], 4, group_size=16)
    q = torch.randn(4, 1, 64, generator=gen)
    empty = torch.zeros(1, 0, 64)
    got = kernels.mixed_attention(q, seg.blocks[0].keys, seg.blocks[0].values, empty, empty, causal=False)
    out, lse = reference.mixed_attention(q, seg.blocks[0].keys, seg.blocks[0].values, empty, empty, None, 0.125, False)
    torch.testing.assert_close(got.output, out, **TOL[torch.float32])
    torch.testing.assert_close(got.lse, lse, **LSE_TOL)


def scoring_inputs(dtype: torch.dtype, gen: torch.Generator):
    """3 heads, 40 queries, 130 keys, head dim 80; head 1 has padding, head 2 is all padding."""
    q = torch.randn(3, 40, 80, generator=gen).to(dtype)
    k = torch.randn(3, 130, 80, generator=gen).to(dtype)
    bias = torch.randn(3, 130, generator=gen)
    bias[1, 100:] = float("-inf")
    bias[2] = float("-inf")
    return q, k, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_chunked_reference_scores_match_solvers(scoring, dtype) -> None:
    q, k, bias = scoring_inputs(dtype, torch.Generator().manual_seed(6))
    got = reference.key_scores(q, k, bias, 80**-0.5, scoring, chunk=50)
    torch.testing.assert_close(got, score_keys(q, k, bias, scoring=scoring), **SCORE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scoring", ["rms", "mean", "max"])
def test_key_scores_kernel(force_triton, dtype, scoring) -> None:
    q, k, bias = scoring_inputs(dtype, torch.Generator().manual_seed(7))
    got = kernels.key_scores(q, k, bias, scoring=scoring)
    torch.testing.assert_close(got, score_keys(q, k, bias, scoring=scoring), **SCORE_TOL)
    assert torch.isneginf(got[2]).all() and torch.isneginf(got[1, 100:]).all()


def test_key_scores_kernel_without_bias(force_triton) -> None:
    q, k, _ = scoring_inputs(torch.float32, torch.Generator().manual_seed(8))
    torch.testing.assert_close(kernels.key_scores(q, k), score_keys(q, k), **SCORE_TOL)


# --- dispatch -------------------------------------------------------------


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1)
    monkeypatch.delenv("KVLAB_KERNELS", raising=False)
    assert kernels.backend(x) == "torch"  # CPU tensors: the references
    monkeypatch.setenv("KVLAB_KERNELS", "triton")
    assert kernels.backend(x) == "triton"
    monkeypatch.setenv("KVLAB_KERNELS", "fast")
    with pytest.raises(ValueError, match="KVLAB_KERNELS must be one of"):
        kernels.backend(x)
    monkeypatch.setenv("KVLAB_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.backend(x)


def test_bad_shapes_get_one_line_errors() -> None:
    with pytest.raises(ValueError, match="cannot be grouped"):
        kernels.decode_attention(torch.zeros(1, 6, 1, 8), torch.zeros(1, 4, 5, 8), torch.zeros(1, 4, 5, 8))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.decode_attention(
            torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), torch.zeros(2, 6)
        )


def biased_decode_inputs():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, 30, 16, generator=gen)
    return q, k, v, ragged_bias(2, 25, gen)


def test_decode_path_uses_the_kernel_when_dispatch_says_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single query over a biased cache goes through the kernel exactly when the dispatch picks Triton.

    The CUDA decision is faked by patching :func:`kvlab.runtime.kernel_launch.backend`; the
    kernel then runs in the interpreter and must agree with the SDPA path.
    """
    calls = []
    real = triton_decode.triton_decode_attention
    monkeypatch.setattr(triton_decode, "triton_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, bias = biased_decode_inputs()
    monkeypatch.delenv("KVLAB_KERNELS", raising=False)
    on_cpu = causal_attention(q, k, v, bias, 0.25)
    assert calls == []  # CPU tensors: SDPA with a float mask, as before
    monkeypatch.setattr(launch, "backend", lambda x: "triton")
    on_fake_cuda = causal_attention(q, k, v, bias, 0.25)
    assert calls == [1]
    torch.testing.assert_close(on_fake_cuda, on_cpu, **TOL[torch.float32])
