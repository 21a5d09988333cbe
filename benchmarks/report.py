"""Benchmark pages from the raw outputs: reads every `benchmarks/results/<machine>-<date>/` folder (its
`machine.json` says what the machine is, its `runs.json` which command wrote which file and which table of it
belongs to which page) and writes `docs/performance/*.md` plus each folder's README.md. Tables hold the latest run
per benchmark and machine class; every row is read from a raw file, never typed. Deterministic: the same folders
give the same bytes (tests/project/test_bench_report.py checks that the committed pages are this script's output).

    python benchmarks/report.py            # rewrite the pages and the folder READMEs
    python benchmarks/report.py --check    # exit 1 if any of them differs from what the raw files give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks/results")
PAGES = Path("docs/performance")
FOLDER = re.compile(r"^(?P<kind>[a-z0-9]+)-(?P<date>\d{4}-\d{2}-\d{2})(?P<suffix>[a-z]?)(?P<label>-[a-z0-9-]+)?$")
# Rows that compare against a former default describe the project's history, not an option a user has: they stay
# in the raw file and out of the tables.
HISTORY_ROWS = ("(before)", "until 2026")

FAMILIES = {  # page file -> (title, one line on what the page measures)
    "main-job": ("Main job", ("`python train.py pipeline --preset quick` (and the other presets): CFRAG's stages "
                 "trained twice on the embedded SynthLaMP LaMP-2 (the recipe's chain and the paper's), the choice "
                 "on dev, the generator, then the table on the test split. Cells of the results tables: metric "
                 "[95% bootstrap interval]; p against the table's reference (paired randomisation test): the "
                 "configuration chosen on dev, or CFRAG in the earlier recipe's tables, which come last.")),
    "llm-feedback": ("LLM feedback throughput", ("`benchmarks/bench_llm.py`: candidates labelled or answered per "
                     "second by each LLM backend on the feedback prompts, against a naive transformers loop; "
                     "\"same as exact\" compares with float32 transformers.")),
    "training": ("Training throughput", ("Optimizer steps of the retriever and reranker stages "
                 "(`benchmarks/bench_retriever_reranker.py`), the generator stage (`benchmarks/bench_generator.py`) "
                 "and where a bf16 step's time goes (`benchmarks/profile_dropout.py`).")),
    "serving": ("Serving latency", ("`CFRAGPipeline.retrieve` one query at a time, without the LLM "
                "(`benchmarks/bench_serving.py`), the reranker's runtimes alone "
                "(`benchmarks/profile_reranker.py`), and `persrag serve` under concurrent clients with and "
                "without its retrieval batching (`benchmarks/bench_load.py`); wall-clock ms.")),
    "user-retrieval": ("User retrieval at scale", ("`benchmarks/bench_retrieval.py`: the top-m similar users "
                       "among a million, by index kind, and the retrieval strategies without the LLM.")),
    "data": ("Data conversion", ("`benchmarks/bench_convert.py`: `persrag data convert` on generated review logs "
             "(read, check every value, split by time, write the LaMP folder), each size in a fresh process, next "
             "to a naive converter (csv.DictReader, a dict per row, json.dump) that writes the same questions.")),
    "runtime": ("CPU runtime: float32 GEMM paths", ("`benchmarks/bench_gemm.py`: the float32 GEMM paths the runtime "
                "policy chooses among at the start of a run (`persrag_lightning/runtime.py`), in GFLOP/s at the "
                "reader's shapes (SmolLM2-135M's MLP) and the encoders' (MiniLM's), on 1 and 2 threads, against the "
                "CPU's float32 peak the script assumes (threads x clock x FLOP per cycle of its instruction sets); and "
                "the reader end to end on each path (`benchmarks/bench_reader.py --gemm`). The policy chooses among "
                "the paths in torch's thread pool (torch, torch-kn, onednn) and keeps torch's unless another measures "
                "at least 1.1 times as fast; numpy, openvino and onnxruntime run threads of their own beside torch's "
                "and are used only when named (`PERSRAG_GEMM`); a run prints its choice and `pipeline.json` keeps it. A CPU capped to fewer instruction sets is labelled so: it emulates the instruction sets of "
                "a class, not its microarchitecture.")),
    "gpu": ("GPU", ("The tests marked `gpu` (`python -m pytest -m gpu tests/training/test_gpu.py`); the GPU rows of the "
            "other pages come from the same machine.")),
}


class ReportError(ValueError):
    """A results folder that cannot be read: names the file and the field."""


@dataclass
class Table:
    header: list[str]
    align: str
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |", self.align]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


@dataclass
class Run:
    folder: str
    order: tuple
    machine: dict
    entry: dict


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _markdown_tables(text: str) -> list[list[str]]:
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def _table(text: str, part: dict) -> Table:
    """Every markdown table of the file whose header starts with `part["header"]`, rows concatenated."""
    found = [t for t in _markdown_tables(text) if t[0].startswith(part["header"])]
    if not found:
        raise ReportError(f"no table with header {part['header']!r}")
    rows = [_cells(line) for t in found for line in t[2:]]
    return Table(_cells(found[0][0]), found[0][1], [r for r in rows if not any(h in r[0] for h in HISTORY_ROWS)])


def _regex_rows(text: str, pattern: str) -> list[list[str]]:
    return [list(m.groups()) for m in re.finditer(pattern, text, re.MULTILINE)]


def _extract(text: str, part: dict) -> Table:
    kind = part.get("kind")
    if kind == "table":
        return _table(text, part)
    if kind == "stages":  # the pipeline's per-stage summary lines
        return Table(["stage", "minutes"], "|---|---:|", _regex_rows(text, r"^\[pipeline\] ([\w ]+): ([\d.]+) min$"))
    if kind == "time":  # GNU time -v
        wall = _regex_rows(text, r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)$")
        rss = _regex_rows(text, r"Maximum resident set size \(kbytes\): (\d+)$")
        rows = [[w[0], r[0]] for w, r in zip(wall, rss)]
        return Table(["wall clock (h:mm:ss or m:ss)", "peak RSS (kB)"], "|---:|---:|", rows)
    if kind == "pytest":
        return Table(["pytest summary"], "|---|", _regex_rows(text, r"^(\d+ passed.*)$")[-1:])
    if kind == "retriever_reranker":  # the fixed-width summary of bench_retriever_reranker.py
        rows = _regex_rows(text, r"^(retriever|reranker)\s+(\d+) (.+?)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+x)$")
        return Table(["module", "candidates", "mode", "steps", "texts/pairs encoded", "s/round", "samples/s",
                      "speedup"], "|---|---:|---|---:|---:|---:|---:|---:|", rows)
    if kind == "lines":
        columns = part["columns"]
        return Table(columns, "|" + "---|" * len(columns), _regex_rows(text, part["pattern"]))
    raise ReportError(f"unknown part kind {kind!r}")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"{path}: missing (every results folder has a machine.json saying what the machine is "
                          "and a runs.json with the command of each file; see docs/performance/index.md)") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None


def load_runs(root: Path = ROOT) -> list[Run]:
    runs = []
    for folder in sorted(p for p in (root / RESULTS).iterdir() if p.is_dir()):
        m = FOLDER.match(folder.name)
        if not m:
            raise ReportError(f"{folder}: folder name is not <machine>-<YYYY-MM-DD>[letter][-label]")
        machine = _read_json(folder / "machine.json")
        for key in ("class", "cpu", "instruction_sets", "date", "software"):
            if key not in machine:
                raise ReportError(f"{folder / 'machine.json'}: field {key!r} missing")
        entries = _read_json(folder / "runs.json")
        for i, entry in enumerate(entries):
            for key in ("family", "files", "command"):
                if key not in entry:
                    raise ReportError(f"{folder / 'runs.json'}: entry {i}: field {key!r} missing")
            for f in entry["files"]:
                if not (folder / f).is_file():
                    raise ReportError(f"{folder / 'runs.json'}: entry {i}: file {f!r} not in the folder")
            if "superseded" in entry and not (isinstance(entry["superseded"], str) and entry["superseded"].strip()):
                raise ReportError(f"{folder / 'runs.json'}: entry {i}: field 'superseded' must say what replaced it")
            if entry["family"] is not None and entry["family"] not in FAMILIES:
                raise ReportError(f"{folder / 'runs.json'}: entry {i}: family {entry['family']!r} is not one of "
                                  f"{', '.join(FAMILIES)}")
            runs.append(Run(folder.name, (m["date"], m["suffix"], folder.name, i), machine, entry))
    return runs


def describe(machine: dict) -> str:
    """A machine by what it is: CPU, instruction sets, GPU and driver."""
    gpu = machine.get("gpu")
    gpu_text = (f"{gpu}, driver {machine['driver']}, CUDA {machine['cuda']}" if gpu else "no GPU")
    return f"{machine['cpu']}; {', '.join(machine['instruction_sets'])}; {gpu_text}"


def latest(runs: list[Run]) -> dict[tuple[str, str, str], Run]:
    """(family, benchmark, machine class) -> the latest run of it."""
    out: dict[tuple[str, str, str], Run] = {}
    for run in sorted((r for r in runs if r.entry["family"]), key=lambda r: r.order):
        out[(run.entry["family"], run.entry["benchmark"], run.machine["class"])] = run
    return out


def _tables(run: Run, root: Path) -> list[Table]:
    tables = []
    for j, part in enumerate(run.entry["parts"]):
        path = root / RESULTS / run.folder / part["file"]
        try:
            table = _extract(path.read_text(encoding="utf-8"), part)
        except ReportError as e:
            raise ReportError(f"{path}: runs.json part {j}: {e}") from None
        if not table.rows:
            raise ReportError(f"{path}: runs.json part {j} ({part['kind']}): no rows found")
        tables.append(table)
    return tables


def _section(run: Run, root: Path, level: int = 3) -> str:
    e, m = run.entry, run.machine
    files = ", ".join(f"`{RESULTS / run.folder / f}`" for f in e["files"])
    lines = [f"{'#' * level} {m['class']}", "",
             f"Machine: {describe(m)}. Software: {m['software']}.  ",
             f"Command: `{e['command']}`  ",
             f"Raw output: {files} ({m['date']})" + (f"; {e['note']}" if e.get("note") else ""), "", ""]
    return "\n".join(lines) + "\n\n".join(t.markdown() for t in _tables(run, root)) + "\n"


# ---- the main-job page's opening: one row per stored run whose runs.json entry has a `glance` ({"results": its
# results.md, "log": the pipeline's output}), every cell copied from those files, and a plot of the same rows

GLANCE_HEADER = ["run", "machine", "date", "wall clock", "estimated (min)", "reference row (chosen on dev)",
                 "reference", "bm25", "p", "w/o user retrieval", "p", "reference + tuned generator",
                 "bm25 + tuned generator", "p"]


@dataclass
class GlanceRow:
    run: Run
    cells: list[str]
    minutes: float | None
    rows: dict[str, str]  # every row of the results table: method -> its first metric's cell


def _minutes(wall: str) -> float | None:
    """'26:38.46' (GNU time's m:ss) or '1:02:03' (h:mm:ss) or '27.9 min' (the pipeline's count) in minutes."""
    if wall.endswith(" min"):
        return float(wall[:-4])
    if not wall:
        return None
    parts = [float(x) for x in wall.split(":")]
    return sum(v * 60 ** (len(parts) - 1 - i) for i, v in enumerate(parts)) / 60


def glance_row(run: Run, root: Path) -> GlanceRow:
    folder, spec = root / RESULTS / run.folder, run.entry["glance"]
    text, log = ((folder / spec[k]).read_text(encoding="utf-8") for k in ("results", "log"))
    table = next((t for t in _markdown_tables(text) if t[0].startswith("| method |")), None)
    if table is None:
        raise ReportError(f"{folder / spec['results']}: glance: no results table")
    header, body = _cells(table[0]), [_cells(line) for line in table[2:]]
    found = re.match(r"p vs (.+) \(", header[2])
    if found is None:
        raise ReportError(f"{folder / spec['results']}: glance: no 'p vs <reference>' column")
    reference, by = found.group(1), {r[0]: r for r in body}
    ablation = next((n for n in by if n.startswith("w/o user retrieval") and "paper" not in n), None)
    pair = re.search(rf"Paired test, {re.escape(reference)} \+ tuned generator vs bm25 \+ tuned generator: "
                     r"\w+ \S+ \(p = ([^)]+)\)", text)
    missing = [n for n in (reference, "bm25", ablation, f"{reference} + tuned generator", "bm25 + tuned generator")
               if n not in by]
    if missing or pair is None:
        raise ReportError(f"{folder / spec['results']}: glance: no row {missing[0] if missing else 'of the pair'}")
    counted = re.findall(r"^\[pipeline\] ([\d.]+) min in all; estimated ([\d.]+)", log, re.MULTILINE)
    timed = re.findall(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)$", log, re.MULTILINE)
    wall = f"{counted[-1][0]} min" if counted else (timed[-1] if timed else "")
    cells = [run.entry["benchmark"], run.machine["class"], run.machine["date"], wall,
             counted[-1][1] if counted else "", reference, by[reference][1], by["bm25"][1], by["bm25"][2],
             by[ablation][1], by[ablation][2], by[f"{reference} + tuned generator"][1],
             by["bm25 + tuned generator"][1], pair.group(1)]
    return GlanceRow(run, cells, _minutes(wall), {n: r[1] for n, r in by.items()})


def glance_rows(runs: dict[tuple[str, str, str], Run], root: Path) -> list[GlanceRow]:
    chosen = [r for (fam, _, _), r in sorted(runs.items(), key=lambda kv: kv[1].order)
              if fam == "main-job" and r.entry.get("glance")]
    return [glance_row(r, root) for r in chosen]


GLANCE_PLOT = "main-job.png"


def glance_section(rows: list[GlanceRow]) -> str:
    sources = sorted({f"`{RESULTS / r.run.folder / f}`" for r in rows for f in
                      ("machine.json", "runs.json", *r.run.entry["glance"].values())})
    table = Table(GLANCE_HEADER, "|" + "---|" * len(GLANCE_HEADER), [r.cells for r in rows])
    return "\n".join([
        "## At a glance", "",
        ("Each stored main-job run, newest last: its wall clock (the pipeline's own count, or GNU time's m:ss), the "
         "estimate it printed before training where it had one, the configuration dev chose (the table's "
         "reference), and the goal's three differences: the reference against BM25, against its own chain without "
         "user retrieval, and read by the tuned generator against BM25 read by it, each with its paired p. First "
         "metric of the task, cells as in the run's table below. The recipes differ by row: the run's name says "
         "which."), "",
        f"Raw output: {', '.join(sources)}", "", table.markdown(), "",
        f"![Wall clock per run, and the newest run's rows with their intervals]({GLANCE_PLOT})", ""])


def _point_interval(cell: str) -> tuple[float, float, float] | None:
    found = re.match(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", cell)
    return tuple(float(x) for x in found.groups()) if found else None


def glance_plot(rows: list[GlanceRow], path: Path) -> None:
    """Left: wall clock per run; right: the newest run's rows (first metric) with their 95 % intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.minutes is not None]
    newest = rows[-1]
    points = {n: v for n, c in newest.rows.items() if (v := _point_interval(c)) is not None}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [1, 1.2]})
    labels = [textwrap.fill(f"{r.run.machine['class']}, {r.run.machine['date']}", 34) for r in timed]
    left.barh(range(len(timed)), [r.minutes for r in timed], color="#4c72b0")
    left.set_yticks(range(len(timed)), labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("wall clock (min)")
    left.set_title("main job, per run", fontsize=9)
    names = list(points)
    values = [points[n][0] for n in names]
    errors = [[points[n][0] - points[n][1] for n in names], [points[n][2] - points[n][0] for n in names]]
    right.errorbar(values, range(len(names)), xerr=errors, fmt="o", capsize=3, color="#dd8452")
    right.set_yticks(range(len(names)), names, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("first metric [95% bootstrap interval]")
    right.set_title(textwrap.fill(f"{newest.run.entry['benchmark']} · {newest.run.machine['class']}", 70), fontsize=9)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, metadata={"Software": None})
    plt.close(fig)
    tmp.replace(path)


# ---- README.md's main-job blocks, between `<!-- report.py: NAME -->` and `<!-- /report.py -->`: the newest glance
# run's own lines and table, so that the README shows a stored run and no typed figure

README = Path("README.md")
# the files with such blocks, and the blocks each must have
BLOCK_FILES = {README: ("main-job output", "main-job table"),
               Path("docs/evaluation/reading-the-table.md"): ("main-job table",)}
BLOCK = re.compile(r"(<!-- report\.py: (?P<name>[\w -]+) -->\n)(?P<body>.*?)(<!-- /report\.py -->)", re.DOTALL)
OUTPUT_LINES = re.compile(r"^\[pipeline\] (?!\w+: python train\.py)(?![\w' ]+: [\d.]+ min$).*$", re.MULTILINE)


def readme_blocks(row: GlanceRow, root: Path) -> dict[str, str]:
    folder, spec = root / RESULTS / row.run.folder, row.run.entry["glance"]
    log = (folder / spec["log"]).read_text(encoding="utf-8")
    said = [m.group(0) for m in OUTPUT_LINES.finditer(log)]
    head, tail = [x for x in said if "min in all" not in x], [x for x in said if "min in all" in x]
    text = (folder / spec["results"]).read_text(encoding="utf-8")
    table = next(t for t in _markdown_tables(text) if t[0].startswith("| method |"))
    compact = ["| " + " | ".join(_cells(line)[:3]) + " |" for line in table]
    source = (f"{row.run.entry['benchmark']}, {row.run.machine['class']}, {row.run.machine['date']}: "
              f"`{RESULTS / row.run.folder / spec['results']}` (every column: the run's own table)")
    pairs = [line for line in text.splitlines() if line.startswith("Paired test,")]
    note = [f"The run's note: {row.run.entry['note']}.", ""] if row.run.entry.get("note") else []
    return {"main-job output": "```text\n" + "\n".join([*head, "...", *tail]) + "\n```\n",
            "main-job table": "\n".join([source, "", *note, *compact, "", *pairs]) + "\n"}


def readme_text(current: str, blocks: dict[str, str], path: Path = README) -> str:
    """`path`'s text with each of its blocks' body replaced; a block `blocks` names but `path` lacks is an error."""
    seen = {m.group("name") for m in BLOCK.finditer(current)}
    if set(blocks) - seen:
        raise ReportError(f"{path}: no block {min(set(blocks) - seen)!r} (<!-- report.py: NAME -->)")
    return BLOCK.sub(lambda m: m.group(1) + (blocks.get(m.group("name"), m.group("body"))) + m.group(4), current)


# A benchmark whose runs.json entries all carry `superseded` (one line: what replaced it) measured a former recipe or
# default: its tables stay on the page, after the current ones, under this heading.
EARLIER_HEADING = "Earlier recipes"
EARLIER_INTRO = ("Kept for comparison with the tables above, which are the current ones; each says what replaced it. "
                 "The raw files stay in their folders.")

GENERATED = ("<!-- Written by `python benchmarks/report.py` from benchmarks/results/; edit the raw files' runs.json "
             "or the script, not this page. -->")


def family_page(family: str, all_runs: list[Run], runs: dict[tuple[str, str, str], Run], root: Path) -> str:
    title, intro = FAMILIES[family]
    parts = [GENERATED, "", f"# {title}", "", intro, ""]
    if family == "main-job" and (rows := glance_rows(runs, root)):
        parts += [glance_section(rows)]
    benchmarks: list[str] = []  # in the order they were first run
    for run in sorted(all_runs, key=lambda r: r.order):
        if run.entry["family"] == family and run.entry["benchmark"] not in benchmarks:
            benchmarks.append(run.entry["benchmark"])
    shown = {b: [run for (fam, name, _), run in sorted(runs.items()) if fam == family and name == b]
             for b in benchmarks}
    current = [b for b in benchmarks if not all(r.entry.get("superseded") for r in shown[b])]
    for bench in current:
        parts += [f"## {bench}", ""]
        parts += [_section(run, root) for run in shown[bench]]
    earlier = [b for b in benchmarks if b not in current]
    if earlier:
        parts += [f"## {EARLIER_HEADING}", "", EARLIER_INTRO, ""]
    for bench in earlier:
        parts += [f"### {bench}", "", f"Superseded: {shown[bench][-1].entry['superseded']}.", ""]
        parts += [_section(run, root, level=4) for run in shown[bench]]
    return "\n".join(parts).rstrip("\n") + "\n"


def index_page(all_runs: list[Run], runs: dict[tuple[str, str, str], Run]) -> str:
    families = [f for f in FAMILIES if any(k[0] == f for k in runs)]
    machines: dict[str, tuple[str, list[str]]] = {}
    for run in sorted(all_runs, key=lambda r: r.order):
        desc, folders = machines.setdefault(run.machine["class"], (describe(run.machine), []))
        if run.folder not in folders:
            folders.append(run.folder)
    lines = [GENERATED, "", "# Performance", "",
             ("Every table on these pages is read from the raw outputs under `benchmarks/results/<machine>-<date>/` "
             "by `python benchmarks/report.py`; each names the command that wrote it, the machine it ran on and "
             "the raw file. A table shows the latest run of its benchmark on each class of machine; earlier runs "
             "stay in their folders as raw files, and the tables of a former recipe come last on their page, "
             f"under \"{EARLIER_HEADING}\", each saying what replaced it. Timings are wall-clock seconds of one "
             "run on the machine named, not guarantees."), "", "## Pages", ""]
    lines += [f"- [{FAMILIES[f][0]}]({f}.md)" for f in families]
    lines += ["", "## Machines", "", "| machine class | what it is | result folders |", "|---|---|---|"]
    for cls, (desc, folders) in sorted(machines.items()):
        lines.append(f"| {cls} | {desc} | {', '.join(f'`{f}`' for f in folders)} |")
    lines += ["", "## Adding a result", "",
              ("Run the benchmark, store its output under `benchmarks/results/<machine>-<YYYY-MM-DD>/` with a "
              "`machine.json` (what the machine is: `class`, `cpu`, `instruction_sets`, `gpu`, `driver`, `cuda`, "
              "`software`, `date`) and a `runs.json` entry per command (`family`, `benchmark`, `command`, "
              "`files`, and the `parts` that say which table of a file goes on the page), then run "
              "`python benchmarks/report.py` and commit the folder with the pages it rewrote."), ""]
    return "\n".join(lines)


def folder_readme(folder: str, all_runs: list[Run]) -> str:
    mine = [r for r in all_runs if r.folder == folder]
    m = mine[0].machine
    lines = [f"# Raw outputs, {m['date']}: {m['class']}", "",
             f"Machine: {describe(m)}. Software: {m['software']}.", ""]
    if m.get("note"):
        lines += [m["note"], ""]
    lines += [("`machine.json` describes the machine, `runs.json` each command (on the pages of docs/performance "
              "where `family` is set); `python benchmarks/report.py` writes this file from them. Commands, from "
              "the repository root, in the order they ran:"), ""]
    for r in mine:
        e = r.entry
        files = ", ".join(f"`{f}`" for f in e["files"])
        page = f" ({FAMILIES[e['family']][0]})" if e["family"] else ""
        command = e["command"] if e["command"].startswith("a one-off") else f"`{e['command']}`"
        lines.append(f"- {files}{page}: {command}" + (f"; {e['note']}" if e.get("note") else ""))
    return "\n".join(lines) + "\n"


def build(root: Path = ROOT) -> dict[Path, str]:
    """Every page and folder README, by path relative to the repository root."""
    all_runs = load_runs(root)
    runs = latest(all_runs)
    out = {PAGES / "index.md": index_page(all_runs, runs)}
    for family in FAMILIES:
        if any(k[0] == family for k in runs):
            out[PAGES / f"{family}.md"] = family_page(family, all_runs, runs, root)
    for folder in sorted({r.folder for r in all_runs}):
        out[RESULTS / folder / "README.md"] = folder_readme(folder, all_runs)
    if rows := glance_rows(runs, root):
        blocks = readme_blocks(max(rows, key=lambda r: r.run.order), root)
        for path, names in BLOCK_FILES.items():
            if (root / path).is_file():
                out[path] = readme_text((root / path).read_text(encoding="utf-8"),
                                        {n: blocks[n] for n in names}, path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from the raw files' output")
    args = parser.parse_args(argv)
    try:
        pages = build(ROOT)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = [p for p, text in pages.items() if not (ROOT / p).is_file() or (ROOT / p).read_text() != text]
    if args.check:
        for p in stale:
            print(f"differs from the raw files: {p}", file=sys.stderr)
        return 1 if stale else 0
    (ROOT / PAGES).mkdir(parents=True, exist_ok=True)
    if rows := glance_rows(latest(load_runs(ROOT)), ROOT):  # a picture of the page's opening table, not compared
        glance_plot(rows, ROOT / PAGES / GLANCE_PLOT)
    for p in stale:
        tmp = (ROOT / p).with_suffix(".tmp")
        tmp.write_text(pages[p], encoding="utf-8")
        tmp.replace(ROOT / p)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
