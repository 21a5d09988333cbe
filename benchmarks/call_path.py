"""The main job's own call path, traced: `persrag pipeline --preset quick` with its stages and evaluations replaced
by stand-ins (the pipeline tests' `fake_fit` / `fake_evaluate`), the rate probes and the GEMM probe stubbed, and every
call a function of the package makes to another one recorded. Prints the files it visits (all of them) and those on
the call path: reached from the main job through the package's own functions alone, so not what runs while a module
is imported (a module or class body and whatever it calls), nor what a library calls back (a config parser building
a strategy while it resolves a config) or a stand-in calls; then the calls that climb back up a layer of pyproject's import-linter
contract (distinct caller -> callee pairs) and the task-spec lookups on the call path (`get_task` calls, by caller).

Then, statically, the files one step from the main job's own modules (`--room`, default every module of
persrag_lightning/pipeline/): those modules and every module of the package they import.

Run from the repository root: `python benchmarks/call_path.py` (a few seconds; nothing trains, nothing is written
outside a temporary folder)."""
import contextlib
import io
import sys
import tempfile
from collections import Counter
from pathlib import Path

import tomllib

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
PKG = str(ROOT / "persrag_lightning")
layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
LAYER = {room.strip(): i for i, layer in enumerate(layers) for room in layer.split("|")}


def room(path: str) -> str | None:
    if not path.startswith(PKG + "/"):
        return None
    first = path[len(PKG) + 1:].split("/")[0]
    return first.removesuffix(".py")


def on_call_path(frame) -> bool:
    """Whether a call was reached from the main job through the package's own functions alone: no module or class
    body run while a module is imported above it, and no library in between (a config parser building a class,
    importlib). A dataclass's generated `__init__` (file `<string>`) passes through."""
    if frame.f_code.co_name == "<module>":
        return False
    caller = frame.f_back
    while caller is not None and (room(caller.f_code.co_filename) is not None or caller.f_code.co_filename == "<string>"):
        if caller.f_code.co_name == "<module>":
            return False
        caller = caller.f_back
    return caller is not None and caller.f_code.co_name == "main" and caller.f_code.co_filename == __file__


def one_step(room: list[Path]) -> set[str]:
    """The room's modules and every module of the package they import (at the top or inside a function)."""
    import ast

    touched = {str(p.relative_to(PKG)) for p in room}
    for path in room:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("persrag_lightning"):
                module = Path(PKG).parent / node.module.replace(".", "/")
                for alias in node.names:
                    found = next(c for c in (module / f"{alias.name}.py", module.with_suffix(".py"),
                                             module / "__init__.py") if c.is_file())
                    touched.add(str(found.relative_to(PKG)))
    return touched


def main() -> None:
    from persrag_lightning import runtime
    from persrag_lightning.pipeline import command as pipeline
    from persrag_lightning.pipeline import rates
    from tests.conftest import fake_evaluate, fake_fit
    rates.reader_rates = lambda *a: {"answers": 2.0, "labels": 4.0}
    rates.encoder_rate = lambda *a: 60.0
    choice = runtime.GemmChoice(2, {"reader": {"torch": 1.0}, "encoders": {"torch": 1.0}},
                                {"reader": "torch", "encoders": "torch"}, {})
    runtime.gemm_choice = lambda: choice
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("persrag_lightning") and hasattr(module, "gemm_choice"):
            module.gemm_choice = lambda: choice
    pipeline.run_stage, pipeline.run_evaluation = fake_fit(), fake_evaluate()
    files, called, climbs, lookups, by_caller = set(), set(), set(), [0], Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        # the package's own path: a call made by a function of the package, not by a library it hands work to
        # (the config parsers call the package's classes while they resolve a config)
        if room(callee) is None or frame.f_back is None or room(frame.f_back.f_code.co_filename) is None:
            return
        files.add(callee)
        if on_call_path(frame):
            called.add(callee)
        if frame.f_code.co_name == "get_task" and on_call_path(frame):
            lookups[0] += 1
            by_caller[f"{Path(frame.f_back.f_code.co_filename).relative_to(PKG)}:{frame.f_back.f_code.co_name}"] += 1
        caller = frame.f_back
        a, b = room(caller.f_code.co_filename), room(callee)
        if a in LAYER and b in LAYER and LAYER[b] < LAYER[a]:
            climbs.add((f"{Path(caller.f_code.co_filename).relative_to(PKG)}:{caller.f_code.co_name}",
                        f"{Path(callee).relative_to(PKG)}:{frame.f_code.co_name}"))

    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        sys.setprofile(profile)
        try:
            pipeline.main(["--preset", "quick", "--export_root", root])
        finally:
            sys.setprofile(None)
    print(f"files visited: {len(files)}, of them on the call path (reached from main through the package's functions): "
          f"{len(called)}")
    print(f"calls back up a layer (distinct caller → callee): {len(climbs)}")
    for a, b in sorted(climbs):
        print(f"  {a} → {b}")
    print(f"task-spec lookups on the call path (get_task calls): {lookups[0]}")
    for caller, n in sorted(by_caller.items()):
        print(f"  {n} from {caller}")
    print("files (* on the call path):")
    for f in sorted(files):
        print(f"  {Path(f).relative_to(PKG)}{' *' if f in called else ''}")


if __name__ == "__main__":
    main()
    default = [p for p in sorted(Path(PKG, "pipeline").glob("*.py")) if p.name != "__init__.py"]
    room = [ROOT / p for p in sys.argv[1:]] or default
    static = one_step(room)
    print(f"files one step from the main job's own modules ({len(room)} modules): {len(static)}")
    for f in sorted(static):
        print(f"  {f}")
