"""The house's import graph, read from the source (ast), not from what Python happened to import.

Every import of every module under kvlab/ counts: at the top, inside a
function (an import put there to dodge a circle is still a circle) or under
``TYPE_CHECKING``. A module's edge goes to the module it names: ``from
kvlab.lab import fates`` to ``kvlab.lab.fates`` when that is a module, else to
the package ``kvlab.lab`` (its ``__init__``). Importing a submodule runs its
packages' ``__init__`` first, so an edge to ``kvlab.ui.links`` is an edge to
``kvlab.ui`` too (unless the importer is inside that package already).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The house's layers, lowest first: a module may import its own layer and the layers below, never
#: one above. Each entry is a module or package prefix; a module belongs to its longest matching
#: prefix, and every module under kvlab/ must match one (a new top-level module takes a place here).
LAYERS: list[tuple[str, list[str]]] = [
    (
        "plain helpers: paths, limits, messages, the Learn tab's prose and its loader, the figures (no model code)",
        ["kvlab.paths", "kvlab.limits", "kvlab.messages", "kvlab.learn_text", "kvlab.figures"],
    ),
    ("cancellation and the compute slot; values made once", ["kvlab.cancellation", "kvlab.scheduler", "kvlab.memo"]),
    (
        "text in: documents, the chat template, the bundled examples, a document's sentences",
        ["kvlab.documents", "kvlab.prompts", "kvlab.examples", "kvlab.sentences"],
    ),
    (
        "the runtime: a loaded model's geometry, the attention maths and its decode kernel, caches, decode",
        ["kvlab.runtime"],
    ),
    ("the kernels dispatched to Triton or their torch references (built on the runtime's maths)", ["kvlab.kernels"]),
    ("loading models by name", ["kvlab.models"]),
    ("the result store (it keeps any value and knows no method)", ["kvlab.results"]),
    (
        "a document read by a model, its reference queries, the errors of a cache",
        ["kvlab.context", "kvlab.context_store", "kvlab.queries", "kvlab.metrics"],
    ),
    ("the compression core", ["kvlab.compression"]),
    (
        "what the methods share, by family: the shared scorers, a family's base and machinery (not methods)",
        ["kvlab.methods.families"],
    ),
    ("the methods (found by discovery)", ["kvlab.methods"]),
    ("the catalog: the methods as front ends show them", ["kvlab.catalog"]),
    ("one run", ["kvlab.pipeline"]),
    ("a compressed cache in a researcher's own code: their model, transformers' generate, a file", ["kvlab.api"]),
    ("generation with a bounded cache", ["kvlab.bounded"]),
    ("tasks with known answers", ["kvlab.tasks"]),
    ("the lab layer", ["kvlab.lab"]),
    (
        "the front ends and what tests build on them",
        ["kvlab.ui", "kvlab.cli", "kvlab.bench_command", "kvlab.cache_command", "kvlab.__main__", "kvlab.testing"],
    ),
]
#: The package itself (its __init__) imports nothing below it; every layer may name it.
ROOT_PACKAGE = "kvlab"


def layer_of(module: str, layers: list[tuple[str, list[str]]] = LAYERS) -> int | None:
    """The index of ``module``'s layer (its longest matching prefix), None for none."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if under(module, prefix) and len(prefix) > best:
                best, found = len(prefix), i
    return found


#: The UI's tabs: none imports another (what two share lives in kvlab.ui.common or kvlab.ui.tasks).
TABS = ["kvlab.ui.explore", "kvlab.ui.compare", "kvlab.ui.generate", "kvlab.ui.learn"]
#: Packages that never import gradio (the lab layer runs without the UI; methods and figures too), and the
#: device suite, which ``python -m benchmarks.gpu_check`` runs on a GPU machine that may have no gradio.
NO_GRADIO = [
    "kvlab.compression",
    "kvlab.methods",
    "kvlab.lab",
    "kvlab.runtime",
    "kvlab.figures",
    "kvlab.kernels",
    "kvlab.testing.device_suite",
]


