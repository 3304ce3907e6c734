"""Head budgets (issue #42): where the budget goes, at equal bytes, and where it came from.

Each check stands on something the code does not compute itself: totals and allocations worked by
hand, the definition of a water-filling, top-k counts over a Python sort, each head solved alone
(:func:`compact_block`), the o_proj contributions in float64 by hand, and profile files written here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvlab.compression.block_solve import BlockJob, solve_ragged
from kvlab.compression.budget_profiles import BUDGET_DIR, allocate, budgets_text, cap_shares, find_profile, profile_name
from kvlab.compression.options import MethodError
from kvlab.compression.request import Request
from kvlab.compression.solvers.compact import compact_block
from kvlab.context import prepare_context
from kvlab.lab.budget_sweep import save_profile, sensitivity_sweep
from kvlab.methods import get_method
from kvlab.methods.families.am_recipe import AMOptions
from kvlab.methods.families.compaction import compact_cache
from kvlab.metrics import head_errors, output_shares, reference_attention, weighted_output_error
from kvlab.pipeline import evaluation
from kvlab.queries import repeat_queries
from kvlab.tasks.items import TaskError
from kvlab.tasks.task_registry import build_items

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96))
QUESTION = "w3 w5 w8"
SMOLLM2 = BUDGET_DIR / "smollm2-135m-instruct-embedded-gguf.json"


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


def write_profile(folder, name: str, shares: list[list[float]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / profile_name(name)).write_text(json.dumps({"model": name, "document": "by hand", "shares": shares}))


# --- equal bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [2, 5, 10, 20])
def test_the_shipped_profile_keeps_the_ratios_total_even_where_heads_hold_the_whole_document(ratio):
    """On the story's 2,058 tokens a head of the SmolLM2 profile would take up to 9x the uniform budget:
    at 2x and 5x that is more than the document, and what such a head cannot hold must go to the
    others, so that the cache stores T/r keys per head on average (before: 3.47x stored at "2x")."""
    shares = torch.tensor(json.loads(SMOLLM2.read_text())["shares"], dtype=torch.float64)
    length = 2058
    per_head = round(length / ratio)
    budgets = allocate(shares, per_head, length)
    assert int(budgets.sum()) == per_head * shares.numel()
    assert int(budgets.min()) >= 1 and int(budgets.max()) <= length


@pytest.mark.parametrize("seed", range(6))
def test_capped_shares_are_a_water_filling(seed):
    """The definition, checked entry by entry: mean 1, every share in [lo, hi], and one scale c with
    each free share c x its own, each share at hi at least that and each at lo at most."""
    gen = torch.Generator().manual_seed(seed)
    shares = torch.rand(40, generator=gen, dtype=torch.float64) ** 4 * 20
    lo, hi = 1 / 7, [9.0, 2.0, 1.3][seed % 3]
    capped = cap_shares(shares, lo, hi)
    assert float(capped.mean()) == pytest.approx(1.0, abs=1e-9)
    assert float(capped.min()) >= lo - 1e-12 and float(capped.max()) <= hi + 1e-12
    s = shares / shares.mean()
    free = (capped > lo + 1e-9) & (capped < hi - 1e-9)
    assert bool(free.any())
    c = capped[free] / s[free]
    assert float(c.max() - c.min()) <= 1e-9 * float(c.max())
    assert bool((s[capped >= hi - 1e-9] * c[0] >= hi - 1e-9).all())
    assert bool((s[capped <= lo + 1e-9] * c[0] <= lo + 1e-9).all())


# --- where the budgets come from -----------------------------------------------------------------


def test_attention_matching_uses_the_models_profile_by_default_at_equal_bytes(ctx, tmp_path, monkeypatch):
    """A profile of shares 4, 1, 0.5, 0.5 (mean 1.5): at 4x (24 keys a head on 96 tokens) the budgets are
    64, 16, 8, 8 (no cap reached); at 2x (48) the first head may hold only the 96 tokens, 2x the
    uniform budget, so the scale of the others grows until the total is met: 96, 48, 24, 24."""
    folder = tmp_path / "measured"
    monkeypatch.setenv("KVLAB_BUDGETS_DIR", str(folder))
    write_profile(folder, ctx.lm.name, [[4.0, 1.0], [0.5, 0.5]])
    for ratio, expected in ((4.0, [[64, 16], [8, 8]]), (2.0, [[96, 48], [24, 24]])):
        stored = get_method("attention_matching").compress(Request(ctx, ratio))
        assert stored.meta["budgets"] == "profile"
        assert profile_name(ctx.lm.name) in stored.meta["budgets_source"]
        assert (stored.kept_per_head().cpu() - ctx.prefix_len).tolist() == expected
        uniform = get_method("attention_matching", budgets="uniform").compress(Request(ctx, ratio))
        assert stored.nbytes == uniform.nbytes


def test_a_model_without_a_profile_runs_uniform_and_says_why(ctx):
    assert find_profile(ctx.lm.name) is None
    stored = get_method("attention_matching").compress(Request(ctx, 4.0))
    assert stored.meta["budgets"] == "uniform"
    assert f"no profile for {ctx.lm.name}" in stored.meta["budgets_source"]
    assert "kvlab budgets" in stored.meta["budgets_source"]
    with pytest.raises(MethodError, match="no head-budget profile"):
        get_method("attention_matching", budgets="profile").compress(Request(ctx, 4.0))
    # What the run's summary, the page and `kvlab run` print: the reason once, not "uniform: uniform ...".
    assert budgets_text(stored.meta) == stored.meta["budgets_source"]
    profiled = {"budgets": "profile", "budgets_source": "the model's profile m.json"}
    assert budgets_text(profiled) == "profile: the model's profile m.json"
    assert budgets_text({"kept": 3}) is None


def test_a_measured_profile_is_kept_and_used(ctx, tmp_path, monkeypatch):
    """`kvlab budgets` on a model without a profile: the sweep's shares are written to the user's
    budgets folder, and from then on Attention Matching's default follows them."""
    folder = tmp_path / "kept"
    monkeypatch.setenv("KVLAB_BUDGETS_DIR", str(folder))
    evs = [evaluation(ctx, QUESTION, 4)]
    sweep = sensitivity_sweep(ctx, evs, ratio=8.0, boost=2.0)
    path = save_profile(ctx, sweep, 8.0, 2.0, "doc")
    assert find_profile(ctx.lm.name) is not None and str(folder) in path
    assert json.loads(open(path).read())["shares"] == [[round(x, 6) for x in r] for r in sweep.shares.tolist()]
    stored = get_method("attention_matching").compress(Request(ctx, 4.0))
    assert stored.meta["budgets"] == "profile"
    expected = allocate(sweep.shares, 24, ctx.doc_len)
    assert torch.equal(stored.kept_per_head().cpu() - ctx.prefix_len, expected)


