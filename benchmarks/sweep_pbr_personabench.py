"""Sweep P-Anchor's θ, k2 and α on one PersonaBench community (tune on community_0 only), in one process:
documents are embedded once (memoised encoder) and P-PRF answers come from the LLM cache, so only a variant
with P-PRF whose answers are missing calls the LLM. Prints a markdown table sorted by R@5.

    python benchmarks/sweep_pbr_personabench.py --data-dir ../shared/data/personabench/community_0 \
        --variant "PBR w/o P-PRF" --theta 0.5 0.75 0.9 --k2 5 10 50 --damping 0.5 0.85 1.0
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from persrag_lightning.data.personabench import load_personabench
from persrag_lightning.evaluation.personabench_eval import PersonaBenchEvalConfig, evaluate_variants
from persrag_lightning.retrieval.llm_cache import CachedLLM
from persrag_lightning.retrieval.pbr import PBRSettings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--variant", default="PBR w/o P-PRF")
    p.add_argument("--theta", type=float, nargs="+", default=[0.5, 0.6, 0.75, 0.9])
    p.add_argument("--k2", type=int, nargs="+", default=[5, 10, 50])
    p.add_argument("--damping", type=float, nargs="+", default=[0.5, 0.85, 1.0])
    p.add_argument("--llm-backend", default="llamacpp")
    p.add_argument("--llm-model", default="smollm2")
    p.add_argument("--llm-threads", type=int, default=1)
    p.add_argument("--cache-dir", default=".cache/pbr")
    p.add_argument("--history-chars", type=int, default=None)
    p.add_argument("--utterance-tokens", type=int, default=512)
    p.add_argument("--reasoning-tokens", type=int, default=256)
    p.add_argument("--max-questions-per-person", type=int, default=None)
    args = p.parse_args(argv)

    from persrag_lightning.models.text_encoder import TextEncoder

    encoder = TextEncoder.from_pretrained("minilm", max_length=256)
    memo: dict[str, np.ndarray] = {}

    def encode(texts: list[str]) -> np.ndarray:
        todo = [t for t in dict.fromkeys(texts) if t not in memo]
        if todo:
            for t, v in zip(todo, encoder.encode(todo).numpy()):
                memo[t] = v.astype(np.float32)
        return np.stack([memo[t] for t in texts]) if texts else np.zeros((0, encoder.dim), np.float32)

    base = PBRSettings(history_chars=args.history_chars, utterance_tokens=args.utterance_tokens,
                       reasoning_tokens=args.reasoning_tokens)
    llm = None
    if base.for_variant(args.variant).use_prf:
        from persrag_lightning.llm.registry import load_llm

        kw = {"n_threads": args.llm_threads} if args.llm_backend == "llamacpp" else {"num_threads": args.llm_threads}
        llm = CachedLLM(load_llm(args.llm_backend, args.llm_model, **kw), Path(args.cache_dir) / "llm")
    community = load_personabench(args.data_dir)
    rows = []
    for theta, k2, damping in itertools.product(args.theta, args.k2, args.damping):
        config = PersonaBenchEvalConfig(data_dir=args.data_dir, variants=[args.variant], warm_rerun=False,
                                        bootstrap_samples=200, max_questions_per_person=args.max_questions_per_person,
                                        pbr=replace(base, theta=theta, k2=k2, damping=damping))
        s = evaluate_variants(community, encode, config, llm, "sweep").summaries[0]
        rows.append((s.recall, s.ndcg, theta, k2, damping, s.llm_calls_per_query))
    print(f"{args.variant} on {Path(args.data_dir).name} ({rows and len(rows)} settings)\n")
    print("| R@5 | N@5 | θ | k2 | α | LLM calls / query |\n|---|---|---|---|---|---|")
    for r in sorted(rows, reverse=True):
        print(f"| {r[0]:.4f} | {r[1]:.4f} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
