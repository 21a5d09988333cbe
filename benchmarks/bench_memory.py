"""Memory bank quality and cost: recall@k of planted facts over simulated conversations, and recall latency.

Extraction is either the identity (each message stored verbatim, tags empty) or a real LLM backend; the text
encoder is MiniLM unless told otherwise. Prints a table; asserts nothing.

    python benchmarks/bench_memory.py --users 20
    python benchmarks/bench_memory.py --users 5 --llm llamacpp:smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.registry import load_llm
from persrag_lightning.memory import MemoryBank, MemorySettings, RecallSettings
from persrag_lightning.memory.simulate import measure_recall, simulate_conversations
from persrag_lightning.models.text_encoder import TextEncoder


class IdentityLLM(LLM):
    """Extraction that returns the message itself as the memory, no tags (isolates the retrieval side)."""

    backend = "identity"

    @property
    def name(self) -> str:
        return "identity"

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        return [json.dumps({"memory": p.split("Latest user message:\n", 1)[1].rsplit("\nJSON:", 1)[0]})
                for p in prompts]

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        raise NotImplementedError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--facts", type=int, default=3)
    ap.add_argument("--fillers", type=int, default=2)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--llm", default="identity", help="identity, or BACKEND:MODEL (e.g. llamacpp:smollm2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seed-rule-only", action="store_true", help="skip the top-k comparison (halves LLM time)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    llm: LLM = IdentityLLM() if args.llm == "identity" else load_llm(*args.llm.split(":", 1))
    encoder = TextEncoder.from_pretrained(args.encoder)
    convs = simulate_conversations(args.users, args.facts, args.fillers, seed=args.seed)
    rows = []
    rules = [(2, "seed (score >= N-2)"), (20, "no score cut (top-k)")]
    for margin, label in rules[:1] if args.seed_rule_only else rules:
        with tempfile.TemporaryDirectory() as tmp:
            settings = MemorySettings(recall=RecallSettings(k=args.k, score_margin=margin))
            bank = MemoryBank(Path(tmp) / "bank", encoder, llm=llm, settings=settings)
            t0 = time.perf_counter()
            report = measure_recall(bank, convs)
            total = time.perf_counter() - t0
            lat = []
            for conv in convs[:10]:
                t = time.perf_counter()
                bank.recall(conv.user_id, conv.facts[0].question, tags=None)
                lat.append(time.perf_counter() - t)
            rows.append((label, report, total, statistics.median(lat)))
    print(f"users={args.users} facts/user={args.facts} fillers/fact={args.fillers} encoder={args.encoder} "
          f"llm={args.llm} k={args.k}")
    print(f"{'recall rule':24} {'questions':>9} {'recall@k':>9} {'MRR':>6} {'foreign':>7} {'fallbacks':>9} "
          f"{'repaired':>8} {'total s':>8} {'recall p50 ms':>13}")
    for label, r, total, p50 in rows:
        print(f"{label:24} {r.questions:9d} {r.recall_at_k:9.3f} {r.mrr:6.3f} {r.foreign:7d} {r.fallbacks:9d} "
              f"{r.repaired:8d} {total:8.1f} {p50 * 1000:13.1f}")


if __name__ == "__main__":
    main()