def _pooled_by_hand(scores: list[torch.Tensor], per_head: int) -> list[list[int]]:
    """Each head's count among the top L*H*per_head scores of all heads, each head's best first (a sort)."""
    entries = [
        (float(v), layer, head, j)
        for layer, s in enumerate(scores)
        for head in range(s.shape[0])
        for j, v in enumerate(s[head].tolist())
    ]
    best = {
        (layer, head): max(e for e in entries if e[1:3] == (layer, head))
        for layer, head in {(e[1], e[2]) for e in entries}
    }
    chosen = set(best.values())
    rest = sorted((e for e in entries if e not in chosen), reverse=True)
    total = len(best) * per_head
    chosen |= set(rest[: total - len(chosen)])
    counts = [[0] * scores[0].shape[0] for _ in scores]
    for _, layer, head, _ in chosen:
        counts[layer][head] += 1
    return counts


def test_global_budgets_rank_a_scorers_scores_across_heads_and_layers(ctx):
    req = Request(ctx, 4.0)
    scores = get_method("knorm").scores(req)
    stored = get_method("knorm", budgets="global").compress(req)
    assert stored.meta["budgets"] == "global"
    assert (stored.kept_per_head().cpu() - ctx.prefix_len).tolist() == _pooled_by_hand(scores, req.doc_budget)
    # SnapKV scores its window +inf: more than the total here; every head still keeps its best token.
    snap = get_method("snapkv", budgets="global").compress(req).kept_per_head() - ctx.prefix_len
    assert int(snap.min()) >= 1 and int(snap.sum()) == req.doc_budget * snap.numel()


