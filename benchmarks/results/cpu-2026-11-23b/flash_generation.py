import sys

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_llm import feedback_prompts

from persrag_lightning.llm import default_max_new_tokens, load_llm

hf = load_llm("hf", "smollm2", batch_size=16, dtype="float32")
for task in ("LaMP-5", "LaMP-2"):
    prompts = feedback_prompts(task, 16, hf.count_tokens, 220)
    exact = hf.generate(prompts, default_max_new_tokens(task))
    for fa in (False, True):
        llm = load_llm("llamacpp", "smollm2", n_threads=1, flash_attn=fa)
        out = llm.generate(prompts, default_max_new_tokens(task))
        print(task, "flash" if fa else "no-flash", sum(a == b for a, b in zip(out, exact)), "/16 equal to exact",
              [i for i, (a, b) in enumerate(zip(out, exact)) if a != b])
        llm.close()
