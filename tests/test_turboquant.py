"""vLLM's TurboQuant KV formats (``turboquant``, presets ``turboquant_k8v4`` ... ``turboquant_3bit_nc``).

The centroids are checked against a float64 Lloyd iteration written here twice: once with vLLM's
trapezoid rule (``solve_lloyd_max``: what the engine computes) and once with the Gaussian's exact
cell means (the textbook Lloyd-Max values); the rounding against a key and values worked by hand;
the bytes against vLLM's ``key_packed_size`` + ``value_packed_size`` written out by hand.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import with_template
from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.turboquant import (
    TQ_PRESETS,
    TurboQuantSegment,
    boundary_layers,
    decode_keys,
    decode_values,
    encode_keys,
    encode_values,
    hadamard,
    lloyd_max_centroids,
    pack_codes,
)
from kvlab.runtime.cache import DenseSegment
from kvlab.runtime.decode import extend, open_session

DOC = " ".join(f"w{(i * 13) % 58 + 2}" for i in range(90))
PRESETS = list(TQ_PRESETS)
#: Lloyd-Max quantisers of N(0, 1), the positive half (Max 1960; Lloyd 1982), to 4 decimals.
KNOWN = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3440, 2.1520],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326],
}


@pytest.fixture(scope="module")
def ctx(tiny):
    """The tiny model (float32, 2 layers, 2 KV heads, head dim 16) with a 2-token template, 90-token document."""
    ctx = prepare_context(with_template(tiny), DOC)
    assert ctx.prefix_len == 2 and ctx.lm.head_dim == 16 and ctx.lm.n_layers == 2
    return ctx


# --- centroids -----------------------------------------------------------------------------------


def trapezoid_lloyd_max(d: int, bits: int) -> list[float]:
    """vLLM's rule in plain float64 Python: start cells on [-3.5 s, 3.5 s], outer edges +-10.5 s,
    cell means by a 200-step trapezoid, stop (keeping the old centroids) when none moves by 1e-10."""
    n, s2 = 2**bits, 1.0 / d
    s = math.sqrt(s2)

    def pdf(x: float) -> float:
        return math.exp(-x * x / (2 * s2)) / math.sqrt(2 * math.pi * s2)

    def trapz(f, a, b, steps=200):
        h = (b - a) / steps
        return (0.5 * (f(a) + f(b)) + sum(f(a + i * h) for i in range(1, steps))) * h

    c = [-3.5 * s + 7 * s * (i + 0.5) / n for i in range(n)]
    for _ in range(200):
        edges = [-10.5 * s] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [10.5 * s]
        new = [trapz(lambda x: x * pdf(x), a, b) / trapz(pdf, a, b) for a, b in itertools.pairwise(edges)]
        if max(abs(p - q) for p, q in zip(new, c)) < 1e-10:
            break
        c = new
    return c


def exact_lloyd_max(bits: int) -> list[float]:
    """Lloyd's iteration for N(0, 1) with the exact cell means, (phi(a) - phi(b)) / (Phi(b) - Phi(a))."""

    def phi(x: float) -> float:
        return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0

    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    n = 2**bits
    c = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(5000):
        edges = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        c = [(phi(a) - phi(b)) / (cdf(b) - cdf(a)) for a, b in itertools.pairwise(edges)]
    return c


@pytest.mark.parametrize(("d", "bits"), [(16, 2), (64, 3), (64, 4), (128, 3), (128, 4)])
def test_centroids_follow_vllms_trapezoid_lloyd_max(d, bits):
    got = lloyd_max_centroids(d, bits)
    assert got.dtype == torch.float32 and got.shape == (2**bits,)
    # float32 storage: half an ulp, 6e-8 relative; the loops' order of summation is far below it.
    want = torch.tensor(trapezoid_lloyd_max(d, bits), dtype=torch.float64)
    assert torch.allclose(got.double(), want, rtol=1.2e-7, atol=0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_centroids_are_the_gaussians_lloyd_max_scaled_by_one_over_root_d(bits):
    known = torch.tensor([-x for x in reversed(KNOWN[bits])] + KNOWN[bits], dtype=torch.float64)
    # The exact iteration reproduces the textbook table (to its 4 decimals)...
    assert torch.allclose(torch.tensor(exact_lloyd_max(bits), dtype=torch.float64), known, atol=1e-4)
    # ... and vLLM's 200-step trapezoid (cells up to 8.75 sigma wide: h <= 0.044 sigma) moves the
    # outermost centroids by under 2e-3 sigma.
    d = 128
    got = lloyd_max_centroids(d, bits).double() * math.sqrt(d)
    assert torch.allclose(got, known, atol=2e-3)


def test_hadamard_is_sylvesters_orthonormal_matrix():
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float32) / 2
    assert torch.equal(hadamard(4, torch.device("cpu")), h4)
    h = hadamard(64, torch.device("cpu")).double()
    assert torch.allclose(h @ h, torch.eye(64, dtype=torch.float64), atol=1e-6)