def test_global_budgets_of_attention_matching_rank_the_reference_queries_rms_attention(ctx):
    """The RMS over the fitting queries of each key's attention, computed here in float64 from the
    repeat pass's queries (every one: fewer than the cap), then pooled by hand."""
    req = Request(ctx, 4.0)
    scores = []
    for layer, q in enumerate(repeat_queries(ctx)):
        keys = ctx.full.keys[layer][:, ctx.prefix_len :].double()
        grouped = q.double().reshape(keys.shape[0], -1, keys.shape[-1])
        assert grouped.shape[1] <= AMOptions().max_queries
        a = torch.softmax(grouped @ keys.mT / math.sqrt(keys.shape[-1]), dim=-1)
        scores.append(a.square().mean(dim=1).sqrt())
    stored = get_method("attention_matching", budgets="global").compress(req)
    assert stored.meta["budgets"] == "global"
    assert (stored.kept_per_head().cpu() - ctx.prefix_len).tolist() == _pooled_by_hand(scores, req.doc_budget)


def test_a_methods_own_allocation_is_not_replaced(ctx, tmp_path, monkeypatch):
    req = Request(ctx, 4.0)
    with pytest.raises(MethodError, match="PyramidKV"):
        get_method("pyramidkv", budgets="global").compress(req)
    with pytest.raises(MethodError, match="prune=global"):
        get_method("kvzip", budgets="global").compress(req)
    stored = get_method("kvzip", prune="head", budgets="global").compress(req)
    assert stored.meta["budgets"] == "global"
    monkeypatch.setenv("KVLAB_BUDGETS_DIR", str(tmp_path))
    write_profile(tmp_path, ctx.lm.name, [[4.0, 1.0], [0.5, 0.5]])
    stored = get_method("knorm", budgets="profile").compress(req)
    assert (stored.kept_per_head().cpu() - ctx.prefix_len).tolist() == [[64, 16], [8, 8]]
    assert stored.nbytes == get_method("knorm").compress(req).nbytes


# --- ragged heads solved batched --------------------------------------------------------------------


def test_ragged_heads_solved_together_equal_each_head_solved_alone():
    """Two layers' heads with budgets from 3 to the whole block: regrouped by budget and solved in
    batches, each head's kept keys are those of its own solve, and its biases and values agree within
    the forward-error bound of the value fit's normal equations (n eps cond(X)^2 of the values)."""
    gen = torch.Generator().manual_seed(3)
    n, T, d = 40, 16, 8
    jobs = []
    for budgets in ([3, 9, 16], [5, 9, 12]):
        q, k, v = (
            torch.randn(3, n, d, generator=gen),
            torch.randn(3, T, d, generator=gen),
            torch.randn(3, T, d, generator=gen),
        )
        jobs.append(BlockJob(q, k, v, None, torch.tensor(budgets)))
    solved = solve_ragged(jobs, AMOptions())
    for job, block in zip(jobs, solved):
        for h, t in enumerate(job.budgets.tolist()):
            real = int(block.lengths[h])
            assert real == t
            if t == T:  # keeps everything: the block itself
                assert block.index[h, :T].tolist() == list(range(T))
                assert torch.equal(block.values[h, :T], job.values[h]) and bool((block.bias[h, :T] == 0).all())
                continue
            alone = compact_block(job.queries[h : h + 1], job.keys[h : h + 1], job.values[h : h + 1], t)
            assert block.index[h, :real].tolist() == alone.index[0].tolist()
            assert bool((block.index[h, real:] == -1).all()) and bool(torch.isinf(block.bias[h, real:]).all())
            torch.testing.assert_close(block.bias[h, :real], alone.bias[0], rtol=0, atol=1e-4)
            x = torch.softmax(
                job.queries[h].double() @ alone.keys[0].double().T / math.sqrt(d) + alone.bias[0].double(), -1
            )
            tol = (
                n * torch.finfo(torch.float32).eps * float(torch.linalg.cond(x)) ** 2 * float(alone.values.abs().max())
            )
            assert float((block.values[h, :real] - alone.values[0]).abs().max()) <= tol


