"""Encoders exported once to ONNX and run outside torch, for serving on CPUs: ONNX Runtime (float32,
exact to 1e-4) or OpenVINO's CPU plugin (bf16 where the CPU computes it natively, on AMX matrix
units where it has them). The reranker's cross-encoder and the retriever's query encoder take this
one path (models/reranker.py, retrieval/corpus_retriever.py). A session is a function of the
tokenised batch (right-padded tensors by input name) to the module's float32 output."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

__all__ = ["EXPORTED_RUNTIMES", "WIDTH_STEP", "Session", "StaticShapes", "export_onnx",
           "export_path", "openvino_session", "session"]

EXPORTED_RUNTIMES = ("onnx", "openvino")
Session = Callable[[dict[str, torch.Tensor]], torch.Tensor]

# OpenVINO compiles one static shape of one row per tokens rounded up to WIDTH_STEP, lazily, and
# keeps the last MAX_SHAPES: static shapes reranked faster than one dynamic-shape model, at both p50
# and p95 (both step sizes probed alike), and a shape compiles once, paid by the first query of that
# shape (benchmarks/profile_reranker.py, docs/performance/serving.md, docs/serving/pipeline.md).
# Batches of several rows take one model of dynamic rows and width (BATCH_SHAPE) instead: within a
# few percent of a model per width, compiled once, and one copy of the weights (docs/serving/pipeline.md).
WIDTH_STEP = 16
MAX_SHAPES = 64
DYNAMIC = -1  # a dimension OpenVINO leaves open
BATCH_SHAPE = (DYNAMIC, DYNAMIC)  # StaticShapes' one model for batches of several rows
# 2: eager attention (1, the SDPA export, ran slower in OpenVINO); in the file names
EXPORT_FORMAT = 2


def export_path(cache_dir: str | Path, kind: str, digest: str) -> Path:
    """Where the export of a module (`kind`: reranker, query) of the given content digest is kept,
    once for every later process: `<cache_dir>/onnx/<kind>-<digest>-f<EXPORT_FORMAT>.onnx`."""
    return Path(cache_dir) / "onnx" / f"{kind}-{digest}-f{EXPORT_FORMAT}.onnx"


class _Positional(nn.Module):
    """`fn(**inputs)` as a function of tensors in input-name order (what torch.onnx exports)."""

    def __init__(
        self, fn: nn.Module, names: list[str], output: Callable[[object], torch.Tensor]
    ) -> None:
        super().__init__()
        self.fn, self.names, self.output = fn, names, output

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.output(self.fn(**dict(zip(self.names, tensors))))


@contextmanager
def _eager_attention(model: nn.Module | None) -> Iterator[None]:
    """The transformers model's attention as explicit matmul + mask + softmax for the block
    (restored after): exported so, OpenVINO fuses each layer's attention into one kernel; torch's
    SDPA exports as a masked softmax with NaN guards that it runs op by op, slower on the reranker's
    pairs (docs/serving/pipeline.md)."""
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if before is None or before == "eager" or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def export_onnx(fn: nn.Module, model: nn.Module, sample: dict[str, torch.Tensor], path: str | Path | None,
                output: Callable[[object], torch.Tensor] = lambda out: out, eager: bool = True) -> Path:
    """`output(fn(**inputs))` as ONNX at `path` (dynamic rows and tokens; `model` is the
    transformers model inside `fn`, exported with eager attention unless `eager=False`: the model's
    own, format 1, which only the benchmarks' before rows use), made once (atomic rename; a temp
    file when None) and reused when it exists. Needs the `onnx` package (extras onnx, openvino)."""
    path = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="persrag-onnx-")) / "encoder.onnx"
    if path.is_file():
        return path
    try:
        import onnx  # noqa: F401  (torch.onnx.export writes through it)
    except ImportError:
        raise ImportError(
            'exporting an encoder to ONNX needs onnx: pip install -e ".[onnx]" (or ".[openvino]")'
        ) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(sample)
    axes = {n: {0: "rows", 1: "tokens"} for n in names}
    # processes exporting at once each write their own
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with warnings.catch_warnings(), torch.no_grad(), _eager_attention(model if eager else None):
        warnings.simplefilter("ignore")  # the tracer's notes on python-side shape checks
        torch.onnx.export(_Positional(fn, names, output).eval(), tuple(sample[n] for n in names), str(tmp),
                          input_names=names, output_names=["out"], dynamic_axes={**axes, "out": {0: "rows"}},
                          opset_version=17, dynamo=False)
    tmp.replace(path)
    return path


def session(runtime: str, path: Path, width_step: int | None = WIDTH_STEP, precision: str | None = None) -> Session:
    """The exported module at `path` in `runtime` (one of EXPORTED_RUNTIMES), on torch's thread
    count; `width_step` and `precision`: OpenVINO's (`openvino_session`)."""
    if runtime == "onnx":
        return _onnx_session(path)
    if runtime == "openvino":
        return openvino_session(path, width_step, precision)
    raise ValueError(
        f"exported runtime must be one of {', '.join(EXPORTED_RUNTIMES)}, got {runtime!r}"
    )


