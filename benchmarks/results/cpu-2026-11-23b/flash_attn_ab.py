import sys
import time

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
import random

import llama_cpp
import numpy as np
from bench_llm import feedback_prompts, synthetic_text

from persrag_lightning.llm import load_llm

task = sys.argv[1]
llms = {}
for fa in (False, True):
    llm = load_llm("llamacpp", "smollm2", n_threads=2)
    llm.engine.context_params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    llms[fa] = llm
prompts = feedback_prompts(task, 16, llms[False].count_tokens, 220)
rng = random.Random(1)
targets = [synthetic_text(rng, 10).rstrip(".") if task == "LaMP-5" else "comedy" for _ in prompts]
for llm in llms.values(): llm.score(prompts[:1], targets[:1])
times = {False: [], True: []}; scores = {}
for r in range(3):
    for fa in ((False, True) if r % 2 == 0 else (True, False)):
        t = time.perf_counter(); scores[fa] = llms[fa].score(prompts, targets); times[fa].append(time.perf_counter() - t)
for fa in (False, True):
    print(task, "flash" if fa else "no-flash", ["%.2f/s" % (16 / t) for t in times[fa]])
d = np.abs(np.array(scores[True]) - np.array(scores[False]))
print("max diff nat", d.max(), "median", np.median(d))
