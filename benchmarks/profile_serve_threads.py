"""Where a server's threads spend their time, from a py-spy profile of `persrag serve` under load: every sample of
a running thread (py-spy leaves idle threads out) is put in the first layer its stack passes through — the memory
bank's encoder, its vector search, its usage update, its table adds, its turn log, the CFRAG retrieval, the LLM's
replies, the trained reader, LanceDB's own background thread, the web stack — and the table gives each layer's share.
Thread time, not CPU time: sixteen threads waiting inside one layer's kernels count sixteen times. With py-spy's
`--gil`, only the thread holding Python's GIL is sampled: what the server's Python threads take turns at, one at a
time. A profile attached as the server starts also holds its start (the main thread importing and loading the
run): those samples are counted apart and left out of the shares. Asserts nothing.

    py-spy record -p <server pid> -d 60 -r 67 --nonblocking --threads [--gil] -f raw -o profile.txt   # pip install py-spy
    python benchmarks/profile_serve_threads.py profile.txt [another.txt ...]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

# (layer, a frame that marks it), the first that a stack holds wins: the bank's parts before the bank as a whole
LAYERS = (
    ("bank: the encoder", "BatchedEncoder._encode_many"),  # its worker thread, where chats' texts are batched
    ("bank: the encoder", "MemoryBank._embed"),
    ("bank: vector search", "MemoryStore.search"),
    ("bank: usage update", "MemoryStore.note_used"),  # the marks kept, and their write when due
    ("bank: usage update", "MemoryStore.mark_used"),  # each recall's own update (older profiles)
    ("bank: the turn log", "MemoryBank.log_turn"),
    ("bank: storing the memory", "MemoryBank._store"),
    ("bank: other", "MemoryBank."),
    ("retrieval (CFRAG)", "ChatService.guarded_docs"),
    ("LLM replies", "ChatAnswerer"),
    ("LLM replies", "ContinuousReplies"),
    ("label questions", "AnswerService"),
    ("LanceDB's background thread", "LanceDBBackgroundEventLoop"),
    ("web stack (uvicorn, FastAPI, Starlette, asyncio)", "uvicorn"),
    ("web stack (uvicorn, FastAPI, Starlette, asyncio)", "starlette"),
    ("web stack (uvicorn, FastAPI, Starlette, asyncio)", "asyncio"),
)

START = "server start, samples left out"


def starting(stack: str) -> bool:
    """A sample of the server's start: its main thread importing and loading the run, before it
    serves (a profile attached as the server starts holds them)."""
    thread_root = stack.split(";", 2)[1] if stack.count(";") >= 1 else ""
    return thread_root.startswith("<module>") and "_serve_until_stopped" not in stack


def layer_samples(path: Path) -> tuple[collections.Counter, int]:
    """Samples per layer (unmatched stacks: `other`; the server's start: `START`, left out of the
    total the shares are of), and the samples of serving."""
    counts: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        layer = START if starting(stack) else next((name for name, mark in LAYERS if mark in stack), "other")
        counts[layer] += int(n)
    return counts, sum(counts.values()) - counts[START]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", type=Path, help="py-spy raw outputs (-f raw), one column each")
    args = ap.parse_args()
    columns = [layer_samples(p) for p in args.profiles]
    names = list(dict.fromkeys([name for name, _ in LAYERS] + ["other"]))
    print("| layer | " + " | ".join(p.name for p in args.profiles) + " |")
    print("|---|" + "---|" * len(columns))
    for name in names:
        if any(c[name] for c, _ in columns):
            print(f"| {name} | " + " | ".join(f"{100 * c[name] / total:.1f} %" for c, total in columns) + " |")
    print("| samples | " + " | ".join(str(total) for _, total in columns) + " |")
    if any(c[START] for c, _ in columns):
        print(f"| {START} | " + " | ".join(str(c[START]) for c, _ in columns) + " |")


if __name__ == "__main__":
    main()
