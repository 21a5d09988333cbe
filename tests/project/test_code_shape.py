"""The package's shape, kept where it landed: no module over 500 lines, no function over 60, an `__all__` in every
package (ruff keeps the complexity at 15 and import-linter the layers; both run in .ci/run)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "persrag_lightning"
MAX_LINES, MAX_FUNCTION_LINES = 500, 60


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in modules() if (n := p.read_text().count("\n")) > MAX_LINES}
    assert not long, f"split these by concern: {long}"


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES):
                long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not long, f"split these: {long}"


def test_every_package_declares_its_public_names_and_each_exists() -> None:
    for init in sorted(PACKAGE.rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        declared = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                         and any(getattr(t, "id", None) == "__all__" for t in node.targets)), None)
        assert declared is not None, f"{init.relative_to(PACKAGE)}: no __all__"
        names = ast.literal_eval(declared)
        bound = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)}
        bound |= {(a.asname or a.name) for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
        for name in names:  # a name the package binds, or one of its modules (imported on use)
            assert name in bound or (init.parent / f"{name}.py").is_file() or (init.parent / name).is_dir(), \
                f"{init.relative_to(PACKAGE)}: __all__ names {name!r}, which is neither bound there nor a module"


def test_every_name_a_benchmark_imports_from_the_package_exists() -> None:
    """Benchmarks run by hand, not in the suite: a name moved or renamed in the package must not break them unseen."""
    import importlib

    missing = []
    for script in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("persrag_lightning"):
                module = importlib.import_module(node.module)
                missing += [f"{script.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name)
                            and not (Path(module.__file__).parent / f"{a.name}.py").is_file()]
    assert not missing, missing
