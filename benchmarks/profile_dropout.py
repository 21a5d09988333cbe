"""Where dropout's time goes in a batched bf16 training step at m·k = 30 (bench_retriever_reranker.py's setting: 4
examples, 60 % of each list shared, docs of 40-120 words). `--share`: the retriever's and the reranker's step with
every nn.Dropout at MiniLM's p = 0.1 and at p = 0 (attention dropout included: BERT passes its module's p to SDPA),
alternating, 3 rounds of 3 steps. `--ops`: torch.profiler over one reranker step (dropout's `aten::bernoulli_`
beside the matmuls), and one dropout mask of a 32 x 12 x 64 x 64 attention map by torch's generator and by four
16-bit draws per 64-bit random number. Measures only; training keeps MiniLM's dropout.

    python benchmarks/profile_dropout.py [--share] [--ops]    # both when neither is given
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_retriever_reranker import make_examples, train_step

from persrag_lightning.data.candidates import collate_candidates
from persrag_lightning.logs import configure_logs
from persrag_lightning.models.reranker import PersonalizedReranker
from persrag_lightning.models.retriever import PersonalizedRetriever

MASK_SHAPE, KEEP = (32, 12, 64, 64), 0.9


def setup(model: torch.nn.Module):
    """The model in training mode, its optimizer, one candidate batch and user vectors, all seeded."""
    rng = random.Random(0)
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=6e-5)
    examples, corpus = make_examples(rng, 4, 30, 0.6, (40, 120))
    batch = collate_candidates(examples, {e.user_id: i for i, e in enumerate(examples)}, corpus)
    return opt, batch, torch.randn(4, 384)


def dropout_share() -> None:
    for name, model, tau in (("retriever", PersonalizedRetriever.from_encoder("minilm", 384), 1.0),
                             ("reranker", PersonalizedReranker.from_encoder("minilm", 384), 0.1)):
        opt, batch, e_u = setup(model)
        drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        times: dict[float, list[float]] = {0.1: [], 0.0: []}
        for rnd in range(3):
            for p in (0.1, 0.0) if rnd % 2 == 0 else (0.0, 0.1):
                for m in drops:
                    m.p = p
                train_step(model, opt, batch, e_u, tau, True)  # untimed
                start = time.perf_counter()
                for _ in range(3):
                    train_step(model, opt, batch, e_u, tau, True)
                times[p].append((time.perf_counter() - start) / 3)
        on, off = min(times[0.1]), min(times[0.0])
        print(f"{name}: {len(drops)} dropout modules; bf16 step with dropout {on:.2f} s, without {off:.2f} s (best "
              f"of 3): dropout {1 - off / on:.0%} of the step; rounds {[round(t, 2) for t in times[0.1]]} / "
              f"{[round(t, 2) for t in times[0.0]]}", flush=True)


def torch_mask() -> torch.Tensor:
    return torch.empty(MASK_SHAPE, dtype=torch.bfloat16).bernoulli_(KEEP)


def draws16_mask() -> torch.Tensor:
    """Keep iff a 16-bit draw < round(KEEP * 65536): four draws out of each 64-bit random number."""
    n = MASK_SHAPE[0] * MASK_SHAPE[1] * MASK_SHAPE[2] * MASK_SHAPE[3]
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2**63, 2**63 - 1)
    return (words.view(torch.int16)[:n] < -32768 + round(KEEP * 65536)).view(MASK_SHAPE)


def dropout_ops() -> None:
    model = PersonalizedReranker.from_encoder("minilm", 384)
    opt, batch, e_u = setup(model)
    train_step(model, opt, batch, e_u, 0.1, True)  # untimed
    with torch.profiler.profile() as prof:
        train_step(model, opt, batch, e_u, 0.1, True)
    events = {e.key: e for e in prof.key_averages()}
    total = sum(e.self_cpu_time_total for e in events.values())
    for key in ("aten::bernoulli_", "aten::mm", "aten::addmm", "aten::bmm"):
        e = events[key]
        print(f"{key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.0f} ms ({e.self_cpu_time_total / total:.0%} of "
              f"the step's self CPU time), {e.self_cpu_time_total / e.count / 1e3:.2f} ms per call")
    for name, fn in (("torch bernoulli_", torch_mask), ("four 16-bit draws per int64", draws16_mask)):
        fn()
        start = time.perf_counter()
        for _ in range(20):
            mask = fn()
        ms = (time.perf_counter() - start) / 20 * 1e3
        print(f"mask {MASK_SHAPE} by {name}: {ms:.2f} ms, keep rate {mask.float().mean().item():.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share", action="store_true", help="dropout's share of each stage's bf16 step")
    parser.add_argument("--ops", action="store_true", help="the reranker step's ops and one mask drawn two ways")
    args = parser.parse_args(argv)
    configure_logs(verbose=False)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    if args.share or not args.ops:
        dropout_share()
    if args.ops or not args.share:
        dropout_ops()
    print(f"# load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
