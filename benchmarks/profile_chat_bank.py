"""Where a chat's time goes in the memory bank (persrag_lightning/memory/bank.py), the part of a chat without the
LLM that is not retrieval: `remember_and_recall` of each message and `log_turn` of its answer, one chat at a time,
under cProfile, on a new bank in a temp folder (verbatim extraction, no LLM), its encoder in torch (serving's
default) or in another runtime (`--runtime openvino`: persrag serve's `--bank_runtime`, serving/bank_encoder.py).
The messages are bench_load.py's distinct ones, so no text repeats. Prints the mean milliseconds of each call and
the profile's heaviest functions by cumulative time (LanceDB's waits show as its background loop, count_rows, search
and add). Measures only.

    python benchmarks/profile_chat_bank.py [--chats 64] [--users 16] [--encoder minilm] [--runtime fp32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import message

from persrag_lightning.memory.bank import MemoryBank
from persrag_lightning.serving.bank_encoder import BANK_RUNTIMES, bank_encoder

ANSWER = "an answer of about twenty words " * 2  # the assistant turn logged after each chat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=64, help="chats profiled, after one warm-up chat per user")
    ap.add_argument("--users", type=int, default=16, help="users the chats go to in turn")
    ap.add_argument("--encoder", default="minilm", help="the bank's encoder (persrag serve --encoder)")
    ap.add_argument("--runtime", default="fp32", choices=BANK_RUNTIMES, help="what runs the encoder (--bank_runtime)")
    ap.add_argument("--top", type=int, default=30, help="functions of the profile printed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bank-profile-") as tmp:
        encoder = bank_encoder(args.encoder, Path(tmp) / "cache", args.runtime)
        print(f"the bank's encoder: {args.encoder} in {getattr(encoder, 'runtime', 'fp32')}")
        bank = MemoryBank.open(Path(tmp) / "memory", encoder, None, None)
        users = [f"u{i}" for i in range(args.users)]
        for i, user in enumerate(users):  # warm-up: the encoder's first call, each user's tables
            bank.remember_and_recall(user, message(0, i), "s")
            bank.log_turn(user, "s", "assistant", ANSWER)
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
