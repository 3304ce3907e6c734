"""What the app draws, from plain data: plotly figures, the token view, the answers' word diff.

Every function takes lists, dicts and numbers (the fields of
:class:`kvlab.pipeline.RunResult`, a token-fate dict) and returns a plotly
figure, ``(text, label)`` pairs for ``gr.HighlightedText`` or HTML. Nothing here
imports a model, torch or gradio, so the figures can be tested (and reused
by notebooks or reports) on small synthetic data.

- :mod:`kvlab.figures.plots`: heatmaps per layer x KV head, memory, time, sweeps;
- :mod:`kvlab.figures.tokens`: the document coloured by token fate, the bits strip;
- :mod:`kvlab.figures.diff`: the word diff of two answers, and where they part token by token;
- :mod:`kvlab.figures.needle`: one needle's tokens followed through a compression.
"""

from kvlab.figures.diff import DIFF_COLORS, DIFF_COMPRESSED, DIFF_FULL, answers_agree, divergence_figure, word_diff
from kvlab.figures.generation import beacon_figure, cache_size_figure, logprob_figure, texts_html
from kvlab.figures.needle import needle_figure, needle_table
from kvlab.figures.plots import (
    FIGURE_HEIGHT,
    MASS_RATIO_LIMIT,
    METHOD_COLORS,
    bias_histogram,
    budget_profile_figure,
    error_heatmap,
    fit_vs_eval_figure,
    head_heatmap,
    histogram_bins,
    human_bytes,
    kept_heatmap,
    mass_heatmap,
    memory_figure,
    roles_heatmap,
    sweep_figure,
    time_figure,
)
from kvlab.figures.tokens import (
    BIT_COLORS,
    EVICTED,
    EVICTED_SHADE,
    FATE_COLORS,
    LEVEL_STEPS,
    WEAKEST_SHADE,
    bits_of,
    bits_strip_html,
    fate_colors,
    fate_counts,
    fate_html,
    fate_segments,
    level_step,
)

__all__ = [
    "BIT_COLORS",
    "DIFF_COLORS",
    "DIFF_COMPRESSED",
    "DIFF_FULL",
    "EVICTED",
    "EVICTED_SHADE",
    "FATE_COLORS",
    "FIGURE_HEIGHT",
    "LEVEL_STEPS",
    "MASS_RATIO_LIMIT",
    "METHOD_COLORS",
    "WEAKEST_SHADE",
    "answers_agree",
    "bias_histogram",
    "budget_profile_figure",
    "histogram_bins",
    "divergence_figure",
    "bits_of",
    "bits_strip_html",
    "error_heatmap",
    "fate_colors",
    "fate_counts",
    "fate_html",
    "fate_segments",
    "fit_vs_eval_figure",
    "head_heatmap",
    "human_bytes",
    "kept_heatmap",
    "level_step",
    "mass_heatmap",
    "memory_figure",
    "roles_heatmap",
    "sweep_figure",
    "time_figure",
    "word_diff",
    "beacon_figure",
    "cache_size_figure",
    "logprob_figure",
    "texts_html",
    "needle_figure",
    "needle_table",
]
