"""The serving engines' KV formats (fp8_e4m3, fp8_e5m2, nvfp4, fp4_e2m1): their rounding, scales, bytes and ratio.

The FP8 codes are checked against torch's own float8 casts, done here element by element with the
saturation written out (vLLM's conversion saturates; torch's e5m2 cast does not). The NVFP4 and
SGLang's KVFP4 codes are checked against blocks of 16 numbers worked by hand.
"""

from __future__ import annotations

import pytest
import torch

from conftest import with_template
from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.families.engine_format import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from kvlab.runtime.decode import extend, open_session
from kvlab.runtime.engine_formats import (
    FP4Segment,
    FP8Segment,
    e2m1_decode,
    e2m1_encode,
    fp8_decode,
    fp8_encode,
    kvfp4_decode,
    kvfp4_encode,
    nvfp4_decode,
    nvfp4_encode,
)

DOC = " ".join(f"w{(i * 13) % 58 + 2}" for i in range(90))
QUESTION = "w3 w5 w8"
FP8 = [("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)]
FORMATS = ["fp8_e4m3", "fp8_e5m2", "nvfp4", "fp4_e2m1"]


@pytest.fixture(scope="module")
def ctx(tiny):
    """The tiny model (float32, head dim 16) with a 2-token chat template, on a 90-token document."""
    ctx = prepare_context(with_template(tiny), DOC)
    assert ctx.prefix_len == 2 and ctx.lm.head_dim == 16
    return ctx


def saturated_cast(y: torch.Tensor, dtype: torch.dtype, top: float) -> torch.Tensor:
    """torch's cast of each in-range element; ±top for the others (what a saturating conversion stores)."""
    cast = torch.stack([t.to(dtype).float() for t in y.unbind()])
    return torch.where(y.abs() > top, torch.sign(y) * top, cast)


# --- FP8 rounding --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype", "top"), FP8)
def test_fp8_codes_are_torchs_cast_with_saturation(name, dtype, top):
    torch.manual_seed(1)
    scale = torch.tensor(0.37)
    x = torch.cat(
        [
            torch.randn(500) * top * scale / 8,  # in range: the cast alone
            torch.tensor([1.01, -1.5, 4.0, -1e3]) * top * scale,  # past the largest value: saturated
            torch.tensor([top * scale, 0.0, -0.0]),
        ]
    )
    y = x / scale
    assert (y.abs() > top).sum() >= 4
    got = fp8_encode(x, scale, dtype)
    assert got.dtype == dtype
    assert torch.equal(got.float(), saturated_cast(y, dtype, top))
    assert torch.isfinite(got.float()).all()


def test_torchs_own_e5m2_cast_does_not_saturate():
    """Why fp8_encode clamps first: torch rounds a value past e5m2's largest to inf."""
    assert torch.tensor(1e6).to(torch.float8_e5m2).float().isinf()
    assert fp8_encode(torch.tensor(1e6), torch.tensor(1.0), torch.float8_e5m2).float() == 57344.0


@pytest.mark.parametrize(("name", "dtype", "top"), FP8)
def test_fp8_values_of_the_format_survive_the_round_trip(name, dtype, top):
    scale = torch.tensor(0.25)  # a power of two: scaling is exact
    every_byte = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = every_byte[torch.isfinite(every_byte)]
    back = fp8_decode(fp8_encode(grid * scale, scale, dtype), scale, torch.float32)
    assert torch.equal(back, grid * scale)


@pytest.mark.parametrize(("name", "dtype", "top"), FP8)
@pytest.mark.parametrize("scale", ["fixed", "calculated", "checkpoint"])
def test_fp8_method_stores_every_token_as_the_cast_of_its_scaled_value(ctx, name, dtype, top, scale):
    # Ratio 2 on a float32 model: fp8 is 4x, so every token is stored, none evicted.
    stored = get_method(name, scale=scale).compress(Request(ctx, 2.0))
    assert stored.kept_per_head().min() == ctx.length and stored.meta["evicted_tokens_per_head"] == 0
    for layer, (k, v) in enumerate(zip(ctx.full.keys, ctx.full.values)):
        (seg,) = stored.layers[layer]
        assert isinstance(seg, FP8Segment) and seg.fate == "8-bit"
        divisors = {"calculated": (K_SCALE_CONSTANT, V_SCALE_CONSTANT), "checkpoint": (top, top)}
        if scale == "fixed":
            assert float(seg.k_scale) == float(seg.v_scale) == 1.0
        else:
            k_divisor, v_divisor = divisors[scale]
            assert float(seg.k_scale) == pytest.approx(float(k.abs().max()) / k_divisor, rel=1e-6)
            assert float(seg.v_scale) == pytest.approx(float(v.abs().max()) / v_divisor, rel=1e-6)
        view = seg.view()
        for head in range(k.shape[0]):
            y = (k[head] / seg.k_scale).flatten()
            assert torch.equal(view.keys[head].flatten(), saturated_cast(y, dtype, top) * seg.k_scale)
            y = (v[head] / seg.v_scale).flatten()
            assert torch.equal(view.values[head].flatten(), saturated_cast(y, dtype, top) * seg.v_scale)


# --- NVFP4 rounding ------------------------------------------------------------------------------

# One block of 16, its amax 6 with global scale 1: the block scale is e4m3 1.0 (byte 0x38) and the
# elements are rounded as they are. Codes: sign in bit 3; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are 0-7.
BLOCK = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, -2.9, 0.1, 4.4, 5.2, -1.4, 0.6, -6.0]
BLOCK_CODES = [
    0x0,  # 0
    0x0,  # 0.25: a tie of 0 (code 0) and 0.5 (code 1): the even code, 0
    0x2,  # 0.75: tie of 0.5 (1) and 1 (2): 1
    0x2,  # 1.25: tie of 1 (2) and 1.5 (3): 1
    0x4,  # 1.75: tie of 1.5 (3) and 2 (4): 2
    0x4,  # 2.5: tie of 2 (4) and 3 (5): 2
    0x6,  # 3.5: tie of 3 (5) and 4 (6): 4
    0x6,  # 5: tie of 4 (6) and 6 (7): 4
    0x9,  # -0.3: nearest 0.5 (1), negative
    0xD,  # -2.9: nearest 3 (5), negative
    0x0,  # 0.1: nearest 0
    0x6,  # 4.4: nearest 4
    0x7,  # 5.2: nearest 6
    0xB,  # -1.4: nearest 1.5 (3), negative
    0x1,  # 0.6: nearest 0.5
    0xF,  # -6: 6 (7), negative
]
BLOCK_VALUES = [0, 0, 1, 1, 2, 2, 4, 4, -0.5, -3, 0, 4, 6, -1.5, 0.5, -6]


def test_nvfp4_rounds_a_hand_worked_block():
    # Row 1 is row 0 halved: its amax is 3, its block scale 0.5 (byte 0x30), its codes the same.
    x = torch.tensor([BLOCK, [b / 2 for b in BLOCK]])
    codes, block_scale = nvfp4_encode(x, torch.tensor(1.0))
    assert block_scale.shape == (2, 1)
    assert block_scale.view(torch.uint8).flatten().tolist() == [0x38, 0x30]
    # Two codes per byte, the first in the low nibble.
    pairs = [BLOCK_CODES[i] | BLOCK_CODES[i + 1] << 4 for i in range(0, 16, 2)]
    assert codes.tolist() == pairs + pairs
    back = nvfp4_decode(codes, block_scale, torch.tensor(1.0), torch.float32)
    assert back.tolist() == [BLOCK_VALUES, [b / 2 for b in BLOCK_VALUES]]


def test_e2m1_saturates_at_six_and_keeps_the_sign_of_zero():
    assert e2m1_encode(torch.tensor([6.5, 100.0, -7.0, -0.1])).tolist() == [0x7, 0x7, 0xF, 0x8]
    assert e2m1_decode(torch.tensor([0x7, 0xF, 0x8], dtype=torch.uint8)).tolist() == [6.0, -6.0, 0.0]


def test_nvfp4_block_scales_are_e4m3_of_the_block_amax_over_six_global():
    """Two blocks per row: each its own scale; a global scale g divides the block scales and
    multiplies back on decoding; an all-zero block has scale 0 and stores zeros."""
    g = torch.tensor(1 / 64)
    row = torch.tensor(BLOCK + [0.0] * 16) * 0.5 / 64  # block amax 3 g: scale e4m3(0.5) = 0.5
    codes, block_scale = nvfp4_encode(row, g)
    assert block_scale.float().tolist() == [0.5, 0.0]
    assert codes.tolist()[:8] == [BLOCK_CODES[i] | BLOCK_CODES[i + 1] << 4 for i in range(0, 16, 2)]
    back = nvfp4_decode(codes, block_scale, g, torch.float32)
    assert torch.equal(back, torch.tensor(BLOCK_VALUES + [0.0] * 16) * 0.5 / 64)


def test_nvfp4_refuses_a_head_dim_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_encode(torch.zeros(2, 24), torch.tensor(1.0))


def test_nvfp4_method_uses_the_documented_global_scale(ctx):
    stored = get_method("nvfp4").compress(Request(ctx, 2.0))
    for layer, (k, v) in enumerate(zip(ctx.full.keys, ctx.full.values)):
        (seg,) = stored.layers[layer]
        assert isinstance(seg, FP4Segment) and seg.fate == "4-bit"
        assert float(seg.k_global) == pytest.approx(float(k.abs().max()) / (6 * 448), rel=1e-6)
        assert float(seg.v_global) == pytest.approx(float(v.abs().max()) / (6 * 448), rel=1e-6)
        # Recomputed here from the head-major tokens: the same codes and scales.
        codes, scales = nvfp4_encode(k.reshape(-1, k.shape[-1]), seg.k_global)
        assert torch.equal(codes, seg.key_codes)
        assert torch.equal(scales.view(torch.uint8), seg.key_block_scales.view(torch.uint8))


#: A KVFP4 block worked by hand (SGLang's kvfp4_tensor.py): amax 5, so 5 / 6 < 1 and the scale is
#: 2^0 (byte 127). Each code counts the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 reached: the
#: ties (the first seven, and their negatives) go to the larger magnitude, where NVFP4's round to
#: nearest even would send 0.25, 1.25, 2.5 and 5 down.
KV_BLOCK = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.25, -2.5, -5.0, 0.2, 0.3, 4.4, 0.0, 1.0]
KV_CODES = [0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0x9, 0xB, 0xD, 0xF, 0x0, 0x1, 0x6, 0x0, 0x2]
KV_VALUES = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.5, -3.0, -6.0, 0.0, 0.5, 4.0, 0.0, 1.0]


