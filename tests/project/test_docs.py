"""Every shell command in README.md, CONTRIBUTING.md and docs/ is one the test suite knows.

A command is either marked as needing what CI lacks (`# needs: gpu`, `# needs: cluster`, `# needs: server`,
`# needs: data (…)`, `# needs: full run`, `# needs: llama.cpp`) or it is a command this file checks: `train.py` /
`persrag` subcommands have their arguments parsed by the real parsers (LightningCLI with `--print_config`, the
evaluate, cluster, serve and pipeline parsers) and name a test that runs the subcommand at smoke scale; scripts
have every flag checked against their `--help`; install, CI, pytest, ruff, pip and mkdocs lines are checked against
the files and extras they name. A doc that gains a command none of these know fails here."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO, fake_evaluate, fake_fit

FENCE = re.compile(r"^ {0,4}```(\w*)[^\n]*\n(.*?)^ {0,4}```", re.MULTILINE | re.DOTALL)  # in list items too
SHELL = {"bash", "sh", "shell", "console"}
NEEDS = re.compile(r"#\s*needs:\s*(gpu|cluster|server|data|full run|llama\.cpp)\b")
LIGHTNING = {"fit", "validate", "test", "predict", "export"}
# each CLI subcommand a doc may show, and the test that runs it at smoke scale (checked to exist below)
SMOKE = {
    "fit": "tests/test_cli.py::test_logs_are_quiet_unless_verbose",
    "validate": "tests/training/test_ddp.py::test_retriever_and_reranker_train_on_two_processes",
    "export": "tests/models/test_user_encoder.py::test_export_subcommand_rewrites_bundle_from_checkpoint",
    "feedback": "tests/feedback/test_feedback.py::test_feedback_command_builds_shards_and_prints_stats",
    "evaluate": "tests/models/test_generator.py::test_fit_generator_yaml_exports_and_evaluates_tuned_rows",
    "pipeline": "tests/e2e/test_e2e.py::test_pipeline_smoke_with_real_models",
    "cluster": "tests/commands/test_cluster_command.py::test_export_holds_assignments_centroids_settings_sizes_noise_and_ari",
    "serve": "tests/serving/test_serve.py::test_killed_server_restarts_consistent",
    "data": "tests/e2e/test_e2e.py::test_a_review_log_in_every_format_converts_and_trains_to_its_table",
}
SCRIPTS_RUN_BY_CI = {".ci/install.sh", ".ci/install_tests.sh", ".ci/run"}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]
    needs: str | None

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def commands_of(path: Path) -> list[Command]:
    """The commands of the fenced shell blocks of a markdown file: continuation lines joined, `a && b` split,
    leading `VAR=value` assignments dropped, comments dropped (a `# needs:` marker kept)."""
    text = path.read_text()
    out = []
    for block in FENCE.finditer(text):
        if block.group(1) not in SHELL:
            continue
        first_line = text[: block.start(2)].count("\n") + 1
        lines = block.group(2).splitlines()
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            needs = NEEDS.search(line)
            tokens = shlex.split(line, comments=True)
            where = f"{path.relative_to(REPO)}:{first_line + start}"
            for part in _split_and(tokens):
                part = _unwrap(part)
                if part:
                    out.append(Command(where, tuple(part), needs.group(1) if needs else None))
    return out


def _unwrap(argv: list[str]) -> list[str]:
    """`FOO=bar cmd`, `time cmd`, `/usr/bin/time -v cmd`, `nice -n 10 cmd`, `timeout 60 cmd` → `cmd`."""
    while argv:
        if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            argv = argv[1:]
        elif argv[0] in ("time", "/usr/bin/time"):
            argv = argv[2:] if argv[1:2] == ["-v"] else argv[1:]
        elif argv[0] == "nice":
            argv = argv[3:] if argv[1:2] == ["-n"] else argv[1:]
        elif argv[0] == "timeout" and len(argv) > 1:
            argv = argv[2:]
        else:
            return argv
    return argv


def _split_and(tokens: list[str]) -> list[list[str]]:
    parts, current = [], []
    for token in tokens:
        if token in ("&&", ";", "||"):
            parts.append(current)
            current = []
        else:
            current.append(token)
    return [*parts, current]


ALL = [c for f in doc_files() for c in commands_of(f)]


def test_the_docs_have_commands_and_markers_are_spelled_right():
    assert len(ALL) > 30, "the extraction found too few commands: is the fence pattern broken?"
    for path in doc_files():
        for line in path.read_text().splitlines():
            if "# needs" in line or "#needs" in line:
                assert NEEDS.search(line), f"{path.relative_to(REPO)}: unknown marker in {line.strip()!r}"


def test_readme_and_contributing_links_resolve():
    """mkdocs checks the links inside docs/; these two files live outside it."""
    for name in ("README.md", "CONTRIBUTING.md"):
        text = (REPO / name).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"\w+://", target):
                assert (REPO / target).exists(), f"{name}: broken link {target}"


def test_every_cli_subcommand_names_an_existing_smoke_test():
    for subcommand, test in SMOKE.items():
        file, name = test.split("::")
        tree = ast.parse((REPO / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{subcommand}: {test} does not exist"
        assert subcommand in (REPO / file).read_text(), f"{test} does not run `{subcommand}`"


def classify(cmd: Command) -> str:
    """Which check a command gets; 'unknown' fails the test."""
    argv = list(cmd.argv)
    head = "python" if argv[0] == "python3" else argv[0]  # python3: a GPU image's interpreter (docs/training/gpu.md)
    if head in (".", "source"):
        return "environment"
    if head in ("bash", "sh") and len(argv) > 1 and argv[1].startswith("benchmarks/"):
        return "benchmark-script"
    if head in ("bash", "sh") and len(argv) > 1 or head.startswith(".ci/"):
        return "ci-script"
    if head == "python" and argv[1:2] == ["train.py"] or head == "persrag":
        return "cli"
    if head == "python" and argv[1:3] == ["-m", "pytest"]:
        return "pytest"
    if head == "python" and len(argv) > 1 and (argv[1].endswith(".py") or argv[1] == "-m"):
        return "script"
    if head in ("pip", "python") and ("install" in argv or "uninstall" in argv):
        return "pip"
    if head == "ruff":
        return "ruff"
    if head == "mkdocs":
        return "mkdocs"
    if head in ("sbatch",) or head.startswith("slurm/") and head.endswith(".sh"):
        return "slurm"
    if head == "curl":
        return "http"
    return "unknown"


def test_every_command_is_known():
    unknown = [str(c) for c in ALL if classify(c) == "unknown"]
    assert not unknown, "commands no test knows (add a `# needs: …` marker or teach tests/project/test_docs.py):\n" + \
        "\n".join(unknown)


def test_commands_that_need_what_ci_lacks_say_so():
    """Slurm jobs need a cluster and HTTP calls a running `persrag serve`: such lines must carry the marker."""
    needs = {"slurm": "cluster", "http": "server"}
    missing = [str(c) for c in ALL if classify(c) in needs and c.needs != needs[classify(c)]]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("cmd", [c for c in ALL if classify(c) == "ci-script"], ids=str)
def test_ci_scripts_exist_and_ci_runs_them(cmd):
    script = cmd.argv[1] if cmd.argv[0] in ("bash", "sh") else cmd.argv[0]
    assert script in SCRIPTS_RUN_BY_CI and (REPO / script).is_file(), cmd


@pytest.mark.parametrize("cmd", [c for c in ALL if classify(c) == "benchmark-script"], ids=str)
def test_benchmark_shell_scripts_exist_and_know_their_steps(cmd):
    script = REPO / cmd.argv[1]
    assert script.is_file(), cmd
    steps = set(re.findall(r"^\s*(\w+)\)", script.read_text(), re.MULTILINE))
    assert set(cmd.argv[2:]) <= steps, f"{cmd}: unknown steps {set(cmd.argv[2:]) - steps}"


def test_pytest_lines_name_existing_markers_and_files():
    markers = set(re.findall(r'^\s*"(\w+): ', _pyproject_section("tool.pytest.ini_options"), re.MULTILINE))
    assert {"slow", "gpu"} <= markers
    for cmd in (c for c in ALL if classify(c) == "pytest"):
        argv = list(cmd.argv[3:])
        for i, arg in enumerate(argv):
            if arg == "-m":
                used = set(re.findall(r"\w+", argv[i + 1])) - {"not", "and", "or"}
                assert used <= markers, f"{cmd}: unknown markers {used - markers}"
            elif arg.startswith("tests/"):
                assert (REPO / arg.split("::")[0]).is_file(), f"{cmd}: no {arg}"


def test_pip_lines_name_existing_extras():
    extras = set(re.findall(r"^(\w+) = \[", _pyproject_section("project.optional-dependencies"), re.MULTILINE))
    assert {"dev", "docs"} <= extras
    for cmd in (c for c in ALL if classify(c) == "pip"):
        for arg in cmd.argv:
            match = re.fullmatch(r"\.\[([\w,]+)\]", arg)
            if match:
                assert set(match.group(1).split(",")) <= extras, cmd


def test_ruff_and_mkdocs_lines_name_existing_paths():
    for cmd in (c for c in ALL if classify(c) in ("ruff", "mkdocs")):
        if cmd.argv[0] == "ruff":
            assert cmd.argv[1] == "check", cmd
            assert all((REPO / p).exists() for p in cmd.argv[2:] if not p.startswith("-")), cmd
        else:
            assert cmd.argv[1] in ("serve", "build"), cmd
    assert (REPO / "mkdocs.yml").is_file()


def test_slurm_lines_name_existing_scripts_and_configs():
    for cmd in (c for c in ALL if classify(c) == "slurm"):
        scripts = [a for a in cmd.argv if a.startswith("slurm/")]
        assert scripts and all((REPO / s).is_file() for s in scripts), cmd
        configs = [a for a in cmd.argv if a.endswith(".yaml") and not a.startswith("-")]
        assert all((REPO / "configs" / c).is_file() or (REPO / c).is_file() for c in configs), cmd


def test_http_lines_name_routes_of_the_service():
    source = (REPO / "persrag_lightning" / "serving" / "app.py").read_text()
    routes = [re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", r) + "$")
              for r in re.findall(r'@app\.\w+\("([^"]+)"', source)]
    for cmd in (c for c in ALL if classify(c) == "http"):
        url = next(a for a in cmd.argv if "localhost" in a or "127.0.0.1" in a)
        path = "/" + url.split("/", 1)[1] if "/" in url else "/"
        assert any(r.match(path) for r in routes), f"{cmd}: {path} is not a route of serving/app.py"


@pytest.mark.parametrize("cmd", [c for c in ALL if classify(c) == "script"], ids=str)
def test_script_flags_are_in_their_help(cmd):
    argv = list(cmd.argv[1:])
    target = argv[:2] if argv[0] == "-m" else argv[:1]
    if cmd.needs is None:
        assert target[0] == "-m" or (REPO / target[0]).is_file(), f"{cmd}: no such script"
    if cmd.needs is not None and (target[0] != "-m" and not (REPO / target[0]).is_file()):
        return  # a marked command outside the repository (e.g. llama.cpp's converter)
    rest = argv[len(target):]
    sub = [rest[0]] if rest and not rest[0].startswith("-") and "/" not in rest[0] else []
    help_text = _help(tuple(target), tuple(sub))
    flags = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    unknown = {f for f in flags if not re.search(re.escape(f) + r"\b", help_text)}
    assert not unknown, f"{cmd}: flags not in its --help: {sorted(unknown)}"


CLI = [c for c in ALL if classify(c) == "cli"]


@pytest.mark.parametrize("cmd", CLI, ids=str)
def test_cli_commands_parse_and_their_subcommand_has_a_smoke_test(cmd, in_tmp_cwd, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI is given its arguments, not pytest's
    argv = list(cmd.argv[2:] if cmd.argv[0] == "python" else cmd.argv[1:])
    sub = argv[0]
    assert sub in SMOKE, f"{cmd}: `{sub}` is run by no test listed in SMOKE"
    check_cli_args(sub, argv[1:], monkeypatch, capsys)


def test_readme_quickstart_on_your_own_lamp_folder_trains_stage_1_at_smoke_scale(in_tmp_cwd, tiny_bert, monkeypatch):
    """The README's "your own LaMP folder" stage-1 line, run as written on a small LaMP folder (SynthLaMP's files
    under the README's folder name), with a tiny encoder and one epoch: it exports where the next lines read."""
    from persrag_lightning.cli import main
    from persrag_lightning.data.synth import main as synth

    readme = [c for c in commands_of(REPO / "README.md") if "--data.init_args.data_dir=my_lamp" in c.argv]
    assert readme, "the README lost its own-folder quickstart"
    stage1 = next(c for c in readme if "cfrag_user_encoder.yaml" in c.argv)
    task = next(a.split("=", 1)[1] for a in stage1.argv if a.startswith("--data.init_args.task="))
    run_name = stage1.argv[stage1.argv.index("--run_name") + 1]
    synth(["my_lamp", "--task", task, "--num-users", "16"])
    monkeypatch.setattr(sys, "argv", ["train.py"])
    main([*stage1.argv[2:], f"--data.init_args.encoder={tiny_bert}", "--trainer.max_epochs=1",
          "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"])
    bundle = in_tmp_cwd / "checkpoints" / run_name / "user_encoder"
    assert (bundle / "config.json").is_file() and (bundle / "users.faiss").is_file()
    assert all(f"--run_name {run_name}" in str(c) or "--run_name" not in c.argv for c in readme), readme


