"""The Gradio app: widgets and callbacks that call kvlab.lab; no maths here.

One module per tab (explore, compare, generate, learn; a tab never imports
another; Explore's widgets and events are in explore_widgets and
explore_events), presentation (present: texts, tables, figures of a result;
tasks: the views of task results that Explore and Compare both show), method
knobs as a panel (knobs), what the tabs share (common), the page (app), its
links (page_links) and its serving (serve). ``app.py`` at the repository root
calls :func:`main`.
"""

from kvlab.ui.app import build_app, default_method
from kvlab.ui.serve import launch_options, main, prepare

__all__ = ["build_app", "default_method", "launch_options", "main", "prepare"]
