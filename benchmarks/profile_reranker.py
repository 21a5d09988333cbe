"""Where the serving reranker's time goes, and what other runtimes make of it: the cross-encoder alone on the m·k
(query, doc) pairs of real test questions of an export (the pairs `CFRAGPipeline.retrieve` reranks), one question
at a time, for torch's bf16 autocast (the serving default without OpenVINO) next to the fp32 baseline and to
runtimes that are not options of the pipeline: the weights themselves in bf16, length-sorted chunks (less padding), torch.compile (inductor,
frozen weights, dynamic shapes) and OpenVINO (the serving default where the `openvino` extra is installed) on
the export before and after its eager attention and static shapes (models/exported.py).
Prints the pairs' padding share, the work per question (GFLOP) and, per row, p50 / p95 ms, the rate of useful work
(GFLOP/s) and the agreement of the final top-k with the fp32 reranker's. Wall-clock; asserts nothing.

    python benchmarks/profile_reranker.py --run checkpoints/synthlamp-quick --questions 40
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.tasks import get_task
from persrag_lightning.logs import configure_logs
from persrag_lightning.models.common import encode_by_length
from persrag_lightning.models.exported import WIDTH_STEP, StaticShapes, openvino_session
from persrag_lightning.models.reranker import cls_state, export_onnx, personalized_rerank_score
from persrag_lightning.retrieval.base import Query
from persrag_lightning.serving.cfrag_pipeline import CFRAGPipeline

Encode = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # tokenised pairs -> CLS states [P, d], float32


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def torch_encode(encoder: torch.nn.Module, autocast: bool, chunk: int | None = None) -> Encode:
    """The reranker's own torch path (models/common.py's encode_by_length): one chunk of every pair unless `chunk`."""
    @torch.inference_mode()
    def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        def encode(rows: torch.Tensor, part: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return cls_state(encoder(**part).last_hidden_state).float()
        return encode_by_length(inputs, encode, torch.device("cpu"), chunk or len(inputs["input_ids"]))
    return run


def flops(encoder: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Useful GFLOP of one question's pairs (real tokens only: linear layers 2·params·tokens, attention 4·L²·d per
    layer and pair) and the same with the padding the single batch computes."""
    layers = encoder.encoder.layer
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    d = encoder.config.hidden_size
    lengths = inputs["attention_mask"].sum(1).double()
    width = inputs["attention_mask"].shape[1]
    useful = 2 * linear * lengths.sum() + 4 * len(layers) * d * (lengths ** 2).sum()
    padded = 2 * linear * width * len(lengths) + 4 * len(layers) * d * width ** 2 * len(lengths)
    return float(useful) / 1e9, float(padded) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="checkpoints/synthlamp-quick", help="an exported run with a reranker")
    p.add_argument("--questions", type=int, default=40, help="test questions, one at a time")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--cache-dir", default=".cache/persrag")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (its compile takes ~15 s)")
    args = p.parse_args()
    configure_logs(verbose=False)
    # the reranker named: it is what is profiled, whichever order the run's pipeline.json chose on dev
    pipe = CFRAGPipeline.from_pretrained(args.run, cache_dir=args.cache_dir, reranker_runtime="fp32",
                                         reranker="reranker")
    s = pipe.strategy
    reranker = s._reranker
    if reranker is None:
        raise SystemExit(f"{args.run}: no reranker export")
    spec = get_task(pipe.task)
    source = LampSource(pipe.task, cache_dir=args.cache_dir)
    source.prepare()
    questions = []  # (tokenised pairs, user vectors MLP2(e_u) or None) per question
    with torch.inference_mode():
        for e in source.load().examples["test"][:args.questions]:
            q = Query(e.user_id, spec.extract_query(e.input), e.input)
            cands = s.candidates([q])[0]
            texts = [s.store.text(d.row) for d in cands]
            users = (reranker.user_vectors(s.e_u(q.user_id).expand(len(cands), -1))
                     if reranker.config.use_user else None)
            questions.append((reranker.tokenize_pairs([q.query] * len(cands), texts), users))
    encoder = reranker.encoder.eval()
    threads = torch.get_num_threads()
    tokens = [int(t["attention_mask"].sum()) for t, _ in questions]
    padded = [t["attention_mask"].numel() for t, _ in questions]
    work = [flops(encoder, t) for t, _ in questions]
    useful_gflop = sum(w[0] for w in work) / len(work)
    print(f"{args.run}: {len(questions)} test questions x {questions[0][0]['input_ids'].shape[0]} pairs, "
          f"{sum(tokens) / len(questions):.0f} tokens per question ({sum(tokens) / sum(padded):.1%} of the padded "
          f"batch), {useful_gflop:.1f} GFLOP per question ({sum(w[1] for w in work) / len(work):.1f} with the "
          f"padding); {threads} torch threads; wall-clock ms, shared CPU if other jobs run")

    rows: dict[str, Encode | str] = {
        "fp32 (the evaluation's reranker)": torch_encode(encoder, autocast=False),
        "bf16 autocast (serving default without openvino)": torch_encode(encoder, autocast=True),
        "bf16 autocast, chunks of 8 by length": torch_encode(encoder, autocast=True, chunk=8),
        "bf16 weights (no autocast)": torch_encode(copy.deepcopy(encoder).to(torch.bfloat16), autocast=False),
    }
    setup: dict[str, float] = {}
    if not args.no_compile:
        import torch._inductor.config as inductor

        inductor.freezing = True  # weights folded into the graph as constants (inference only)
        t0 = time.perf_counter()
        compiled = torch_encode(torch.compile(copy.deepcopy(encoder), dynamic=True), autocast=True)
        compiled(questions[0][0])
        setup["torch.compile + bf16 autocast"] = time.perf_counter() - t0
        rows["torch.compile + bf16 autocast"] = compiled
    with tempfile.TemporaryDirectory() as tmp:
        # the serving runtime itself (models/exported.py): bf16 where the CPU computes it natively; before and after
        # the eager-attention export and the static shapes
        for name, eager, step in (("OpenVINO, SDPA export, dynamic shapes (serving until 2026-11-23)", False, None),
                                  ("OpenVINO, eager export, dynamic shapes", True, None),
                                  ("OpenVINO, eager export, static shapes (serving default)", True, WIDTH_STEP)):
            t0 = time.perf_counter()
            try:
                path = export_onnx(reranker, Path(tmp) / f"encoder-{eager}.onnx", eager=eager)
                rows[name] = openvino_session(path, width_step=step)
                setup[name] = time.perf_counter() - t0
            except ImportError as err:
                rows[name] = str(err)

        def scores(encode: Encode, inputs: dict[str, torch.Tensor], users: torch.Tensor | None) -> torch.Tensor:
            with torch.inference_mode():
                return personalized_rerank_score(reranker.head, encode(inputs), users)

        base = [torch.argsort(scores(rows["fp32 (the evaluation's reranker)"], t, u), descending=True,
                              stable=True)[:args.k].tolist() for t, u in questions]
        print(f"\n| runtime | setup s | p50 ms | p95 ms | GFLOP/s (useful) | overlap@{args.k} with fp32 | same order |")
        print("|---|---|---|---|---|---|---|")
        for name, encode in rows.items():
            if not callable(encode):
                print(f"| {name} | skipped: {encode} | | | | | |")
                continue
            for t, u in questions[:2]:  # warm-up: allocator, oneDNN primitives, graph specialisations
                scores(encode, t, u)
            ms, tops = [], []
            for t, u in questions:
                t0 = time.perf_counter()
                out = scores(encode, t, u)
                ms.append(1000 * (time.perf_counter() - t0))
                tops.append(torch.argsort(out, descending=True, stable=True)[:args.k].tolist())
            overlap = sum(len(set(a) & set(b)) for a, b in zip(tops, base)) / (args.k * len(base))
            same = sum(a == b for a, b in zip(tops, base)) / len(base)
            rate = useful_gflop / (sum(ms) / len(ms) / 1000)
            shapes = f" ({len(encode.requests)} static shapes)" if isinstance(encode, StaticShapes) else ""
            print(f"| {name}{shapes} | {setup.get(name, 0.0):.1f} | {pct(ms, .5):.1f} | {pct(ms, .95):.1f} | "
                  f"{rate:.0f} | {overlap:.3f} | {same:.2f} |", flush=True)


if __name__ == "__main__":
    main()
