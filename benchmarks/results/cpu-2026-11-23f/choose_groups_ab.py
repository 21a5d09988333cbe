"""One-off: llamacpp `choose` (score_options) with one llama_decode per option (its first version, `option_seqs=1`)
and with all 15 LaMP-2 labels in one call (the default), on the bench's LaMP-2 feedback prompts; one process per
weight type, both settings on the same context, alternating order, 3 rounds.

    python benchmarks/results/cpu-2026-11-23f/choose_groups_ab.py 2 32 f16 bf16
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_llm import feedback_prompts

from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm.llamacpp import OPTION_SEQS, LlamaCppLLM

threads, n = int(sys.argv[1]), int(sys.argv[2])
labels = list(LAMP2_LABELS)
for weights in sys.argv[3:]:
    llm = LlamaCppLLM("smollm2", n_threads=threads, weights=weights)
    prompts = feedback_prompts("LaMP-2", n, llm.count_tokens, 220)
    print(f"# weights={weights} threads={threads} prompts={n} load {os.getloadavg()}")
    llm.choose(prompts[:1], labels)  # warm-up
    res: dict[str, list] = {}
    for rnd in range(3):
        order = (("one call per option", 1), ("all options in one call", OPTION_SEQS))
        for name, seqs in order if rnd % 2 == 0 else order[::-1]:
            llm.option_seqs = seqs
            t0 = time.perf_counter(); rows = llm.score_options(prompts, labels); dt = time.perf_counter() - t0
            res.setdefault(name, []).append((dt, rows))
            print(f"round {rnd} {name}: {n / dt:.2f} prompts/s ({dt:.1f} s)", flush=True)
    (_, b), (_, a) = res["one call per option"][0], res["all options in one call"][0]
    gaps = [abs(x - y) for rb, ra in zip(b, a) for x, y in zip(rb, ra)]
    same = sum(max(range(len(r1)), key=r1.__getitem__) == max(range(len(r2)), key=r2.__getitem__)
               for r1, r2 in zip(b, a))
    best = {name: n / min(dt for dt, _ in runs) for name, runs in res.items()}
    print(f"best of 3: {best['one call per option']:.2f} -> {best['all options in one call']:.2f} prompts/s "
          f"({best['all options in one call'] / best['one call per option']:.2f}x); max |before - after| "
          f"{max(gaps):.4f} nat over {len(gaps)} scores; same choice {same}/{len(b)}")
    llm.close()
print(f"# load at the end {os.getloadavg()}")