def module_files(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__) for every .py under root/kvlab."""
    out = {}
    for path in sorted((root / "kvlab").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imported_names(path: Path, module: str, package: bool) -> set[str]:
    """Every absolute name ``path`` imports.

    ``module`` for ``import module``, ``module.attr`` for ``from module import attr``.
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``source.attr``: resolve() keeps the submodule when attr is one, else the package.
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def resolve(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The kvlab module ``name`` lives in (its longest prefix that is a module), None outside kvlab."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def packages_run(target: str, importer: str, modules: dict[str, tuple[Path, bool]]) -> set[str]:
    """The packages whose ``__init__`` importing ``target`` runs: its parents, but those ``importer`` is inside."""
    parts = target.split(".")
    parents = {".".join(parts[:i]) for i in range(2, len(parts))}
    return {p for p in parents if p in modules and modules[p][1] and not under(importer, p)}


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the kvlab modules it imports, the package ``__init__``s that runs included (itself excluded)."""
    graph = {}
    for module, (path, package) in modules.items():
        targets = {resolve(n, modules) for n in imported_names(path, module, package) if n.split(".")[0] == "kvlab"}
        targets = {t for t in targets if t is not None}
        targets |= {p for t in targets for p in packages_run(t, module, modules)}
        graph[module] = {t for t in targets if t != module}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files())


# --- the checker itself, on hand-made graphs and files --------------------------------------------


def test_cycles_finds_a_circle_and_only_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_and_relative_imports_count(tmp_path: Path) -> None:
    pkg = tmp_path / "kvlab" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "kvlab" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .low import thing\n")
    (pkg / "low.py").write_text("def f():\n    from kvlab.top import g\n    return g\nthing = 1\n")
    (tmp_path / "kvlab" / "top.py").write_text("from kvlab.sub import low\nfrom typing import TYPE_CHECKING\n")
    graph = import_graph(module_files(tmp_path))
    assert graph["kvlab.sub"] == {"kvlab.sub.low"}
    assert graph["kvlab.top"] == {"kvlab.sub.low", "kvlab.sub"}  # importing sub.low runs sub's __init__
    assert cycles(graph) == [["kvlab.sub", "kvlab.sub.low", "kvlab.top"]]


# --- the house --------------------------------------------------------------------------------------


def test_kvlab_has_no_import_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    detail = "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a}->{b}" for a in c for b in sorted(graph[a] & set(c))) + ")"
        for c in found
    )
    assert not found, f"import cycles: {detail}"


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]] = LAYERS) -> list[str]:
    """Every import of a module in a higher layer than its importer's, as one line each."""
    wrong = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if b != ROOT_PACKAGE and la is not None and lb is not None and lb > la:
                wrong.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return wrong


def test_the_layer_check_sees_an_upward_import_and_only_it() -> None:
    layers = [("low", ["kvlab.low"]), ("high", ["kvlab.high", "kvlab.low.top"])]
    graph = {
        "kvlab.low.a": {"kvlab.high.b", "kvlab.low.b"},
        "kvlab.high.b": {"kvlab.low.a"},
        "kvlab.low.b": {"kvlab.low.top"},
        "kvlab.low.top": {"kvlab.low.a"},
    }
    assert upward_imports(graph, layers) == [
        "kvlab.low.a (low) imports kvlab.high.b (high)",
        "kvlab.low.b (low) imports kvlab.low.top (high)",
    ]


def sibling_imports(
    graph: dict[str, set[str]], package: str = "kvlab.methods", shared: str = "kvlab.methods.families"
) -> list[str]:
    """Every import of a module of ``package`` (its ``__init__`` included) by another, but of ``shared``."""
    return [
        f"{a} imports {b}"
        for a, targets in sorted(graph.items())
        if under(a, package) and not under(a, shared)
        for b in sorted(targets)
        if under(b, package) and not under(b, shared)
    ]


def test_a_layer_inside_a_higher_package_is_checked_both_ways(tmp_path: Path) -> None:
    """A subpackage that is a layer below its own package (kvlab.methods.families under kvlab.methods):
    its package's modules import it, it imports none of them nor the package (whose ``__init__`` is
    above it), and a module below both that imports it is caught twice (importing it runs the package's
    ``__init__`` first)."""
    layers = [
        ("core", ["kvlab.core"]),
        ("shared", ["kvlab.methods.shared"]),
        ("methods", ["kvlab.methods"]),
        ("high", ["kvlab.high"]),
    ]
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/low.py": "from kvlab.methods.shared import s\n",
        "methods/__init__.py": "from kvlab.core import low\n",
        "methods/a.py": "from kvlab.methods.shared.s import f\n",
        "methods/b.py": "from kvlab.methods import a\n",
        "methods/shared/__init__.py": "",
        "methods/shared/s.py": "from kvlab.methods.shared import t\ndef f(): pass\n",
        "methods/shared/t.py": "from kvlab.methods import MethodError\n",
        "high.py": "import kvlab.methods.shared.s\n",
    }
    for name, text in files.items():
        (tmp_path / "kvlab" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "kvlab" / name).write_text(text)
    graph = import_graph(module_files(tmp_path))
    assert graph["kvlab.methods.a"] == {"kvlab.methods.shared.s", "kvlab.methods.shared"}
    assert graph["kvlab.methods.shared.s"] == {"kvlab.methods.shared.t"}  # inside both packages already
    assert graph["kvlab.high"] == {"kvlab.methods.shared.s", "kvlab.methods.shared", "kvlab.methods"}
    assert upward_imports(graph, layers) == [
        "kvlab.core.low (core) imports kvlab.methods (methods)",
        "kvlab.core.low (core) imports kvlab.methods.shared (shared)",
        "kvlab.core.low (core) imports kvlab.methods.shared.s (shared)",
        "kvlab.methods.shared.t (shared) imports kvlab.methods (methods)",
    ]
    assert sibling_imports(graph, "kvlab.methods", "kvlab.methods.shared") == [
        "kvlab.methods.b imports kvlab.methods.a"
    ]


