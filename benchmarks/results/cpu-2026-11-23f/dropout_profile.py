"""One-off: where dropout's time comes from on this CPU. (1) `torch.profiler` over one batched bf16 reranker step at
m·k = 30 (bench_retriever_reranker.py's setting): the share of `aten::bernoulli_` (dropout's mask) beside the
matmuls; (2) one dropout mask for a 32 x 12 x 64 x 64 attention map by torch's generator (what F.dropout does) and
by four 16-bit draws per 64-bit random number (keep iff the draw < round(0.9 * 65536)), with the keep rate of each.

    python benchmarks/results/cpu-2026-11-23f/dropout_profile.py
"""
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_retriever_reranker import make_examples, train_step

from persrag_lightning.data.candidates import collate_candidates
from persrag_lightning.logs import configure_logs
from persrag_lightning.models.reranker import PersonalizedReranker

configure_logs(verbose=False)
print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
rng = random.Random(0); torch.manual_seed(0)
model = PersonalizedReranker.from_encoder("minilm", 384).train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=6e-5)
examples, corpus = make_examples(rng, 4, 30, 0.6, (40, 120))
batch = collate_candidates(examples, {e.user_id: i for i, e in enumerate(examples)}, corpus)
e_u = torch.randn(4, 384)
train_step(model, opt, batch, e_u, 0.1, True)  # untimed
with torch.profiler.profile() as prof:
    train_step(model, opt, batch, e_u, 0.1, True)
events = {e.key: e for e in prof.key_averages()}
total = sum(e.self_cpu_time_total for e in events.values())
for key in ("aten::bernoulli_", "aten::mm", "aten::addmm", "aten::bmm"):
    e = events[key]
    print(f"{key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.0f} ms ({e.self_cpu_time_total / total:.0%} of "
          f"the step's self CPU time), {e.self_cpu_time_total / e.count / 1e3:.2f} ms per call")

shape, keep = (32, 12, 64, 64), 0.9
n = 32 * 12 * 64 * 64
threshold = -32768 + round(keep * 65536)


def torch_mask() -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16).bernoulli_(keep)


def draws16_mask() -> torch.Tensor:
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2**63, 2**63 - 1)
    return (words.view(torch.int16)[:n] < threshold).view(shape)


for name, fn in (("torch bernoulli_", torch_mask), ("four 16-bit draws per int64", draws16_mask)):
    fn()
    start = time.perf_counter()
    for _ in range(20):
        mask = fn()
    ms = (time.perf_counter() - start) / 20 * 1e3
    print(f"mask {shape} by {name}: {ms:.2f} ms, keep rate {mask.float().mean().item():.4f}")
print(f"# load at the end {os.getloadavg()}")