# ------------------------------------------------------------------------------------------- how each parses


def check_cli_args(sub: str, args: list[str], monkeypatch, capsys) -> None:
    from persrag_lightning.commands.train import resolve_config_args
    from persrag_lightning.logs import pop_verbose

    args, _ = pop_verbose(args)
    args = resolve_config_args(args)
    if sub in LIGHTNING:
        return print_config(sub, args, capsys)
    if sub == "feedback":
        from persrag_lightning.commands.feedback import feedback_parser

        _, rest = feedback_parser().parse_known_args(args)
        return print_config("fit", rest, capsys)
    if sub == "evaluate":
        return parse_evaluate(args)
    if sub == "cluster":
        from persrag_lightning.commands.cluster import parser

        parser().parse_args(args)
        return None
    if sub == "serve":
        return parse_serve(args, monkeypatch)
    if sub == "data":
        from persrag_lightning.commands.data import parser

        parser().parse_args(args)
        return None
    if sub == "pipeline":
        return parse_pipeline(args, monkeypatch, capsys)
    raise AssertionError(sub)


_PARSED: set[tuple[str, ...]] = set()  # the same line in the README and a page is parsed once


def print_config(sub: str, args: list[str], capsys) -> None:
    from persrag_lightning.commands.train import lightning_command

    if (sub, *args) in _PARSED:
        return
    with pytest.raises(SystemExit) as done:
        lightning_command([sub, *args, "--print_config"])
    out = capsys.readouterr()
    assert done.value.code in (0, None), out.err
    assert "class_path" in out.out, out.err
    _PARSED.add((sub, *args))


