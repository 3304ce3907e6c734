"""Attention Matching (Zweiger, Fu, Guo, Kim, 2026, "Fast KV Compaction via Attention Matching").

Each KV head's document block is replaced by t compact keys (a subset of the
original keys, RoPE phases kept), one bias beta per key and refitted values,
chosen in closed form so that, for reference queries, the block's attention
output and attention mass are preserved (kvlab.methods.families.compaction). The
chat-template prefix stays as it is.

The published configurations are presets under the public code's names
(kvlab.methods.families.am_recipe.PRESETS, which summary_am shares).
The defaults are ``AM-HighestAttnKeys-basic`` (HighestAttnKeys, not
on-policy). On-policy fitting (``on_policy``) reads the reference text once
more, in one forward sweep that fits each layer as it reaches it
(``on_policy_sweep``; the paper's code re-reads the text once per layer, kept
as the reference the sweep is tested against), and combines with self-study
(``self_study_weight``): the paper's recipe, which is not yet the default
until the lab has measured it on real text.
"""

from __future__ import annotations

from kvlab.compression.interface import Method
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.am_recipe import PAPER, PRESETS, AMOptions, QuerySourced
from kvlab.methods.families.compaction import compact_document
from kvlab.runtime.cache import CompressedKV


@register
class AttentionMatching(QuerySourced, Method):
    name = "attention_matching"
    summary = "compact keys + per-key bias + refitted values matching attention output and mass (closed form)"
    learn = (
        "Instead of choosing which tokens to keep, Attention Matching *builds* a small cache that behaves "
        "like the big one. Each KV head's T document keys and values are replaced by t = T/r keys "
        "$C_k$ (a subset of the original keys), one scalar bias $\\beta_j$ per key, and refitted values "
        "$C_v$, so that for reference queries $q$ both the attention **mass** and the attention **output** "
        "of the block are preserved:\n\n"
        "$$\\sum_{j=1}^{t} e^{q\\cdot c_j/\\sqrt d+\\beta_j}\\approx\\sum_{j=1}^{T} e^{q\\cdot k_j/\\sqrt d},"
        "\\qquad \\operatorname{softmax}\\!\\Big(\\tfrac{qC_k^\\top}{\\sqrt d}+\\beta\\Big)C_v\\approx"
        "\\operatorname{softmax}\\!\\Big(\\tfrac{qK^\\top}{\\sqrt d}\\Big)V$$\n\n"
        "Matching both makes the compact block a drop-in replacement whatever is read after it. Three "
        "closed-form steps, no gradient descent: keep the keys the reference queries attend to most "
        "(`scoring`: RMS attention as in the published code, mean or max) or pick them by orthogonal "
        "matching pursuit (`key_selection`), fit $w=e^{\\beta}$ by non-negative least squares on the mass "
        "($\\beta$ bounded to $[-3,3]$ for HighestAttnKeys as published, to [`drop_below`, 7] for OMP), "
        "then fit $C_v$ by least squares on the outputs. $e^{\\beta_j}$ reads as "
        '"how many original keys\' worth of mass key $j$ stands for". The reference queries come from '
        "`query_source`: a *repeat-prefill* (the model is asked to repeat the document and its queries while "
        "re-reading it are recorded), the prefill itself, self-study answers or random vectors; your question "
        "is used only with `query_source=question`.\n\n"
        "The published configurations are presets: `AM-HighestAttnKeys-basic` (the defaults), "
        "`AM-HighestAttnKeys` (the same, on-policy: each layer's queries are read with the layers before "
        "it already compacted), `AM-OMP-basic`, `AM-OMP` (on-policy) and `AM-OMP-fast` (more keys per OMP "
        "iteration, fewer refits). On-policy costs one more pass over the reference text: kvlab fits each "
        "layer as that pass reaches it and carries the pass on through the compacted layer (`on_policy_sweep`; "
        "the paper's code reads the text again for every layer, L times the work, for the same cache), and "
        "it combines with `self_study_weight` (the self-study conversations read after the repeat in the same "
        "pass). `AM-HighestAttnKeys-ss-plus-repeat` is the paper's headline recipe as far as the lab has it "
        "(on-policy; the repeat and self-study queries in one pool, up to 50,000 per head). On book needles "
        "with the embedded model it keeps more needles than the defaults from 10x, no more than self-study "
        "queries alone, and few at 50x, for several times the defaults' compression time "
        "(docs/head-budgets.md), so it is a preset, not the default. "
        "`key_selection=kvzip` keeps KVzip's "
        "keys (the most attended while the model repeats the document) and fits their bias and values.\n\n"
        "**Knobs that aim at keeping a needle.** *What the values are pulled toward:* `value_anchor` "
        "$\\lambda>0$ fits the $C_v$ that minimises the squared error $\\lVert XC_v-Y\\rVert$ plus "
        "$\\lambda$ times the squared distance $\\lVert C_v-V_S\\rVert$, a ridge toward the kept keys' own values "
        "$V_S$ rather than toward zero ($\\lambda$ relative to the "
        "Gram's mean diagonal, as `ridge`), so a key that no reference query reads keeps its own value; "
        "`value_fit=original` keeps the values and fits only $\\beta$. *Which queries the fit sees:* "
        "`max_queries=50000` (the published runs' cap) fits on every repeat-pass query instead of a "
        "subsample; `self_study_weight` adds self-study queries (the model answering generic prompts about "
        "the document, closer to questions), each weighted in the least squares and in the scores. *Which "
        "keys:* `key_selection=kvzip_union` keeps `kvzip_share` of each head's keys by KVzip's scores and the "
        "rest by HighestAttnKeys. *Exact tokens:* `exact_share` keeps that share of each head's budget as the "
        "tokens themselves, chosen by KVzip's scores (`exact_keys=kvzip`) or by the reference queries' "
        "attention (`exact_keys=attention`), own keys and values and bias 0, outside the fit; the other compact "
        "keys are fitted only to what those leave unexplained (the block's mass and output minus the exact "
        "tokens' part, under the softmax over every slot); `exact_share=1` is eviction.\n\n"
        "**Per-head budgets** (`budgets`; the Learn tab's \"Where the budget goes\"). The paper's best results give "
        "each head a budget of its own, from a per-model sensitivity profile; so does kvlab's default (`auto`): "
        "the model's profile where it has one (both offline models do; `kvlab budgets --model M` measures one), "
        "else uniform, said in the run. `uniform` gives every head T/r keys; `document` sizes each head by how "
        "concentrated its reference queries' attention is ($\\log T$ minus the mean entropy of one query's "
        "softmax); `global` ranks every head's keys by the reference queries' RMS attention in one pool, as "
        "the published global-RMS budgets. Every allocation stores the same bytes.\n\n"
        "**What the measurements say** (tables with their commands, n, intervals and dates in "
        "docs/head-budgets.md). On five public-domain books (24 single needles of three shapes in about 1,500 "
        "tokens each) on SmolLM2-135M, at 2x, 5x, 10x and 20x: with uniform budgets this fit keeps four "
        "needles, then one, then none; with the model's profile (the default) 17/13/3/0, and KVzip, an "
        "eviction, 20/20/19/6. Where the "
        "budget goes decides more than how keys are chosen or fitted, and a small attention error still "
        "does not guarantee that a rare token survives at 10x. Self-study queries on top of the profile "
        "(`self_study_weight=4.0`) keep 20/17/11/8: no variant is within one needle of KVzip at every ratio, "
        "so for needles on that model, use KVzip. The needle trace (`python -m benchmarks.needle_view`) "
        "shows how a near miss happens: the compact keys sit on the needle's digits and draw the question's "
        "attention as in the full cache, but the refitted values lower one digit's log-probability until the "
        "answer drifts. On Gemma 3 270M (three global layers of one KV head) the profile keeps 23/24 at 2x "
        "and none from 5x on, as every eviction tried there; `beaconkv_mixed`, which quantises what it does "
        "not keep, keeps 24/24/21/15."
    )
    paper = PAPER
    family = "compaction"
    # a least-squares fit absorbs the rounding of its inputs (test_bf16's drift check sees a solver run in bf16)
    bf16_tolerance = "fit"
    Options = AMOptions
    presets = PRESETS

    def compress(self, req: Request) -> CompressedKV:
        return compact_document(req, self.options, self.name)
