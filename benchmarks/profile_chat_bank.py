"""Where a chat's time goes in the memory bank (persrag_lightning/memory/bank.py), the part of a chat without the
LLM that is not retrieval: `remember_and_recall` of each message and `log_turn` of its answer, one chat at a time,
under cProfile, on a new bank in a temp folder (verbatim extraction, no LLM), its encoder in torch (serving's
default) or in another runtime (`--runtime openvino`: persrag serve's `--bank_runtime`, serving/bank_encoder.py).
The messages are bench_load.py's distinct ones, so no text repeats. Prints the mean milliseconds of each call and
the profile's heaviest functions by cumulative time (LanceDB's waits show as its background loop, count_rows, search
and add). With `--lancedb_calls` it runs without the profiler and names instead every call into LanceDB a chat
makes, by the bank's function that made it and LanceDB's that waited: calls and ms per chat, beside a chat's whole
part in the bank and the encoder alone on the same messages afterwards. Measures only.

    python benchmarks/profile_chat_bank.py [--chats 64] [--users 16] [--encoder minilm] [--runtime fp32]
                                           [--lancedb_calls]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import message

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.serving.bank_encoder import BANK_RUNTIMES, bank_encoder

ANSWER = "an answer of about twenty words " * 2  # the assistant turn logged after each chat


@contextlib.contextmanager
def lancedb_calls(counts: collections.Counter, spent: collections.Counter) -> Iterator[None]:
    """Within: every wait on LanceDB's background loop (each call of its synchronous API) counted and timed in
    `counts` and `spent`, keyed by the package's function that called it and LanceDB's that waited."""
    from lancedb.background_loop import BackgroundEventLoop

    run = BackgroundEventLoop.run

    def timed(loop, future):
        frames = traceback.extract_stack(limit=14)[:-1]
        ours = next((f"{Path(f.filename).name}:{f.name}" for f in reversed(frames) if "persrag_lightning" in f.filename),
                    "?")
        theirs = next((f.name for f in reversed(frames) if "lancedb" in f.filename), "?")
        t0 = time.perf_counter()
        try:
            return run(loop, future)
        finally:
            counts[f"{ours} > {theirs}"] += 1
            spent[f"{ours} > {theirs}"] += time.perf_counter() - t0

    BackgroundEventLoop.run = timed
    try:
        yield
    finally:
        BackgroundEventLoop.run = run


def count_calls(bank: MemoryBank, encoder, users: list[str], chats: int) -> None:
    """`chats` chats without the profiler, each LanceDB call named (`lancedb_calls`); then the encoder alone on the
    same messages. Prints the table."""
    counts: collections.Counter = collections.Counter()
    spent: collections.Counter = collections.Counter()
    texts = [message(0, len(users) + n) for n in range(chats)]
    t0 = time.perf_counter()
    with lancedb_calls(counts, spent):
        for n, text in enumerate(texts):
            bank.remember_and_recall(users[n % len(users)], text, "s")
            bank.log_turn(users[n % len(users)], "s", "assistant", ANSWER)
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for text in texts:
        encoder.encode([text])
    alone = time.perf_counter() - t0
    print(f"a chat's part in the bank {1e3 * wall / chats:.1f} ms; LanceDB's calls {sum(counts.values()) / chats:.1f}, "
          f"{1e3 * sum(spent.values()) / chats:.1f} ms; the encoder alone afterwards {1e3 * alone / chats:.1f} ms\n")
    print("| the bank's function > LanceDB's | calls a chat | ms a chat |\n|---|---|---|")
    for key, n in counts.most_common():
        print(f"| {key} | {n / chats:.2f} | {1e3 * spent[key] / chats:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=64, help="chats profiled, after one warm-up chat per user")
    ap.add_argument("--users", type=int, default=16, help="users the chats go to in turn")
    ap.add_argument("--encoder", default="minilm", help="the bank's encoder (persrag serve --encoder)")
    ap.add_argument("--runtime", default="fp32", choices=BANK_RUNTIMES, help="what runs the encoder (--bank_runtime)")
    ap.add_argument("--top", type=int, default=30, help="functions of the profile printed")
    ap.add_argument("--lancedb_calls", action="store_true", help="no profiler: name each LanceDB call a chat makes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bank-profile-") as tmp:
        encoder = bank_encoder(args.encoder, Path(tmp) / "cache", args.runtime)
        print(f"the bank's encoder: {args.encoder} in {getattr(encoder, 'runtime', 'fp32')}")
        bank = MemoryBank.open(Path(tmp) / "memory", encoder, None, None)
        users = [f"u{i}" for i in range(args.users)]
        for i, user in enumerate(users):  # warm-up: the encoder's first call, each user's tables
            bank.remember_and_recall(user, message(0, i), "s")
            bank.log_turn(user, "s", "assistant", ANSWER)
        if args.lancedb_calls:
            count_calls(bank, encoder, users, args.chats)
            bank.close()
            return
        spent = {"remember_and_recall": 0.0, "log_turn": 0.0}
        profile = cProfile.Profile()
        for n in range(args.chats):
            user = users[n % len(users)]
            t0 = time.perf_counter()
            profile.enable()
            bank.remember_and_recall(user, message(0, len(users) + n), "s")
            profile.disable()
            t1 = time.perf_counter()
            profile.enable()
            bank.log_turn(user, "s", "assistant", ANSWER)
            profile.disable()
            spent["remember_and_recall"] += t1 - t0
            spent["log_turn"] += time.perf_counter() - t1
        print({k: round(1e3 * v / args.chats, 1) for k, v in spent.items()},
              "ms per chat, one at a time, under the profiler")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