def test_kvfp4_rounds_a_hand_worked_block_with_power_of_two_scales():
    """Row 1 is row 0 times 4: amax 20, 20 / 6 = 3.3, the scale 2^2 (byte 129), the same codes. Row 2
    is zeros: amax / 6 is clamped to 1e-10, 2^-33 (byte 94), codes 0."""
    x = torch.tensor([KV_BLOCK, [4 * b for b in KV_BLOCK], [0.0] * 16])
    codes, exponents = kvfp4_encode(x)
    assert exponents.dtype == torch.uint8 and exponents.flatten().tolist() == [127, 129, 94]
    pairs = [KV_CODES[i] | KV_CODES[i + 1] << 4 for i in range(0, 16, 2)]  # the first of two in the low nibble
    assert codes.tolist() == pairs + pairs + [0] * 8
    back = kvfp4_decode(codes, exponents, torch.float32)
    assert back.tolist() == [KV_VALUES, [4 * v for v in KV_VALUES], [0.0] * 16]


def test_kvfp4_a_block_whose_amax_is_six_times_a_power_of_two_keeps_it_exactly():
    x = torch.tensor([[12.0, -12.0, 6.0] + [0.0] * 13])  # 12 / 6 = 2: scale 2^1, 12 -> code 6.0
    codes, exponents = kvfp4_encode(x)
    assert exponents.tolist() == [[128]]
    assert kvfp4_decode(codes, exponents, torch.float32)[0, :3].tolist() == [12.0, -12.0, 6.0]


