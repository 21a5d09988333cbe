"""Training throughput of stages 2 and 3 with the real MiniLM (CPU, or CUDA with --device): batched CandidateBatch
steps (each distinct doc encoded once per batch) against a naive loop (one example per step, every candidate encoded
for its example).

Candidate lists overlap across the examples of a batch as real feedback does (similar users share docs): a share
of each list comes from a pool common to the batch, the rest is the example's own. Prints a table; asserts nothing.

    python benchmarks/bench_retriever_reranker.py --quick
    python benchmarks/bench_retriever_reranker.py --device cuda --batch 32 --candidates 30 --rows 32 256 960 --tf32
                                                                              # docs/performance/training.md
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from persrag_lightning.data.candidates import Candidate, CandidateBatch, FeedbackExample, collate_candidates
from persrag_lightning.hardware import cpu_has_native_bf16
from persrag_lightning.logs import configure_logs
from persrag_lightning.models import common
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.models.retriever import PersonalizedRetriever
from persrag_lightning.modules.losses import kl_to_llm_feedback

WORDS = ("model", "data", "user", "query", "history", "document", "retrieval", "personal", "movie",
         "review", "paper", "title", "news", "tweet", "rating", "science", "fiction", "comedy", "drama",
         "market", "election", "team", "season", "recipe", "garden", "music", "travel", "health", "policy",
         "network", "learning", "graph", "language", "generation", "feedback", "ranking", "similar",
         "collaborative", "filtering")


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_examples(rng: random.Random, batch: int, candidates: int, shared: float, doc_words: tuple[int, int]
                  ) -> tuple[list[FeedbackExample], list[str]]:
    """`batch` examples of `candidates` docs each; round(shared·candidates) of them from a pool common to the batch."""
    n_shared = round(shared * candidates)
    corpus: list[str] = [text(rng, *doc_words) for _ in range(n_shared)]
    examples = []
    for i in range(batch):
        rows = list(range(n_shared))
        for _ in range(candidates - n_shared):
            rows.append(len(corpus))
            corpus.append(text(rng, *doc_words))
        rng.shuffle(rows)
        cands = tuple(Candidate(row=r, doc_id=str(r), owner=f"u{i}", user_sim=1.0, first_stage=0.0, output="",
                                label=rng.random()) for r in rows)
        examples.append(FeedbackExample(f"e{i}", f"u{i}", "", text(rng, 12, 30), "", cands))
    return examples, corpus


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: CandidateBatch,
               e_u: torch.Tensor, temperature: float, bf16: bool = False) -> None:
    """One optimiser step; `bf16` runs the forward under bfloat16 autocast as Lightning's `bf16-mixed` does
    (float32 weights, optimiser and loss reduction)."""
    with torch.autocast(e_u.device.type, dtype=torch.bfloat16, enabled=bf16):
        scores = model(batch, e_u[batch.users])
    loss = kl_to_llm_feedback(scores.float(), batch.labels, batch.mask, temperature, temperature)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def time_rounds(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[CandidateBatch],
                e_u: torch.Tensor, temperature: float, rounds: int, bf16: bool = False, tf32: bool = False,
                rows: int | None = None) -> float:
    """Seconds per round; a round trains once on each of `batches` (together, the same examples in every mode).
    `tf32` lets float32 matmuls use TensorFloat-32 (`torch.set_float32_matmul_precision("high")`); `rows` sets the
    rows per encoder forward on this device (models/common.py), restored after. One untimed step first: a new
    chunk shape or precision compiles/warms its kernels."""
    device = e_u.device.type
    saved_rows, saved_precision = common.ROWS_PER_FORWARD_BY_DEVICE.get(device), torch.get_float32_matmul_precision()
    try:
        if rows is not None:
            common.ROWS_PER_FORWARD_BY_DEVICE[device] = rows
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        train_step(model, optimizer, batches[0], e_u, temperature, bf16)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(rounds):
            for batch in batches:
                train_step(model, optimizer, batch, e_u, temperature, bf16)
        if device == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously: count them all
        return (time.perf_counter() - start) / rounds
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        if saved_rows is None:
            common.ROWS_PER_FORWARD_BY_DEVICE.pop(device, None)
        else:
            common.ROWS_PER_FORWARD_BY_DEVICE[device] = saved_rows


def bench(name: str, model: torch.nn.Module, temperature: float, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=6e-5)
    model.to(args.device)
    e_u = torch.randn(args.batch, 384, device=args.device)
    rows = []
    chunk_sizes = args.rows or [None]
    for candidates in args.candidates:
        examples, corpus = make_examples(rng, args.batch, candidates, args.shared, tuple(args.doc_words))
        user_row = {e.user_id: i for i, e in enumerate(examples)}
        # on the device before timing, as Lightning's transfer_batch_to_device does
        batched = move_data_to_device(collate_candidates(examples, user_row, corpus), args.device)
        singles = [move_data_to_device(collate_candidates([e], user_row, corpus), args.device) for e in examples]
        # (label, batches, bf16, tf32, rows per forward); the naive loop keeps the default chunk and float32
        modes = []
        for chunk in chunk_sizes:
            suffix = "" if chunk is None else f" r{chunk}"
            modes.append((f"batched{suffix}", [batched], False, False, chunk))
            if args.tf32:
                modes.append((f"batched+tf32{suffix}", [batched], False, True, chunk))
            if args.bf16:
                modes.append((f"batched+bf16{suffix}", [batched], True, False, chunk))
        for mode, batches, bf16, tf32, chunk in modes + [("naive", singles, False, False, None)]:
            seconds = time_rounds(model, optimizer, batches, e_u, temperature, args.rounds, bf16, tf32, chunk)
            docs = sum(len(b.docs) for b in batches) + len(examples)
            texts = docs if name == "retriever" else args.batch * candidates
            rows.append({"module": name, "C": candidates, "mode": mode, "steps": len(batches), "encoded": texts,
                         "s/round": seconds, "samples/s": args.batch / seconds})
            print(f"  {name} C={candidates} {mode}: {seconds:.2f} s per {args.batch} examples", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timed round per setting instead of --rounds")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (of --batch examples) per setting")
    parser.add_argument("--batch", type=int, default=4, help="examples per batched step")
    parser.add_argument("--candidates", type=int, nargs="+", default=[15, 30], help="m·k candidates per example")
    parser.add_argument("--shared", type=float, default=0.6, help="share of each list drawn from the batch's pool")
    parser.add_argument("--doc-words", type=int, nargs=2, default=[40, 120], help="doc length range in words")
    parser.add_argument("--modules", nargs="+", default=["retriever", "reranker"], choices=["retriever", "reranker"])
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the batched step under bfloat16 autocast (default: on CUDA, and where the "
                             "CPU has native bf16)")
    parser.add_argument("--tf32", action="store_true",
                        help="also time float32 with TensorFloat-32 matmuls (GPUs with tensor cores)")
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="rows per encoder forward to compare (default: the device's, models/common.py)")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bf16 is None:
        args.bf16 = args.device == "cuda" or cpu_has_native_bf16()
    configure_logs(verbose=False)  # no "Loading weights" bars in the tables
    if args.quick:
        args.rounds = 1
    on = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {on}, encoder {args.encoder}, batch {args.batch}, "
          f"{args.shared:.0%} of each list shared, docs {args.doc_words[0]}-{args.doc_words[1]} words, "
          f"{args.rounds} timed round(s) per setting", flush=True)
    rows = []
    if "retriever" in args.modules:
        rows += bench("retriever", PersonalizedRetriever.from_encoder(args.encoder, 384), 1.0, args)
    if "reranker" in args.modules:
        rows += bench("reranker", PersonalizedReranker.from_encoder(args.encoder, 384), 0.1, args)

    print()
    header = f"{'module':<10} {'C':>3} {'mode':<20} {'steps':>5} {'texts/pairs encoded':>20} {'s/round':>8} " \
             f"{'samples/s':>10} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        naive = next(r for r in rows if r["module"] == row["module"] and r["C"] == row["C"] and r["mode"] == "naive")
        print(f"{row['module']:<10} {row['C']:>3} {row['mode']:<20} {row['steps']:>5} {row['encoded']:>20} "
              f"{row['s/round']:>8.2f} {row['samples/s']:>10.3f} {row['samples/s'] / naive['samples/s']:>7.2f}x")
    print("\nsteps: optimizer steps per round of the same examples; texts/pairs encoded: docs through the doc "
          "encoder (retriever, plus one query per example) or (query, doc) pairs through the cross-encoder.")


if __name__ == "__main__":
    main()
