"""benchmarks/report.py: the committed performance pages are its output, byte for byte, and every cell of every table
is text of the raw file the table names; the newest run per machine class wins; bad folders fail clearly."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(spec)
sys.modules["bench_report"] = report  # dataclasses look their module up while the class is made
spec.loader.exec_module(report)


def test_committed_pages_and_folder_readmes_are_the_reports_output() -> None:
    pages = report.build(ROOT)
    for path, text in pages.items():
        assert (ROOT / path).read_text(encoding="utf-8") == text, f"{path} differs: run python benchmarks/report.py"
    written = {p for p in pages if p.parent == report.PAGES}
    on_disk = {p.relative_to(ROOT) for p in (ROOT / report.PAGES).glob("*.md")}
    assert on_disk == written, f"pages not written by report.py: {sorted(on_disk - written)}"


def _tables_with_sources(page: str) -> list[tuple[list[str], list[list[str]]]]:
    """(raw files named above the table, the table's body rows as cells) for every table of a page."""
    out, sources, rows = [], [], []
    for line in page.splitlines() + [""]:
        if line.startswith("Raw output:"):
            sources = re.findall(r"`(benchmarks/results/[^`]+)`", line)
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            out.append((sources, [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows[2:]]))
            rows = []
    return out


def test_every_table_cell_is_text_of_the_raw_file_the_table_names() -> None:
    checked = 0
    for page in sorted((ROOT / report.PAGES).glob("*.md")):
        if page.name == "index.md":
            continue
        tables = _tables_with_sources(page.read_text(encoding="utf-8"))
        assert tables, f"{page.name}: no tables"
        for sources, rows in tables:
            assert sources, f"{page.name}: a table names no raw file"
            raw = "\n".join((ROOT / s).read_text(encoding="utf-8") for s in sources)
            for row in rows:
                missing = [c for c in row if c not in raw]
                assert not missing, f"{page.name}: {missing} of row {row} not in {sources}"
                checked += 1
    assert checked > 100


@pytest.fixture
def results_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / report.RESULTS, tmp_path / report.RESULTS)
    return tmp_path


def test_a_changed_raw_number_changes_the_page(results_copy: Path) -> None:
    raw = results_copy / report.RESULTS / "cpu-2026-11-23c" / "bench_retriever_reranker.txt"
    raw.write_text(raw.read_text().replace("3.68x", "9.99x"))
    training = report.build(results_copy)[report.PAGES / "training.md"]
    assert "| retriever | 30 | batched+bf16 | 1 | 70 | 1.71 | 2.335 | 9.99x |" in training
    assert "3.68x" not in training


def test_the_newest_run_of_a_machine_class_replaces_the_older_one(results_copy: Path) -> None:
    old = results_copy / report.RESULTS / "cpu-2026-11-23f"
    new = results_copy / report.RESULTS / "cpu-2026-11-24"
    new.mkdir()
    shutil.copy(old / "machine.json", new / "machine.json")
    shutil.copy(old / "bench_llm_lamp2.txt", new / "lamp2.txt")
    (new / "lamp2.txt").write_text((new / "lamp2.txt").read_text().replace("| 4.07 |", "| 4.08 |"))
    entry = next(e for e in json.loads((old / "runs.json").read_text()) if e["files"] == ["bench_llm_lamp2.txt"])
    entry = dict(entry, files=["lamp2.txt"], parts=[dict(entry["parts"][0], file="lamp2.txt")])
    (new / "runs.json").write_text(json.dumps([entry]))
    page = report.build(results_copy)[report.PAGES / "llm-feedback.md"]
    assert "cpu-2026-11-24/lamp2.txt" in page and "cpu-2026-11-23f/bench_llm_lamp2.txt" not in page
    assert "| 4.08 |" in page
    assert "cpu-2026-11-23b/bench_llm_2threads_lamp2.md" in page  # another machine class keeps its own run