def test_fp4_e2m1_method_stores_the_recipes_codes_of_every_token(ctx):
    stored = get_method("fp4_e2m1").compress(Request(ctx, 2.0))
    for layer, k in enumerate(ctx.full.keys):
        (seg,) = stored.layers[layer]
        assert isinstance(seg, FP4Segment) and seg.k_global is None and seg.fate == "4-bit"
        codes, exponents = kvfp4_encode(k.reshape(-1, k.shape[-1]))  # the head-major tokens
        assert torch.equal(codes, seg.key_codes) and torch.equal(exponents, seg.key_block_scales)


# --- bytes ---------------------------------------------------------------------------------------


def test_bytes_of_a_small_cache_by_hand():
    # 2 heads x 5 tokens x d = 16, keys and values.
    keys, values = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    lengths, index = torch.tensor([5, 5]), torch.arange(5).expand(2, 5)
    one = torch.tensor(1.0)
    fp8 = FP8Segment.quantize(keys, values, lengths, index, torch.float8_e4m3fn, one, one)
    # A byte per element (2 x 2 x 5 x 16 = 320), two float32 scales (8).
    assert fp8.breakdown() == {"fp8 codes": 320, "per-tensor scales": 8} and fp8.nbytes == 328
    nvfp4 = FP4Segment.quantize(keys, values, lengths, index, one, one)
    # Half a byte per element (160), one e4m3 scale per 16 elements (2 x 2 x 5 = 20), two float32 (8).
    assert nvfp4.breakdown() == {"e2m1 codes": 160, "e4m3 block scales": 20, "global scales": 8}
    assert nvfp4.nbytes == 188
    kvfp4 = FP4Segment.quantize(keys, values, lengths, index)
    # The same codes and one exponent byte per 16 elements; no global scale.
    assert kvfp4.breakdown() == {"e2m1 codes": 160, "e8m0 block exponents": 20} and kvfp4.nbytes == 180