def test_the_cache_fitted_ragged_equals_the_layers_fitted_one_by_one(ctx, tmp_path, monkeypatch):
    """compact_cache solves every layer's heads together; compacting one layer at a time (the
    on-policy path's unit) keeps the same keys with the same biases."""
    queries = repeat_queries(ctx)
    budgets = torch.tensor([[40, 7], [12, 13]])
    together = compact_cache(ctx.full.stored, queries, budgets, AMOptions(), ctx.prefix_len)
    for layer in range(2):
        alone = compact_cache(
            ctx.full.stored,
            queries,
            torch.where(torch.arange(2).unsqueeze(1) == layer, budgets, ctx.doc_len),
            AMOptions(),
            ctx.prefix_len,
        )
        a, b = together.layer_view(layer), alone.layer_view(layer)
        assert torch.equal(a.token_index, b.token_index)
        torch.testing.assert_close(a.bias, b.bias, rtol=0, atol=1e-4)


# --- the error weighted by what each head contributes ------------------------------------------------


def test_output_shares_are_each_heads_part_of_its_layers_output_by_hand(ctx):
    """Per query head: softmax over the full cache in float64, its output through o_proj's columns of
    that head, the norm averaged over the queries; a KV head sums its group; shares per layer."""
    ev = evaluation(ctx, QUESTION, 4)
    full = reference_attention(ctx.full.stored, ev.queries)
    got = output_shares(ctx.lm, full)
    H, H_kv = ctx.lm.model.config.num_attention_heads, ctx.lm.n_kv_heads
    for layer, q in enumerate(ev.queries):
        keys, values = ctx.full.keys[layer].double(), ctx.full.values[layer].double()
        d = keys.shape[-1]
        w = ctx.lm.model.model.layers[layer].self_attn.o_proj.weight.detach().double()
        per_kv = [0.0] * H_kv
        for h in range(H):
            kv = h // (H // H_kv)
            y = torch.softmax(q[h].double() @ keys[kv].T / math.sqrt(d), -1) @ values[kv]
            per_kv[kv] += float((y @ w[:, h * d : (h + 1) * d].T).norm(dim=-1).mean())
        expected = torch.tensor(per_kv, dtype=torch.float64) / sum(per_kv)
        torch.testing.assert_close(got[layer].double(), expected, rtol=1e-4, atol=1e-6)
    errors = head_errors(ctx.full.stored, get_method("snapkv").compress(Request(ctx, 4.0)), ev.queries)
    by_hand = sum(float((errors.output[i] * got[i]).sum()) for i in range(ctx.lm.n_layers)) / ctx.lm.n_layers
    assert weighted_output_error(errors, got) == pytest.approx(by_hand, rel=1e-6)


# --- real books as the haystack ----------------------------------------------------------------------

BOOK_A = (
    "The first chapter of the first book has a long paragraph with the year 1843 and a man named Abel "
    "Crane in it. He walked to the harbour every morning. The boats were painted red and blue."
)
BOOK_B = (
    "The second book opens in a garden where Miss Ada Lorne counted 27 roses before noon. She kept "
    "the count in a notebook. Her brother laughed at her and went to the mill."
)
VERSE = "    A short verse line, indented as verse is,\n    and another that the haystack must skip over entirely."


def _books(tmp_path):
    prose = tmp_path / "prose"
    prose.mkdir()
    (prose / "a.txt").write_text("\n\n".join([BOOK_A, VERSE, BOOK_A.replace("first", "next")] * 8))
    (prose / "b.txt").write_text("\n\n".join([BOOK_B, "CHAPTER II", BOOK_B.replace("second", "other")] * 8))
    return tmp_path


