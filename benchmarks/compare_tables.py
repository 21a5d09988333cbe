"""Two main-job runs' tables compared to the last digit, timings aside: the test table, the dev choices' tables and
the evaluation's metrics.json of `runs/<a>` and `runs/<b>`. A refactor that changes no behaviour must print "every
table identical" for the same seed on the same CPU class (the table of the run before the change against the one
after). The `retrieve_ms_per_query` column and every timing key are left out, and the runs' names in paths are
read as one name.

    python benchmarks/compare_tables.py runs/before runs/after
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TABLES = ["evaluate/results.md", "select-on-dev/results.md", "select-on-dev/reader-trained/results.md",
          "select-on-dev/reader-llm/results.md", "select-on-dev/generator/results.md"]
TIMING = re.compile(r"(^|_)(ms|seconds|time|minutes)(_|$)")


def table(path: Path) -> tuple[list[list[str]], list[str]]:
    """A results.md's table rows without timing columns, and its other lines."""
    lines = path.read_text().splitlines()
    rows = [line.split("|") for line in lines if line.startswith("|")]
    timing = {i for i, cell in enumerate(rows[0]) if "retrieve_ms" in cell} if rows else set()
    return ([[c.strip() for i, c in enumerate(r) if i not in timing] for r in rows],
            [line for line in lines if not line.startswith("|")])


def metrics(path: Path, name: str) -> object:
    """metrics.json without timing keys, the run's name replaced."""
    def scrub(obj: object) -> object:
        if isinstance(obj, dict):
            return {k: scrub(v) for k, v in obj.items() if not TIMING.search(k)}
        if isinstance(obj, list):
            return [scrub(v) for v in obj]
        return obj.replace(f"/{name}/", "/<run>/") if isinstance(obj, str) else obj

    return scrub(json.loads(path.read_text()))


def main(a: Path, b: Path) -> int:
    same_all = True
    for name in TABLES:
        (rows_a, text_a), (rows_b, text_b) = table(a / name), table(b / name)
        same = rows_a == rows_b and text_a == text_b
        cells = sum(1 for r in rows_a for c in r if re.search(r"\d", c))
        print(f"{name}: {'identical' if same else 'DIFFERENT'} ({len(rows_a) - 2} rows, {cells} cells with digits)")
        for x, y in zip(rows_a, rows_b):
            if x != y:
                print(f"  {a.name}: {'|'.join(x)}\n  {b.name}: {'|'.join(y)}")
        same_all &= same
    same = metrics(a / "evaluate/metrics.json", a.name) == metrics(b / "evaluate/metrics.json", b.name)
    print(f"evaluate/metrics.json: {'identical' if same else 'DIFFERENT'} (timing keys left out)")
    same_all &= same
    print("every table identical" if same_all else "the tables differ")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
