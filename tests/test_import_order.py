"""The import order written in src/draftling/__init__.py's docstring, checked over every module.

Every import of a draftling module is read with ``ast``, function-level ones included (they run
later, but they still make the importer depend on what it imports). No module may import from
a later stage, and no two modules may import each other, directly or round a loop.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "draftling"

# Known breaks of the order, as (importer, imported): each needs a reason, and the test fails
# once it is gone, so the list only shrinks. None today.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def stages() -> dict[str, tuple[int, str]]:
    """Top-level name (module or subpackage of draftling) -> (rank, stage), from the docstring."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    lines = re.findall(r"^    (\w+) +([\w ]+?)\s*$", doc, flags=re.M)
    assert lines, "src/draftling/__init__.py: the docstring lists no stages"
    return {name: (rank, stage) for rank, (stage, names) in enumerate(lines) for name in names.split()}


def module_names() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("draftling",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported draftling module, line) for every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                # `from pkg import sub` imports the module pkg.sub; `from mod import name`, mod.
                found.append((f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno))
    return [(m, line) for m, line in found if m == "draftling" or m.startswith("draftling.")]


def graph() -> dict[str, list[tuple[str, int]]]:
    modules = module_names()
    return {m: imports(m, p, set(modules)) for m, p in modules.items()}


def top(module: str) -> str:
    return module.split(".")[1] if "." in module else "draftling"


def stage_of(module: str, order: dict) -> tuple[int, str]:
    return order[top(module)] if top(module) != "draftling" else (0, "base")


def test_every_module_has_a_stage():
    order = stages()
    missing = sorted({top(m) for m in module_names()} - set(order) - {"draftling"})
    assert not missing, f"add {missing} to the stage list in src/draftling/__init__.py"


def test_no_module_imports_from_a_later_stage():
    order = stages()
    edges = graph()
    bad, seen = [], set()
    for module, deps in edges.items():
        for dep, line in deps:
            assert dep in edges, f"{module}:{line} imports {dep}, which is not a module of the package"
            if {top(module), top(dep)} - set(order) - {"draftling"}:
                continue  # reported by test_every_module_has_a_stage
            if stage_of(dep, order) > stage_of(module, order):
                seen.add((module, dep))
                if (module, dep) not in EXCEPTIONS:
                    bad.append(
                        f"{module}:{line} imports {dep}: stage {stage_of(module, order)[1]} "
                        f"imports the later stage {stage_of(dep, order)[1]}"
                    )
    assert not bad, "imports from a later stage:\n" + "\n".join(sorted(set(bad)))
    stale = sorted(set(EXCEPTIONS) - seen)
    assert not stale, f"EXCEPTIONS no longer needed, remove them: {stale}"


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components of more than one module."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycles():
    edges = {m: {d for d, _ in deps if d != m and (m, d) not in EXCEPTIONS} for m, deps in graph().items()}
    cycles = strongly_connected(edges)
    assert not cycles, "modules that import each other (directly or round a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_checks_catch_what_they_should():
    """The checker itself: loops in a made-up graph, the stage ranks, function-level imports."""
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    order = stages()
    assert stage_of("draftling.cli", order) > stage_of("draftling.recipes.quickstart", order)
    assert stage_of("draftling.errors", order) == stage_of("draftling", order) == (0, "base")
    assert stage_of("draftling.target.load", order) < stage_of("draftling.data.prepare", order)
    edges = graph()
    # Function-level imports count: cli/quickstart.py imports the quickstart recipe only inside its
    # run; `from draftling.bench import release` is an import of the module bench.release.
    assert "draftling.recipes.quickstart" in {d for d, _ in edges["draftling.cli.quickstart"]}
    assert "draftling.bench.release" in {d for d, _ in edges["draftling.cli.bench"]}
    # `from draftling.cli import bench` in the package's __init__ is an import of the submodule.
    assert "draftling.cli.bench" in {d for d, _ in edges["draftling.cli"]}
