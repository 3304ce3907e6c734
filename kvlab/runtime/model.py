"""A loaded model as the runtime sees it: its tokenizer, device and dtype, each layer's geometry (window,
scaling, RoPE), and the attention features kvlab refuses because it would get them wrong.

Loading a model from a name (the embedded GGUF, a packaged one, a hub id, a folder) is
:mod:`kvlab.models`, above the runtime; a model loaded elsewhere becomes a :class:`LoadedModel` the same way
(:func:`check_supported`, then :func:`kvlab.runtime.hooks.use_kvlab_attention`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names what was tried."""


@dataclass(frozen=True)
class LayerGeometry:
    """How one attention layer reads its cache.

    window: transformers' ``sliding_window`` when it can drop a key within the
    model's context (a query sees itself and the ``window - 1`` tokens before
    it; the layer keeps those), None for a layer that sees every key.
    scaling: the module's own factor on q.k (Gemma 3's query_pre_attn_scalar ** -0.5).
    rope_type: the layer type its rotary embedding is asked for (Gemma 3's
    local and global RoPEs), None where the model has one RoPE for every layer.
    """

    window: int | None
    scaling: float
    rope_type: str | None


@dataclass
class LoadedModel:
    """A model ready for kvlab: its tokenizer, geometry and where it runs."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype

    @property
    def n_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.model.config.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @functools.cached_property
    def geometry(self) -> list[LayerGeometry]:
        """Per layer, its window, scaling and RoPE (:func:`layer_geometry`), read once."""
        return layer_geometry(self.model)

    @property
    def compressed_layers(self) -> list[int]:
        """The layers a method compresses: those that see every key (a window layer keeps its window)."""
        return [i for i, g in enumerate(self.geometry) if g.window is None]


def unsupported_message(name: str, problems: list[tuple[str, str]]) -> str:
    """One line: ``"<name>: <feature> is not supported by kvlab (<why>)"``, features joined when several."""
    features = [feature for feature, _ in problems]
    listed = features[0] if len(features) == 1 else ", ".join(features[:-1]) + " and " + features[-1]
    verb = "is" if len(features) == 1 else "are"
    return f"{name}: {listed} {verb} not supported by kvlab ({'; '.join(why for _, why in problems)})"


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's attention modules, in layer order (every transformers attention class has
    ``layer_idx`` and ``scaling``)."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    return sorted(found, key=lambda m: m.layer_idx)


def layer_geometry(model: PreTrainedModel) -> list[LayerGeometry]:
    """Per layer, how it attends: the window it sees, its scaling, the RoPE it rotates by.

    Qwen2, Qwen3 and Gemma 3 keep a per-layer window on the attention module
    (None on full layers); Mistral reads ``config.sliding_window`` in every
    layer. A window at least ``max_position_embeddings`` long never drops a
    key: full attention.
    """
    cfg = model.config.get_text_config()
    horizon = getattr(cfg, "max_position_embeddings", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    out = []
    for m in _attention_modules(model):
        window = getattr(m, "sliding_window", getattr(cfg, "sliding_window", None))
        bites = bool(window) and (horizon is None or window < horizon)
        scaling = float(m.scaling) if m.scaling is not None else float(m.head_dim) ** -0.5
        rope_type = types[m.layer_idx] if per_type and types else None
        out.append(LayerGeometry(int(window) if bites else None, scaling, rope_type))
    return out


def unsupported_features(model: PreTrainedModel) -> list[tuple[str, str]]:
    """(feature, why kvlab would get it wrong) for each attention feature of ``model`` kvlab does not handle.

    kvlab's attention function (kvlab.runtime.hooks) builds its own causal
    (and, on window layers, sliding-window) mask and applies no ``softcap``;
    each layer's window, scaling and RoPE come from :func:`layer_geometry`.
    A model that needs anything else would get silently wrong numbers, so it
    is refused instead.
    """
    # A multimodal model (Gemma 3 4B+) keeps the language model's settings in its text config.
    cfg = model.config.get_text_config()
    problems: list[tuple[str, str]] = []
    if getattr(cfg, "use_bidirectional_attention", False):
        problems.append(("bidirectional attention", "kvlab's attention is causal"))
    types = list(getattr(cfg, "layer_types", None) or [])
    for kind in sorted(set(types) - {"full_attention", "sliding_attention"}):
        problems.append((f"{kind} layers", "kvlab's attention knows full and sliding-window layers only"))
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap:
        problems.append((f"attention logit softcapping ({softcap:g})", "kvlab's attention applies no tanh cap"))
    return problems


def check_supported(model: PreTrainedModel, name: str | None = None) -> None:
    """ModelLoadError, in one line naming the model and the feature, for a model kvlab would get wrong.

    Called before any work wherever a LoadedModel is built from a model
    (:func:`kvlab.models.load_model`, :mod:`kvlab.testing.random_models`). See :func:`unsupported_features`.
    """
    problems = unsupported_features(model)
    if problems:
        label = name or getattr(model.config, "name_or_path", "") or model.config.model_type
        raise ModelLoadError(unsupported_message(label, problems))
