"""The memory bank under concurrent chats, without the rest of the server: `--threads` threads each run chats on one
bank (`remember_and_recall` of a new message and `log_turn` of its answer, no LLM, 16 users), as the chat route's
worker threads do. Prints, per thread count and the bank encoder's runtime (`--runtimes`, persrag serve's
`--bank_runtime`), chats/s and each chat's p50/p99 ms, and how much of the run the store's memories lock was held
and how long a chat waited for it: a lock held nearly all the time caps the chats whatever the encoder costs.
Measures only.

    python benchmarks/probe_bank_concurrency.py [--threads 1,16] [--chats 320] [--runtimes fp32,onnx]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import message
from profile_chat_bank import ANSWER

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.serving.bank_encoder import bank_encoder

USERS = 16


class TimedLock:
    """A reentrant lock that sums how long it was held (outermost holds only) and waited for."""

    def __init__(self, lock) -> None:
        self.lock, self.held_s, self.waited_s = lock, 0.0, 0.0
        self._local = threading.local()

    def __enter__(self) -> None:
        t0 = time.perf_counter()
        self.lock.acquire()
        t1 = time.perf_counter()
        self.waited_s += t1 - t0
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.since = t1
        self._local.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            self.held_s += time.perf_counter() - self._local.since
        self.lock.release()


def measure(encoder, folder: Path, threads: int, chats: int) -> str:
    """One table row: `chats` chats over `threads` threads on a new bank in `folder`."""
    bank = MemoryBank.open(folder, encoder, None, None)
    users = [f"u{i}" for i in range(USERS)]
    for i, user in enumerate(users):  # warm-up: each user's first rows
        bank.remember_and_recall(user, message(0, i), "s")
        bank.log_turn(user, "s", "assistant", ANSWER)
    lock = TimedLock(bank.store._lock)
    bank.store._lock = lock
    seconds: list[float] = []

    def work(t: int) -> None:
        for n in range(chats // threads):
            user, t0 = users[(t + n * threads) % USERS], time.perf_counter()
            bank.remember_and_recall(user, message(1, t * (chats // threads) + n), "s")
            bank.log_turn(user, "s", "assistant", ANSWER)
            seconds.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    wall = time.perf_counter() - t0
    bank.close()
    ms = 1e3 * np.array(seconds)
    return (f"| {getattr(encoder, 'runtime', 'fp32')} | {threads} | {len(seconds) / wall:.1f} | "
            f"{np.percentile(ms, 50):.0f} | {np.percentile(ms, 99):.0f} | {100 * lock.held_s / wall:.0f} % | "
            f"{1e3 * lock.waited_s / len(seconds):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,16", help="thread counts, comma-separated")
    ap.add_argument("--chats", type=int, default=320, help="chats per row, shared among the threads")
    ap.add_argument("--runtimes", default="fp32,onnx", help="the bank encoder's runtimes, comma-separated")
    ap.add_argument("--encoder", default="minilm", help="the bank's encoder (persrag serve --encoder)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bank-concurrency-") as tmp:
        for runtime in args.runtimes.split(","):
            encoder = bank_encoder(args.encoder, Path(tmp) / "cache", runtime)
            for threads in (int(t) for t in args.threads.split(",")):
                rows.append(measure(encoder, Path(tmp) / f"bank-{runtime}-{threads}", threads, args.chats))
    print(f"{args.chats} chats per row, {USERS} users, bank encoder {args.encoder}, no LLM\n")
    print("| runtime | threads | chats/s | p50 ms | p99 ms | memories lock held | waited for it, ms a chat |\n"
          "|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