@pytest.mark.parametrize(
    ("name", "token_bytes", "layer_bytes"),
    [("fp8_e4m3", 32, 8), ("fp8_e5m2", 32, 8), ("nvfp4", 18, 8), ("fp4_e2m1", 18, 0)],
)
def test_a_stored_cache_counts_codes_and_scales_only(ctx, name, token_bytes, layer_bytes):
    stored = get_method(name).compress(Request(ctx, 2.0))
    lm = ctx.lm
    # Per layer: every token of every KV head (d = 16: 32 bytes in fp8, 8 + 1 + 8 + 1 in nvfp4 and
    # fp4_e2m1), then the layer's per-tensor scales (8 bytes; fp4_e2m1 has none).
    assert stored.nbytes == lm.n_layers * (lm.n_kv_heads * ctx.length * token_bytes + layer_bytes)
    assert stored.meta["memory_ratio"] == pytest.approx(ctx.full.nbytes / stored.nbytes)
    assert stored.nbytes <= ctx.full.nbytes / 2


# --- ratio, eviction, invariants -----------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_ratio_one_is_the_full_cache(ctx, name):
    stored = get_method(name).compress(Request(ctx, 1.0))
    full = ctx.full.stored
    assert stored.nbytes == full.nbytes
    for layer in range(ctx.lm.n_layers):
        assert torch.equal(stored.layer_view(layer).keys, full.layer_view(layer).keys)


@pytest.mark.parametrize("name", FORMATS)
def test_past_the_formats_own_ratio_the_oldest_document_tokens_go(ctx, name):
    ratio = 12.0  # beyond fp8's 4x and nvfp4's 7.1x of float32
    stored = get_method(name).compress(Request(ctx, ratio))
    assert stored.nbytes <= ctx.full.nbytes / ratio
    kept = ctx.length - stored.meta["evicted_tokens_per_head"]
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            # The template, then the newest document tokens.
            assert sorted(stored.fates(layer, head)) == [0, 1] + list(range(ctx.length - kept + 2, ctx.length))
    # One more token in every head would not fit.
    one_more = ctx.lm.n_layers * ctx.lm.n_kv_heads * get_method(name).token_bytes(ctx.lm.head_dim)
    assert stored.nbytes + one_more > ctx.full.nbytes / ratio


def test_evict_with_a_scorer_keeps_its_top_tokens_and_records_its_scores(ctx):
    stored = get_method("fp8_e4m3", evict_with="snapkv").compress(Request(ctx, 12.0, record_importance=True))
    scores = get_method("snapkv").scores(Request(ctx, 12.0))
    n_doc = ctx.doc_len - stored.meta["evicted_tokens_per_head"]
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            kept = {i - ctx.prefix_len for i in stored.fates(layer, head) if i >= ctx.prefix_len}
            assert kept == set(torch.topk(scores[layer][head], n_doc).indices.tolist())
    assert stored.importance is not None and len(stored.importance) == ctx.lm.n_layers
    assert get_method("fp8_e4m3").compress(Request(ctx, 12.0, record_importance=True)).importance is None


def test_a_query_aware_scorer_makes_the_format_query_aware():
    assert not get_method("nvfp4").uses_question()
    assert get_method("nvfp4", evict_with="snapkv_question").uses_question()


@pytest.mark.parametrize("name", FORMATS)
def test_a_stored_format_decodes_to_finite_logits_close_to_the_full_cache(ctx, name):
    stored = get_method(name).compress(Request(ctx, 2.0))
    ids = torch.tensor([5, 9, 11])
    got = extend(ctx.lm, open_session(ctx.lm, stored), ids)
    want = extend(ctx.lm, open_session(ctx.lm, ctx.full.stored), ids)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scale": "dynamic"}, "^fp8_e4m3: scale must be one of fixed, calculated, checkpoint, got 'dynamic'$"),
        ({"evict_with": "kivi"}, "^fp8_e4m3: evict_with must be oldest or a scoring method"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(MethodError, match=message):
        get_method("fp8_e4m3", **options)


def test_a_ratio_with_no_room_for_a_document_token_is_refused(ctx):
    with pytest.raises(MethodError, match="no room for one document token"):
        get_method("fp8_e4m3").compress(Request(ctx, 500.0))


def test_presets_are_the_engine_flags():
    assert get_method("fp8_e4m3", preset="fp8+calculate-kv-scales").options.scale == "calculated"
    assert get_method("fp8_e5m2", preset="fp8_e5m2").options.scale == "fixed"
