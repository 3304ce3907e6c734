"""The Learn tab: what the lab measures, the paper's claims checked (kvlab.lab.claims), then every
method's own Learn text (kvlab.catalog).

The prose is markdown (kvlab/learn_text/page.md and what it includes, kvlab.learn_text); this module
gives it the values computed in code and draws the shipped budget profiles under its "Where the budget
goes".
"""

from __future__ import annotations

import gradio as gr

from kvlab import figures, learn_text
from kvlab.catalog import methods_markdown
from kvlab.compression.budget_profiles import shipped_profiles
from kvlab.lab import claims
from kvlab.lab.head_roles import RETRIEVAL_THRESHOLD, ROLE_WINDOW
from kvlab.methods.families.scorers import N_SINK
from kvlab.ui.common import LATEX


def page_values() -> dict[str, str]:
    """page.md's ``{{value NAME}}``s: the head roles' sinks, window and threshold (kvlab.lab.head_roles'
    constants, so the text says what the figure computes), and every registered method's text."""
    return {
        "n_sink": str(N_SINK),
        "role_window": str(ROLE_WINDOW),
        "retrieval_threshold": f"{RETRIEVAL_THRESHOLD:.0%}",
        "methods": methods_markdown(),
    }


def learn_markdown() -> str:
    """The tab's text: the lab's measures, where the budget goes, then every registered method."""
    return learn_text.page_text("page.md", **page_values())


def build_learn_tab() -> None:
    """The Learn tab's content (inside an open ``gr.Tab``): the text, with the shipped profiles drawn
    under "Where the budget goes", then the paper's claims beside the lab's measures
    (kvlab.lab.claims), then every method."""
    intro, methods = learn_markdown().split("\n## Methods\n", 1)
    gr.Markdown(intro, latex_delimiters=LATEX, elem_id="kvlab-learn")
    profiles = shipped_profiles()
    with gr.Row():
        for i, (model, shares) in enumerate(profiles.items()):
            gr.Plot(figures.budget_profile_figure(shares, model), show_label=False, elem_id=f"kvlab-learn-budgets-{i}")
    gr.Markdown(claims.claims_markdown(claims.load()), elem_id="kvlab-claims")
    gr.Markdown("## Methods\n" + methods, latex_delimiters=LATEX, elem_id="kvlab-learn-methods")
