"""A model from a local folder (``KVLAB_MODEL=DIR``), served end to end by the CLI and by the app.

The folder is written here with ``save_pretrained``: a tiny random Qwen3
(2 layers, 4 query heads, 2 KV heads, head dim 16) and the embedded SmolLM2's
tokenizer, whose chat template kvlab's prompts use. Its answers are
gibberish; what is checked is that they come back, and that the folder's
model (its name, its geometry) produced them. Both front ends run as their
own process, the way a user starts them, with only the environment pointing
at the folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from transformers import AutoTokenizer

gradio_client = pytest.importorskip("gradio_client")
httpx = pytest.importorskip("httpx")

from test_app import _run  # noqa: E402 - the app tests' /run helper (their document and question)

from benchmarks.browser import free_port, serve_process  # noqa: E402
from kvlab.documents import read_document  # noqa: E402
from kvlab.models import EMBEDDED, resolve_source  # noqa: E402
from kvlab.prompts import context_tokens  # noqa: E402
from kvlab.runtime.model import ModelLoadError  # noqa: E402

pytestmark = pytest.mark.slow  # model folders loaded in subprocesses: left out of make test-fast

ROOT = Path(__file__).resolve().parents[1]
NAME = "kvlab-tiny-qwen3"
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
#: Seconds the app may take to come up (importing gradio and torch dominates: about 10 s here).
START_TIMEOUT_S = 90


def kv_bytes(context_tokens: int) -> int:
    """Bytes of a float32 KV cache of the tiny Qwen3 over ``context_tokens`` tokens: keys and values."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * context_tokens


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a random Qwen3 (safetensors) and the embedded model's tokenizer, written by save_pretrained."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    source = resolve_source(EMBEDDED)  # only its tokenizer is read (a few seconds), not its weights
    tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Untied: with tied embeddings and small random weights the model echoes its last input token, a
        # newline, so every answer would be blank; a random output head writes visible (random) words.
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("models") / NAME
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    return folder


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any model or Space settings, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KVLAB_MODEL", "KVLAB_MODELS", "KVLAB_ALLOWED_MODELS", "KVLAB_SPACE", "SPACE_ID")
    }
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def test_cli_runs_a_model_from_a_folder(qwen3_dir: Path, tmp_path: Path) -> None:
    doc = tmp_path / "keeper.txt"
    doc.write_text(
        "The lighthouse keeper on Gull Island is named Marta Venn. "
        "She rows to the mainland every Friday to buy lamp oil and bread.\n",
        encoding="utf-8",
    )
    argv = [
        "run",
        "--doc",
        str(doc),
        "--method",
        "snapkv",
        "--ratio",
        "2",
        "--question",
        "Who keeps the lighthouse?",
        "--max-new-tokens",
        "8",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab", *argv],
        cwd=ROOT,
        env=_env(KVLAB_MODEL=str(qwen3_dir)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()

    def reported(label: str) -> str:
        """The value on the summary's line for ``label`` (labels are padded with spaces)."""
        found = [line[len(label) :].strip() for line in lines if re.match(re.escape(label) + r"\s{2,}", line)]
        assert len(found) == 1, (label, proc.stdout)
        return found[0]

    assert reported("model") == NAME
    # The folder's geometry, not the embedded model's (30 layers, 3 KV heads, head dim 64): a float32
    # cache of 2 layers x 2 KV heads x 16 over the chat-templated document.
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    tokens = context_tokens(tokenizer, read_document(str(doc)))
    assert reported("method").startswith(f"snapkv at 2x  ({tokens.doc_len} document tokens")
    assert reported("memory").startswith(f"{kv_bytes(tokens.ids.numel()):,} B full -> ")
    assert reported("answer (full)") and reported("answer (compressed)")


@pytest.fixture(scope="module")
def folder_app_url(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python app.py`` with KVLAB_MODEL=the folder, as a Space (KVLAB_SPACE=1: the allowlist applies)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("app") / "app.log"
    env = _env(
        KVLAB_MODEL=str(qwen3_dir),
        KVLAB_SPACE="1",
        GRADIO_SERVER_NAME="127.0.0.1",
        GRADIO_SERVER_PORT=str(port),
        GRADIO_ANALYTICS_ENABLED="False",
    )
    with serve_process([sys.executable, "app.py"], ROOT, env, log_path, START_TIMEOUT_S) as url:
        yield url


def test_app_serves_a_model_from_a_folder(folder_app_url: str, qwen3_dir: Path) -> None:
    client = gradio_client.Client(folder_app_url, verbose=False)
    props = {c["props"].get("elem_id"): c["props"] for c in client.config["components"] if c.get("props")}
    # The page names the folder's model as the default, and is built for its geometry.
    menu = props["kvlab-model"]
    assert menu["value"] == str(qwen3_dir)
    assert [list(c) for c in menu["choices"]][0] == [f"{NAME} (default)", str(qwen3_dir)]
    assert props["kvlab-layer"]["maximum"] == LAYERS - 1 and props["kvlab-head"]["maximum"] == KV_HEADS - 1
    # One Explore run with the default model: the folder's, which answers (random words).
    out = _run(client, method="snapkv", ratio=2, max_new_tokens=8, layer=LAYERS - 1, head=KV_HEADS - 1)
    summary, full, compressed = out[0], out[1], out[2]
    assert f"with {NAME}:" in summary and "at **2x**" in summary
    assert full.strip() and compressed.strip()
    assert out[11].startswith(f"Layer {LAYERS - 1}, KV head {KV_HEADS - 1}:")


def test_a_folder_must_hold_a_model_and_its_tokenizer(
    qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused in one line before transformers reads anything: it would fail with a long message about
    # tokenizer backends, or build an empty tokenizer from a config alone ("the document has no tokens").
    with pytest.raises(ModelLoadError, match="is not a model folder: it has no config.json"):
        resolve_source(str(tmp_path))
    (tmp_path / "config.json").write_bytes((qwen3_dir / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        resolve_source(str(tmp_path))
    # "." is named after the folder it stands for.
    monkeypatch.chdir(qwen3_dir)
    assert resolve_source(".").label == NAME and resolve_source(str(qwen3_dir)).label == NAME
