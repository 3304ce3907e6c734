"""Figure builders on small synthetic data: shapes, titles, heights (no model)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import plotly.graph_objects as go
import pytest

from kvlab import figures
from kvlab.figures.tokens import _shade

# Figures only pass numbers through or take means and log2 of them: any difference
# beyond float64 rounding would be a bug.
TOL = 1e-12

PER_HEAD = {
    "attn_output_rel_err": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]],  # 2 layers x 3 KV heads
    "attn_mass_rel_err": [[0.01, 0.02, 0.03], [0.04, 0.05, 0.06]],
    "attn_mass_ratio": [[0.99, 1.02, 0.97], [0.25, 1.0, 4.0]],
    "kept_tokens": [[40, 40, 40], [38, 41, 45]],
}


def _heights_set(fig: go.Figure) -> None:
    assert fig.layout.height and 300 <= fig.layout.height <= 450


def test_figures_import_no_model_code():
    # figures is plain-data only: importing it (all its modules) must not pull torch or a model in.
    code = (
        "import sys, kvlab.figures; "
        "print(sorted(m for m in ('torch', 'transformers', 'kvlab.models') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_error_heatmap_is_layers_by_heads():
    fig = figures.error_heatmap(PER_HEAD)
    _heights_set(fig)
    heat = fig.data[0]
    assert isinstance(heat, go.Heatmap)
    # x: layers, y: KV heads; z[head][layer] == per_head[layer][head]
    assert list(heat.x) == [0, 1] and list(heat.y) == [0, 1, 2]
    assert heat.z[2][1] == 0.6 and heat.z[0][1] == 0.4
    assert "output" in fig.layout.title.text.lower()


def test_mass_figure_compares_compressed_with_full():
    fig = figures.mass_heatmap(PER_HEAD)
    _heights_set(fig)
    full, compressed, heat = fig.data
    assert list(full.y) == [1.0, 1.0]  # the full cache draws its own mass
    # per layer, the mean over KV heads
    assert list(compressed.y) == pytest.approx([(0.99 + 1.02 + 0.97) / 3, (0.25 + 1.0 + 4.0) / 3], abs=TOL)
    # per head on a log2 scale centred on "as much as the full cache": 1/4x, 1x, 4x
    assert isinstance(heat, go.Heatmap) and heat.zmid == 0.0
    assert [heat.z[h][1] for h in range(3)] == pytest.approx([-2.0, 0.0, 2.0], abs=TOL)
    assert heat.customdata[2][1][1] == pytest.approx(0.06, abs=TOL)  # the relative error on hover
    assert "mass" in fig.layout.title.text.lower()


def test_kept_heatmap():
    kept = figures.kept_heatmap(PER_HEAD)
    _heights_set(kept)
    assert len(kept.data[0].z) == 3 and len(kept.data[0].z[0]) == 2
    assert "keys" in kept.layout.title.text.lower()
    assert kept.data[0].z[2][1] == 45


def test_memory_figure_stacks_the_breakdown():
    breakdown = {"full-precision keys+values": 900, "biases": 100}
    fig = figures.memory_figure(10_000, 1_000, breakdown)
    _heights_set(fig)
    assert fig.layout.barmode == "stack"
    names = [bar.name for bar in fig.data]
    assert names == ["full cache", *breakdown]
    assert sum(bar.y[0] for bar in fig.data[1:]) == 1_000
    assert "10.0x" in fig.layout.title.text


def test_human_bytes_counts_in_1024s():
    assert figures.human_bytes(0) == "0 B" and figures.human_bytes(1023) == "1,023 B"
    assert figures.human_bytes(1536) == "1.5 KiB"  # 1.5 * 1024
    assert figures.human_bytes(3 * 1024**2 + 100 * 1024) == "3.1 MiB"  # 3.0977 MiB
    assert figures.human_bytes(5 * 1024**4) == "5,120.0 GiB"  # no unit past GiB


def test_time_figure():
    fig = figures.time_figure({"prefill": 2.0, "compression": 0.5, "answers": 1.25})
    _heights_set(fig)
    assert list(fig.data[0].y) == ["prefill", "compression", "answers"]
    assert list(fig.data[0].x) == pytest.approx([2.0, 0.5, 1.25], abs=TOL)
    assert list(fig.data[0].text) == ["2.00 s", "0.50 s", "1.25 s"]


def test_time_figure_marks_reused_stages_and_total():
    fig = figures.time_figure({"prefill": 0.0, "compression": 0.5}, {"prefill": "reused (2.81 s when run)"}, total=4.0)
    assert list(fig.data[0].text) == ["reused (2.81 s when run)", "0.50 s"]
    assert "4.0 s" in fig.layout.title.text


def test_sweep_figure_draws_one_line_per_method_against_the_ratio():
    points = [
        {"method": "am", "ratio": 10, "err": 0.3},
        {"method": "am", "ratio": 2, "err": 0.1},
        {"method": "snap", "ratio": 2, "err": 0.2},
        {"method": "snap", "ratio": 10, "err": float("nan")},  # a failed value is left out
        {"method": "snap", "ratio": 50, "err": None},
    ]
    fig = figures.sweep_figure(points, "err", "Error vs ratio", "relative error", reference=0.05)
    _heights_set(fig)
    am, snap, ref = fig.data
    assert (am.name, list(am.x)) == ("am", [2.0, 10.0]) and list(am.y) == pytest.approx(
        [0.1, 0.3], abs=TOL
    )  # sorted by ratio
    assert (snap.name, list(snap.x)) == ("snap", [2.0]) and list(snap.y) == pytest.approx([0.2], abs=TOL)
    assert am.line.color != snap.line.color
    assert ref.name.startswith("full cache") and list(ref.y) == pytest.approx([0.05, 0.05], abs=TOL)
    assert ref.line.dash == "dash"
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.ticktext) == ["2x", "10x"]
    assert fig.layout.yaxis.title.text == "relative error"
    # Without a reference there is no extra line.
    assert len(figures.sweep_figure(points, "err", "t").data) == 2


def test_fate_segments_joins_runs_and_marks_missing_as_evicted():
    texts = ["<s>", "The", " cat", " sat", " on", " mat", ""]
    fates = {0: "template", 1: "kept", 2: "kept", 5: "kept"}
    segs = figures.fate_segments(texts, fates)
    assert segs == [
        ("<s>", "template", None),
        ("The cat", "kept", None),
        (" sat on", "evicted", None),
        (" mat", "kept", None),
    ]
    assert "".join(t for t, _, _ in segs) == "".join(texts)
    assert figures.fate_counts(len(texts), fates) == {"template": 1, "kept": 3, "evicted": 3}


def test_fate_colors_cover_unknown_fates():
    colors = figures.fate_colors(["kept", "sketched", "evicted"])
    assert {"kept", "sketched", "evicted"} <= set(colors)
    assert len(set(colors.values())) == len(colors)  # every fate told apart, a new one included
    assert figures.fate_colors(["kept"])["kept"] == colors["kept"]  # a fate's colour does not depend on the others


def _span_colours(html: str) -> dict[str, set[str]]:
    """Background colours of the token spans by their title (the fate), as the browser would read them."""
    out: dict[str, set[str]] = {}
    for title, style in re.findall(r'<span title="([^"]*)" style="([^"]*)"', html):
        out.setdefault(title, set()).add((re.findall(r"background-color:(#[0-9a-f]{6})", style) or ["none"])[0])
    return out


def _legend_colours(html: str) -> dict[str, str]:
    """The legend's chip colour per label."""
    chips = re.findall(r'<span class="kvlab-chip" style="([^"]*)">([^<]*)</span>', html)
    return {
        label: (re.findall(r"background(?:-color)?:(#[0-9a-f]{6})", style) or ["none"])[0] for style, label in chips
    }