def test_no_method_imports_another(graph: dict[str, set[str]]) -> None:
    """A method's file imports what its family shares (kvlab.methods.families) and the layers below, never
    another method's file: adding, renaming or removing a method is one file."""
    wrong = sibling_imports(graph)
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    missing = [m for m in graph if m != ROOT_PACKAGE and layer_of(m) is None]
    assert not missing, f"modules in no layer of LAYERS: {', '.join(missing)}"


def test_no_import_goes_up_the_layers(graph: dict[str, set[str]]) -> None:
    wrong = upward_imports(graph)
    assert not wrong, "\n".join(wrong)


def test_ui_tabs_do_not_import_each_other(graph: dict[str, set[str]]) -> None:
    wrong = [f"{a} imports {b}" for a in TABS for b in sorted(graph[a]) if b in TABS]
    assert not wrong, "\n".join(wrong)


def test_library_layers_import_no_gradio(graph: dict[str, set[str]]) -> None:
    files = module_files()
    direct = {
        module
        for module, (path, package) in files.items()
        if any(n.split(".")[0] == "gradio" for n in imported_names(path, module, package))
    }
    # Directly, or through any module they import (a package's __init__ included).
    wrong = [
        f"{module} ({', '.join(sorted(({module} | reachable(graph, module)) & direct))})"
        for module in files
        if any(under(module, p) for p in NO_GRADIO) and ({module} | reachable(graph, module)) & direct
    ]
    assert not wrong, f"reach gradio: {', '.join(wrong)}"


def test_a_submodule_import_counts_its_packages_init(tmp_path: Path) -> None:
    """``from kvlab.ui.links import x`` runs kvlab/ui/__init__.py: an import of gradio there is reached."""
    (tmp_path / "kvlab" / "ui").mkdir(parents=True)
    (tmp_path / "kvlab" / "lab").mkdir()
    (tmp_path / "kvlab" / "__init__.py").write_text("")
    (tmp_path / "kvlab" / "ui" / "__init__.py").write_text("from kvlab.ui.app import main\n")
    (tmp_path / "kvlab" / "ui" / "app.py").write_text("import gradio\nfrom kvlab.ui import links\n")
    (tmp_path / "kvlab" / "ui" / "links.py").write_text("x = 1\n")
    (tmp_path / "kvlab" / "lab" / "__init__.py").write_text("")
    (tmp_path / "kvlab" / "lab" / "warm.py").write_text("from kvlab.ui.links import x\n")
    graph = import_graph(module_files(tmp_path))
    assert graph["kvlab.lab.warm"] == {"kvlab.ui.links", "kvlab.ui"}
    assert graph["kvlab.ui.app"] == {"kvlab.ui.links"}  # inside kvlab.ui already: its __init__ has run
    assert "kvlab.ui.app" in reachable(graph, "kvlab.lab.warm")


@pytest.mark.parametrize("root", ["kvlab.compression", "kvlab.methods.families"])
def test_the_compression_cores_packages_run_nothing_on_import(root: str) -> None:
    """Importing kvlab.compression (or its subpackages) runs no module: the core is imported piece by piece;
    so is what the methods share (kvlab.methods.families)."""
    files = module_files()
    inits = {m: path for m, (path, package) in files.items() if package and under(m, root)}
    assert root in inits
    busy = [
        m
        for m, path in inits.items()
        if any(
            not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            for node in ast.parse(path.read_text(encoding="utf-8")).body
        )
    ]
    assert not busy, f"more than a docstring in: {', '.join(busy)}"
