"""The device-mixing check (kvlab.testing.fake_cuda) and the device suite under it.

The first tests pin the stand-in to what PyTorch does on CUDA (hand-written
cases of its documented rules); the suite then runs every method and the
lab's entry points on a tiny model whose tensors are tagged "cuda", so a CPU
tensor meeting a model tensor fails here as it would on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.runtime.model import LoadedModel
from kvlab.testing.device_suite import run_step, steps, suite_model
from kvlab.testing.fake_cuda import FAKE_DEVICE, DeviceMixError, fake_cuda, is_fake, to_fake_cuda


def test_tagged_tensors_act_as_cuda_tensors() -> None:
    with fake_cuda():
        x = torch.arange(4, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda
        y = x.float() * 2 + torch.tensor(1.0)  # a 0-dim CPU tensor is a scalar: allowed
        assert is_fake(y) and y.tolist() == [1.0, 3.0, 5.0, 7.0]
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            y + torch.ones(4)
        with pytest.raises(DeviceMixError):
            torch.cat([y, torch.ones(2)])
        with pytest.raises(DeviceMixError):
            torch.where(torch.ones(4, dtype=torch.bool), y, y)  # a CPU mask
        back = y.cpu()
        assert not is_fake(back) and back.device.type == "cpu"
        back[0] = 100.0  # .cpu() copies, as from a GPU
        assert float(y[0]) == 1.0
        assert is_fake(torch.zeros(3).to(y.device)) and is_fake(y.to(torch.float16))
        assert not is_fake(y.to("cpu"))
        values, index = torch.topk(y, 2)
        assert is_fake(values) and is_fake(index)


def test_indexing_and_copies_follow_cuda() -> None:
    with fake_cuda():
        y = torch.zeros(4, device="cuda")
        assert is_fake(y[torch.tensor([0, 2])])  # a CPU index into a CUDA tensor: allowed
        y[torch.tensor([0, 2])] = 5.0
        y[:2] = torch.ones(2)  # assignment to a basic slice is a copy_: crosses devices
        y.copy_(torch.arange(4.0))
        assert y.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(DeviceMixError):
            torch.ones(4)[torch.tensor([1], device="cuda")]  # a CUDA index into a CPU tensor
        with pytest.raises(DeviceMixError):
            y[torch.tensor([0, 1])] = torch.ones(2)  # index_put_ of CPU values
        with pytest.raises(TypeError, match="numpy"):
            y.numpy()
        with pytest.raises(DeviceMixError, match="generator"):
            torch.randn(3, generator=torch.Generator().manual_seed(0), device="cuda")


def test_a_tagged_model_runs_on_tagged_inputs_only(tiny: LoadedModel) -> None:
    lm = suite_model()
    to_fake_cuda(lm.model)
    ids = torch.tensor([[1, 2, 3]])
    with fake_cuda() as mode:
        with pytest.raises(DeviceMixError):  # input ids left on the CPU
            lm.model(input_ids=ids)
        logits = lm.model(input_ids=ids.to(FAKE_DEVICE)).logits
    assert is_fake(logits) and mode.on_cuda > 0


@pytest.fixture(scope="module")
def fake_lm() -> LoadedModel:
    lm = suite_model(name="fake-cuda-llama")
    to_fake_cuda(lm.model)
    return LoadedModel(lm.name, lm.model, lm.tokenizer, FAKE_DEVICE, lm.dtype)


@pytest.mark.slow  # every method and lab path under the CUDA stand-in: minutes
@pytest.mark.parametrize("step", steps(), ids=lambda s: s.name)
def test_every_path_stays_on_the_models_device(fake_lm: LoadedModel, step, monkeypatch: pytest.MonkeyPatch) -> None:
    """No op mixes devices, and nothing copies a layer's keys or values to the CPU."""
    monkeypatch.setenv("KVLAB_KERNELS", "torch")  # the Triton kernels have their own tests
    cfg = fake_lm.model.config
    layer_elements = cfg.num_key_value_heads * cfg.head_dim * 256  # a layer of 256 tokens
    with fake_cuda() as mode:
        run_step(step, fake_lm)
    assert mode.on_cuda > 0
    big = [t for t in mode.to_cpu if t.numel >= layer_elements]
    assert not big, f"copied to the CPU: {big[:3]}"
