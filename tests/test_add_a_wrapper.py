"""A selection wrapper is one file and its Learn text: a throwaway stage, written into the wrappers folder
and nothing else, becomes a knob of every scoring method in the CLI, the app and the docs, and its declared
exclusion is refused in one line.

The wrapper (:data:`WRAPPER`, "oldest": each head keeps a share of its budget for the oldest document
tokens) is written as ``oldest.py``, its Learn text as ``oldest.md``, into a temporary folder appended to the
``kvlab.compression.wrappers`` package's ``__path__``, so that other test runs sharing this checkout
never see it. kvlab.compression.selection assembles its knobs when it is imported, so the folder is
appended in a fresh interpreter (:data:`CHILD`) before anything imports the methods; the test reads
back what that interpreter saw, as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_add_a_method import tiny_folder  # noqa: F401  (a fixture: a 2-layer random Llama saved as a model folder)

from kvlab.compression.selection import STAGES
from kvlab.methods import MethodError, get_method

ROOT = Path(__file__).resolve().parent.parent

#: Its Learn sentences, ``oldest.md`` beside it.
WRAPPER_LEARN = "`oldest_share` (Oldest): each head keeps that share of its budget for the oldest document tokens.\n"

WRAPPER = '''
from dataclasses import dataclass

import torch

from kvlab.compression.options import knob
from kvlab.compression.stage import Stage


@dataclass(frozen=True)
class OldestKnobs:
    oldest_share: float = knob(
        0.0, "share of each head's budget kept for the oldest document tokens", low=0.0, high=1.0
    )


def keep_oldest(req, scores, head, opts):
    """Per layer [H_kv, T_doc]: each head's first int(oldest_share * budget) tokens at +inf."""
    out = []
    for s, budgets in zip(scores, head.budgets):
        first = (budgets.to(s.device).double() * opts.oldest_share).long()  # [H_kv]
        oldest = torch.arange(s.shape[-1], device=s.device).unsqueeze(0) < first.unsqueeze(1)
        out.append(torch.where(oldest, float("inf"), s.float()))
    return out, head


