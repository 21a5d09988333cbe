"""The float32 GEMM paths the runtime policy (runtime.py) chooses among: one way per library to compute
a float32 Linear (torch's MKL, MKL on a transposed weight, oneDNN, numpy's OpenBLAS, OpenVINO, ONNX
Runtime), each packing its weights once and returning the function of the input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PATHS", "GemmPath", "LinearFn"]

LinearFn = Callable[[torch.Tensor], torch.Tensor]


def _torch(w: torch.Tensor, b: torch.Tensor | None, threads: int) -> LinearFn:
    return lambda x: torch.nn.functional.linear(x, w, b)


def _torch_kn(w: torch.Tensor, b: torch.Tensor | None, threads: int) -> LinearFn:
    """MKL again, on the weight stored [in, out]: its kernel for an untransposed right operand."""
    wt = w.detach().t().contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.mm(rows, wt) if b is None else torch.addmm(b, rows, wt)
        return y.reshape(*x.shape[:-1], wt.shape[1])

    return run


def _onednn(w: torch.Tensor, b: torch.Tensor | None, threads: int) -> LinearFn:
    """oneDNN's linear on a weight packed once in its own layout (what torch.compile's CPU freezing
    uses)."""
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this torch build has no oneDNN")
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def _numpy(w: torch.Tensor, b: torch.Tensor | None, threads: int) -> LinearFn:
    """numpy's matmul: the BLAS its wheel ships (OpenBLAS), with its own threads."""
    import numpy as np

    _blas_threads(threads)
    wt = np.ascontiguousarray(w.detach().numpy().T)
    bias = None if b is None else b.detach().numpy()

    def run(x: torch.Tensor) -> torch.Tensor:
        y = np.matmul(x.reshape(-1, x.shape[-1]).numpy(), wt)
        if bias is not None:
            y += bias
        return torch.from_numpy(y).reshape(*x.shape[:-1], wt.shape[1])

    return run


def _blas_threads(threads: int) -> None:
    """numpy's BLAS on `threads` threads (threadpoolctl, where installed; else the BLAS's own
    default)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=threads, user_api="blas")


def _openvino(w: torch.Tensor, b: torch.Tensor | None, threads: int) -> LinearFn:
    """OpenVINO's CPU plugin on a one-MatMul model (any number of rows), in f32."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    wt = np.ascontiguousarray(w.detach().numpy().T)
    x_in = ops.parameter([-1, wt.shape[0]], np.float32)
    y = ops.matmul(x_in, ops.constant(wt), False, False)
    if b is not None:
        y = ops.add(y, ops.constant(b.detach().numpy()))
    config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    request = ov.Core().compile_model(ov.Model([y], [x_in]), "CPU", config).create_infer_request()

    def run(x: torch.Tensor) -> torch.Tensor:
        out = request.infer({0: x.reshape(-1, x.shape[-1]).numpy()}, share_inputs=True)[0]
        return torch.from_numpy(out.copy()).reshape(*x.shape[:-1], wt.shape[1])

    return run


def _onnxruntime(w: torch.Tensor, b: torch.Tensor | None, threads: int) -> LinearFn:
    """ONNX Runtime's CPU provider on a one-MatMul graph (any number of rows)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    wt = np.ascontiguousarray(w.detach().numpy().T)
    nodes, inits = [helper.make_node("MatMul", ["x", "w"], ["y" if b is None else "xw"])], [
        numpy_helper.from_array(wt, "w")]
    if b is not None:
        nodes.append(helper.make_node("Add", ["xw", "b"], ["y"]))
        inits.append(numpy_helper.from_array(b.detach().numpy(), "b"))
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", wt.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", wt.shape[1]])], inits)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = threads, 3
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )

    def run(x: torch.Tensor) -> torch.Tensor:
        out = session.run(None, {"x": x.reshape(-1, x.shape[-1]).numpy()})[0]
        return torch.from_numpy(out).reshape(*x.shape[:-1], wt.shape[1])

    return run


@dataclass(frozen=True)
class GemmPath:
    """One way to compute a float32 Linear: `prepare(weight, bias, threads)` packs the weights once
    and returns the function of the input; it raises where the path cannot load here (its package
    missing, no oneDNN). `own_threads`: the library runs its own thread pool beside torch's, whose
    threads still spin from the model's torch operations between two layers; the policy measures
    such a path but chooses it only where it is named."""

    name: str
    what: str
    prepare: Callable[[torch.Tensor, torch.Tensor | None, int], LinearFn]
    own_threads: bool = False


PATHS: dict[str, GemmPath] = {p.name: p for p in (
    GemmPath("torch", "torch's linear (MKL), the weight as stored", _torch),
    GemmPath("torch-kn", "torch's matmul (MKL) on the weight stored transposed", _torch_kn),
    GemmPath("onednn", "oneDNN's linear on a packed weight (torch.ops.mkldnn)", _onednn),
    GemmPath("numpy", "numpy's matmul (the BLAS of its wheel: OpenBLAS)", _numpy, own_threads=True),
    GemmPath("openvino", "OpenVINO's CPU plugin, f32 (the openvino extra)", _openvino, own_threads=True),
    GemmPath("onnxruntime", "ONNX Runtime's CPU provider (the onnx extra)", _onnxruntime, own_threads=True),
)}