def _onnx_session(path: Path) -> Session:
    """ONNX Runtime on the CPU (float32). Needs the optional extra: pip install -e ".[onnx]"."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ImportError(
            'runtime "onnx" needs onnxruntime and onnx: pip install -e ".[onnx]"'
        ) from None
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3
    ort_session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in ort_session.get_inputs()}
    return lambda inputs: torch.from_numpy(ort_session.run(None, _numpy_feed(inputs, names))[0])


def openvino_session(path: Path, width_step: int | None = WIDTH_STEP, precision: str | None = None) -> Session:
    """OpenVINO's CPU plugin, latency mode: bf16 where the CPU computes it natively (its default
    there), f32 elsewhere, unless `precision` ("f32", "bf16") says which. With `width_step`, static
    shapes (StaticShapes); None: one model of dynamic shape. Needs the optional extra: pip install
    -e ".[openvino]"."""
    try:
        import openvino as ov
    except ImportError:
        raise ImportError(
            'runtime "openvino" needs openvino and onnx: pip install -e ".[openvino]"'
        ) from None
    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    model = core.read_model(str(path))
    if width_step is not None:
        return StaticShapes(core, model, config, width_step)
    request = core.compile_model(model, "CPU", config).create_infer_request()
    names = {i.get_any_name() for i in model.inputs}
    return lambda inputs: torch.from_numpy(
        request.infer(_numpy_feed(inputs, names))[0].copy()
    ).float()


class StaticShapes:
    """An OpenVINO model compiled for each shape it meets: the batch right-padded (token id 0, mask
    0) to its width rounded up to `width_step`; one row (a served query) in a shape of exactly one
    row, batches of several rows in one model whose rows and width are dynamic (BATCH_SHAPE). Each
    compiled model holds its own copy of the weights, so a model per batch shape grew a batching
    server's memory with every shape it met, and its first batch of each waited for a compile.
    Padded tokens are masked like the batch's own padding, so the output is the dynamic model's.
    The last MAX_SHAPES compiled shapes are kept."""

    def __init__(self, core, model, config: dict, width_step: int) -> None:
        if width_step < 1:
            raise ValueError(f"width_step must be positive, got {width_step}")
        self.core, self.model, self.config, self.width_step = core, model, config, width_step
        self.names = {i.get_any_name() for i in model.inputs}
        self.requests: OrderedDict[tuple[int, int], object] = OrderedDict()

    def _request(self, shape: tuple[int, int]):
        if shape in self.requests:
            self.requests.move_to_end(shape)
            return self.requests[shape]
        import openvino as ov

        model = self.model.clone()
        model.reshape({name: ov.PartialShape(list(shape)) for name in self.names})
        request = self.core.compile_model(model, "CPU", self.config).create_infer_request()
        self.requests[shape] = request
        if len(self.requests) > MAX_SHAPES:
            self.requests.popitem(last=False)
        return request

    def warm(self, max_width: int) -> int:
        """Compile now the shapes of one row at every width up to `max_width` tokens (at most
        MAX_SHAPES - 1; 0: none) and the batches' model, so that no later call pays a compile;
        returns how many models that is."""
        step = self.width_step
        widths = list(range(step, -(-max_width // step) * step + 1, step))[:MAX_SHAPES - 1]
        for width in widths:
            self._request((1, width))
        self._request(BATCH_SHAPE)
        return len(widths) + 1

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, width = inputs["input_ids"].shape
        padded = -(-width // self.width_step) * self.width_step
        feed = {k: torch.nn.functional.pad(v, (0, padded - width)) for k, v in inputs.items() if k in self.names}
        shape = (1, padded) if rows == 1 else BATCH_SHAPE
        return torch.from_numpy(
            self._request(shape).infer(_numpy_feed(feed, self.names))[0].copy()
        ).float()


def _numpy_feed(inputs: dict[str, torch.Tensor], names: set[str]) -> dict:
    """The tokenised batch an exported module takes (by input name), as numpy arrays."""
    return {k: v.cpu().numpy() for k, v in inputs.items() if k in names}
