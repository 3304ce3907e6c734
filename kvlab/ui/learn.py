"""The Learn tab: what the lab measures, then every method's own Learn text (kvlab.catalog)."""

from __future__ import annotations

import gradio as gr

from kvlab import figures
from kvlab.catalog import methods_markdown
from kvlab.compression.budget_profiles import BUDGETS_LEARN, shipped_profiles
from kvlab.lab.head_roles import ROLES_LEARN
from kvlab.ui.common import LATEX

LEARN_INTRO = (
    """\
## What the lab shows
A language model reads your document once (the *prefill*) and keeps, for every layer and every KV head, \
a key and a value vector per token: the **KV cache**. It grows with the document and is what limits how long \
a text a GPU can hold. A compression method keeps about *1/ratio* of the document's entries per head (the chat \
template's tokens are always kept) and the model answers your question from that smaller cache. The prefill \
is done once per document and model: changing the method, the ratio or the question reuses it.

Notation below: T document tokens, ratio r, budget B = T/r keys per KV head, d the head dimension, and \
$a_{ij}$ the attention query i pays key j:

$$a_{ij}=\\frac{e^{q_i\\cdot k_j/\\sqrt d}}{\\sum_{l} e^{q_i\\cdot k_l/\\sqrt d}}$$

### The Explore tab
- **Answers**: from the full cache and from the compressed cache, with their word-level differences \
(red: only in the full cache's answer; blue: only in the compressed cache's).
- **Attention-output error** (heatmap, layer x KV head): for queries the compressed cache never saw \
(your question's and the answer's, *held out*), how far each head's attention output moves, \
$\\lVert y_{\\text{compressed}}-y_{\\text{full}}\\rVert/\\lVert y_{\\text{full}}\\rVert$, averaged over the queries. \
0 is perfect; around 1 means the head's output is lost.
- **Attention mass, full vs compressed** (a line per layer, a heatmap per layer x KV head): \
$e^{\\mathrm{LSE}_{\\text{compressed}}-\\mathrm{LSE}_{\\text{full}}}$, the attention weight the compressed \
document draws as a share of what the full one draws (1x: the same; blue below, red above). It matters because \
the document competes with the tokens after it (question, answer) for attention: eviction loses mass, \
Attention Matching's biases put it back. The summary's *mass error* is $|\\text{ratio}-1|$, averaged.
- **Keys per head** (heatmap): how many keys each head stores; some methods give heads different budgets.
"""
    + ROLES_LEARN
    + """\
- **Memory**: bytes of the full cache and of the compressed one, stacked by what is stored (keys and \
values, biases, packed codes, scales).
- **Time per stage**: prefill, reference queries, compression, the two answers and the measurements; \
stages reused from an earlier run are marked *reused*.
- **Token fates**: for one layer and KV head, what happened to each token: kept, evicted, or another fate \
of the method (quantised, compacted, ...). The **intensity** shades each token by its percentile rank within \
the head, of the method's own score (methods without one show no shading) or of the attention the question \
and the answer pay it in the full cache: pale is low, strong is high (an evicted token on grey ranked high).

### The Compare tab
A sweep: every chosen method at every chosen ratio, with default knobs, on the Explore tab's document, \
question and model. Three line charts against the ratio (log scale), one line per method: the \
attention-output error, the attention-mass error, and the **log-perplexity** of the full cache's own answer \
$y$ when read from the compressed cache,

$$\\text{log-ppl}=-\\frac1m\\sum_{t=1}^{m}\\log p_{\\text{compressed}}(y_t\\mid\\text{question},y_{<t}),$$

with the full cache's value as a dashed reference line: the closer to it, the more the compressed cache \
behaves like the full one. The table and the CSV / JSON downloads hold every number.

### The Generate tab
Compression while the model *writes*: the cache may hold at most a budget B of keys per KV head while the \
model reads the prompt and writes its answer, and each method makes room its own way: StreamingLLM's \
**sliding window** \
(StreamingLLM: 4 sinks + the latest tokens, one eviction per step), **H2O** (the keys with the most attention \
accumulated so far + a recent half), **BeaconKV** (keys scored by recent queries and beacon queries picked by \
farthest-point sampling over the whole history; 16 evicted at a time) and **online Attention Matching** \
(compacts the cache to B/2 fitted keys with biases whenever it is full). The unbounded cache writes first; the \
tab shows each text from where it first differs from the unbounded one (highlighted), the cache size against \
the tokens written with every eviction or compaction marked, the log-probability of each token of the unbounded \
text re-read under each bounded cache, which tokens were BeaconKV's beacons at each eviction, and tokens per \
second. The default prompt is a copy task (a list of codes to copy back), scored by the codes' F1.

## Methods
"""
)


def learn_markdown() -> str:
    """The tab's text: the lab's measures (LEARN_INTRO), where the budget goes (BUDGETS_LEARN), then every
    registered method."""
    return LEARN_INTRO.removesuffix("## Methods\n") + BUDGETS_LEARN + "\n## Methods\n\n" + methods_markdown()


def build_learn_tab() -> None:
    """The Learn tab's content (inside an open ``gr.Tab``): the text, with the shipped profiles drawn
    under "Where the budget goes"."""
    intro, methods = learn_markdown().split("\n## Methods\n", 1)
    gr.Markdown(intro, latex_delimiters=LATEX, elem_id="kvlab-learn")
    profiles = shipped_profiles()
    with gr.Row():
        for i, (model, shares) in enumerate(profiles.items()):
            gr.Plot(figures.budget_profile_figure(shares, model), show_label=False, elem_id=f"kvlab-learn-budgets-{i}")
    gr.Markdown("## Methods\n" + methods, latex_delimiters=LATEX, elem_id="kvlab-learn-methods")
