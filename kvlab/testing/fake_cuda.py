"""A CPU stand-in for CUDA that raises where CUDA would: the device-mixing check.

On a machine without a GPU, code that mixes devices runs fine: every tensor
is on the CPU. This module makes the mistake visible there. Inside
:class:`FakeCuda` (a ``TorchFunctionMode``, so it sees every torch call):

* a tensor is tagged "cuda" when it is a :class:`FakeCudaTensor`: an ordinary
  CPU tensor that reports ``device == cuda:0`` and ``is_cuda``. The model's
  weights are tagged (:func:`to_fake_cuda`), so is everything computed from
  them, and so is every factory call given ``device=<cuda>``
  (``torch.arange(n, device=lm.device)``) and every ``.to(<cuda>)``;
* ``.cpu()`` and ``.to("cpu")`` drop the tag (a copy, as on a GPU);
* an op that meets a tagged tensor and an untagged one raises
  :class:`DeviceMixError`, except where PyTorch accepts it on CUDA: 0-dim
  CPU tensors (CPU scalars), CPU index tensors in indexing, and copies
  (``copy_``, assignment to a basic slice);
* ``.numpy()`` of a tagged tensor raises, and a factory asked for CUDA with a
  CPU generator raises, both as on CUDA.

The tag lives on the Python object only: the maths runs on the CPU as usual,
so the results are the CPU's and every other check still holds.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

FAKE_DEVICE = torch.device("cuda", 0)
CPU = torch.device("cpu")


class DeviceMixError(RuntimeError):
    """An op met a CUDA tensor and a CPU tensor where CUDA would refuse it."""


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` (see the module docstring)."""

    # Outside FakeCuda it behaves as a plain tensor; FakeCuda does the tagging.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return FAKE_DEVICE

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return 0

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first (fake CUDA)")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self.numpy()


def is_fake(x: object) -> bool:
    return isinstance(x, FakeCudaTensor)


def tag(x: torch.Tensor) -> torch.Tensor:
    """The same storage, tagged "cuda"."""
    return x if is_fake(x) else x.as_subclass(FakeCudaTensor)


def untag(x: torch.Tensor) -> torch.Tensor:
    """The same storage, untagged (a plain CPU tensor)."""
    return x.as_subclass(torch.Tensor) if is_fake(x) else x


def _is_cuda(device: object) -> bool:
    if device is None or isinstance(device, (torch.dtype, torch.Tensor, bool)):
        return False
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


def _is_device(x: object) -> bool:
    if isinstance(x, torch.device):
        return True
    if isinstance(x, str):
        with contextlib.suppress(RuntimeError):
            torch.device(x)
            return True
    return isinstance(x, int) and not isinstance(x, bool)


def _to_cpu_device(x: object) -> object:
    return CPU if _is_cuda(x) else x


def _tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor inside ``obj``'s tuples, lists and dict values (torch calls nest them shallowly)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for part in obj for t in _tensors(part)]
    return []


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _shapes(ts: list[torch.Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in ts[:4])


def _refuse(func: Any, cuda: list[torch.Tensor], cpu: list[torch.Tensor], what: str = "") -> None:
    raise DeviceMixError(
        f"Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
        f"({_name(func)}{what}: cuda tensors {_shapes(cuda)}; cpu tensors {_shapes(cpu)})"
    )


def _check_mixed(func: Any, tensors: list[torch.Tensor]) -> bool:
    """Raise if CUDA would refuse these operands together; True when any is on (fake) CUDA."""
    cuda = [t for t in tensors if is_fake(t)]
    if not cuda:
        return False
    cpu = [t for t in tensors if not is_fake(t) and t.dim() > 0 and t.device.type == "cpu"]
    if cpu:
        _refuse(func, cuda, cpu)
    return True


def _check_indexing(func: Any, args: tuple, kwargs: dict) -> bool:
    """x[index] and x[index] = value: CPU index tensors are fine for a CUDA x, not the reverse."""
    self, index = args[0], args[1] if len(args) > 1 else kwargs.get("indices")
    index_tensors = _tensors(index)
    if is_fake(self):
        pass  # CUDA indexes with CPU or CUDA index tensors alike
    elif any(is_fake(t) for t in index_tensors):
        _refuse(func, [t for t in index_tensors if is_fake(t)], [self], " (indices on cuda, indexed tensor on cpu)")
    values = _tensors(args[2:]) + _tensors({k: v for k, v in kwargs.items() if k != "indices"})
    basic = not index_tensors  # assignment to a basic slice is a copy_, which crosses devices
    if values and not basic:
        _check_mixed(func, [self, *values])
    return is_fake(self)


_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}
_COPIES = {torch.Tensor.copy_}
_TO_CPU = {torch.Tensor.cpu}
_TO_CUDA = {torch.Tensor.cuda}


