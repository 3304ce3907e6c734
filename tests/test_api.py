"""kvlab in a researcher's own code (kvlab.api): their model, answers through ``model.generate``, a cache on disk.

The reference is always the lab's own path on a model kvlab built: the
document read by :func:`kvlab.context.prepare_context`, the method's
``compress``, and :func:`kvlab.runtime.decode.greedy`'s tokens. The tested
side is a second model with the same weights, as a researcher loads it (under
transformers' own sdpa attention), given to :func:`kvlab.api.compress` and
asked through ``model.generate(..., custom_generate=cache.decode)``; then the
cache saved, loaded back, and the file refused when it must be. README's
"Use it in your own code" runs here too, on a tiny model of every family of
the architecture matrix and on the embedded model, and the CLI's
``run --save-cache`` / ``ask`` on a tiny model folder.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from conftest import tiny_tokenizer, with_template
from kvlab import api
from kvlab.cli import main
from kvlab.context import prepare_context
from kvlab.methods import REGISTRY, Request, get_method
from kvlab.prompts import question_tokens
from kvlab.runtime.cache_file import LAYOUT_KEY, VERSION, CacheFileError, cache_layout
from kvlab.runtime.decode import greedy, stop_token_ids
from kvlab.runtime.hooks import ATTENTION_NAME
from kvlab.runtime.model import LoadedModel, ModelLoadError
from kvlab.testing.device_suite import suite_model
from kvlab.testing.fake_cuda import fake_cuda, is_fake, to_fake_cuda
from kvlab.testing.random_models import FAMILIES, SPECIAL_IDS, TINY, random_model, save_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(72))
QUESTION = "w3 w5 w8"
NEW_TOKENS = 10
#: A window shorter than the document: the hybrid model's local layers drop keys.
W = 16

#: One method of each family, each on a tiny model of a family: (method, knobs, family, config overrides).
FAMILY_CASES = {
    "eviction": ("snapkv", {}, "llama", {}),
    "eviction, keys re-rotated": ("snapkv", {"rerotate": True}, "qwen3", {}),
    "compaction with biases": ("attention_matching", {}, "qwen3", {}),
    "quantised": ("kivi", {"bits": 4}, "mistral", {}),
    "mixed": ("beaconkv_mixed", {"rest": "4bit"}, "qwen2", {}),
    "hybrid windows": ("attention_matching", {}, "gemma3", {"sliding_window": W}),
}


def strip_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """transformers keeps the end-of-sequence token it stopped on; kvlab's loop stops before it."""
    return tokens[:-1] if tokens and tokens[-1] in stops else tokens