STAGE = Stage(
    name="oldest",
    order=25,
    knobs=OldestKnobs,
    preset={"oldest_share": 0.5},
    excludes={"chunkkv": "chunks are the same in every head"},
    scores=keep_oldest,
    records=("oldest_share",),
)
'''

#: The fresh interpreter: argv = [the wrapper's folder, the tiny model's folder, a document file].
CHILD = """
import contextlib, io, json, sys
import kvlab.compression.wrappers
kvlab.compression.wrappers.__path__.append(sys.argv[1])
import torch
from kvlab.cli import main
from kvlab import catalog
from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.testing.random_models import tiny_llama

seen = {}
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["run", "--help"])
seen["run_help"] = out.getvalue()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    seen["run_code"] = main(["run", "--doc", sys.argv[3], "--method", "knorm", "--ratio", "4", "--question", "w3 w5",
                             "--max-new-tokens", "2", "--model", sys.argv[2], "--json",
                             "--oldest-share", "0.5"])
seen["run"] = json.loads(out.getvalue())
seen["knobs"] = {name: [(k.name, k.default, k.allowed) for k in knobs] for name, knobs in catalog.all_knobs().items()}
seen["presets"] = catalog.presets("knorm")
seen["markdown"] = catalog.method_markdown("knorm")
seen["table"] = catalog.methods_table()
try:
    get_method("snapkv", oldest_share=0.5, granularity="chunk")
except MethodError as exc:
    seen["refused"] = str(exc)

ctx = prepare_context(tiny_llama(), " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96)))
stored = get_method("knorm", oldest_share=0.5).compress(Request(ctx, 4.0))
seen["prefix"], seen["budget"] = ctx.prefix_len, int(Request(ctx, 4.0).doc_budget)
seen["keys"] = [k[:, ctx.prefix_len:].double().tolist() for k in ctx.full.keys]
seen["kept"] = [[sorted(i - ctx.prefix_len for i in stored.fates(layer, head) if i >= ctx.prefix_len)
                 for head in range(ctx.lm.n_kv_heads)] for layer in range(ctx.lm.n_layers)]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def seen(tmp_path_factory, tiny_folder):  # noqa: F811
    """What the fresh interpreter with the wrapper file in the package's folders saw."""
    folder = tmp_path_factory.mktemp("wrappers")
    (folder / "oldest.py").write_text(WRAPPER, encoding="utf-8")
    (folder / "oldest.md").write_text(WRAPPER_LEARN, encoding="utf-8")
    doc = folder / "doc.txt"
    doc.write_text(" ".join(f"w{(i * 7) % 60 + 2}" for i in range(60)))
    ran = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), str(tiny_folder), str(doc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    return json.loads(ran.stdout.splitlines()[-1])


def test_kvlab_run_has_its_flag_and_a_run_honours_it(seen):
    assert "--oldest-share OLDEST_SHARE" in seen["run_help"]
    assert "share of each head's budget kept for the oldest document tokens" in " ".join(seen["run_help"].split())
    assert seen["run_code"] == 0 and seen["run"]["method"] == "knorm"
    assert seen["run"]["details"]["oldest_share"] == 0.5  # the stage's recorded knob, in the stored cache's meta


def test_the_knobs_every_scoring_method_gets_include_it_in_its_order(seen):
    """Every method that takes the wrappers' knobs (the app's Advanced widgets are these) has it, between
    ChunkKV's and CriticalKV's (its order 25 between 20 and 30); the others do not."""
    wrapped = {name for name, knobs in seen["knobs"].items() if any(key == "granularity" for key, *_ in knobs)}
    assert {"knorm", "snapkv", "tova", "kvzip"} <= wrapped
    for name, knobs in seen["knobs"].items():
        keys = [key for key, *_ in knobs]
        if name in wrapped:
            assert ["oldest_share", 0.0, "a number from 0 to 1"] in knobs
            at = keys.index("oldest_share")
            assert keys[at - 2 : at + 2] == ["granularity", "chunk_size", "oldest_share", "critical"]
        else:
            assert "oldest_share" not in keys


def test_the_docs_have_its_knob_its_preset_and_its_learn_text(seen):
    assert seen["presets"]["oldest"] == {"oldest_share": 0.5}
    assert "| `oldest_share` | `0.0` | a number from 0 to 1 |" in seen["markdown"]
    assert "`oldest_share` (Oldest): each head keeps" in seen["markdown"]
    footnote = seen["table"].splitlines()[-1]
    assert "`chunkkv`, `oldest`, `criticalkv`" in footnote  # the presets in the stages' order


def test_its_declared_exclusion_is_refused_in_one_line(seen):
    assert seen["refused"] == "snapkv: granularity=chunk needs oldest_share=0.0: chunks are the same in every head"


def test_each_head_keeps_its_oldest_share_then_its_best_by_the_key_norm(seen):
    """KNorm's score worked from the keys (s_j = -||k_j||): each head keeps its first int(0.5 B) document
    tokens, then the best of the rest, B = 96 / 4 = 24."""
    budget, first = seen["budget"], seen["budget"] // 2
    assert seen["prefix"] == 0 and budget == 24
    for layer, heads in enumerate(seen["kept"]):
        for head, got in enumerate(heads):
            norms = [sum(x * x for x in key) ** 0.5 for key in seen["keys"][layer][head]]
            rest = sorted(range(first, len(norms)), key=lambda j: norms[j])[: budget - first]
            assert got == sorted([*range(first), *rest]), (layer, head)


def test_the_shipped_stages_exclusions_are_refused_in_one_line():
    """ChunkKV's declared exclusions (AdaKV's budgets, CriticalKV), each with both presets on."""
    declared = {(stage.name, other): why for stage in STAGES for other, why in stage.excludes.items()}
    assert set(declared) == {("chunkkv", "adakv"), ("chunkkv", "criticalkv")}
    expected = {
        "adakv": "budgets=document needs granularity=token",
        "criticalkv": "critical=true needs granularity=token",
    }
    for (_, other), why in declared.items():
        with pytest.raises(MethodError) as refused:
            get_method("snapkv", preset=other, granularity="chunk")
        assert str(refused.value) == f"snapkv: {expected[other]}: {why}"