def test_books_haystack_reads_real_passages_around_the_needle(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DATA", str(_books(tmp_path)))
    items = build_items("niah_single", tiny, 6, seed=0, length=300, haystack="books", values="mixed")
    assert {it.task for it in items} == {"niah_single[books,mixed]"}
    nouns = [it.question.split("special magic ")[1].split()[0] for it in items]
    assert nouns == ["number", "code", "name"] * 2
    for i, it in enumerate(items):
        other = "second book" if i % 2 == 0 else "first book"
        text = it.document
        assert it.answers[0] in text and f"is: {it.answers[0]}." in text
        assert ("the year 1843" if i % 2 == 0 else "27 roses") in text and other not in text
        assert "verse" not in text and "CHAPTER II" not in text  # indented verse and headings are left out
        assert len(tiny.tokenizer(text).input_ids) <= 300


def test_books_haystack_without_the_books_says_where_to_put_them(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DATA", str(tmp_path))
    with pytest.raises(TaskError, match=r"books haystack needs public-domain books in .*KVLAB_DATA"):
        build_items("niah_single", tiny, 2, seed=0, length=300, haystack="books")


# --- budgets as a sweep's axis ---------------------------------------------------------------------


def test_a_sweep_runs_each_method_once_per_budget_it_has(tiny, monkeypatch, tmp_path):
    """Compare's budgets axis: KNorm under uniform, AdaKV (its reading of the document) and the global
    ranking; Attention Matching under uniform, document and global; StreamingLLM (no budgets knob) once,
    with its uniform budgets; PyramidKV keeps its pyramid under "uniform", shares each layer's among
    its heads under AdaKV, and refuses to have it replaced by the global ranking; every run of a
    method with a knob stores the bytes of the uniform run."""
    from kvlab import lab, models

    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    methods = ["knorm", "attention_matching", "streaming_llm", "pyramidkv"]
    sweep = lab.compare(
        DOC + " w9 w9", None, methods, [4.0], "w5 w6", max_new_tokens=3, budgets=["uniform", "document", "global"]
    )
    labels = [lab.sweep_label(sweep, r) for r in sweep.results]
    assert labels == [
        "knorm [budgets=uniform]",
        "knorm [budgets=document]",
        "knorm [budgets=global]",
        "attention_matching [budgets=uniform]",
        "attention_matching [budgets=document]",
        "attention_matching [budgets=global]",
        "streaming_llm [budgets=uniform]",
        "pyramidkv [budgets=pyramid]",
        "pyramidkv [budgets=document]",
    ]
    assert [e.method for e in sweep.errors] == ["pyramidkv [budgets=global]"]
    assert "PyramidKV" in sweep.errors[0].message
    for name in ("knorm", "attention_matching"):
        assert len({r.bytes_compressed for r in sweep.results if r.method == name}) == 1
    with pytest.raises(lab.InputError, match="unknown head budgets nope"):
        lab.compare(DOC, None, ["knorm"], [4.0], "w5", budgets=["nope"])


def test_the_old_spellings_of_budgets_are_read_as_todays():
    """One vocabulary (uniform, profile, document, global) for every method's ``budgets``: scripts, sheets
    and links written before it keep working, each old value (nonuniform, adakv) read as today's, and a
    link says so in one line."""
    from kvlab.catalog import method_names
    from kvlab.cli import build_parser, method_from_args
    from kvlab.compression.request import MAX_RATIO, MIN_RATIO
    from kvlab.lab.links import LinkChoices, parse_link

    am, knorm = "attention_matching", "knorm"
    assert get_method(am, budgets="nonuniform").options == get_method(am, budgets="profile").options
    assert get_method(knorm, budgets="adakv").options == get_method(knorm, budgets="document").options
    argv = ["run", "--doc", "d.txt", "--method", knorm, "--ratio", "4", "--question", "q", "--budgets", "adakv"]
    assert method_from_args(knorm, build_parser().parse_args(argv)).options.budgets == "document"
    choices = LinkChoices((), tuple(method_names()), (MIN_RATIO, MAX_RATIO), (), (MIN_RATIO, MAX_RATIO), ())
    link = parse_link({"method": f"{am}:budgets=nonuniform:max_queries=4096", "ratio": "5"}, choices)
    assert link.options == (("budgets", "profile"), ("max_queries", 4096)) and link.notes == ()
    assert link.note() == (
        "**This link uses older spellings, read as today's:** `budgets=nonuniform` is `budgets=profile` now."
    )
    assert parse_link({"method": f"{am}:budgets=profile", "ratio": "5"}, choices).note() == ""
