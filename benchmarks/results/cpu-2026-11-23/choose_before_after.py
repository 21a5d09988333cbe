"""One-off: llamacpp `choose` (score_options) before (logits_all context, 0bbc3b8) and after (batch API) on the
bench's 16 LaMP-2 feedback prompts, 15 labels, f16 weights, same threads; alternating order, 2 rounds.

    git show 0bbc3b8:persrag_lightning/llm/llamacpp.py > /tmp/llamacpp_before.py
    python benchmarks/results/cpu-2026-11-23/choose_before_after.py 2 /tmp/llamacpp_before.py
"""
import importlib.util
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_llm import feedback_prompts

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm.llamacpp import LlamaCppLLM

spec = importlib.util.spec_from_file_location("llamacpp_before", sys.argv[2])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
threads = int(sys.argv[1])
after = LlamaCppLLM("smollm2", n_threads=threads)
before = mod.LlamaCppLLM("smollm2", n_threads=threads)
prompts = feedback_prompts("LaMP-2", 16, after.count_tokens, 220)
labels = list(LAMP2_LABELS)
print(f"# load {os.getloadavg()} threads={threads} weights={after.weights}/{before.weights}")
for llm in (before, after):
    llm.choose(prompts[:1], labels)  # warm-up
res = {}
for rnd in range(2):
    for name, llm in (("before", before), ("after", after)) if rnd == 0 else (("after", after), ("before", before)):
        t0 = time.perf_counter(); rows = llm.score_options(prompts, labels); dt = time.perf_counter() - t0
        res.setdefault(name, []).append((dt, rows))
        print(f"round {rnd} {name}: {len(prompts)/dt:.2f} prompts/s ({dt:.1f} s)", flush=True)
b, a = res["before"][0][1], res["after"][0][1]
gaps = [abs(x - y) for rb, ra in zip(b, a) for x, y in zip(rb, ra)]
same = sum(max(range(len(r1)), key=r1.__getitem__) == max(range(len(r2)), key=r2.__getitem__) for r1, r2 in zip(b, a))
print(f"max |before - after| {max(gaps):.4f} nat over {len(gaps)} scores; same choice {same}/{len(b)}")
print(f"# load at the end {os.getloadavg()}")
