"""Property-based checks (hypothesis) of the cache maths and of the document reader.

Each property is checked against a plain construction: a key removed or
written twice, one head at a time without padding, the quantisation grid's
half step, and "only DocumentError" for any bytes at all.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlab.documents import DocumentError, read_document  # noqa: E402
from kvlab.runtime.attention import attend  # noqa: E402
from kvlab.runtime.cache import DenseSegment  # noqa: E402
from kvlab.runtime.low_bit import quantize_keys, quantize_values  # noqa: E402

FEW = settings(max_examples=40, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def randn(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@FEW
@given(seed=seeds, n_keys=st.integers(2, 12), data=st.data())
def test_a_key_with_bias_minus_infinity_is_a_key_not_there(seed, n_keys, data):
    gone = data.draw(st.integers(0, n_keys - 1))
    q, k, v = randn(seed, 3, 8), randn(seed + 1, n_keys, 8, scale=2.0), randn(seed + 2, n_keys, 5)
    bias = torch.zeros(n_keys)
    bias[gone] = -math.inf
    keep = [i for i in range(n_keys) if i != gone]
    with_bias, without = attend(q, k, v, bias), attend(q, k[keep], v[keep])
    assert close(with_bias.output, without.output) and close(with_bias.lse, without.lse)


@FEW
@given(seed=seeds, n_keys=st.integers(1, 12), data=st.data())
def test_a_key_with_bias_log_two_is_that_key_written_twice(seed, n_keys, data):
    twice = data.draw(st.integers(0, n_keys - 1))
    q, k, v = randn(seed, 4, 8), randn(seed + 1, n_keys, 8, scale=2.0), randn(seed + 2, n_keys, 5)
    bias = torch.zeros(n_keys)
    bias[twice] = math.log(2.0)
    with_bias = attend(q, k, v, bias)
    doubled = attend(q, torch.cat([k, k[twice : twice + 1]]), torch.cat([v, v[twice : twice + 1]]))
    assert close(with_bias.output, doubled.output) and close(with_bias.lse, doubled.lse)


@FEW
@given(seed=seeds, lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4))
def test_ragged_heads_attend_as_each_head_alone(seed, lengths):
    # Padded storage with ragged lengths: every head must see exactly its own keys.
    n_heads, width = len(lengths), max(max(lengths), 1)
    keys, values = randn(seed, n_heads, width, 8), randn(seed + 1, n_heads, width, 6)
    bias_in = randn(seed + 2, n_heads, width, scale=0.5)
    index = torch.arange(width).expand(n_heads, width)
    seg = DenseSegment.from_padded(keys, values, torch.tensor(lengths), index, bias=bias_in)
    view = seg.view()
    q = randn(seed + 3, n_heads, 2, 8)
    padded = attend(q, view.keys, view.values, view.bias)
    for h, n in enumerate(lengths):
        alone = attend(q[h], keys[h, :n], values[h, :n], bias_in[h, :n])
        if n == 0:  # no key at all: zero output and zero mass
            assert torch.all(padded.output[h] == 0) and torch.all(padded.lse[h] == -math.inf)
        else:
            assert close(padded.output[h], alone.output) and close(padded.lse[h], alone.lse)


def _group_scale_per_element(scale: torch.Tensor, group_size: int, length: int) -> torch.Tensor:
    return scale.float().repeat_interleave(group_size, dim=-1)[..., :length]


@FEW
@given(
    seed=seeds,
    heads=st.integers(1, 3),
    tokens=st.integers(1, 40),
    dim=st.sampled_from([4, 8, 16]),
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([1, 3, 8, 32]),
    spread=st.sampled_from([1e-3, 1.0, 300.0]),
)
def test_dequantised_values_are_within_half_a_step_of_the_originals(seed, heads, tokens, dim, bits, group, spread):
    x = randn(seed, heads, tokens, dim, scale=spread) + randn(seed + 1, 1, 1, dim, scale=spread)
    # Keys: groups run along tokens (per channel); values: along channels (per token).
    pk, pv = quantize_keys(x, bits, group), quantize_values(x, bits, group)
    step_k = _group_scale_per_element(pk.scale, group, tokens).transpose(-1, -2)  # [H, T, d]
    step_v = _group_scale_per_element(pv.scale, group, dim)
    for packed, step in ((pk, step_k), (pv, step_v)):
        err = (packed.dequantize() - x).abs()
        # Half a step, plus float32 rounding of zero + code * scale.
        assert torch.all(err <= step / 2 + 1e-6 * (1 + x.abs()) * 4), float((err - step / 2).max())


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), suffix=st.sampled_from([".txt", ".md", ".pdf", ""]), pdf_header=st.booleans())
def test_any_bytes_give_text_or_a_document_error(data, suffix, pdf_header):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"upload{suffix}"
        path.write_bytes((b"%PDF-1.4\n" if pdf_header else b"") + data)
        try:
            text = read_document(path)
        except DocumentError as exc:
            assert str(exc)  # a message for the user
        else:
            assert isinstance(text, str) and text.strip()
