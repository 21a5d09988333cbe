"""GGUF sources for the transformers and vLLM backends: de-quantised once to a safetensors folder in
the project cache (`<cache>/llm/<name>-<digest>`), written atomically and shared by concurrent processes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from persrag_lightning.llm.base import LLMBackendError, ModelSource, cache_root

__all__ = ["dtype_kw", "load_tokenizer", "local_model_path"]

_DONE_MARKER = "persrag_source.json"


def _converted_dir(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the safetensors copy of a GGUF source lives: <cache>/llm/<name>-<digest>."""
    return cache_root(cache_dir) / "llm" / f"{source.name}-{source.digest}"


def _gguf_to_safetensors(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Path:
    """De-quantise a GGUF once and save model + tokenizer as safetensors, atomically, so later loads
    are instant."""
    target = _converted_dir(source, cache_dir)
    if (target / _DONE_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        gguf = Path(source.path)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     **dtype_kw(torch.float32))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The de-quantised weights are plain float tensors; drop the GGUF quantizer so they can be
        # serialised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {"source": source.path, "digest": source.digest, "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / _DONE_MARKER).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():  # not a concurrent winner: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, LLMBackendError):
            raise
        raise LLMBackendError(
            f"could not convert GGUF {source.path} to safetensors in {target}: {err}"
        ) from err
    return target


def local_model_path(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> str:
    """A path (or cached Hub name) that `from_pretrained` can load without network."""
    return str(_gguf_to_safetensors(source, cache_dir)) if source.is_gguf else source.path


def load_tokenizer(source: ModelSource, cache_dir: str | os.PathLike | None = None) -> Any:
    """The source's tokenizer (chat template included), from the converted copy when there is
    one."""
    from transformers import AutoTokenizer

    try:
        if source.is_gguf:
            done = _converted_dir(source, cache_dir)
            if (done / _DONE_MARKER).is_file():
                return AutoTokenizer.from_pretrained(str(done))
            gguf = Path(source.path)
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    except OSError as err:
        raise LLMBackendError(
            f"cannot load the tokenizer of {source.path!r} from local files: {err}"
        ) from err


def dtype_kw(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers >= 4.56 spells it `dtype`, older releases `torch_dtype`."""
    import transformers
    from packaging.version import Version

    return {"dtype": dtype} if Version(transformers.__version__) >= Version("4.56") else {"torch_dtype": dtype}