# --- rounding worked by hand ---------------------------------------------------------------------

# d = 8, k = 3 e_1: the unit vector e_1 rotates to row 1 of H, (1, -1, 1, -1, ...) / sqrt(8), every
# coordinate +-1 sigma (sigma = 1/sqrt(8)). 3 bits: 1 sigma lies between 0.5005 and 1.05 sigma (the
# midpoints around 0.7560), so + -> code 5 (0.7560), - -> code 2 (-0.7560). 4 bits: between 0.7996
# and 1.0993 sigma (around 0.9424): + -> 11, - -> 4.
KEY = [0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("bits", "codes", "packed", "level"),
    [
        (3, [5, 2] * 4, [0x55, 0x55, 0x55], 0.7560),  # 5 | 2 << 3 = 21 = 0b010101 per pair: 0x555555
        (4, [11, 4] * 4, [0x4B] * 4, 0.9424),  # 11 | 4 << 4 = 0x4B
    ],
)
def test_a_key_rounded_by_hand(bits, codes, packed, level):
    got_codes, norms = encode_keys(torch.tensor([KEY]), bits)
    assert got_codes.tolist() == [codes]
    assert norms.dtype == torch.float16 and norms.tolist() == [3.0]
    assert pack_codes(got_codes, bits).tolist() == [packed]
    # Norm correction: the centroid vector +-level/sqrt(8) rescaled to unit length is row 1 of H again.
    back = decode_keys(got_codes, norms, bits, norm_correction=True)
    assert torch.allclose(back, torch.tensor([KEY]), atol=1e-6)
    # Without it the key comes back shortened by the centroid's level (the trapezoid's 2e-3 on it).
    back = decode_keys(got_codes, norms, bits, norm_correction=False)
    assert torch.allclose(back, torch.tensor([KEY]) * level, atol=3 * 2e-3)


def test_values_rounded_by_hand():
    v = torch.tensor([[-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5]])
    # 3 bits: scale (2.5 + 1) / 7 = 0.5, codes floor((v + 1) / 0.5 + 0.5) = 0..7, exact.
    codes, scale, zero = encode_values(v, 3)
    assert codes.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]] and scale.tolist() == [0.5] and zero.tolist() == [-1.0]
    assert pack_codes(codes, 3).tolist() == [[0x88, 0xC6, 0xFA]]  # octal 76543210 = 0xFAC688, low byte first
    assert torch.equal(decode_values(codes, scale, zero), v)
    # 4 bits: scale 3.5 / 15; (v + 1) / scale = 15 j / 7 for j = 0..7: 0, 2.14, 4.29, 6.43, 8.57, 10.71,
    # 12.86, 15, plus a half, floored.
    codes, scale, zero = encode_values(v, 4)
    assert codes.tolist() == [[0, 2, 4, 6, 9, 11, 13, 15]]
    assert pack_codes(codes, 4).tolist() == [[0x20, 0x64, 0xB9, 0xFD]]
    fp16_scale = float(torch.tensor(3.5 / 15).half())
    assert scale.tolist() == [fp16_scale]
    want = torch.tensor([[0, 2, 4, 6, 9, 11, 13, 15]]) * fp16_scale - 1.0
    assert torch.allclose(decode_values(codes, scale, zero), want, atol=1e-6)


def test_a_constant_value_row_stores_its_minimum():
    codes, scale, zero = encode_values(torch.full((1, 8), 0.75), 4)
    assert codes.tolist() == [[0] * 8] and zero.tolist() == [0.75]
    assert decode_values(codes, scale, zero).tolist() == [[0.75] * 8]