def test_bad_folders_fail_with_the_file_and_field(results_copy: Path) -> None:
    folder = results_copy / report.RESULTS / "cpu-2026-11-27c-mainjob"  # the newest main job of its class: shown
    runs = json.loads((folder / "runs.json").read_text())
    next(r for r in runs if r.get("benchmark", "").endswith("seed 1"))["parts"][0]["header"] = "| no such column"
    (folder / "runs.json").write_text(json.dumps(runs))
    with pytest.raises(report.ReportError, match=r"evaluate_results_seed1\.md: runs\.json part 0: no table with header"):
        report.build(results_copy)
    (folder / "machine.json").unlink()
    with pytest.raises(report.ReportError, match=r"cpu-2026-11-27c-mainjob/machine\.json: missing"):
        report.build(results_copy)


def test_superseded_benchmarks_come_after_the_current_ones_and_say_what_replaced_them(results_copy: Path) -> None:
    page = report.build(results_copy)[report.PAGES / "main-job.md"]
    earlier = page.index(f"## {report.EARLIER_HEADING}")
    assert page.index("## Main job, quick preset (calibrated reader), seed 0") < earlier
    assert page.index("### Main job, quick preset (uncalibrated reader), seed 0") > earlier
    assert page.index("### Main job, quick preset\n") > earlier  # the earlier recipe's runs, one level down
    assert "Superseded: by the quick preset's current recipe" in page[earlier:]
    folder = results_copy / report.RESULTS / "cpu-2026-11-23e"
    runs = json.loads((folder / "runs.json").read_text())
    next(r for r in runs if r.get("family") == "main-job")["superseded"] = " "
    (folder / "runs.json").write_text(json.dumps(runs))
    with pytest.raises(report.ReportError, match=r"cpu-2026-11-23e/runs\.json: entry 0: field 'superseded'"):
        report.build(results_copy)


def test_the_main_job_page_opens_with_the_goal_of_each_stored_run(results_copy: Path) -> None:
    """The glance table: one row per main-job run with a `glance` entry, its reference and the goal's three
    differences copied from the run's results.md; a results file without the pair's sentence is refused by name."""
    page = report.build(results_copy)[report.PAGES / "main-job.md"]
    opening = page.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in opening.splitlines() if "| AMD EPYC Zen 4 class, 2 vCPUs | 2026-11-28 |" in line)
    assert "| 26:38.46 |  | w/o reranker tuning | 0.523 [0.467, 0.577] | 0.377 [0.323, 0.433] | 0.001 * |" in row
    assert row.endswith("| 0.523 [0.470, 0.577] | 0.333 [0.280, 0.387] | 0.001 * |")
    results = results_copy / report.RESULTS / "cpu-2026-11-28b-mainjob-calibrated" / "evaluate_results.md"
    results.write_text(results.read_text().replace("Paired test,", "A test,"))
    with pytest.raises(report.ReportError, match=r"calibrated/evaluate_results\.md: glance: no row of the pair"):
        report.build(results_copy)


def test_the_readme_shows_the_newest_stored_runs_lines_and_table(results_copy: Path) -> None:
    """README.md's two report.py blocks hold the newest glance run's own output lines and its table's first columns;
    the rest of the README is left as it is, and a README without the blocks is refused by name."""
    shutil.copy(ROOT / report.README, results_copy / report.README)
    readme = report.build(results_copy)[report.README]
    newest = max(report.glance_rows(report.latest(report.load_runs(results_copy)), results_copy),
                 key=lambda r: r.run.order)
    assert f"`{report.RESULTS / newest.run.folder / newest.run.entry['glance']['results']}`" in readme
    table = readme.split("<!-- report.py: main-job table -->", 1)[1].split("<!-- /report.py -->", 1)[0]
    assert "| bm25 |" in table and "Paired test," in table
    assert readme.split("<!-- report.py:", 1)[0] == (ROOT / report.README).read_text().split("<!-- report.py:", 1)[0]
    (results_copy / report.README).write_text("# no blocks\n")
    with pytest.raises(report.ReportError, match=r"README\.md: no block 'main-job output'"):
        report.build(results_copy)