def test_word_diff():
    same = figures.word_diff("Paris is the capital.", "Paris is the capital.")
    assert same == [("Paris is the capital.", None)]
    diff = figures.word_diff("The boat is Saint Kilda.", "The boat is Saint Mary.")
    labels = {label for _, label in diff}
    assert labels == {None, figures.DIFF_FULL, figures.DIFF_COMPRESSED}
    assert ("Kilda.", figures.DIFF_FULL) in diff and ("Mary.", figures.DIFF_COMPRESSED) in diff
    assert figures.answers_agree("a b c", "a b c") == 1.0
    assert 0 < figures.answers_agree("a b c d", "a b x d") < 1
    assert figures.word_diff("", "") == []


def test_fate_segments_split_runs_by_intensity_step():
    texts = ["a", "b", "c", "d", "e"]
    fates = {0: "kept", 1: "kept", 2: "kept", 3: "kept"}
    # Levels 250 and 255 share the top step; 1 is the bottom one; 0 means no level.
    segs = figures.fate_segments(texts, fates, levels=bytes([250, 255, 1, 0, 128]))
    assert segs == [("ab", "kept", 7), ("c", "kept", 0), ("d", "kept", None), ("e", "evicted", 3)]
    assert [figures.level_step(x) for x in (0, 1, 32, 33, 255)] == [None, 0, 0, 1, figures.LEVEL_STEPS - 1]


def test_fate_html_shades_by_step_and_says_the_percentile():
    segs = [
        ("<i>x</i>", "kept", 7),
        (" y", "kept", 0),
        (" z", "evicted", 7),
        (" w", "evicted", 0),
        (" t", "template", None),
    ]
    html = figures.fate_html(segs, intensity="the method's <score>")
    assert "&lt;i&gt;x&lt;/i&gt;" in html and "<i>" not in html
    assert "intensity = the method&#x27;s &lt;score&gt;" in html
    assert 'title="kept, percentile 87-100"' in html and 'title="kept, percentile 0-12"' in html
    assert 'title="template"' in html  # no level, no percentile
    # The top step is the fate's own colour (the legend's), the bottom step a paler shade of it.
    strong = _legend_colours(figures.fate_html([(" a", "kept", None)]))["kept"]
    assert _span_colours(html)["kept, percentile 87-100"] == {strong}
    assert _span_colours(html)["kept, percentile 0-12"] == {_shade(strong, figures.WEAKEST_SHADE)}
    # An important evicted token gets a grey background; an unimportant one almost none.
    assert f"background-color:{figures.EVICTED_SHADE};color:#6b7280" in html
    assert _shade("#000000", 0.15) == "#d9d9d9" and _shade("#86efac", 1) == "#86efac"
    # Without an intensity the view is as before: fate colours, no note.
    assert "intensity" not in figures.fate_html([(" a", "kept", None)])


