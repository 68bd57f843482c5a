"""The package's layers import downward only, never in a circle (imports inside functions
count too), and the performance model needs neither strategies nor the run."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "refdl"

# Layers, bottom to top (docs/design.md); a module may import its own layer or lower ones.
# The core (layers, losses, optimizers) knows no model; assembling a data set, a model and
# an optimizer into a Task (``refdl.assemble``) sits above all three; the predictor draws
# with ``refdl.plots`` and knows no benchmark; the command lines' shared parser
# (``refdl.cli``) reads RunSpec's fields; the performance model's two entries that load
# hardware profiles by name (predictions, plans) sit with ``refdl.hw``.
LAYERS = {
    "refdl.errors": 0, "refdl.registry": 0, "refdl.progress": 0, "refdl.plots": 0,
    "refdl.config": 1, "refdl.cli": 1,
    "refdl.core": 2, "refdl.data": 2, "refdl.comm": 2, "refdl.parallel": 2,
    "refdl.models": 3,
    "refdl.assemble": 4,
    "refdl.strategies": 5, "refdl.perf": 5,
    "refdl.hw": 6, "refdl.perf.prediction": 6, "refdl.perf.planning": 6,
    "refdl.run": 7, "refdl.adapters": 7,
    "refdl.testing": 8, "refdl.named": 8, "refdl.predict": 8, "refdl.launch": 8,
    "refdl.elastic": 8, "refdl.train": 8,
    "refdl.validate": 9, "refdl.bench": 9, "refdl.__main__": 9, "refdl": 9,
}  # fmt: skip


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        name = ".".join(f.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in the file)."""
    mods = modules()
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = m.split(".") if is_pkg else m.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m and n != "refdl":
                    g[m].add(n)
    return g


def layer(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer of docs/design.md")


def test_no_import_cycle():
    g = graph()
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not found, f"import cycles: {found}"


def test_imports_point_downward():
    wrong = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in graph().items()
        for d in deps
        if layer(d) > layer(m)
    ]
    assert not wrong, "\n".join(wrong)


def test_perf_needs_neither_strategies_nor_the_run_and_strategies_know_no_perf():
    g = graph()
    for m, deps in g.items():
        if m.startswith("refdl.perf"):
            bad = {d for d in deps if d.startswith(("refdl.strategies", "refdl.run"))}
            assert not bad, f"{m} imports {bad}"
        if m.startswith("refdl.strategies"):
            bad = {d for d in deps if d.startswith(("refdl.perf", "refdl.run", "refdl.bench"))}
            assert not bad, f"{m} imports {bad}"
        if m.startswith("refdl.run"):
            bad = {d for d in deps if d.startswith(("refdl.bench", "refdl.plots"))}
            assert not bad, f"the run draws nothing: {m} imports {bad}"


def test_the_layer_table_has_every_module():
    for m in modules():
        layer(m)
