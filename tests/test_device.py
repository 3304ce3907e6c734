"""The one device-placement rule (kvlab.models.pick_device / device_map) and its KVLAB_DEVICE override."""

from __future__ import annotations

import pytest
import torch

from kvlab.models import device_map, pick_device
from kvlab.runtime.model import ModelLoadError


def test_default_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLAB_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device() == (torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == (torch.device("cuda"), torch.bfloat16)


def test_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    assert pick_device() == (torch.device("cpu"), torch.float32)  # even with a GPU present
    monkeypatch.setenv("KVLAB_DEVICE", "cuda:1")
    assert pick_device() == (torch.device("cuda", 1), torch.bfloat16)


@pytest.mark.parametrize(("spec", "message"), [("gpu", "is not a device"), ("meta", "only cpu and cuda")])
def test_bad_override(monkeypatch: pytest.MonkeyPatch, spec: str, message: str) -> None:
    monkeypatch.setenv("KVLAB_DEVICE", spec)
    with pytest.raises(ModelLoadError, match=message):
        pick_device()


def test_cuda_override_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("KVLAB_DEVICE", "cuda")
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        pick_device()


def test_device_map() -> None:
    assert device_map(torch.device("cpu")) is None
    assert device_map(torch.device("cuda")) == "auto"  # spread a large model over every GPU
    assert device_map(torch.device("cuda", 1)) == {"": torch.device("cuda", 1)}


def test_sdpa_on_cuda_leaves_cudnn_out_and_restores_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, kvlab's attention never reaches cuDNN's SDPA (a plan built per new key length made an 8B
    decode step 3x slower on an H200); the caller's own switch is as it was afterwards, and the CPU path
    is untouched."""
    from kvlab.runtime import attention
    from kvlab.testing.fake_cuda import fake_cuda, tag

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 16, generator=gen), *torch.randn(2, 1, 2, 9, 16, generator=gen))
    want = attention.attend(q.reshape(2, 2, 1, 16), k.transpose(0, 1), v.transpose(0, 1), scale=0.25)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with fake_cuda():
        got = attention.causal_attention(tag(q), tag(k), tag(v), None, 0.25)
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled() == before
    torch.testing.assert_close(got.reshape(2, 2, 1, 16), want.output)
    seen.clear()
    attention.causal_attention(q, k, v, None, 0.25)
    assert seen == []  # a CPU decode step takes the grouped matmuls, not SDPA
