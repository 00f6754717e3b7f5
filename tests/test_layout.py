"""The tests' own layout: no test module imports another, and no fixture name means two things.

Shared builders live in tests/helpers.py and shared fixtures in tests/conftest.py; a test module
that imports another runs (and collects) that module's code and couples the two. Every import in
every file under tests/ and lab/tests/ is read with ``ast``, function-level ones included.
"""

import ast
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
TEST_DIRS = [CHECKOUT / "tests", CHECKOUT / "lab" / "tests"]


def python_files() -> list[Path]:
    return sorted(p for d in TEST_DIRS for p in d.rglob("*.py"))


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(CHECKOUT).with_suffix("").parts)


def imported_modules(source: str, module: str) -> list[tuple[str, int]]:
    """(dotted name, line) for every module an import statement may load: ``from a import b``
    gives both a and a.b (b may be a submodule); relative imports are resolved from ``module``."""
    package = module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def imports_of_test_modules(source: str, module: str) -> list[str]:
    """The test modules (``test_*``, by dotted name or bare, as rootdir imports allow) imported."""
    return sorted(
        {
            f"{name}:{line}"
            for name, line in imported_modules(source, module)
            if name.rpartition(".")[2].startswith("test_")
        }
    )


def test_no_test_module_imports_another():
    bad = []
    for path in python_files():
        bad += [
            f"{path.relative_to(CHECKOUT)} imports {hit}"
            for hit in imports_of_test_modules(path.read_text(), module_of(path))
        ]
    assert not bad, "move what they share into tests/helpers.py or tests/conftest.py:\n" + "\n".join(bad)


def fixtures_in(source: str) -> list[str]:
    """Names of the functions decorated with ``pytest.fixture`` or ``fixture`` (called or not)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
                    isinstance(target, ast.Name) and target.id == "fixture"
                ):
                    names.append(node.name)
    return names


def test_no_fixture_name_is_defined_twice():
    where: dict[str, list[str]] = {}
    for path in python_files():
        for name in fixtures_in(path.read_text()):
            where.setdefault(name, []).append(str(path.relative_to(CHECKOUT)))
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"fixtures defined in more than one place (one in conftest.py, or distinct names): {twice}"


def test_the_checks_catch_what_they_should():
    mod = "tests.train.test_a"
    assert imports_of_test_modules("from tests.train.test_plan import SHAPE", mod) == ["tests.train.test_plan:1"]
    assert imports_of_test_modules("from .test_plan import SHAPE", mod) == ["tests.train.test_plan:1"]
    assert imports_of_test_modules("from . import test_plan", mod) == ["tests.train.test_plan:1"]
    assert imports_of_test_modules("from ..engine import test_engine", mod) == ["tests.engine.test_engine:1"]
    assert imports_of_test_modules("def f():\n    import test_plan", mod) == ["test_plan:2"]
    assert imports_of_test_modules("from tests.helpers import test_vocab, tiny\nimport testing", mod) == [
        "tests.helpers.test_vocab:1"
    ]  # a name starting test_ taken from a module counts: it may be a submodule
    assert imports_of_test_modules("from tests.helpers import tiny\nfrom tests.conftest import CHECKOUT", mod) == []
    assert fixtures_in(
        "@pytest.fixture\ndef a(): ...\n@pytest.fixture(scope='module')\ndef b(): ...\ndef c(): ..."
    ) == [
        "a",
        "b",
    ]


def test_product_files_and_functions_fit_a_screen():
    """The package's size rules: no source file over 500 lines, no function over 60."""
    long_files, long_functions = [], []
    for path in sorted((CHECKOUT / "src" / "draftling").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(CHECKOUT)
        if text.count("\n") > 500:
            long_files.append(f"{where}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long_functions.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions
