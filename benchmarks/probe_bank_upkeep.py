"""Whether a memory bank's chats stay as cheap as it grows (persrag_lightning/memory/store.py): chats one after
another (`remember_and_recall` of a new message and `log_turn` of its answer, no LLM, 16 users in turn) on a new
bank in a temp folder per setting of the store's upkeep: a compaction every N commits (`optimize_every`), removing
the table versions older than S seconds (`keep_versions_s`; none: LanceDB's week), writing the recalls' usage marks
together every U recalls (`usage_every`, optional: 1 when left out, each recall's own commit). The earlier defaults
(500:none) run in the same process as the baseline. Prints, per setting, a chat's mean, p50 and longest
milliseconds in blocks of chats (a cost that grows with the bank shows block by block), then the versions and
fragments the tables hold at the end and the folder's size. `--without_usage_update` repeats the last setting with
the recall's usage marks (`MemoryStore.note_used`) left out: what writing them less often can at most save.
`--max_turns` and `--trim_turns_to` set the turn log's bound and how far a trim brings a user back below it
(MemorySettings), to measure a bank whose users are at that bound. Measures only.

    python benchmarks/probe_bank_upkeep.py [--chats 1000] [--block 200] [--settings 500:none,100:30:1,100:30:16]
        [--without_usage_update] [--max_turns 1000] [--trim_turns_to 0.9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_load import message
from profile_chat_bank import ANSWER

from persrag_lightning.memory.bank import MemoryBank, MemorySettings
from persrag_lightning.memory.store import StoreSettings
from persrag_lightning.serving.bank_encoder import bank_encoder


def parse_setting(text: str) -> StoreSettings:
    """`every:keep[:usage]` (keep in seconds, or none; usage 1 when left out) as the store's settings."""
    every, keep, usage = (text.split(":") + ["", "1"])[:3]
    return StoreSettings(optimize_every=int(every), keep_versions_s=None if keep in ("", "none") else float(keep),
                         usage_every=int(usage))


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def run(encoder, folder: Path, settings: MemorySettings, chats: int, users: int, usage: bool = True) -> list[float]:
    """Seconds of each chat on a new bank in `folder` with `settings`; `usage` False: the recall's
    usage marks left out."""
    bank = MemoryBank.open(folder, encoder, None, settings)
    if not usage:
        bank.store.note_used = lambda user_id, ids: None
    spent = []
    for n in range(chats):
        user = f"u{n % users}"
        started = time.perf_counter()
        bank.remember_and_recall(user, message(0, n), "s")
        bank.log_turn(user, "s", "assistant", ANSWER)
        spent.append(time.perf_counter() - started)
    bank.close()  # the marks still kept, before the folder is measured
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=1000, help="chats per setting")
    ap.add_argument("--block", type=int, default=200, help="chats per row of the table")
    ap.add_argument("--users", type=int, default=16, help="users the chats go to in turn")
    ap.add_argument("--encoder", default="minilm", help="the bank's encoder (persrag serve --encoder)")
    ap.add_argument("--settings", default="500:none,100:30:1,100:30:16",
                    help="comma-separated optimize_every:keep_versions_s[:usage_every] (seconds, or none)")
    ap.add_argument("--without_usage_update", action="store_true",
                    help="repeat the last setting without the recall's usage marks")
    ap.add_argument("--max_turns", type=int, default=MemorySettings.max_turns_per_user,
                    help="turns kept per user (MemorySettings.max_turns_per_user): small, to reach the bound soon")
    ap.add_argument("--trim_turns_to", type=float, default=MemorySettings.trim_turns_to,
                    help="the fraction of --max_turns a trim brings a user back to (1.0: a trim every turn)")
    args = ap.parse_args()
    settings = [(text, text, True) for text in args.settings.split(",")]
    if args.without_usage_update:
        settings.append((f"{settings[-1][0]}, no usage update", settings[-1][1], False))
    rows, ends = [], []
    with tempfile.TemporaryDirectory(prefix="bank-upkeep-") as tmp:
        encoder = bank_encoder(args.encoder, Path(tmp) / "cache", "fp32")
        encoder.encode(["warm-up"])
        for i, (text, setting, usage) in enumerate(settings):
            folder = Path(tmp) / f"bank{i}"
            memory = MemorySettings(store=parse_setting(setting), max_turns_per_user=args.max_turns,
                                    trim_turns_to=args.trim_turns_to)
            spent = run(encoder, folder, memory, args.chats, args.users, usage)
            for start in range(0, len(spent), args.block):
                block = [1e3 * s for s in spent[start:start + args.block]]
                rows.append(f"| {text} | {start + 1}-{start + len(block)} | {statistics.fmean(block):.1f} | "
                            f"{statistics.median(block):.1f} | {max(block):.0f} |")
            bank = MemoryBank.open(folder, encoder, None)
            tables = (bank.store.memories, bank.store.sessions)
            versions = " / ".join(str(len(t.list_versions())) for t in tables)
            fragments = " / ".join(str(t.stats()["fragment_stats"]["num_fragments"]) for t in tables)
            ends.append(f"| {text} | {sum(spent):.1f} | {versions} | {fragments} | {folder_mb(folder):.1f} |")
    print(f"{args.chats} chats per setting, {args.users} users in turn, bank encoder {args.encoder} (torch), "
          f"at most {args.max_turns} turns per user, trimmed back to {args.trim_turns_to:g} of it\n")
    print("| optimize_every:keep_versions_s[:usage_every] | chats | mean ms | p50 ms | max ms |\n"
          "|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| optimize_every:keep_versions_s[:usage_every] | seconds | versions (memories / turns) "
          "| fragments (memories / turns) | folder MB |\n|---|---|---|---|---|")
    print("\n".join(ends))


if __name__ == "__main__":
    main()