def parse_evaluate(args: list[str]) -> None:
    from persrag_lightning.commands.evaluate import evaluate_args
    from persrag_lightning.evaluation.arguments import evaluate_parser, only_names

    parser = evaluate_parser()
    cfg = parser.parse_args(evaluate_args(args))
    if cfg.only is not None:  # the strategies load nothing until prepare(): instantiating them is cheap
        names = {s.name for s in parser.instantiate_classes(cfg).strategies}
        unknown = set(only_names(cfg.only)) - names
        assert not unknown, f"--only names no strategy of the config: {sorted(unknown)}"


def parse_serve(args: list[str], monkeypatch) -> None:
    from persrag_lightning.serving import service

    class Parsed(Exception):
        pass

    def opened(*a, **k):
        raise Parsed

    monkeypatch.setattr(service.ChatService, "open", staticmethod(opened))
    from persrag_lightning.commands.serve import serve_command

    with pytest.raises(Parsed):
        serve_command(args)


def parse_pipeline(args: list[str], monkeypatch, capsys) -> None:
    """The pipeline's own options parse, its fits and evaluations are given resolved configurations, and every
    stage command it prints parses as `fit` does."""
    from persrag_lightning.pipeline import command as pipeline
    from persrag_lightning.pipeline import runs

    fits, evaluations = [], []
    monkeypatch.setattr(pipeline, "run_stage", fake_fit(fits))
    monkeypatch.setattr(pipeline, "run_evaluation", fake_evaluate(evaluations))
    monkeypatch.setattr(pipeline, "check_data_dir", lambda *a: None)  # a `--data_dir` of the docs is the user's
    with tempfile.TemporaryDirectory() as root:  # the run's pipeline.json goes there, not into the checkout
        pipeline.main([*args, "--export_root", root])
        record = next((json.loads(p.read_text()) for p in Path(root).glob("*/pipeline.json")), None)
    capsys.readouterr()
    if "--plan" in args:  # the decisions, the plan and the estimate: it stops before anything trains
        assert not fits and not evaluations and record is None
        return
    assert fits and evaluations
    for stage in record["stages"]:
        argv = runs.StageRun(**stage).argv()
        print_config(argv[0], argv[1:], capsys)
    for evaluation in record["evaluations"]:  # the choice on dev (quick) and the table
        parse_evaluate(runs.EvaluationRun(**evaluation).argv())


