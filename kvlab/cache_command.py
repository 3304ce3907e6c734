"""A compressed cache kept on disk from the command line: ``kvlab run ... --save-cache F``, then ``kvlab ask``.

    python -m kvlab run --doc story.txt --method snapkv --ratio 4 --question "Who?" --save-cache story.kvcache
    python -m kvlab ask --cache story.kvcache --question "Where does the ferry cross?" [--model M] [--json]

The file is kvlab.api's (:meth:`kvlab.api.KVCache.save`: safetensors, the
layout as JSON in its header). ``ask`` loads the model the cache names
(``--model`` overrides it) and answers as ``run`` does, greedily, without
reading the document again. A file made with another model, of another
format version, truncated or not a cache: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from kvlab.api import cache_for, load_into
from kvlab.lab.inputs import check_answer_length, check_question, check_question_tokens
from kvlab.methods import Method
from kvlab.models import EMBEDDED, get_model
from kvlab.pipeline import Run
from kvlab.runtime.cache_file import CacheFileError, read_cache_file


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``ask`` subcommand on the CLI's subparsers."""
    ask = subparsers.add_parser("ask", help="answer a question from a compressed cache saved by `run --save-cache`")
    ask.add_argument(
        "--cache",
        required=True,
        metavar="FILE",
        help="a cache file written by `kvlab run --save-cache` (or kvlab.api's KVCache.save)",
    )
    ask.add_argument("--question", required=True, help="the question asked after the cached document")
    ask.add_argument(
        "--model", default=None, help="the model the cache was made with (default: the one the file names)"
    )
    ask.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap (default 48)")
    ask.add_argument("--json", action="store_true", help="print one JSON object")
    return ask


def model_source(spec: str | None) -> str:
    """What loads the run's model again from anywhere: the spec (``--model``, KVLAB_MODEL or the embedded
    model), a local path made absolute."""
    spec = (spec or os.environ.get("KVLAB_MODEL") or EMBEDDED).strip()
    return str(Path(spec).expanduser().resolve()) if Path(spec).expanduser().exists() else spec


def check_save_path(path: str) -> Path:
    """``--save-cache``'s file, refused before any work when it names a folder (CacheFileError)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise CacheFileError(f"--save-cache {path} is a folder: give a file name, e.g. {target / 'document.kvcache'}")
    return target


def save_run_cache(run: Run, method: Method, path: Path, spec: str | None) -> Path:
    """Write a finished ``kvlab run``'s compressed cache to ``path`` (kvlab.api's file)."""
    cache = cache_for(run.ctx, method, run.result.ratio, run.result.question, run.stored, model_source(spec))
    return cache.save(path)


def cmd_ask(args: argparse.Namespace) -> int:
    """Answer ``--question`` from the cache file ``--cache``; print the answer (or one JSON object)."""
    question = check_question(args.question)
    max_new_tokens = check_answer_length(args.max_new_tokens)
    layout, _ = read_cache_file(args.cache, tensors=False)  # a bad file is refused before a model loads
    lm = get_model(args.model or layout.get("source"))
    check_question_tokens(lm.tokenizer, question)
    cache = load_into(args.cache, lm)
    answer = cache.answer(question, max_new_tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "answer": answer.text,
                    "answer_ids": answer.ids,
                    "question": question,
                    "model": lm.name,
                    "method": cache.info.method,
                    "options": cache.info.options,
                    "ratio": cache.info.ratio,
                    "bytes_compressed": cache.nbytes,
                    "document_sha256": cache.info.document_sha256,
                }
            )
        )
    else:
        print(f"{cache.info.method} at {cache.info.ratio:g}x, {cache.nbytes:,} B stored, {lm.name}")
        print(f"answer  {answer.text}")
    return 0