def test_token_view_of_a_long_document_stays_small():
    n = 2_000
    texts = [f" w{i}" for i in range(n)]
    fates = {i: "kept" for i in range(0, n, 3)}
    levels = bytes((i * 97) % 255 + 1 for i in range(n))  # adjacent levels differ: the worst case
    html = figures.bits_strip_html(n, fates) + figures.fate_html(
        figures.fate_segments(texts, fates, levels=levels), intensity="x"
    )
    assert html.count("<span title=") == n and len(html) < 400_000


def test_fate_html_escapes_and_colours():
    html = figures.fate_html([("<b>Hi</b>\n", "template", None), (" there", "kept", None), (" gone", "evicted", None)])
    assert "&lt;b&gt;Hi&lt;/b&gt;" in html and "<b>" not in html
    spans, legend = _span_colours(html), _legend_colours(html)
    assert set(spans) == set(legend) == {"template", "kept", "evicted"}
    assert all(spans[fate] == {legend[fate]} for fate in spans)  # each token coloured as the legend says
    assert len(set(legend.values())) == 3
    assert "white-space:pre-wrap" in html
    assert html.count('class="kvlab-chip"') == 3


def test_attention_matching_figures():
    hist = figures.bias_histogram([-1.0, 0.0, 0.5, 2.0], bins=3)
    # Edges -1, 0, 1, 2 by hand: [-1, 0) holds -1; [0, 1) holds 0 and 0.5; [1, 2] holds 2.
    assert hist.layout.height and list(hist.data[0].y) == [1, 2, 1]
    assert list(hist.data[0].x) == pytest.approx([-0.5, 0.5, 1.5], abs=TOL)
    fit = figures.fit_vs_eval_figure([[0.1, 0.3], [0.2, 0.2]], [[0.2, 0.4], [0.3, 0.5]])
    assert fit.layout.height
    assert [list(t.y) for t in fit.data] == [pytest.approx([0.2, 0.2], abs=TOL), pytest.approx([0.3, 0.4], abs=TOL)]


def test_bits_strip_counts_every_token():
    fates = {0: "template", 1: "4-bit", 2: "2-bit", 4: "beacon"}
    strip = figures.bits_strip_html(5, fates)
    assert strip.count("flex:1 1 0") == 5
    # A run of tokens stored alike is one cell as wide as the run.
    assert figures.bits_strip_html(6, {0: "template", 1: "template"}).count("flex:") == 2
    assert "flex:2 1 0" in figures.bits_strip_html(6, {0: "template", 1: "template"})
    assert [figures.bits_of(f) for f in ("template", "4-bit", "2-bit", figures.EVICTED)] == ["full", 4, 2, 0]
    # Each cell has the legend's colour of its token's bits: full, 4, 2, 0 (token 3, evicted), full (a beacon).
    legend = _legend_colours(strip)
    cells = re.findall(r'<span style="flex:1 1 0;min-width:0;background:(#[0-9a-f]{6})"></span>', strip)
    assert cells == [legend[x] for x in ("full precision", "4 bits", "2 bits", "0 bits", "full precision")]
    assert len(set(legend.values())) == len(legend)


def test_divergence_figure_draws_both_caches_and_marks_where_answers_part():
    fig = figures.divergence_figure([" The", " cat", "."], [-0.1, -0.2, -0.3], [-0.1, -2.5, -0.4], 1)
    full, compressed = fig.data
    assert list(full.y) == [-0.1, -0.2, -0.3] and list(compressed.y) == [-0.1, -2.5, -0.4]
    assert [s.x0 for s in fig.layout.shapes] == [1]
    assert "token 1" in fig.layout.title.text and "cat" in fig.layout.title.text
    same = figures.divergence_figure(["a"], [-0.5], [-0.5], None)
    assert not same.layout.shapes and "the same" in same.layout.title.text


@pytest.mark.parametrize("bins", [1, 7, 60])
def test_bias_histogram_bins_as_numpy_does(bins):
    values = np.random.default_rng(bins).normal(size=500).round(1).tolist()  # rounded: values on edges occur
    edges, counts = figures.histogram_bins(values, bins)
    ref_counts, ref_edges = np.histogram(values, bins=bins)
    assert counts == ref_counts.tolist() and sum(counts) == len(values)
    assert edges == pytest.approx(ref_edges.tolist(), abs=1e-12)


def test_bias_histogram_of_equal_values_is_one_bin():
    edges, counts = figures.histogram_bins([0.3] * 4, 5)
    assert sum(counts) == 4 and counts.count(4) == 1 and edges[0] < 0.3 < edges[-1]