def generated(model, cache: api.KVCache, question: str, stops: set[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """The new tokens of ``model.generate`` from ``cache`` (greedy), end-of-sequence token dropped."""
    ids = cache.prompt(question)
    out = model.generate(
        ids, custom_generate=cache.decode, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(stops)
    )
    assert torch.equal(out[0, : ids.shape[1]].cpu(), ids[0].cpu())
    return strip_stop(out[0, ids.shape[1] :].tolist(), stops)


def theirs(family: str, overrides: dict) -> tuple[torch.nn.Module, object]:
    """The same seeded weights as ``random_model(family, overrides)``, as a researcher has them: transformers'
    sdpa attention, nothing of kvlab's switched on."""
    lm = random_model(family, overrides)
    lm.model.set_attn_implementation("sdpa")
    return lm.model, lm.tokenizer


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_generate_answers_as_kvlabs_own_decode(case):
    method, knobs, family, overrides = FAMILY_CASES[case]
    lab = random_model(family, overrides)
    ctx = prepare_context(lab, DOC)
    stored = get_method(method, **knobs).compress(Request(ctx, 4.0, QUESTION))
    stops = stop_token_ids(lab)
    want = greedy(lab, stored, question_tokens(lab.tokenizer, QUESTION), NEW_TOKENS).ids
    assert want, "the reference answer is empty: nothing would be compared"

    model, tokenizer = theirs(family, overrides)
    cache = api.compress(model, tokenizer, DOC, method, 4, question=QUESTION, **knobs)
    assert model.config._attn_implementation == ATTENTION_NAME  # switched by compress
    assert cache.nbytes == stored.nbytes and cache.stored.position_shift == stored.position_shift
    assert generated(model, cache, QUESTION, stops) == want
    if overrides.get("sliding_window"):  # the local layers kept their window only
        assert any(seg.fate == "window" for layer in cache.stored.layers for seg in layer)


def test_compress_leaves_the_cache_untouched_and_serves_many_questions():
    model, tokenizer = theirs("llama", {})
    cache = api.compress(model, tokenizer, DOC, "attention_matching", 4)
    before = [seg.view().keys.clone() for layer in cache.stored.layers for seg in layer]
    stops = stop_token_ids(cache.lm)
    first = generated(model, cache, QUESTION, stops)
    generated(model, cache, "w9 w10", stops)
    assert generated(model, cache, QUESTION, stops) == first
    after = [seg.view().keys for layer in cache.stored.layers for seg in layer]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_unsupported_attention_is_refused_in_one_line_and_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    config = Gemma3TextConfig(**{**TINY, **FAMILIES["gemma3"].tiny, **SPECIAL_IDS, "attn_logit_softcapping": 50.0})
    model = Gemma3ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    with pytest.raises(ModelLoadError) as refused:
        api.compress(model, tiny_tokenizer(), DOC, "snapkv", 4)
    assert "\n" not in str(refused.value)
    assert "attention logit softcapping (50) is not supported by kvlab" in str(refused.value)
    assert model.config._attn_implementation == "eager"


def test_generate_refuses_what_a_stored_cache_cannot_answer_in_one_line():
    model, tokenizer = theirs("llama", {})
    cache = api.compress(model, tokenizer, DOC, "snapkv", 4)
    ids = cache.prompt(QUESTION)
    for kwargs, message in [
        ({"input_ids": ids.repeat(2, 1)}, "one sequence at a time"),
        ({"input_ids": ids, "num_beams": 2}, "num_beams=2 is not supported"),
    ]:
        with pytest.raises(ValueError, match=message) as refused:
            model.generate(custom_generate=cache.decode, max_new_tokens=3, **kwargs)
        assert "\n" not in str(refused.value)
    other, _ = theirs("llama", {})
    with pytest.raises(ValueError, match="with the model it was made with"):
        other.generate(ids, custom_generate=cache.decode, max_new_tokens=3)


def test_generate_follows_transformers_settings():
    """max_new_tokens caps the answer and min_new_tokens' processor keeps end-of-sequence away (the picks are made
    on the processed scores); return_dict_in_generate gives the sequences and the scores."""
    model, tokenizer = theirs("qwen2", {})
    cache = api.compress(model, tokenizer, DOC, "snapkv", 4)
    ids = cache.prompt(QUESTION)
    eos = model.generation_config.eos_token_id
    raw = model.generate(
        ids,
        custom_generate=cache.decode,
        max_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert int(raw.logits[0].argmax()) != eos, "the first greedy token is end-of-sequence: nothing would be kept away"
    out = model.generate(
        ids,
        custom_generate=cache.decode,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    new = out.sequences[0, ids.shape[1] :].tolist()
    assert len(new) == 4 and len(out.scores) == 4 and eos not in new
    assert [int(s.argmax()) for s in out.scores] == new
    assert all(float(s[0, eos]) == float("-inf") for s in out.scores)


# --- save and load -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ctx():
    """The tests' tiny Llama with a chat template (a template prefix to keep) and the document read."""
    lm = with_template(random_model("llama"))
    return prepare_context(lm, DOC)


def tensors_of(stored) -> dict[str, torch.Tensor]:
    """Every tensor ``stored`` holds, by its place in the cache (kvlab.runtime.cache_file's names)."""
    tensors: dict[str, torch.Tensor] = {}
    cache_layout(stored, tensors)
    return tensors


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN-safe, any dtype, 0-dim included)."""
    return t.flatten().contiguous().view(torch.uint8)


#: A random model writes its summary to the cap: a short one keeps the summary's context within the tiny window.
ROUND_TRIP_KNOBS = {"summary_am": {"summary_tokens": 32}, "summarisation": {"max_tokens": 32}}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_survives_a_round_trip_bit_for_bit(tiny_ctx, name, tmp_path):
    """The same bytes stored, every tensor equal bit for bit and on the model's device, the same attention
    view of every layer, the same logical positions; for the quick methods the same answer too."""
    method = get_method(name, **ROUND_TRIP_KNOBS.get(name, {}))
    stored = method.compress(Request(tiny_ctx, 4.0, QUESTION))
    cache = api.cache_for(tiny_ctx, method, 4.0, QUESTION, stored)
    path = cache.save(tmp_path / f"{name}.kvcache")
    back = api.load_into(path, tiny_ctx.lm)
    assert back.nbytes == stored.nbytes and back.stored.breakdown() == stored.breakdown()
    assert (back.stored.logical_len, back.stored.position_shift) == (stored.logical_len, stored.position_shift)
    want, got = tensors_of(stored), tensors_of(back.stored)
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(raw_bytes(want[key]), raw_bytes(got[key])), key
    for layer in range(stored.n_layers):
        a, b = stored.layer_view(layer), back.stored.layer_view(layer)
        assert all(torch.equal(x, y) for x, y in [(a.keys, b.keys), (a.values, b.values), (a.bias, b.bias)]), layer
    assert back.info == cache.info and back.info.method == name
    if name in ("snapkv", "attention_matching"):
        assert back.answer(QUESTION, 8).ids == cache.answer(QUESTION, 8).ids


def test_the_file_is_safetensors_with_the_layout_as_json_in_its_header(tiny_ctx, tmp_path):
    method = get_method("attention_matching")
    cache = api.cache_for(tiny_ctx, method, 4.0, QUESTION, method.compress(Request(tiny_ctx, 4.0)))
    path = cache.save(tmp_path / "am.kvcache")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        layout = json.loads(f.metadata()[LAYOUT_KEY])
        names = set(f.keys())
    assert (layout["format"], layout["version"]) == ("kvlab-cache", VERSION)
    assert layout["method"] == "attention_matching" and layout["ratio"] == 4.0 and layout["question"] is None
    assert layout["options"]["budgets"] == method.options.budgets
    assert layout["document_sha256"] == hashlib.sha256(DOC.encode("utf-8")).hexdigest()
    assert layout["cache"]["logical_len"] == tiny_ctx.length and layout["cache"]["bytes"] == cache.nbytes
    assert layout["model_identity"]["layers"] == 2 and len(layout["model_identity"]["weights_sha256"]) == 64
    segment = layout["cache"]["layers"][0][-1]
    assert segment["class"] == "kvlab.runtime.cache.DenseSegment" and segment["fields"]["fate"] == "compacted"
    assert segment["fields"]["bias"]["tensor"] in names  # the fitted biases are stored tensors


def refused(path: Path, lm: LoadedModel) -> str:
    """The one-line refusal of loading ``path`` with ``lm``."""
    with pytest.raises(CacheFileError) as exc:
        api.load_into(path, lm)
    message = str(exc.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.fixture
def saved(tiny_ctx, tmp_path) -> Path:
    method = get_method("snapkv")
    return api.cache_for(tiny_ctx, method, 4.0, None, method.compress(Request(tiny_ctx, 4.0))).save(
        tmp_path / "s.kvcache"
    )


def test_a_cache_is_refused_by_another_model(saved, tiny_ctx):
    other_weights = with_template(random_model("llama", seed=1))  # the same geometry, other weights
    assert "its weights differ" in refused(saved, other_weights)
    other_family = with_template(random_model("qwen3"))
    assert "model_type llama there, qwen3 here" in refused(saved, other_family)
    # Its own model reads it back whole: the bytes of the cache the method makes again (SnapKV is deterministic).
    assert api.load_into(saved, tiny_ctx.lm).nbytes == get_method("snapkv").compress(Request(tiny_ctx, 4.0)).nbytes


def bumped(saved: Path, target: Path) -> Path:
    """``saved`` rewritten with safetensors itself, its layout's format version one higher."""
    with safe_open(str(saved), framework="pt", device="cpu") as f:
        layout = json.loads(f.metadata()[LAYOUT_KEY])
    save_file(load_file(str(saved)), str(target), metadata={LAYOUT_KEY: json.dumps({**layout, "version": VERSION + 1})})
    return target


def test_a_cache_of_another_format_version_is_refused(saved, tiny_ctx, tmp_path):
    message = refused(bumped(saved, tmp_path / "v2.kvcache"), tiny_ctx.lm)
    assert f"format version {VERSION + 1}; this kvlab reads version {VERSION}" in message


@pytest.mark.parametrize("keep", [0.3, 0.999])
def test_a_truncated_cache_is_refused(saved, tiny_ctx, tmp_path, keep):
    data = saved.read_bytes()
    cut = tmp_path / "cut.kvcache"
    cut.write_bytes(data[: int(len(data) * keep)])
    assert "is not a whole safetensors file" in refused(cut, tiny_ctx.lm)


def test_a_file_that_is_not_a_whole_kvlab_cache_is_refused(saved, tiny_ctx, tmp_path):
    assert "no such cache file" in refused(tmp_path / "absent.kvcache", tiny_ctx.lm)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2, device="cpu")}, str(plain))
    assert "not a kvlab cache" in refused(plain, tiny_ctx.lm)
    with safe_open(str(saved), framework="pt", device="cpu") as f:
        metadata = f.metadata()
    tensors = load_file(str(saved))
    tensors.pop(sorted(tensors)[0])
    missing = tmp_path / "missing.kvcache"
    save_file(tensors, str(missing), metadata=metadata)
    assert "is missing" in refused(missing, tiny_ctx.lm)


