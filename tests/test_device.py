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
