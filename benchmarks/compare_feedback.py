"""How much two caches of LLM-feedback labels for the same candidates differ as training targets (e.g. float32 vs
bfloat16 LLM weights): per example, whether the best-labelled candidate is the same, Kendall's tau of the label
orders, and KL(P_a || P_b) of the targets the KL loss trains on, P = softmax(labels / teacher temperature).
Reads `persrag feedback` caches (.cache/persrag/feedback/<fingerprint>); asserts nothing.

    python benchmarks/compare_feedback.py .cache/persrag/feedback/<float32> .cache/persrag/feedback/<bf16> --tau 1.0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from persrag_lightning.data.feedback_cache import FeedbackCache


def labels(root: Path, config: dict, split: str) -> dict[str, tuple[list[str], np.ndarray]]:
    chunk = config["settings"]["chunk_size"]
    n = sum(1 for _ in (root / split).glob("chunk-*.jsonl")) * chunk
    return {e.example_id: ([c.doc_id for c in e.candidates], np.array([c.label for c in e.candidates]))
            for e in FeedbackCache(root, chunk).read(split, n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--tau", type=float, default=1.0, help="teacher temperature of the stage (retriever 1.0, "
                   "reranker 0.1)")
    args = p.parse_args()
    configs = {root: json.loads((root / "config.json").read_text()) for root in (args.a, args.b)}
    print(f"a = {args.a} ({configs[args.a]['llm']['options']})\nb = {args.b} ({configs[args.b]['llm']['options']})\n")
    print("| split | examples | same top-1 | Kendall tau (mean) | KL(P_a ‖ P_b) mean / max | max label diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for split in ("train", "dev"):
        a, b = labels(args.a, configs[args.a], split), labels(args.b, configs[args.b], split)
        same = [k for k in a if k in b and a[k][0] == b[k][0]]  # the same candidates, in the same order
        top1 = np.mean([a[k][1].argmax() == b[k][1].argmax() for k in same])
        tau = np.nanmean([kendalltau(a[k][1], b[k][1]).statistic for k in same])
        kl = [float(torch.nn.functional.kl_div(torch.log_softmax(torch.tensor(b[k][1]) / args.tau, 0),
                                               torch.log_softmax(torch.tensor(a[k][1]) / args.tau, 0),
                                               log_target=True, reduction="sum")) for k in same]
        diff = max(float(np.abs(a[k][1] - b[k][1]).max()) for k in same)
        print(f"| {split} | {len(same)} | {top1:.3f} | {tau:.3f} | {np.mean(kl):.4f} / {np.max(kl):.4f} | "
              f"{diff:.3f} |")


if __name__ == "__main__":
    main()
