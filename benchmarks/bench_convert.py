"""`persrag data convert` on generated review logs of 10⁵ and 10⁶ rows, next to a naive converter in the same run.

A log row is a review: a user id, an ISO date-time, a text of 20–40 words, a star rating (1–5, skewed to 5 as
review data is) and a product id; users hold 1–60 reviews (a geometric draw, median about 6), so about a fifth of
the users fall under `--min_items 5`. Each conversion runs in a fresh process, which reports its own wall time and
peak resident memory. The naive converter is what an adopter writes by hand: `csv.DictReader`, a dict per row,
per-user lists sorted in Python, and `json.dump` of every question with its profile objects. Both write the same
questions (the script checks that the parsed files agree on the smallest size).

    python benchmarks/bench_convert.py                       # 10^5 and 10^6 rows, CSV and Parquet
    python benchmarks/bench_convert.py --sizes 20000 --formats csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("user", "time", "text", "stars", "item")
WORDS = ("good", "quality", "cheap", "sturdy", "broke", "returned", "gift", "daughter", "kitchen", "battery",
         "charger", "cable", "fits", "perfectly", "smaller", "than", "expected", "arrived", "late", "works", "great",
         "would", "buy", "again", "smell", "colour", "soft", "loud", "quiet", "heavy", "light", "instructions",
         "unclear", "easy", "setup", "customer", "service", "refund", "size")


def generate(rows: int, seed: int = 0) -> dict[str, list]:
    """A review log of `rows` rows (deterministic in `seed`)."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.geometric(0.12, size=rows), 60)
    counts = counts[np.cumsum(counts) <= rows]
    counts = np.append(counts, rows - counts.sum()) if counts.sum() < rows else counts
    user = np.repeat(np.arange(len(counts)), counts)
    seconds = (1_300_000_000 + rng.integers(0, 300_000_000, rows)).astype("datetime64[s]").astype(str)
    lengths = rng.integers(20, 41, rows)
    words = rng.integers(0, len(WORDS), lengths.sum())
    cuts = np.cumsum(lengths)[:-1]
    vocab = np.array(WORDS, dtype=object)
    texts = [" ".join(chunk) for chunk in np.split(vocab[words], cuts)]
    stars = rng.choice(np.arange(1, 6), size=rows, p=[0.07, 0.05, 0.08, 0.12, 0.68])
    item = np.arange(rows)  # an item id unique per row (a user never reviews a product twice)
    return {"user": [f"A{u:07d}" for u in user.tolist()], "time": [s + "Z" for s in seconds.tolist()],
            "text": texts, "stars": stars.tolist(), "item": [f"B{i:09d}" for i in item.tolist()]}


def write(log: dict[str, list], path: Path) -> Path:
    import pyarrow as pa
    from pyarrow import csv as pa_csv
    from pyarrow import parquet

    table = pa.table({c: log[c] for c in COLUMNS})
    if path.suffix == ".csv":
        pa_csv.write_csv(table, path)
    else:
        parquet.write_table(table, path)
    return path


# ---- the naive converter: the same layout, written the way a first script does it -----------------------------

PROMPT = ("What is the score of the following review on a scale of 1 to 5? just answer with 1, 2, 3, 4, or 5 "
          "without further explanation. review: ")


