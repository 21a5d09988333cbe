"""Probe: OpenVINO static shapes, one request on 2 threads (LATENCY) vs the pairs split over 2 streams x 1 thread
(two requests in flight) -- same scores? faster? Uses profile_reranker's question prep.

    python benchmarks/results/cpu-2026-11-23e/streams_probe.py checkpoints/synthlamp-quick 60  (dev questions)
"""
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np
import openvino as ov
import torch
from profile_reranker import pct

from persrag_lightning.data.source import LampSource
from persrag_lightning.data.tasks import get_task
from persrag_lightning.logs import configure_logs
from persrag_lightning.models.reranker import export_onnx
from persrag_lightning.retrieval.base import Query
from persrag_lightning.serving.pipeline import CFRAGPipeline

run, nq = sys.argv[1], int(sys.argv[2])
configure_logs(verbose=False)
pipe = CFRAGPipeline.from_pretrained(run, cache_dir=".cache/persrag", reranker_runtime="fp32")
s = pipe.strategy; rr = s._reranker; spec = get_task(pipe.task)
src = LampSource(pipe.task, cache_dir=".cache/persrag"); src.prepare()
qs = []
with torch.inference_mode():
    for e in src.load().examples["dev"][:nq]:
        q = Query(e.user_id, spec.extract_query(e.input), e.input)
        c = s.candidates([q])[0]
        qs.append(rr.tokenize_pairs([q.query] * len(c), [s.store.text(d.row) for d in c]))
tmp = tempfile.mkdtemp(); path = export_onnx(rr, Path(tmp) / "r.onnx", eager=True)
core = ov.Core(); model = core.read_model(str(path)); names = {i.get_any_name() for i in model.inputs}
def pad(inp):
    w = inp["input_ids"].shape[1]; W = -(-w // 16) * 16
    return {k: torch.nn.functional.pad(v, (0, W - w)).numpy() for k, v in inp.items() if k in names}
cache = {}
def compiled(shape, cfg):
    key = (shape, tuple(sorted(cfg.items())))
    if key not in cache:
        m = model.clone(); m.reshape({n: ov.PartialShape(list(shape)) for n in names})
        cache[key] = core.compile_model(m, "CPU", cfg)
    return cache[key]
LAT = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 2}
ST2 = {"NUM_STREAMS": 2, "INFERENCE_NUM_THREADS": 2, "PERFORMANCE_HINT": "THROUGHPUT"}
reqs = {}
def one(inp):
    f = pad(inp); cm = compiled(f["input_ids"].shape, LAT)
    r = reqs.setdefault(("lat", f["input_ids"].shape), cm.create_infer_request())
    return r.infer(f)[0].copy()
def two(inp):
    f = pad(inp); n = f["input_ids"].shape[0]; h = (n + 1) // 2
    parts = [{k: v[:h] for k, v in f.items()}, {k: v[h:] for k, v in f.items()}]
    rs = []
    for i, p in enumerate(parts):
        cm = compiled(p["input_ids"].shape, ST2)
        r = reqs.setdefault(("st", i, p["input_ids"].shape), cm.create_infer_request())
        r.start_async(p); rs.append(r)
    for r in rs: r.wait()
    return np.concatenate([r.get_output_tensor(0).data.copy() for r in rs])
for name, fn in (("latency 1x2", one), ("streams 2x1", two), ("latency 1x2 again", one), ("streams 2x1 again", two)):
    for t in qs[:3]: fn(t)
    ms, outs = [], []
    for t in qs:
        t0 = time.perf_counter(); outs.append(fn(t)); ms.append(1000 * (time.perf_counter() - t0))
    ref = [one(t) for t in qs]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(outs, ref))
    print(f"{name}: p50 {pct(ms, .5):.1f} p95 {pct(ms, .95):.1f} ms  max|diff| vs latency {diff:.2e}", flush=True)
