"""Hyper-parameter sweeps on Slurm: one run per grid point, one array task per run, one table at the end.

    python slurm/sweep.py grid slurm/sweeps/user_encoder_tau.yaml        # → runs/sweeps/user_encoder_tau/tasks.txt
    python slurm/sweep.py submit runs/sweeps/user_encoder_tau [--max-parallel 4] [-- sbatch options]
    python slurm/sweep.py aggregate runs/sweeps/user_encoder_tau [--metric val/loss --mode min]

A sweep file names a stage config, fixed CLI arguments and a grid (CLI key → list of values). Grid point i runs
as `fit --config <config> --run_name <sweep>-<i> <args> --<key>=<value>...`, so every array task has its own
runs/<sweep>-<i>/ folder. With `subcommand: evaluate` a point is an evaluation instead (e.g. PBR's θ, k2, α on
PersonaBench: slurm/sweeps/pbr_personabench.yaml) writing its reports to runs/<sweep>-<i>/evaluate/, and
`aggregate` reads their metrics. Run from the repository root; needs only the standard library and PyYAML.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

SWEEP_ROOT = Path("runs") / "sweeps"
SBATCH = Path(__file__).resolve().parent / "sweep_array.sbatch"


def grid_points(grid: dict[str, list]) -> list[dict[str, object]]:
    """The cartesian product of the grid, in the file's key order (the last key varies fastest)."""
    keys = list(grid)
    for key in keys:
        if not isinstance(grid[key], list) or not grid[key]:
            raise ValueError(f"grid[{key!r}] must be a non-empty list of values, got {grid[key]!r}")
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def cli_value(value: object) -> str:
    """A YAML value as LightningCLI reads it back from the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def write_grid(sweep_file: Path, out_root: Path = SWEEP_ROOT, runs_root: Path = Path("runs")) -> Path:
    """Write <out_root>/<name>/tasks.txt (one shell-quoted argument line per array index) and points.json."""
    spec = yaml.safe_load(sweep_file.read_text())
    for key in ("config", "grid"):
        if key not in spec:
            raise SystemExit(f"{sweep_file}: missing key {key!r} (a sweep has config, grid and optional args)")
    name = spec.get("name", sweep_file.stem)
    points = grid_points(spec["grid"])
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, point in enumerate(points):
        subcommand = spec.get("subcommand", "fit")
        reports = ([f"--evaluation.out_dir={runs_root / f'{name}-{i}' / 'evaluate'}"] if subcommand == "evaluate"
                   else [])
        args = [subcommand, "--config", spec["config"], "--run_name", f"{name}-{i}", *reports,
                *map(str, spec.get("args", [])), *(f"--{k}={cli_value(v)}" for k, v in point.items())]
        lines.append(" ".join(shlex.quote(a) for a in args))
    (out / "tasks.txt").write_text("\n".join(lines) + "\n")
    (out / "points.json").write_text(json.dumps({"name": name, "points": points}, indent=1) + "\n")
    print(f"{len(points)} runs in {out / 'tasks.txt'}; submit with: python slurm/sweep.py submit {out}")
    return out


def submit(sweep_dir: Path, max_parallel: int | None, sbatch_args: list[str]) -> str:
    """One array job over the sweep's lines; returns its job id."""
    n = len((sweep_dir / "tasks.txt").read_text().splitlines())
    array = f"0-{n - 1}" + (f"%{max_parallel}" if max_parallel else "")
    cmd = ["sbatch", "--parsable", f"--array={array}", f"--job-name=sweep-{sweep_dir.name}", *sbatch_args,
           str(SBATCH), str(sweep_dir)]
    job = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]
    print(f"submitted {' '.join(cmd)} → job {job}")
    return job


def final_metrics(run_dir: Path) -> dict[str, float]:
    """The last logged value of each metric in the newest metrics.csv of a run (after `fit`, the last val/* row
    is the validation of the best checkpoint), or an evaluation's figures (`evaluation_metrics`)."""
    files = sorted(run_dir.glob("*/logs/*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return evaluation_metrics(run_dir / "evaluate")
    out: dict[str, float] = {}
    with files[-1].open(newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None) and key not in ("epoch", "step"):
                    out[key] = float(value)
    return out


def evaluation_metrics(out_dir: Path) -> dict[str, float]:
    """`<variant>/recall@5`, `<variant>/ndcg@5` of a PersonaBench evaluation (summary.json), or `<strategy>/<metric>`
    of a LaMP one (metrics.json); {} when neither exists."""
    if (out_dir / "summary.json").is_file():
        summary = json.loads((out_dir / "summary.json").read_text())
        return {f"{v['variant']}/{name}": float(v[key]) for v in summary.get("variants", [])
                for key, name in (("recall", "recall@5"), ("ndcg", "ndcg@5"))}
    if (out_dir / "metrics.json").is_file():
        results = json.loads((out_dir / "metrics.json").read_text()).get("results", {})
        return {f"{strategy}/{metric}": float(value) for strategy, metrics in results.items()
                for metric, value in metrics.items() if isinstance(value, (int, float))}
    return {}


def aggregate(sweep_dir: Path, metric: str | None, mode: str, runs_root: Path = Path("runs")) -> list[dict]:
    """One row per grid point (its parameters and final metrics), best first by `metric`; also written as
    <sweep dir>/results.csv and printed as a markdown table."""
    spec = json.loads((sweep_dir / "points.json").read_text())
    rows = [{"index": i, **point, **final_metrics(runs_root / f"{spec['name']}-{i}")}
            for i, point in enumerate(spec["points"])]
    if metric:
        worst = math.inf if mode == "min" else -math.inf
        rows.sort(key=lambda r: r.get(metric, worst), reverse=mode == "max")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with (sweep_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    print(markdown_table(rows, columns))
    return rows


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v: object) -> str:
        return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="slurm/sweep.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grid", help="write the sweep's tasks.txt from a sweep YAML")
    g.add_argument("sweep_file", type=Path)
    g.add_argument("--out-root", type=Path, default=SWEEP_ROOT)
    s = sub.add_parser("submit", help="sbatch one array task per grid point")
    s.add_argument("sweep_dir", type=Path)
    s.add_argument("--max-parallel", type=int, default=None, help="at most this many tasks at once (%%N)")
    s.add_argument("sbatch_args", nargs="*", help="options for sbatch, after --")
    a = sub.add_parser("aggregate", help="print and write the table of final metrics per grid point")
    a.add_argument("sweep_dir", type=Path)
    a.add_argument("--metric", default="val/loss", help="sort key (a logged metric name)")
    a.add_argument("--mode", choices=("min", "max"), default="min")
    a.add_argument("--runs-root", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    if args.command == "grid":
        write_grid(args.sweep_file, args.out_root)
    elif args.command == "submit":
        submit(args.sweep_dir, args.max_parallel, args.sbatch_args)
    else:
        aggregate(args.sweep_dir, args.metric, args.mode, args.runs_root)


if __name__ == "__main__":
    main(sys.argv[1:])
