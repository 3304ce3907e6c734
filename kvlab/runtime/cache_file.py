"""A stored cache as one file: its tensors in safetensors, its layout as JSON in the file's header.

safetensors keeps tensors and nothing else (no pickle: loading a file runs no
code), and its header carries a map of strings; the layout is its ``"kvlab"``
entry, a JSON document (``safetensors.safe_open(path, "pt").metadata()["kvlab"]``
reads it without loading a tensor):

* ``format`` and ``version`` (:data:`FORMAT`, :data:`VERSION`): a file of
  another version is refused, never read as if it were this one;
* what the caller puts beside the cache (:mod:`kvlab.api`: the method and its
  knobs, the model's identity, the document's sha256);
* ``cache``: the :class:`~kvlab.runtime.cache.CompressedKV` (:func:`cache_layout`):
  its logical length and position shift (where the next token's position
  comes from), its stored bytes and their breakdown, and per layer its
  segments, each written field by field: a tensor field names its tensor in
  the file (keys, values, biases, head lengths, token indices, codes,
  scales), a nested part (a quantised block, a packed tensor) is written the
  same way, other fields (bits, fate, a dtype) are plain JSON.

A segment is any dataclass of a kvlab module (the runtime's, and a method's
own such as TurboQuant's), found by its module and name among the modules
loaded (:func:`stored_class`; kvlab.api loads the methods): nothing outside
kvlab is ever built from a file. The per-token ``importance`` (a diagnostic
of the app's token view, not stored bytes) is not written.

Reading checks everything before it returns (:func:`read_cache_file`,
:func:`cache_from_layout`): a truncated or foreign file, another version, a
tensor missing, bytes that do not add up, each refused with a
:class:`CacheFileError` of one line; nothing is half-loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.model import LoadedModel

FORMAT = "kvlab-cache"
#: The layout's version: raised whenever a file of the old one would be read wrong.
VERSION = 1
#: The header entry that holds the layout.
LAYOUT_KEY = "kvlab"
#: Elements taken from each end of every parameter for :func:`weights_fingerprint`.
FINGERPRINT_ELEMENTS = 16


class CacheFileError(ValueError):
    """A cache file kvlab refuses; the message is one line naming the file and why."""


# --- writing ----------------------------------------------------------------------------------------


def encode(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors added to ``tensors`` under names derived from ``name``.

    A tensor becomes ``{"tensor": name}`` (a contiguous CPU copy goes to the
    file: views of one storage are written apart), a dtype ``{"dtype": ...}``,
    a tuple ``{"tuple": [...]}``, a dataclass ``{"class": module.name,
    "fields": {...}}`` (with its ``bytes`` when it counts them), a list a list.
    """
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {"tensor": name}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {
            f.name: encode(getattr(value, f.name), f"{name}.{f.name}", tensors)
            for f in dataclasses.fields(value)
            if f.init
        }
        node = {"class": f"{cls.__module__}.{cls.__qualname__}", "fields": fields}
        if isinstance(getattr(value, "nbytes", None), int):
            node["bytes"] = value.nbytes
        return node
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{name}: a {type(value).__name__} cannot be written to a cache file")


def cache_layout(stored: CompressedKV, tensors: dict[str, torch.Tensor]) -> dict:
    """The layout of ``stored`` (see the module docstring), its tensors added to ``tensors``."""
    return {
        "logical_len": stored.logical_len,
        "position_shift": stored.position_shift,
        "bytes": stored.nbytes,
        "breakdown": stored.breakdown(),
        "kept_per_head": stored.kept_per_head().tolist(),
        "scales": stored.scales,
        "meta": stored.meta,
        "layers": encode(stored.layers, "layers", tensors),
    }