@cache
def _help(target: tuple[str, ...], sub: tuple[str, ...]) -> str:
    for extra in ((*sub, "--help"), ("--help",)):
        out = subprocess.run([sys.executable, *target, *extra], cwd=REPO, capture_output=True, text=True,
                             timeout=300, check=False)
        if out.returncode == 0:
            return out.stdout
    raise AssertionError(f"{' '.join(target)} --help failed: {out.stderr[-2000:]}")


def _pyproject_section(name: str) -> str:
    """The text of one `[section]` of pyproject.toml (Python 3.10 has no tomllib)."""
    text = (REPO / "pyproject.toml").read_text()
    start = text.index(f"[{name}]")
    end = text.find("\n[", start + 1)
    return text[start:] if end < 0 else text[start:end]


# A measured figure (a speed-up, a rate, minutes or milliseconds, an "N of M" count) in a comment, a docstring or a
# config comment rots with the next run: it belongs on a docs page that benchmarks/report.py keeps true.
FIGURE = re.compile(r"\d+(\.\d+)?\s*(x|×)(?![a-z0-9])|prompts/s|labels/s|examples/s|q/s|GFLOP|\d+(\.\d+)?\s*(min|ms)\b"
                    r"|\b\d+ of \d+\b|\d\.\d+\s*-\s*\d\.\d+\s*(x|min)")


def test_no_measured_figure_in_code_or_config_comments():
    import io
    import tokenize

    hits = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        hits += [f"{path.relative_to(REPO)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                 if "#" in line and FIGURE.search(line.split("#", 1)[1])]
    for path in sorted((REPO / "persrag_lightning").rglob("*.py")):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            docstring = token.type == tokenize.STRING and token.string.lstrip("rbfu").startswith(('"""', "'''"))
            if (token.type == tokenize.COMMENT or docstring) and FIGURE.search(token.string):
                hits.append(f"{path.relative_to(REPO)}:{token.start[0]}")
    assert not hits, f"figures in code comments (move them to docs/): {hits}"