def _target_of_to(args: tuple, kwargs: dict) -> bool | None:
    """Where ``x.to(...)`` sends x: True for CUDA, False for the CPU, None when it keeps x's device."""
    target: object = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return is_fake(a)
        if _is_device(a):
            target = a
    if target is None:
        return None
    return _is_cuda(target)


@dataclass(frozen=True)
class Transfer:
    """One copy from the (fake) GPU to the CPU: its shape and the kvlab line that asked for it."""

    shape: tuple[int, ...]
    site: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _caller() -> str:
    """The innermost kvlab line outside this package on the stack, as ``path:line``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/kvlab/" in path and "/kvlab/testing/" not in path:
            return f"{path.split('/kvlab/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class FakeCuda(TorchFunctionMode):
    """The device-mixing check: tagged tensors act as CUDA tensors (see the module docstring).

    ``ops`` counts the torch calls seen and ``on_cuda`` those with a tagged
    operand or result, so a check can show it really ran on "the GPU";
    ``to_cpu`` lists every copy back to the CPU (what a GPU pays for).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.on_cuda = 0
        self.to_cpu: list[Transfer] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        self.ops += 1
        if func in _TO_CPU:
            out = func(*args, **kwargs)
            if not is_fake(args[0]):
                return out
            self.to_cpu.append(Transfer(tuple(args[0].shape), _caller()))
            return out.clone()
        if func in _TO_CUDA:
            self.on_cuda += 1
            return tag(args[0].clone())
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if func in _COPIES:
            return func(*args, **kwargs)
        if func in _INDEXING:
            on_cuda = _check_indexing(func, args, kwargs)
            return self._tagged(func(*args, **kwargs), on_cuda)
        device_given = "device" in kwargs and kwargs["device"] is not None
        if device_given:
            on_cuda = _is_cuda(kwargs["device"])
            generator = kwargs.get("generator")
            if on_cuda and generator is not None and generator.device.type != "cuda":
                raise DeviceMixError(f"Expected a 'cuda' device type for generator but found 'cpu' ({_name(func)})")
            # A factory given a device copies its tensor inputs there (torch.tensor, as_tensor, *_like).
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        else:
            on_cuda = _check_mixed(func, _tensors((args, kwargs)))
        return self._tagged(func(*args, **kwargs), on_cuda)

    def _to(self, func: Any, args: tuple, kwargs: dict) -> Any:
        target = _target_of_to(args, kwargs)
        src = args[0]
        plain_args = tuple(
            a.dtype if isinstance(a, torch.Tensor) else _to_cpu_device(a) if _is_device(a) else a for a in args[1:]
        )
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        out = func(src, *plain_args, **kwargs)
        if target is None:
            return self._tagged(out, is_fake(src))
        if target == is_fake(src):
            return self._tagged(out, target)
        moved = out.clone() if out is src else out  # a move copies, as on a GPU
        if target:
            return self._tagged(moved, True)
        self.to_cpu.append(Transfer(tuple(src.shape), _caller()))
        return untag(moved)

    def _tagged(self, out: Any, on_cuda: bool) -> Any:
        if not on_cuda:
            return out
        self.on_cuda += 1
        return tree_map(lambda x: tag(x) if isinstance(x, torch.Tensor) else x, out)


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """Tag every parameter and buffer of ``module`` "cuda" in place (no copy) and return it."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and not is_fake(p):
                # A Parameter must keep its type through detach(); a tagged tensor in its slot serves inference.
                sub._parameters[name] = tag(p.detach())
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = tag(b)
    return module


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """Run the block under the device-mixing check.

    ``torch.cuda.synchronize`` becomes a no-op meanwhile (kvlab calls it to
    time GPU work), and the warning PyTorch gives for ``autocast("cuda")``
    without CUDA (transformers' rotary embedding opens one) is silenced.
    """
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
            warnings.filterwarnings("ignore", message=".*device_type of 'cuda'.*")
            with FakeCuda() as mode:
                yield mode
    finally:
        torch.cuda.synchronize = sync  # type: ignore[assignment]
