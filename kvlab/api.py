"""kvlab in a researcher's own code: compress a model they loaded, answer through ``model.generate``, save and load.

Three steps (README's "Use it in your own code" runs them on every family)::

    cache = api.compress(model, tokenizer, document, "snapkv", 4)                 # 1. compress
    ids = cache.prompt(question)
    out = model.generate(ids, custom_generate=cache.decode, max_new_tokens=48)     # 2. answer
    cache.save("doc.kvcache"); cache = api.load_cache("doc.kvcache", model, tokenizer)  # 3. keep

* The model is the caller's, on its device and in its dtype: it takes the
  path the lab's own loader takes (:func:`kvlab.runtime.adopt.adopt`:
  unsupported attention refused in one line, kvlab's attention switched on),
  and the document is read and compressed as the lab does it
  (:func:`kvlab.context.prepare_context`, the method's ``compress``).
* ``custom_generate=cache.decode`` is transformers' hook for a decoding loop
  of one's own: ``generate`` prepares its inputs as usual, then
  :func:`kvlab.runtime.hf_generate.generate_from` decodes from the stored
  cache, at its logical positions, with its per-key biases and ragged heads.
* :meth:`KVCache.save` writes one safetensors file with the layout as JSON in
  its header (:mod:`kvlab.runtime.cache_file`); :func:`load_cache` refuses,
  in one line (:class:`CacheFileError`), a file made with another model, of
  another format version, or cut short.

This module is ``kvlab.api``, not re-exported by ``kvlab`` itself: the package's
``__init__`` imports nothing (tests/test_imports.py), so that a light module
of kvlab never loads the methods and transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.utils import GenerateDecoderOnlyOutput

from kvlab.context import Context, prepare_context
from kvlab.methods import Method, Request, get_method
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS
from kvlab.prompts import question_tokens
from kvlab.runtime.adopt import adopt, model_label
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.cache_file import (
    CacheFileError,
    cache_from_layout,
    cache_layout,
    model_identity,
    read_cache_file,
    write_cache_file,
)
from kvlab.runtime.decode import Generation, greedy
from kvlab.runtime.hf_generate import generate_from
from kvlab.runtime.model import LoadedModel

__all__ = ["CacheFileError", "CacheInfo", "KVCache", "compress", "load_cache"]


@dataclass(frozen=True)
class CacheInfo:
    """What a stored cache stands for, written beside its tensors.

    options: every knob of the method (its Options' fields); question: the
    question a query-aware compression read, None when the cache serves any
    question; document_sha256: of the document's text (UTF-8);
    context_tokens / prefix_len: the tokens the cache stands for (the
    template's prefix, then the document); model: the name of the model it
    was made with; source: where that model loads from (``kvlab ask``'s
    default ``--model``).
    """

    method: str
    options: dict[str, Any]
    ratio: float
    question: str | None
    document_sha256: str
    context_tokens: int
    prefix_len: int
    model: str
    source: str


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def method_options(method: Method) -> dict[str, Any]:
    """Every knob of ``method`` by name (the values ``get_method(method.name, **options)`` takes back)."""
    return {f.name: getattr(method.options, f.name) for f in dataclasses.fields(method.options)}


@dataclass
class KVCache:
    """A compressed cache of one document for one model: ask it through ``model.generate``, save it.

    stored: the cache itself (per layer, its segments); lm: the model it reads
    on with; info: what it stands for (:class:`CacheInfo`). Answering never
    changes it: every answer runs on a working copy.
    """

    stored: CompressedKV
    lm: LoadedModel
    info: CacheInfo

    @property
    def nbytes(self) -> int:
        """Bytes the cache stores (keys, values, biases, codes and scales; kvlab.runtime.cache.CompressedKV.nbytes)."""
        return self.stored.nbytes

    def prompt(self, question: str) -> torch.Tensor:
        """The question turn read after the document, as ``generate`` takes it: ids [1, n] on the model's device.

        In the model's chat template when it has one (kvlab.prompts.question_tokens), so
        the answer starts right after these ids.
        """
        return question_tokens(self.lm.tokenizer, question).to(self.lm.device).unsqueeze(0)

    def decode(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: GenerationConfig,
        **model_kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """transformers' ``custom_generate`` loop: ``model.generate(ids, custom_generate=cache.decode, ...)``.

        ``generate`` prepares its inputs (the generation config, ``max_new_tokens``, end-of-sequence
        ids, logits processors, stopping criteria); this decodes from the stored cache
        (:func:`kvlab.runtime.hf_generate.generate_from`). Returns ``input_ids`` [1, n] followed by the
        new tokens, as ``generate`` does (or its output object with ``return_dict_in_generate``).
        """
        if model is not self.lm.model:
            raise ValueError(f"this cache reads on with the model it was made with ({self.info.model}), not another")
        return generate_from(
            self.lm, self.stored, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs
        )

    def answer(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> Generation:
        """kvlab's own greedy answer (kvlab.runtime.decode.greedy: it stops at end-of-turn, and at a base model's
        line end)."""
        return greedy(self.lm, self.stored, question_tokens(self.lm.tokenizer, question), max_new_tokens)

    def save(self, path: str | Path) -> Path:
        """Write the cache to ``path`` (one safetensors file, the layout in its header; kvlab.runtime.cache_file)."""
        tensors: dict[str, torch.Tensor] = {}
        layout = {
            **dataclasses.asdict(self.info),
            "model_identity": model_identity(self.lm),
            "cache": cache_layout(self.stored, tensors),
        }
        return write_cache_file(path, layout, tensors)


def cache_for(
    ctx: Context, method: Method, ratio: float, question: str | None, stored: CompressedKV, source: str | None = None
) -> KVCache:
    """``stored``, made by ``method`` at ``ratio`` from ``ctx``, as a KVCache (the lab's runs become one too).

    source: where the model loads from (default: where transformers loaded it from).
    """
    info = CacheInfo(
        method=method.name,
        options=method_options(method),
        ratio=float(ratio),
        question=question if method.uses_question() else None,
        document_sha256=text_sha256(ctx.text),
        context_tokens=ctx.length,
        prefix_len=ctx.prefix_len,
        model=ctx.lm.name,
        source=source or model_label(ctx.lm.model),
    )
    return KVCache(stored, ctx.lm, info)


def compress_loaded(
    lm: LoadedModel, document: str, method: Method, ratio: float, question: str | None = None
) -> KVCache:
    """Read ``document`` with ``lm`` and compress its cache with ``method`` at ``ratio`` (as a lab run does)."""
    ctx = prepare_context(lm, document)
    stored = method.compress(Request(ctx, float(ratio), question))
    return cache_for(ctx, method, ratio, question, stored)


def compress(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    document: str,
    method: str,
    ratio: float,
    question: str | None = None,
    preset: str | None = None,
    **knobs: Any,
) -> KVCache:
    """The compressed cache of ``document`` read by ``model`` (loaded by the caller: its device, its dtype).

    method: a name of ``kvlab methods``; ratio: the document's tokens over the
    keys kept per head (>= 1; each method's meaning in docs/methods.md);
    knobs: the method's options (``window=8``), over ``preset``'s;
    question: for a query-aware method (or setting), the question it compresses for.
    Raises MethodError for a bad method, knob or ratio (before any model work),
    ModelLoadError for a model kvlab does not support, DocumentError for a
    document that does not fit the model, each in one line.
    """
    chosen = get_method(method, preset=preset, **knobs)
    return compress_loaded(adopt(model, tokenizer), document, chosen, ratio, question)


def check_identity(path: Path, layout: dict, lm: LoadedModel) -> None:
    """CacheFileError, in one line, unless ``lm`` is the model the cache file was made with."""
    made, here = layout.get("model_identity") or {}, model_identity(lm)
    differ = [key for key in here if made.get(key) != here[key]]
    if differ:
        what = (
            "its weights differ"
            if differ == ["weights_sha256"]
            else ", ".join(
                f"{key} {made.get(key)} there, {here[key]} here" for key in differ if key != "weights_sha256"
            )
        )
        raise CacheFileError(
            f"{path} was made with another model ({layout.get('model')}; {what}): load it with that model"
        )


def load_into(path: str | Path, lm: LoadedModel) -> KVCache:
    """The cache saved at ``path`` (:meth:`KVCache.save`), read on with ``lm``; CacheFileError (one line) if refused."""
    path = Path(path)
    layout, tensors = read_cache_file(path)
    check_identity(path, layout, lm)
    try:
        info = CacheInfo(**{f.name: layout[f.name] for f in dataclasses.fields(CacheInfo)})
        stored = cache_from_layout(layout["cache"], tensors, lm.device)
    except KeyError as exc:
        raise CacheFileError(f"{path}: its layout has no {exc}") from None
    except CacheFileError as exc:
        raise CacheFileError(f"{path}: {exc}") from None
    return KVCache(stored, lm, info)


def load_cache(path: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> KVCache:
    """The cache saved at ``path``, for ``model`` (the one it was made with, loaded by the caller) and its tokenizer.

    Raises CacheFileError in one line for a file made with another model, of
    another format version, truncated or not a kvlab cache; nothing is half-loaded.
    """
    return load_into(path, adopt(model, tokenizer))