def naive_convert(log: Path, out: Path, min_items: int = 5, train_per_user: int = 2) -> None:
    """CSV only: one dict per row, sorted per user in Python, json.dump of whole split lists."""
    from datetime import datetime

    users: dict[str, list[dict]] = {}
    with open(log, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            row["ts"] = datetime.fromisoformat(row["time"].replace("Z", "+00:00"))
            users.setdefault(row["user"], []).append(row)
    splits: dict[str, list[dict]] = {"train": [], "dev": [], "test": []}
    golds: dict[str, list[dict]] = {"train": [], "dev": [], "test": []}
    for uid in sorted(users):
        items = sorted(users[uid], key=lambda r: r["ts"])
        if len(items) < min_items:
            continue
        profile = [{"id": f"{uid}-{r['item']}", "date": r["ts"].strftime("%Y-%m-%d-%H-%M-%S"), "text": r["text"],
                    "score": r["stars"]} for r in items]
        n = len(items)
        plan = [(p, "train") for p in range(n - 2 - train_per_user, n - 2)] + [(n - 2, "dev"), (n - 1, "test")]
        for p, split in plan:
            qid = profile[p]["id"]
            splits[split].append({"id": qid, "input": PROMPT + items[p]["text"], "user_id": uid,
                                  "profile": profile[:p]})
            golds[split].append({"id": qid, "output": items[p]["stars"]})
    out.mkdir(parents=True, exist_ok=True)
    for split, questions in splits.items():
        with open(out / f"{split}_questions.json", "w", encoding="utf-8") as f:
            json.dump(questions, f, ensure_ascii=False)
        with open(out / f"{split}_outputs.json", "w", encoding="utf-8") as f:
            json.dump({"task": "LaMP_3", "golds": golds[split]}, f, ensure_ascii=False)


# ---- one measured conversion per process ------------------------------------------------------------------------

def child(which: str, log: str, out: str) -> None:
    """Run one conversion and print {"seconds", "peak_mib", "questions"} as JSON (the process's own peak RSS)."""
    start = time.perf_counter()
    if which == "naive":
        naive_convert(Path(log), Path(out))
        questions = None
    else:
        from persrag_lightning.data.convert import ConvertOptions, convert_log

        conversion = convert_log(log, out, ConvertOptions(task="LaMP-3", user="user", date="time", text="text",
                                                          label="stars", item="item"))
        questions = conversion.questions
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_mib": peak_rss_mib(), "questions": questions}))


def peak_rss_mib() -> float:
    """This process's own peak resident memory: VmHWM (ru_maxrss would keep the forking parent's peak across
    exec on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(which: str, log: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", which, str(log), str(out)], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_questions(a: Path, b: Path) -> bool:
    """The two folders hold the same questions and golds once parsed (dates and scores as the reader reads them)."""
    from persrag_lightning.data.lamp import load_lamp

    x, y = load_lamp(a, "LaMP-3"), load_lamp(b, "LaMP-3")
    return all([(e.example_id, e.user_id, e.input, e.target, e.profile) for e in x.examples[s]]
               == [(e.example_id, e.user_id, e.input, e.target, e.profile) for e in y.examples[s]]
               for s in ("train", "dev", "test"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--formats", nargs="+", default=["csv", "parquet"], choices=["csv", "parquet"])
    p.add_argument("--no-naive", action="store_true", help="skip the naive converter")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(*args.child)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"python {platform.python_version()}")
    print("| log rows | format | converter | users kept | questions | seconds | rows/s | peak MiB | output MiB |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    checked: list[int] = []
    with tempfile.TemporaryDirectory(prefix="bench_convert.") as tmp:
        root = Path(tmp)
        for n in args.sizes:
            log = generate(n)
            paths = {fmt: write(log, root / f"log{n}.{fmt}") for fmt in args.formats}
            del log  # the measured processes start from this one, and the log would stay in its memory
            for fmt, path in paths.items():
                runs = [("persrag data convert", "convert")]
                if fmt == "csv" and not args.no_naive:
                    runs.append(("naive (csv + dicts + json.dump)", "naive"))
                for name, which in runs:
                    out = root / f"out-{which}-{fmt}-{n}"
                    got = measure(which, path, out)
                    size = sum(f.stat().st_size for f in out.glob("*.json")) / 2 ** 20
                    users, questions = "–", "–"
                    if which == "convert":
                        made = json.loads((out / "convert.json").read_text())["conversion"]
                        users, questions = made["users"], sum(made["questions"].values())
                    print(f"| {n:,} | {fmt} | {name} | {users} | {questions} | {got['seconds']:.1f} | "
                          f"{n / got['seconds']:,.0f} | {got['peak_mib']:,.0f} | {size:,.0f} |", flush=True)
                if fmt == "csv" and not args.no_naive and n == min(args.sizes):
                    agree = same_questions(root / f"out-convert-{fmt}-{n}", root / f"out-naive-{fmt}-{n}")
                    if not agree:
                        raise SystemExit("the naive converter's questions differ; the comparison is void")
                    checked.append(n)
                for out in root.glob(f"out-*-{n}"):
                    shutil.rmtree(out)
    for n in checked:
        print(f"\n{n:,} rows: the two converters' folders parse to the same questions, golds and profiles.")


if __name__ == "__main__":
    main()
