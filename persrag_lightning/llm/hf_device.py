"""Where a transformers backend runs: the device and dtype it is asked for, the device its weights
are on now, and the number of beams it decodes with (llm/hf.py, llm/hf_seq2seq.py)."""

from __future__ import annotations

from typing import Any

import torch

from persrag_lightning.hardware import Precision, uses_bf16

__all__ = ["FollowsModelDevice", "check_beams", "resolve_device_dtype"]


def resolve_device_dtype(device: str, dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """`auto` picks CUDA with bfloat16 when present, else CPU with float32. `bf16_if_native` is
    bfloat16 wherever the hardware computes it natively (CUDA, or a CPU with AVX512-BF16/AMX whose
    bfloat16 matmul measures faster than float32's: `hardware.cpu_has_native_bf16`) and float32
    elsewhere: on our 2-core CPU SmolLM2 scores `choose` answers several times faster in it, nearly
    always with the float32 answer (docs/fidelity.md); greedy *generation* drifts more in bfloat16
    on CPU, so `auto` stays float32 there."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if isinstance(dtype, torch.dtype):
        return dev, dtype
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype == "bf16_if_native":
        return dev, torch.bfloat16 if uses_bf16(Precision.NATIVE, dev.type) else torch.float32
    named = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in named:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, bf16_if_native, {', '.join(named)}")
    return dev, named[dtype]


def check_beams(num_beams: int) -> int:
    """`num_beams` when it is an integer ≥ 1 (1 is greedy decoding); else a ValueError naming it."""
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    return num_beams


class FollowsModelDevice:
    """`device` is where the model's weights are now, not where they were when the backend was
    built: the generator stage wraps the model it trains (`from_model`) before Lightning moves it to
    the GPU, and its validation answers must feed their tensors to wherever the weights went. Before
    a model is loaded (or after `close`), the device the backend was asked for."""

    _device: torch.device
    model: Any

    @property
    def device(self) -> torch.device:
        model = getattr(self, "model", None)
        param = next(model.parameters(), None) if model is not None else None
        return param.device if param is not None else self._device

    @device.setter
    def device(self, value: torch.device) -> None:
        self._device = value