def test_save_and_load_keep_every_tensor_on_the_models_device(tmp_path, monkeypatch):
    """Under the CUDA stand-in (kvlab.testing.fake_cuda): compress, answer through generate, save, load."""
    monkeypatch.setenv("KVLAB_KERNELS", "torch")  # the Triton kernels have their own tests
    lm = suite_model(name="fake-cuda-llama")
    to_fake_cuda(lm.model)
    with fake_cuda():
        cache = api.compress(
            lm.model, lm.tokenizer, "The ferry crosses the river at dawn. " * 6, "attention_matching", 4
        )
        assert cache.lm.device.type == "cuda"
        ids = cache.prompt("Who?")
        out = lm.model.generate(ids, custom_generate=cache.decode, max_new_tokens=3, do_sample=False)
        back = api.load_cache(cache.save(tmp_path / "c.kvcache"), lm.model, lm.tokenizer)
        again = lm.model.generate(ids, custom_generate=back.decode, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, again)
    loaded = [
        t for layer in back.stored.layers for seg in layer for t in vars(seg).values() if isinstance(t, torch.Tensor)
    ]
    assert loaded and all(is_fake(t) for t in loaded)


# --- README's "Use it in your own code" ---------------------------------------------------------------


def readme_example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Use it in your own code", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_readme(lm: LoadedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """Run README's example with ``lm`` standing for the model it names, in ``tmp_path``; its namespace,
    with ``made``: the cache compress returned (the example then rebinds ``cache`` to the loaded one)."""
    name = re.search(r'name = "([^"]+)"', readme_example()).group(1)
    loaders = {AutoModelForCausalLM: lm.model, AutoTokenizer: lm.tokenizer}
    for cls, value in loaders.items():
        monkeypatch.setattr(
            cls, "from_pretrained", classmethod(lambda c, spec, _v=value, **_: _v if spec == name else None)
        )
    made = []
    compress = api.compress
    monkeypatch.setattr(api, "compress", lambda *a, **k: made.append(compress(*a, **k)) or made[-1])
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    return {**namespace, "made": made[0]}


def check_readme_run(ns: dict, lm: LoadedModel) -> None:
    """The example's answer is kvlab's own greedy answer from the cache it made, and the cache it loaded
    back stores the same bytes and answers the same."""
    made, loaded, ids, out = ns["made"], ns["cache"], ns["ids"], ns["out"]
    eos = lm.model.generation_config.eos_token_id
    new = strip_stop(out[0, ids.shape[1] :].tolist(), set(eos if isinstance(eos, list) else [eos]))
    want = greedy(lm, made.stored, ids[0].cpu(), 24).ids
    # kvlab's own loop also stops at end-of-turn markers the generation config may not name.
    assert new[: len(want)] == want and (len(new) == len(want) or new[len(want)] in stop_token_ids(lm))
    assert loaded.nbytes == made.nbytes and loaded is not made
    again = lm.model.generate(ids, custom_generate=loaded.decode, max_new_tokens=24, do_sample=False)
    assert torch.equal(again, out)


ARCHITECTURES = {family: (family, {}) for family in FAMILIES} | {"gemma3-windowed": ("gemma3", {"sliding_window": W})}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_readme_example_runs_on_every_family(arch, monkeypatch, tmp_path):
    lm = random_model(*ARCHITECTURES[arch])
    ns = run_readme(lm, monkeypatch, tmp_path)
    assert (tmp_path / "anna.kvcache").is_file()
    check_readme_run(ns, lm)


@pytest.mark.slow  # the embedded model (loaded once per session)
def test_the_readme_example_runs_on_the_embedded_model(embedded, monkeypatch, tmp_path, capsys):
    ns = run_readme(embedded, monkeypatch, tmp_path)
    check_readme_run(ns, embedded)
    assert "tern" in capsys.readouterr().out.lower()


# --- the command line -------------------------------------------------------------------------------


def model_folder(path: Path, seed: int) -> Path:
    """A tiny random Llama and the word tokenizer, written by save_pretrained (``--model DIR``)."""
    return save_tiny_llama(path, tiny_tokenizer(), seed, initializer_range=TINY["initializer_range"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return model_folder(root / "tiny", 0), model_folder(root / "other", 1)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_saves_the_cache_and_ask_answers_from_it(folders, tmp_path, capsys, own_models):
    doc, file = tmp_path / "doc.txt", tmp_path / "caches" / "doc.kvcache"
    doc.write_text(DOC)
    code, out, err = run_cli(
        [
            "run",
            "--doc",
            str(doc),
            "--method",
            "snapkv",
            "--ratio",
            "4",
            "--question",
            QUESTION,
            "--window",
            "8",
            "--max-new-tokens",
            "6",
            "--model",
            str(folders[0]),
            "--json",
            "--save-cache",
            str(file),
        ],
        capsys,
    )
    assert code == 0, err
    result = json.loads(out)
    assert file.is_file() and str(file) in err
    code, out, err = run_cli(
        ["ask", "--cache", str(file), "--question", QUESTION, "--max-new-tokens", "6", "--json"], capsys
    )  # no --model: the one the file names
    assert code == 0, err
    asked = json.loads(out)
    assert asked["answer"] == result["answer_compressed"]
    assert asked["bytes_compressed"] == result["bytes_compressed"]
    assert (asked["method"], asked["ratio"], asked["options"]["window"]) == ("snapkv", 4.0, 8)


def test_cli_refuses_a_bad_cache_in_one_line_with_status_2(folders, tmp_path, capsys, own_models):
    doc, file = tmp_path / "doc.txt", tmp_path / "doc.kvcache"
    doc.write_text(DOC)
    base = [
        "run",
        "--doc",
        str(doc),
        "--method",
        "kivi",
        "--ratio",
        "4",
        "--question",
        QUESTION,
        "--max-new-tokens",
        "2",
        "--model",
        str(folders[0]),
    ]
    code, _, err = run_cli([*base, "--save-cache", str(tmp_path)], capsys)
    assert (code, err.count("\n")) == (2, 1) and "is a folder" in err
    assert run_cli([*base, "--save-cache", str(file)], capsys)[0] == 0
    cut = tmp_path / "cut.kvcache"
    cut.write_bytes(file.read_bytes()[:-64])
    for argv, message in [
        (["--cache", str(tmp_path / "absent.kvcache")], "no such cache file"),
        (["--cache", str(cut)], "is not a whole safetensors file"),
        (["--cache", str(bumped(file, tmp_path / "v2.kvcache"))], f"format version {VERSION + 1}"),
        (["--cache", str(file), "--model", str(folders[1])], "was made with another model"),
    ]:
        code, out, err = run_cli(["ask", "--question", QUESTION, *argv], capsys)
        errors = [line for line in err.splitlines() if "error" in line]  # a model's load may draw its progress bar
        assert (code, out, len(errors)) == (2, "", 1), err
        assert errors[0].startswith("kvlab: error: ") and message in errors[0]
