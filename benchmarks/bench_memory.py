"""Memory bank quality and cost: recall@k of planted facts over simulated conversations, and recall latency.

Extraction is either the identity (each message stored verbatim, tags empty) or a real LLM backend; the text
encoder is MiniLM unless told otherwise. Prints a table; asserts nothing.

    python benchmarks/bench_memory.py --users 20
    python benchmarks/bench_memory.py --users 5 --llm llamacpp:smollm2
    # the seed's path: LLM extraction (memories with tags), questionnaire sign-up, recall on the LLM's summary
    # with the tag re-rank, many other messages per user; --out keeps the figures as JSON
    python benchmarks/bench_memory.py --users 3 --fillers 15 --questionnaire --llm llamacpp:smollm2 --seed-rule-only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.registry import load_llm
from persrag_lightning.memory import MemoryBank, MemorySettings, RecallSettings
from persrag_lightning.memory.simulate import measure_recall, questionnaire_answers, simulate_conversations
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
    ap.add_argument("--questionnaire", action="store_true", help="sign each user up with the seed's questionnaire")
    ap.add_argument("--recall-query", default="summary", choices=["summary", "raw"])
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of torch and of a llamacpp LLM")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.llm == "identity":
        llm: LLM = IdentityLLM()
    else:
        backend, model = args.llm.split(":", 1)
        threads = {"n_threads": args.threads} if backend == "llamacpp" else {"num_threads": args.threads}
        llm = load_llm(backend, model, **threads)
    encoder = TextEncoder.from_pretrained(args.encoder)
    convs = simulate_conversations(args.users, args.facts, args.fillers, seed=args.seed)
    rng = random.Random(args.seed)
    signup = {c.user_id: questionnaire_answers(rng) for c in convs} if args.questionnaire else None
    rows = []
    details = []
    rules = [(2, "seed (score >= N-2)"), (20, "no score cut (top-k)")]
    for margin, label in rules[:1] if args.seed_rule_only else rules:
        with tempfile.TemporaryDirectory() as tmp:
            settings = MemorySettings(recall=RecallSettings(k=args.k, score_margin=margin),
                                      recall_query=args.recall_query)
            bank = MemoryBank(Path(tmp) / "bank", encoder, llm=llm, settings=settings)
            t0 = time.perf_counter()
            report = measure_recall(bank, convs, signup)
            total = time.perf_counter() - t0
            memories = [m for c in convs for m in bank.list(c.user_id)]
            details.append({"rule": label, **asdict(report), "seconds": total,
                            "extractions": bank.extractor.calls if bank.extractor else 0,
                            "memories_per_user": len(memories) / max(1, len(convs)),
                            "memories_with_tags": sum(bool(m.tags.flat()) for m in memories),
                            "recall_inputs": dict(bank.recall_inputs)})
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
    for d in details:
        print(f"{d['rule']}: {d['extractions']} LLM extractions, {d['fallbacks']} fell back to the raw message, "
              f"{d['repaired']} repaired; {d['memories_per_user']:.1f} memories per user, {d['memories_with_tags']} "
              f"with tags; recall embedded {d['recall_inputs']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rules": details}, indent=2))


if __name__ == "__main__":
    main()