def test_fp8_keys_are_the_unscaled_e4m3_cast():
    k = torch.tensor([[0.3, -1.7, 500.0, -1e4, 0.0, 2.0, 3.3, -0.01]])
    seg = TurboQuantSegment.quantize(
        k.view(1, 1, 8), k.view(1, 1, 8), torch.tensor([1]), torch.tensor([[0]]), 8, 4, norm_correction=False
    )
    cast = [
        float(torch.tensor(x).to(torch.float8_e4m3fn).float()) if abs(x) <= 448 else math.copysign(448, x)
        for x in k[0].tolist()
    ]
    assert seg.view().keys[0, 0].tolist() == cast


# --- bytes ---------------------------------------------------------------------------------------

# vLLM's key_packed_size + value_packed_size at d = 128, by hand: FP8 keys 128; 4-bit codes 64 + a
# 2-byte norm; 3-bit codes 48 + 2; 4-bit values 64 + 4 (scale, zero); 3-bit values 48 + 4.
SLOTS_128 = {
    "turboquant_k8v4": 128 + 68,
    "turboquant_4bit_nc": 66 + 68,
    "turboquant_k3v4_nc": 50 + 68,
    "turboquant_3bit_nc": 50 + 52,
}


@pytest.mark.parametrize("preset", PRESETS)
def test_bytes_per_token_and_head_are_vllms_formula(preset):
    assert get_method("turboquant", preset=preset).token_bytes(128) == SLOTS_128[preset]


def test_the_docstring_ratios_of_bf16():
    bf16 = 2 * 2 * 128  # a key and a value of 128 bf16 elements
    ratio = {p: bf16 / b for p, b in SLOTS_128.items()}
    # config.py: "turboquant_k8v4 ... 2.6x", "turboquant_4bit_nc ... 3.8x": the same bytes.
    assert round(ratio["turboquant_k8v4"], 1) == 2.6 and round(ratio["turboquant_4bit_nc"], 1) == 3.8
    # "turboquant_3bit_nc ... 4.9x" is the earlier layout's, whose keys also kept a 2-byte residual norm
    # (512 / 104); the current one is 5.0x. "~3.5x" for k3v4_nc matches neither (4.3x now, 4.3x then).
    assert (
        round(ratio["turboquant_3bit_nc"], 1) == 5.0 and round(bf16 / (SLOTS_128["turboquant_3bit_nc"] + 2), 1) == 4.9
    )
    assert round(ratio["turboquant_k3v4_nc"], 1) == 4.3


def test_a_stored_cache_counts_codes_norms_and_scales(ctx):
    stored = get_method("turboquant", boundary_skip_layers=0).compress(Request(ctx, 2.0))
    n = ctx.lm.n_layers * ctx.lm.n_kv_heads * ctx.length  # every token stored (22 B vs 128 B in float32)
    # d = 16, 4 bits: 8 bytes of key codes, 2 of norm, 8 of value codes, 4 of scale and zero.
    assert stored.breakdown() == {
        "Lloyd-Max key codes": 8 * n,
        "key norms (fp16)": 2 * n,
        "uniform value codes": 8 * n,
        "value scales and zeros (fp16)": 4 * n,
    }
    assert stored.meta["memory_ratio"] == pytest.approx(128 / 22)


# --- layers, eviction, the method ----------------------------------------------------------------


def test_boundary_layers_are_vllms():
    assert boundary_layers(32, 2) == [0, 1, 30, 31]
    assert boundary_layers(4, 2) == [0, 1, 2, 3] and boundary_layers(3, 2) == [0, 2]
    assert boundary_layers(8, 0) == [] and boundary_layers(8, 10) == list(range(8))


def test_by_default_the_boundary_layers_stay_in_the_models_dtype(ctx):
    # Two layers: n = min(2, 2 // 2) = 1, so layers 0 and 1 are both boundary layers.
    stored = get_method("turboquant").compress(Request(ctx, 2.0))
    assert stored.meta["boundary_layers"] == [0, 1]
    for layer in range(ctx.lm.n_layers):
        (seg,) = stored.layers[layer]
        assert isinstance(seg, DenseSegment)
        view = seg.view()
        for head in range(ctx.lm.n_kv_heads):
            assert torch.equal(view.keys[head], ctx.full.keys[layer][head, view.token_index[head]])