def write_cache_file(path: str | Path, layout: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` and ``layout`` (stamped with :data:`FORMAT` and :data:`VERSION`) to ``path``.

    Written to a temporary file beside it and renamed into place: a crash
    never leaves a half-written file under the name a later load would read.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"format": FORMAT, "version": VERSION, **layout})
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    os.close(fd)
    try:
        save_file(tensors, scratch, metadata={LAYOUT_KEY: header})
        os.replace(scratch, path)
    finally:
        Path(scratch).unlink(missing_ok=True)
    return path


# --- reading ----------------------------------------------------------------------------------------


def read_cache_file(path: str | Path, tensors: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(layout, tensors on the CPU) of a kvlab cache file of this :data:`VERSION`; CacheFileError otherwise.

    tensors=False reads the layout alone (the file is checked whole all the same:
    safetensors refuses a file its header does not cover exactly).
    """
    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"{path}: no such cache file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = (f.metadata() or {}).get(LAYOUT_KEY)
            found = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except (SafetensorError, OSError) as exc:
        reason = " ".join(str(exc).split())
        raise CacheFileError(
            f"{path} is not a whole safetensors file ({reason}): truncated, or not a kvlab cache"
        ) from None
    try:
        layout = json.loads(header) if header is not None else None
    except ValueError:
        layout = None
    if not isinstance(layout, dict) or layout.get("format") != FORMAT:
        raise CacheFileError(f"{path} is a safetensors file but not a kvlab cache (its header has no kvlab layout)")
    if layout.get("version") != VERSION:
        raise CacheFileError(
            f"{path} is a kvlab cache of format version {layout.get('version')}; this kvlab reads "
            f"version {VERSION}: compress the document again"
        )
    return layout, found


def stored_class(qualified: str) -> type:
    """The dataclass ``module.Name`` of a loaded kvlab module (CacheFileError for any other name)."""
    module_name, _, class_name = qualified.rpartition(".")
    module = sys.modules.get(module_name) if module_name.startswith("kvlab.") else None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise CacheFileError(f"unknown part {qualified!r} (written by another version of kvlab?)")
    return cls


def decode(node: Any, tensors: dict[str, torch.Tensor], device: torch.device, used: set[str]) -> Any:
    """The inverse of :func:`encode`: tensors are moved to ``device`` and their names added to ``used``."""
    if isinstance(node, list):
        return [decode(v, tensors, device, used) for v in node]
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        if node["tensor"] not in tensors:
            raise CacheFileError(f"the tensor {node['tensor']!r} is missing")
        used.add(node["tensor"])
        return tensors[node["tensor"]].to(device)
    if "dtype" in node:
        dtype = getattr(torch, str(node["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CacheFileError(f"unknown dtype {node['dtype']!r}")
        return dtype
    if "tuple" in node:
        return tuple(decode(v, tensors, device, used) for v in node["tuple"])
    if "class" in node:
        cls = stored_class(node["class"])
        fields = {k: decode(v, tensors, device, used) for k, v in node.get("fields", {}).items()}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise CacheFileError(f"{node['class']} does not take these fields ({exc})") from None
    raise CacheFileError(f"unreadable layout entry with keys {sorted(node)}")


def cache_from_layout(layout: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> CompressedKV:
    """The CompressedKV of :func:`cache_layout`'s ``layout``, every tensor on ``device``.

    CacheFileError when a tensor is missing or left over, or when the
    segments built do not store the bytes the layout says.
    """
    used: set[str] = set()
    try:
        stored = CompressedKV(
            layers=decode(layout["layers"], tensors, device, used),
            logical_len=int(layout["logical_len"]),
            meta=dict(layout.get("meta") or {}),
            scales=layout.get("scales"),
            position_shift=int(layout.get("position_shift", 0)),
        )
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFileError(f"its layout is incomplete ({exc!r})") from None
    if used != set(tensors):
        raise CacheFileError(f"it holds tensors its layout does not name: {', '.join(sorted(set(tensors) - used))}")
    if stored.nbytes != layout.get("bytes"):
        raise CacheFileError(f"its segments store {stored.nbytes:,} bytes, its layout says {layout.get('bytes')}")
    return stored


# --- the model a cache belongs to ---------------------------------------------------------------------


def weights_fingerprint(model: PreTrainedModel) -> str:
    """sha256 of every parameter's name and its first and last :data:`FINGERPRINT_ELEMENTS` values.

    The values are rounded to bfloat16 first, so one checkpoint gives the same
    fingerprint loaded in float32 or bf16, on any device; a few elements per
    parameter (a copy of a few kilobytes to the CPU) tell different weights apart.
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        flat = param.detach().flatten()
        sample = torch.cat([flat[:FINGERPRINT_ELEMENTS], flat[-FINGERPRINT_ELEMENTS:]])
        digest.update(name.encode())
        digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()


def model_identity(lm: LoadedModel) -> dict:
    """What a cache must be read by: the model's architecture, geometry and weights (:func:`weights_fingerprint`)."""
    return {
        "model_type": lm.model.config.model_type,
        "layers": lm.n_layers,
        "kv_heads": lm.n_kv_heads,
        "head_dim": lm.head_dim,
        "vocab_size": int(lm.model.config.get_text_config().vocab_size),
        "weights_sha256": weights_fingerprint(lm.model),
    }
