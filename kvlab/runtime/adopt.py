"""A transformers model loaded anywhere becomes a model kvlab runs: one path for every caller.

The lab's loader (:func:`kvlab.models.load_model`) and a researcher's own code
(:func:`kvlab.api.compress`, :func:`kvlab.api.load_cache`) hand their model here
alike: it is checked (:func:`kvlab.runtime.model.check_supported`: attention kvlab
would get wrong is refused in one line), switched to kvlab's attention function
(:func:`kvlab.runtime.hooks.use_kvlab_attention`) and put in eval mode, and it
stays where it was loaded: its device and dtype are the model's own.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvlab.runtime.hooks import use_kvlab_attention
from kvlab.runtime.model import LoadedModel, check_supported


def model_label(model: PreTrainedModel) -> str:
    """What a model is called when its loader gives no name: where it was loaded from, else its type."""
    return getattr(model.config, "name_or_path", "") or model.config.model_type


def take_over(model: PreTrainedModel, label: str) -> PreTrainedModel:
    """``model`` checked (ModelLoadError naming ``label`` before anything changes on it), switched to
    kvlab's attention (idempotent) and put in eval mode; returns it."""
    check_supported(model, label)
    use_kvlab_attention(model)
    return model.eval()


def adopt(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str | None = None) -> LoadedModel:
    """``model`` and its tokenizer as kvlab's :class:`LoadedModel`, on the model's device and in its dtype.

    Raises ModelLoadError (one line naming the model and the feature) for a
    model kvlab does not support, before anything changes on it. Otherwise
    the model's attention implementation becomes kvlab's (idempotent): on a
    plain cache it computes what eager attention does; it is what lets a
    stored key carry a bias and heads keep different numbers of keys.
    """
    label = name or model_label(model)
    take_over(model, label)
    return LoadedModel(name=label, model=model, tokenizer=tokenizer, device=model.device, dtype=model.dtype)