@pytest.mark.parametrize("preset", PRESETS)
def test_the_method_stores_every_token_as_the_formula_rounds_it(ctx, preset):
    o = TQ_PRESETS[preset]
    stored = get_method("turboquant", preset=preset, boundary_skip_layers=0).compress(Request(ctx, 2.0))
    assert stored.meta["format"] == preset and stored.meta["evicted_tokens_per_head"] == 0
    d = ctx.lm.head_dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    h /= math.sqrt(d)
    for layer, (k, v) in enumerate(zip(ctx.full.keys, ctx.full.values)):
        (seg,) = stored.layers[layer]
        assert isinstance(seg, TurboQuantSegment)
        view = seg.view()
        flat = k.reshape(-1, d).double()
        if o["key_quant_bits"] == 8:
            assert torch.equal(view.keys.reshape(-1, d), flat.float().to(torch.float8_e4m3fn).float())
        else:
            # Float64 by the formula: rotate, round to the nearest centroid, renormalise, rotate back.
            c = torch.tensor(trapezoid_lloyd_max(d, o["key_quant_bits"]), dtype=torch.float64)
            y = flat / flat.norm(dim=1, keepdim=True) @ h
            q = c[(y.unsqueeze(-1) - c).abs().argmin(-1)]
            q = q / q.norm(dim=1, keepdim=True)
            want = flat.norm(dim=1, keepdim=True).half().double() * q @ h
            # fp16 norm and float32 arithmetic: 1e-5 of the key's norm, unless a coordinate sits
            # within float32 rounding of a midpoint (none does on this document).
            assert torch.allclose(view.keys.reshape(-1, d).double(), want, atol=1e-5 * float(flat.norm(dim=1).max()))
        vf = v.reshape(-1, d).double()
        low, top = vf.amin(1, keepdim=True), vf.amax(1, keepdim=True)
        step = (top - low) / (2 ** o["value_quant_bits"] - 1)
        want = torch.floor((vf - low) / step + 0.5) * step.half().double() + low.half().double()
        assert torch.allclose(view.values.reshape(-1, d).double(), want, atol=1e-5 * float(vf.abs().max()))


def test_past_the_formats_own_ratio_the_oldest_document_tokens_go(ctx):
    method, ratio = get_method("turboquant", preset="turboquant_3bit_nc", boundary_skip_layers=0), 12.0
    stored = method.compress(Request(ctx, ratio))
    assert stored.nbytes <= ctx.full.nbytes / ratio
    kept = ctx.length - stored.meta["evicted_tokens_per_head"]
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            assert sorted(stored.fates(layer, head)) == [0, 1] + list(range(ctx.length - kept + 2, ctx.length))
    # d = 16, 3 bits: 6 + 2 + 6 + 4 = 18 bytes a token and head; one more token in every head would not fit.
    assert stored.nbytes + ctx.lm.n_layers * ctx.lm.n_kv_heads * 18 > ctx.full.nbytes / ratio


def test_boundary_layers_count_at_full_precision_in_the_fit(ctx):
    # Both layers kept in float32 (128 bytes a token and head): ratio 2 keeps half the tokens.
    stored = get_method("turboquant").compress(Request(ctx, 2.0))
    kept = ctx.length - stored.meta["evicted_tokens_per_head"]
    assert kept == math.floor(ctx.full.nbytes / 2 / (2 * 2 * 128))
    assert stored.nbytes <= ctx.full.nbytes / 2


@pytest.mark.parametrize("preset", PRESETS)
def test_a_stored_format_decodes_to_finite_logits_close_to_the_full_cache(ctx, preset):
    stored = get_method("turboquant", preset=preset, boundary_skip_layers=0).compress(Request(ctx, 2.0))
    ids = torch.tensor([5, 9, 11])
    got = extend(ctx.lm, open_session(ctx.lm, stored), ids)
    want = extend(ctx.lm, open_session(ctx.lm, ctx.full.stored), ids)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_presets_are_vllms_cache_dtypes():
    m = get_method("turboquant", preset="turboquant_k3v4_nc")
    assert (m.options.key_quant_bits, m.options.value_quant_bits, m.options.norm_correction) == (3, 4, True)
    assert set(TQ_PRESETS) == {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"key_quant_bits": 5}, "^turboquant: key_quant_bits must be 3, 4 or 8, got 5$"),
        ({"value_quant_bits": 8}, "^turboquant: value_quant_bits must be a whole number from 3 to 4, got 8$"),
        ({"evict_with": "kivi"}, "^turboquant: evict_with must be oldest or a scoring method"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(MethodError, match=message):
        get_method("turboquant", **options)
